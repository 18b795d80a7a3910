"""Every command the READMEs show names only flags and choices its script accepts: each
`python SCRIPT.py ...` (or torchrun's) in README.md, results/README.md and weights/*/README.md,
in a code block or inline, parsed by that script's own parser (not run), so a README command
cannot drift from the code; generate.py's commands pass its checks that need no model too.
Research scripts (experiments/): tests/test_experiments.py runs them.

Test: `python -m pytest -q tests/test_readme.py`.
"""

import glob
import importlib
import os
import re
import shlex

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READMES = [
    "README.md",
    "results/README.md",
    *sorted(os.path.relpath(f, ROOT) for f in glob.glob(f"{ROOT}/weights/*/README.md")),
]


def commands(text):
    """The shell commands in a README's code blocks and inline code: [(line, [words])]."""
    found = []
    fenced = re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    blocks = [code for lang, code in fenced if lang in ("", "bash", "sh")]
    inline = re.findall(r"(?<!`)`([^`\n]*(?:python|torchrun) [^`\n]*)`(?!`)", text)
    for chunk in blocks + inline:
        for line in chunk.replace("\\\n", " ").splitlines():
            if not re.search(r"\b(python|torchrun) ", line):
                continue  # a block's output lines, not a command
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            try:
                tokens = list(lexer)
            except ValueError:  # a quote closed on a later line: python -c "...", no script
                continue
            words = []
            for word in [*tokens, "&&"]:  # &&, ||, ;, | end a command
                if word.strip("&|;"):
                    words.append(word)
                elif words:
                    found.append((line.strip(), words))
                    words = []
    return found


def script_and_argv(words):
    """(the script's module name, its arguments) for python X.py / torchrun ... X.py and
    python -m specdec.X (a script of the package), else None."""
    if words[:2] == ["python", "-m"] and words[2].startswith("specdec."):
        return words[2], words[3:]
    for i, word in enumerate(words):
        if word.endswith(".py") and words[0] in ("python", "torchrun") and "/" not in word:
            return word[:-3], words[i + 1 :]
    return None


# the entry scripts whose command line is the package's: where their parser and checks live
COMMAND_LINES = {"generate": "specdec.commands.generate", "bench": "specdec.commands.bench"}


def command_line(name):
    """The module that holds the script `name`'s build_parser()."""
    return importlib.import_module(COMMAND_LINES.get(name, name))


CASES = [
    (readme, line, words)
    for readme in READMES
    for line, words in commands(open(os.path.join(ROOT, readme), encoding="utf-8").read())
    if script_and_argv(words)
]


def test_the_readmes_show_commands():
    assert len(CASES) > 30 and {"generate", "train", "bench", "joint", "export", "tree"} <= {
        script_and_argv(w)[0].split(".")[-1] for _, _, w in CASES
    }


@pytest.mark.parametrize("readme, line, words", CASES, ids=[f"{r}: {l[:60]}" for r, l, _ in CASES])
def test_a_readme_command_parses(readme, line, words):
    name, argv = script_and_argv(words)
    parser = command_line(name).build_parser()
    parser.parse_args(argv)  # a UsageError (cli.Parser.error) names the flag that drifted


def made_by_the_readmes():
    """The relative folders the READMEs' other commands write (train.py --out my-heads, ...): a
    later command may name them."""
    return {
        argv[i + 1]
        for _, _, words in CASES
        for name, argv in [script_and_argv(words)]
        for i in range(len(argv) - 1)
        if name != "generate" and argv[i] == "--out" and not os.path.isabs(argv[i + 1])
    }


GENERATE = [(r, line, words) for r, line, words in CASES if script_and_argv(words)[0] == "generate"]


@pytest.mark.parametrize(
    "readme, line, words", GENERATE, ids=[f"{r}: {l[:60]}" for r, l, _ in GENERATE]
)
def test_a_readme_generate_command_passes_the_checks(readme, line, words, tmp_path, monkeypatch):
    """generate.py's checks before the model loads, run where the earlier commands' folders
    exist (empty: a check that needs more than a folder is left to the load)."""
    generate = command_line("generate")
    monkeypatch.chdir(tmp_path)
    for folder in made_by_the_readmes():
        os.makedirs(folder, exist_ok=True)
    parser = generate.build_parser()
    generate.check_args(parser.parse_args(script_and_argv(words)[1]), parser)


def test_the_readme_says_what_a_full_chat_context_does():
    """Chat.fit drops the oldest messages when the conversation and the reply no longer fit."""
    text = " ".join(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().split())
    chat = text[text.index("**A conversation.**") :].split("```")[0]
    assert "the oldest messages are dropped" in chat


def test_the_readmes_sample_banner_is_what_generate_py_prints(monkeypatch):
    """The first command's sample output: its banner, rebuilt by terminal.banner_line from the same
    model, drafter, device, dtype and threads, is the line the README shows."""
    import types

    from specdec import terminal
    from specdec.fast import kernels

    text = open(os.path.join(ROOT, "README.md")).read()
    shown = re.search(r"^\[SmolLM2-135M-Instruct .* on cpu, .*\]$", text, re.M).group(0)
    monkeypatch.setattr(kernels, "native_library", lambda: object())  # kernels.c runs
    model = types.SimpleNamespace(
        dtype=torch.bfloat16,
        cfg=types.SimpleNamespace(name="SmolLM2-135M-Instruct (SmolLM2-135M-Instruct.Q4_1.gguf)"),
    )
    drafter = types.SimpleNamespace(name="heads: hydra++, tree: 6 nodes")
    dec = types.SimpleNamespace(model=model, drafter=drafter)
    draft = types.SimpleNamespace(kind="heads", heads="auto")
    line = terminal.banner_line(dec, draft, device="cpu", quantize="none", threads=2)
    assert line == shown


def test_the_readmes_generate_commands_run_in_order(tmp_path, monkeypatch):
    """Run one after another in one folder, as a reader runs them, each of README.md's generate.py
    commands passes the checks: none refuses an --out file an earlier one wrote."""
    generate = command_line("generate")
    monkeypatch.chdir(tmp_path)
    for folder in made_by_the_readmes():
        os.makedirs(folder, exist_ok=True)
    parser = generate.build_parser()
    for readme, line, words in GENERATE:
        if readme != "README.md":
            continue
        args = parser.parse_args(script_and_argv(words)[1])
        generate.check_args(args, parser)  # a UsageError names the command's --out
        if args.out:
            open(args.out, "w").close()  # what the command writes
