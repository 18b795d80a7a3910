"""generate.py's command line on bad input: every case ends with ONE line on stderr that starts
with "error:" and names the problem and the fix, exit code 2, and no traceback.

Most cases call generate.cli_main(argv) in-process: the checks that need no model run with
model.load replaced by a tripwire (they must fail before the model loads), the rest with model.load
answering from the session's default model (a real load per case would take minutes). A few cases
run `python generate.py` in a subprocess, to check the real entry point: exit code, stderr, stdout.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import cli
from specdec import drafters
from specdec.engines import decode
from specdec.engines import engine
from specdec.fast import exact
import generate as G
from specdec.commands import generate as command
from specdec import terminal
import heads as heads_lib
from specdec.fast import kernels
from specdec import rows
import tree as tree_lib
from conftest import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVIL = "__import__('os').system('echo hi')"


def check_one_line_error(code, err, *words):
    lines = err.strip().splitlines()
    assert code == 2, f"exit code {code}, stderr: {err}"
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), (
        f"want one line 'error: ...', got {err!r}"
    )
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
    return lines[0]


def run_cli(capsys, *argv):
    code = G.cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_script(*argv, timeout=180):
    """`python generate.py argv` in a subprocess: (exit code, stdout, stderr)."""
    env = dict(
        os.environ, OMP_NUM_THREADS="1", HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5"
    )
    p = subprocess.run(
        [sys.executable, "generate.py", *map(str, argv)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
    )
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def loaded(monkeypatch, default_model):
    """checkpoint.load("default") answers with the session's model; other names load for real."""
    real = checkpoint.load
    monkeypatch.setattr(
        checkpoint,
        "load",
        lambda name, device="cpu", dtype=None: (
            default_model if name == checkpoint.DEFAULT else real(name, device, dtype)
        ),
    )
    return default_model


@pytest.fixture(scope="module")
def heads_dir(default_model, tmp_path_factory):
    """Untrained Hydra heads (3) for the default model, saved by checkpoint.save_heads."""
    folder = tmp_path_factory.mktemp("heads")
    checkpoint.save_heads(
        heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=3), default_model[0]), folder
    )
    return folder


def copy_heads(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in (checkpoint.HEADS_WEIGHTS, checkpoint.HEADS_CONFIG):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    return dst


# --- checks that need no model: they fail before it loads ----------------------------------------

FLAGS = [
    ([], "--prompt"),
    (["--prompt", "hi", "--prompts", "x.jsonl"], "not both"),
    (["--prompt", "   \n "], "empty"),
    (["--prompt", ""], "empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "at least 1"),
    (["--prompt", "hi", "--max-new-tokens", "-5"], "at least 1"),
    (["--prompt", "hi", "--max-new-tokens", "ten"], "invalid int"),
    (["--prompt", "hi", "--bogus-flag"], "unrecognized"),
    (["--prompt", "hi", "--temperature", "-0.1"], ">= 0"),
    (["--prompt", "hi", "--temperature", "nan"], ">= 0"),
    (["--prompt", "hi", "--top-p", "0"], "(0, 1]"),
    (["--prompt", "hi", "--top-p", "1.5"], "(0, 1]"),
    (["--prompt", "hi", "--verify", "greedy", "--temperature", "0.7"], "--verify sample"),
    (["--prompt", "hi", "--verify", "beam"], "invalid choice"),
    (["--prompt", "hi", "--quantize", "int3"], "invalid choice"),
    (["--prompt", "hi", "--seed", "-1"], "--seed"),
    (["--prompt", "hi", "--dtype", "fp8"], "unknown dtype; use auto, fp32, bf16, fp16"),
    (["--prompt", "hi", "--device", "tpu"], "unknown device"),
    (["--prompt", "hi", "--device", "cuda:x"], "unknown device"),
    (["--prompt", "hi", "--heads", "eagle"], "not a heads folder nor one of none, auto, medusa"),
    (["--prompt", "hi", "--heads", "none", "--tree", "chain:2"], "--tree needs draft heads"),
    (["--prompt", "hi", "--tree", EVIL], "is not a tree: expected 'chain:N'"),
    (["--prompt", "hi", "--tree", "cartesian:40,40"], "MAX_NODES"),
    (["--prompt", "hi", "--tree", "chain:5000"], "chain depth"),
    (
        ["--prompt", "hi", "--out", "/no/such/folder/replies.jsonl"],
        "not a file in an existing folder",
    ),
    (["--prompt", "hi", "--out", "."], "not a file in an existing folder"),
]


@pytest.mark.parametrize("argv, words", FLAGS, ids=[" ".join(a)[:40] for a, _ in FLAGS])
def test_bad_flags(no_model, capsys, argv, words):
    check_one_line_error(*run_cli(capsys, *argv)[::2], words)


def test_cuda_missing(no_model, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--device", "cuda")[::2],
        "CUDA is not available",
        "--device cpu",
    )


def test_fp16_weights_are_a_cpu_kernel():
    """--quantize fp16 is fbgemm's CPU kernel: on a GPU the check points to --dtype fp16 (run before
    the model loads; the CUDA device itself cannot be picked on this machine, so it is called
    here)."""
    cli.check_quantize("fp16", "cpu")
    cli.check_quantize("int8", "cuda")
    # fp16 weights: fp32 activations
    assert kernels.pick_dtype("auto", "cpu", "fp16") == torch.float32
    assert kernels.pick_dtype("bf16", "cpu", "fp16") == torch.bfloat16  # unless asked otherwise
    with pytest.raises(
        cli.UsageError, match="--quantize fp16: a CPU kernel; on cuda:1 use --dtype fp16"
    ):
        cli.check_quantize("fp16", "cuda:1")


def test_shipped_heads_missing(no_model, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(catalog, "SHIPPED", str(tmp_path))  # as in a checkout without weights/
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--heads", "medusa")[::2], "train.py --heads medusa"
    )


@pytest.mark.parametrize(
    "paths, words",
    [
        ([[0, 1]], "no parent: (0,) is missing (must be prefix-closed)"),
        ([[0], [-1]], "negative rank"),
        ([[r] for r in range(tree_lib.MAX_NODES)], "over MAX_NODES=1024"),
        ([[0], [2**70]], "ranks index a head's top-k"),
        ([["__import__('os')"]], "not a tuple of ints"),
        ({"nodes": [[0]]}, 'expected a JSON object {"paths"'),
    ],
)
def test_bad_tree_files(no_model, capsys, tmp_path, paths, words):
    file = tmp_path / "tree.json"
    file.write_text(json.dumps(paths if isinstance(paths, dict) else {"paths": paths}))
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--tree", file)[::2], str(file), words)


@pytest.mark.parametrize(
    "content, words",
    [
        ('{"prompt": "fine"}\nnot json\n', "line 2: not valid JSON"),
        (
            '{"prompt": "fine"}\n\n{"text": "no prompt field"}\n',
            'line 3: needs a string field "prompt"',
        ),
        ('{"prompt": 42}\n', 'line 1: needs a string field "prompt"'),
        ('["prompt"]\n', 'line 1: needs a string field "prompt"'),
        ('{"prompt": "  "}\n', "line 1: the prompt is empty"),
        ("", "no prompts in the file"),
        ("\n  \n", "no prompts in the file"),
        (b'{"prompt": "caf\xe9"}\n', "not valid UTF-8"),
        ("[" * 100000, "line 1: not valid JSON"),
        ('{"prompt": "Hi", "category": ["a"]}\n', 'line 1: "category" is a list; give a string'),
        ('{"prompt": "Hi", "id": ["a"]}\n', 'line 1: "id" is a list; give a string or a whole'),
        ('{"prompt": "Hi", "id": true}\n', 'line 1: "id" is true; give a string'),
        (
            '{"messages": [{"role": "user", "content": "Hi"}], "category": {}}\n',
            'line 1: "category" is an object; give a string',
        ),
        ('{"prompt": "Hi", "category": "\\udc80"}\n', 'line 1, "category": not valid Unicode'),
        (
            '{"prompt": "Hi", "id": "a"}\n{"prompt": "Ho", "id": "a"}\n',
            "line 2: the id 'a' is line 1's id too; give each prompt an \"id\" of its own",
        ),
        (
            '{"prompt": "Hi", "id": 3}\n\n{"prompt": "Ho"}\n',
            'line 3: has no "id" and its number, 3, is line 1\'s id too',
        ),
    ],
)
def test_bad_prompts_file(no_model, capsys, tmp_path, content, words):
    file = tmp_path / "prompts.jsonl"
    file.write_bytes(content if isinstance(content, bytes) else content.encode())
    check_one_line_error(*run_cli(capsys, "--prompts", file)[::2], str(file), words)


def test_prompts_file_missing_or_a_folder(no_model, capsys, tmp_path):
    check_one_line_error(
        *run_cli(capsys, "--prompts", tmp_path / "nope.jsonl")[::2], "cannot read it"
    )
    check_one_line_error(*run_cli(capsys, "--prompts", tmp_path)[::2], "cannot read it")


# --- the model ----------------------------------------------------------------------------------


def test_model_not_found(capsys, tmp_path):
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--model", tmp_path / "no" / "such" / "model")[::2],
        "no such folder",
    )
    check_one_line_error(  # a folder, but not a model's
        *run_cli(capsys, "--prompt", "hi", "--model", tmp_path)[::2],
        f"model '{tmp_path}': no config.json there",
        "(config.json and *.safetensors), a hub id (owner/name) or 'default'",
    )


def test_model_of_another_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--model", tmp_path)[::2],
        "architecture 'gpt2' is not supported",
        "llama, mistral",
    )


# --- prompts against the context ----------------------------------------------------------------


def test_prompt_longer_than_context(loaded, capsys):
    context = loaded[0].cfg.max_seq_len
    line = check_one_line_error(
        *run_cli(capsys, "--prompt", "hello world " * 4600)[::2],
        f"the model's context holds {context}",
        "shorten it",
    )
    assert int(line.split("the prompt has ")[1].split()[0]) > context


def test_max_new_tokens_beyond_context(loaded, capsys):
    """Asking for more tokens than the context leaves is an error up front (not a silent clamp)."""
    model, tok = loaded
    n = len(checkpoint.encode(tok, "hello " * 3000))
    room = model.cfg.max_seq_len - n
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hello " * 3000, "--max-new-tokens", room + 1)[::2],
        f"leaves room for {room}",
        f"ask for at most {room}",
    )


def test_default_max_new_tokens_takes_what_the_context_leaves(loaded, capsys):
    """Without --max-new-tokens a long prompt gets the room its context leaves, with a notice;
    given, the flag is checked as before (the test above)."""
    tok = loaded[1]
    prompts = [(0, "hello there", "all")]
    n = len(checkpoint.encode(tok, "hello there"))
    flags = dict(system=None, raw=False, max_new_tokens=None)
    assert (
        command.encode_prompts(prompts, tok, context=n + 1000, **flags)[0][2]
        == command.MAX_NEW_TOKENS
    )
    assert "notice" not in capsys.readouterr().err
    assert command.encode_prompts(prompts, tok, context=n + 5, **flags)[0][2] == 5
    assert "leaves room for 5 new tokens in the model's context of" in capsys.readouterr().err


def test_stats_line_counts_in_words():
    r = decode.Result(tokens=[7], steps=1, seconds=0.5, accepted=[0])
    assert terminal.stats_line(r, 0).startswith("[1 new token, 1 forward pass, tau 1.00")
    r = decode.Result(tokens=[7, 8], steps=2, seconds=0.5, accepted=[0, 0])
    assert terminal.stats_line(r, 0).startswith("[2 new tokens, 2 forward passes,")


def test_help_shows_each_default_once():
    """A flag's default appears once in --help: not twice where the help says it, nor as None."""
    text = command.build_parser().format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    assert text.count("(default: the template's own)") == 1 and "own) (default" not in text


def test_threads_are_the_cores_other_work_leaves_idle(monkeypatch):
    """--threads 0: the cores that are not busy, at least one; a number: that many; below 0: one
    line."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(cli, "busy_cores", lambda seconds=0.1: cores - 1)
    assert cli.use_threads(0) == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr(cli, "busy_cores", lambda seconds=0.1: cores + 3)  # more jobs than cores
    assert cli.use_threads(0) == 1
    monkeypatch.setattr(cli, "busy_cores", lambda seconds=0.1: 0)
    assert cli.use_threads(0) == cores and cli.use_threads(1) == 1 == torch.get_num_threads()
    with pytest.raises(cli.UsageError, match="--threads -1: must be 0"):
        cli.use_threads(-1)
    with pytest.raises(cli.UsageError, match=f"--threads {cores + 1}: .* give at most {cores}"):
        cli.use_threads(cores + 1)
    monkeypatch.undo()  # the real count
    assert 0 <= cli.busy_cores(0.02) <= os.cpu_count()


def test_a_kind_not_shipped_is_the_folder_of_that_name(tmp_path, monkeypatch):
    """joint.py --out medusa-2, then --heads medusa-2 (the README's commands): no medusa-2 heads
    are shipped, so the folder of that name is meant; without one, the fix names joint.py."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        cli.UsageError,
        match=r"--heads medusa-2: no medusa-2 heads are shipped .* specdec.training.joint --init "
        r"medusa --out FOLDER",
    ):
        catalog.find_heads("medusa-2")
    (tmp_path / "medusa-2").mkdir()
    assert catalog.find_heads("medusa-2") == "medusa-2"
    # shipped: the kind's name wins
    assert catalog.find_heads("hydra++") == os.path.join(catalog.SHIPPED, "hydra++")
    (tmp_path / "hydra++").mkdir()
    # still the shipped ones
    assert catalog.find_heads("hydra++") == os.path.join(catalog.SHIPPED, "hydra++")
    monkeypatch.setattr(catalog, "SHIPPED", str(tmp_path / "nothing-shipped"))
    with pytest.raises(
        cli.UsageError,
        match=r"--heads medusa: no medusa heads .* train.py --heads medusa --out FOLDER",
    ):
        catalog.find_heads("medusa")


def test_prompts_file_names_the_prompt_that_is_too_long(loaded, capsys, tmp_path):
    file = tmp_path / "p.jsonl"
    file.write_text(
        json.dumps({"prompt": "short", "id": "a"})
        + "\n"
        + json.dumps({"prompt": "hi " * 9000, "id": "b"})
        + "\n"
    )
    check_one_line_error(*run_cli(capsys, "--prompts", file)[::2], "prompt 'b' has")


def test_unusual_prompts_work(loaded, capsys):
    mixed = "Translate: 😀🎉 naïve café, 世界, مرحبا, Привет, שלום, नमस्ते 👩‍👩‍👧‍👦 \u200b\ufeff"
    code, out, err = run_cli(capsys, "--prompt", mixed, "--max-new-tokens", 3)
    assert code == 0, err
    long = "=" * 6000 + " " + mixed  # 6000+ characters, ~250 tokens
    code, out, err = run_cli(capsys, "--prompt", long, "--max-new-tokens", 2, "--raw")
    assert code == 0, err
    assert "[2 new tokens" in err


# --- heads and trees ----------------------------------------------------------------------------


def test_heads_folder_missing_files(loaded, capsys, tmp_path, heads_dir):
    folder = copy_heads(heads_dir, tmp_path / "h")
    os.remove(folder / checkpoint.HEADS_WEIGHTS)
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--heads", folder)[::2], "has no heads.safetensors"
    )
    copy_heads(heads_dir, folder)
    os.remove(folder / checkpoint.HEADS_CONFIG)
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--heads", folder)[::2], "has no heads.json"
    )


def test_heads_weights_damaged(loaded, capsys, tmp_path, heads_dir):
    folder = copy_heads(heads_dir, tmp_path / "h")
    data = (folder / checkpoint.HEADS_WEIGHTS).read_bytes()
    for damaged in (data[: len(data) // 2], data[:5], b"\x00" * 64, b"hello" + data[5:]):
        (folder / checkpoint.HEADS_WEIGHTS).write_bytes(damaged)
        check_one_line_error(
            *run_cli(capsys, "--prompt", "hi", "--heads", folder)[::2], "unreadable or corrupted"
        )


@pytest.mark.parametrize(
    "change, words",
    [
        ({"dropout": 0.1}, "unknown field(s) ['dropout']"),
        ({"num_heads": "3"}, "field 'num_heads' must be int"),
        ({"own_lm_head": 1}, "field 'own_lm_head' must be bool"),
        ({"kind": "eagle"}, "unknown head kind 'eagle'"),
        ({"num_heads": 4}, "does not hold the weights"),
        ({"num_heads": 0}, "num_heads, num_layers >= 1"),
    ],
)
def test_heads_config_damaged(loaded, capsys, tmp_path, heads_dir, change, words):
    folder = copy_heads(heads_dir, tmp_path / "h")
    good = json.loads((folder / checkpoint.HEADS_CONFIG).read_text())
    (folder / checkpoint.HEADS_CONFIG).write_text(json.dumps(good | change))
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--heads", folder)[::2], f"--heads {folder}", words
    )


def test_heads_for_another_model(loaded, capsys, tmp_path):
    torch.manual_seed(0)
    tiny = rows.Model(tiny_config(name="tiny-llama")).eval()
    checkpoint.save_heads(
        heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=2), tiny), tmp_path
    )
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--heads", tmp_path)[::2],
        "heads were trained for tiny-llama, not SmolLM2",
        "train heads for this one",
    )


def test_tree_that_does_not_fit_the_heads(loaded, capsys, tmp_path, heads_dir):
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--heads", heads_dir, "--tree", "chain:5")[::2],
        "depth 5 needs 5 heads, the heads have 3",
    )
    file = tmp_path / "wide.json"
    file.write_text(json.dumps({"paths": [[0], [60000]]}))
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--heads", heads_dir, "--tree", file)[::2],
        "top-60001",
        f"the heads predict {loaded[0].cfg.vocab_size}",
    )
    # --tree auto reads the tree.json saved with the heads
    folder = copy_heads(heads_dir, tmp_path / "h")
    (folder / "tree.json").write_text('{"paths": [[0], [0, 0, 1]]}')
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--heads", folder)[::2], "tree.json", "no parent"
    )


def test_heads_and_tree_that_fit_work(loaded, capsys, heads_dir):
    code, out, err = run_cli(
        capsys,
        "--prompt",
        "hi",
        "--heads",
        heads_dir,
        "--tree",
        "cartesian:2,2,1",
        "--max-new-tokens",
        4,
    )
    assert code == 0, err
    assert "heads: hydra, tree: 11 nodes" in err


def reply_ids(capsys, tmp_path, *argv):
    """The ids of a 12-token reply to one prompt, and stderr."""
    out = tmp_path / "reply.jsonl"
    out.unlink(missing_ok=True)  # an existing --out is refused
    code, _, err = run_cli(
        capsys,
        "--prompt",
        "Name two rivers.",
        "--max-new-tokens",
        12,
        "--quiet",
        "--out",
        out,
        *argv,
    )
    assert code == 0, err
    return json.loads(out.read_text())["token_ids"], err


def test_sample_and_typical_at_temperature_0_are_greedy(loaded, capsys, tmp_path, heads_dir):
    """At --temperature 0 every verifier reduces to greedy: the same ids as plain greedy
    decoding."""
    ids = {}
    for name, extra in [
        ("plain", ["--heads", "none"]),
        ("greedy", ["--heads", heads_dir, "--verify", "greedy"]),
        ("sample", ["--heads", heads_dir, "--verify", "sample", "--temperature", "0"]),
        ("typical", ["--heads", heads_dir, "--verify", "typical", "--temperature", "0"]),
    ]:
        ids[name], _ = reply_ids(capsys, tmp_path, *extra)
    assert len(ids["plain"]) == 12 or ids["plain"][-1] in loaded[0].cfg.eos_ids + (
        loaded[1].eos_token_id,
    )
    assert ids["greedy"] == ids["sample"] == ids["typical"] == ids["plain"]


# --- drafters: --draft, --draft-model, --gamma, --ngram, --matches --------------------------------

DRAFT_FLAGS = [
    (["--draft", "eagle"], "unknown drafter; use heads, lookup, heads+lookup, layers:N"),
    (["--draft", "layers:x"], "unknown drafter"),
    (["--draft", "layers:0"], "at least 1"),
    (["--draft", "layers:-3"], "at least 1"),
    (["--draft", "lookup", "--gamma", "0"], "--gamma 0: must be at least 1"),
    (["--draft", "layers:4", "--gamma", "-2"], "--gamma -2: must be at least 1"),
    (["--draft", "lookup", "--ngram", "0"], "--ngram 0: must be at least 1"),
    (["--draft", "lookup", "--matches", "0"], "--matches 0: must be at least 1"),
    (["--draft", "lookup", "--gamma", "600", "--matches", "2"], "MAX_NODES"),
    (["--draft", "model", "--draft-model", "x", "--gamma", "5000"], "MAX_NODES"),
    (["--gamma", "3"], "--gamma does not apply to --draft heads"),
    (["--draft", "layers:4", "--ngram", "2"], "--ngram does not apply to --draft layers:4"),
    (["--draft", "lookup", "--tree", "chain:2"], "--tree shapes the heads' tree"),
    (["--draft", "layers:4", "--heads", "medusa"], "drafts without heads"),
    (["--draft", "heads+lookup", "--heads", "none"], "needs heads"),
    (["--draft", "model"], "--draft model needs --draft-model"),
    (["--draft-model", "some/model"], "add --draft model or drop --draft-model"),
    (["--draft", "lookup", "--draft-model", "some/model"], "add --draft model"),
]


# --draft jacobi and lookahead: every count out of range, and the flags and combinations they do not
# take
PARALLEL_FLAGS = [
    ("jacobi --gamma 0", "--gamma 0: must be at least 1"),
    (
        "jacobi --gamma 1024",
        "--gamma 1024: the chain would be over MAX_NODES=1024; use a smaller --gamma",
    ),
    ("lookahead --window 0", "--window 0: must be at least 1"),
    ("lookahead --guesses -1", "--guesses -1: must be at least 1"),
    (
        "lookahead --ngram 1",
        "--ngram 1: lookahead's n-grams are a first token and at least one more; use --ngram 2 or "
        "more",
    ),
    (
        "lookahead --window 100 --ngram 11",
        "--window 100, --ngram 11, --guesses 4: a step would compute 999 window nodes",
    ),
    (
        "lookahead --guesses 600 --ngram 3",
        "verify up to 1200, over MAX_NODES=1024; use smaller values",
    ),
    ("jacobi --window 3", "--window does not apply to --draft jacobi (only to lookahead); drop it"),
    (
        "jacobi --ngram 3",
        "--ngram does not apply to --draft jacobi (only to lookup, heads+lookup and lookahead)",
    ),
    (
        "lookahead --gamma 3",
        "--gamma does not apply to --draft lookahead (only to lookup, heads+lookup, layers:N, "
        "skip, model, jacobi and pass)",
    ),
    ("lookup --guesses 2", "--guesses does not apply to --draft lookup"),
    ("lookahead --matches 2", "--matches does not apply to --draft lookahead"),
    ("jacobi --tree chain:2", "--draft jacobi has none"),
    ("lookahead --heads hydra", "--draft lookahead drafts without heads"),
    ("jacobi --draft-model some/model", "add --draft model or drop --draft-model"),
]
DRAFT_FLAGS += [(["--draft", *argv.split()], words) for argv, words in PARALLEL_FLAGS]


@pytest.mark.parametrize("argv, words", DRAFT_FLAGS, ids=[" ".join(a)[:40] for a, _ in DRAFT_FLAGS])
def test_bad_draft_flags(no_model, capsys, argv, words):
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", *argv)[::2], words)


def test_layers_beyond_the_model(loaded, capsys):
    n = loaded[0].cfg.n_layers
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--draft", f"layers:{n}")[::2],
        f"the model has {n} layers, so N must be 1 to {n - 1}",
    )


def test_layers_of_a_one_layer_model(capsys, tiny_model_dir):
    check_one_line_error(
        *run_cli(capsys, "--model", tiny_model_dir, "--prompt", "hi", "--draft", "layers:1")[::2],
        "the model has one layer, so no fewer can draft for it",
    )


def test_heads_and_lookup_without_heads_for_this_model(loaded, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(catalog, "SHIPPED", str(tmp_path))  # --heads auto finds none
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--draft", "heads+lookup")[::2],
        "no heads are shipped",
        "use --draft lookup",
    )


def tiny_llama_folder(capsys, folder, tokenizer):
    """A 1-layer random Llama saved the transformers way, with `tokenizer` beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        max_position_embeddings=8192,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    capsys.readouterr()  # transformers' progress bars are not the command's output
    return folder


def test_draft_model_with_another_vocabulary(loaded, capsys, tmp_path):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(checkpoint.resolve(checkpoint.DEFAULT))
    other.add_tokens(["<a-token-the-model-lacks>"])
    folder = tiny_llama_folder(capsys, tmp_path / "other", other)
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--draft", "model", "--draft-model", folder)[::2],
        f"--draft-model {folder}: its vocabulary differs",
        "use a draft model with the same tokenizer",
    )


def test_draft_model_not_llama_or_missing(loaded, capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--draft", "model", "--draft-model", tmp_path)[::2],
        f"--draft-model {tmp_path}: architecture 'gpt2' is not supported",
    )
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--draft", "model", "--draft-model", tmp_path / "nope")[
            ::2
        ],
        "--draft-model",
        "no such folder",
    )


def test_fp16_weights_through_the_cli_decode_speculatively_as_plainly(
    loaded, capsys, tmp_path, heads_dir, monkeypatch
):
    """--quantize fp16 (fp32 activations by default): the banner says so; where the CPU's fp16
    product keeps rows alone, the heads' output is the fp16 model's own plain greedy output, and
    where it does not, a notice says greedy output may part. (The session's model: its kernels are
    put back after.)"""
    chosen = kernels.in_use(loaded[0])
    try:
        # auto dtype: fp32
        plain, err = reply_ids(capsys, tmp_path, "--heads", "none", "--quantize", "fp16")
        assert "on cpu, float32, fp16 weights, heads: none" in err
        assert ("may part from plain greedy output" in err) != kernels.fp16_rows_alone()
        if kernels.fp16_rows_alone():
            assert (
                reply_ids(
                    capsys,
                    tmp_path,
                    "--heads",
                    heads_dir,
                    "--tree",
                    "chain:2",
                    "--dtype",
                    "fp32",
                    "--quantize",
                    "fp16",
                )[0]
                == plain
            )
        monkeypatch.setattr(kernels, "fp16_rows_alone", lambda: False)  # an AVX2 CPU's answer
        assert (
            "notice: fbgemm's fp16 product on this CPU"
            in reply_ids(capsys, tmp_path, "--heads", "none", "--quantize", "fp16")[1]
        )
    finally:
        kernels.use(loaded[0], chosen)
    assert kernels.in_use(loaded[0]) == chosen


def test_every_drafter_through_the_cli_gives_plain_greedy_output(
    loaded, capsys, tmp_path, heads_dir
):
    # random weights, the model's tokenizer
    folder = tiny_llama_folder(capsys, tmp_path / "same", loaded[1])
    plain, _ = reply_ids(capsys, tmp_path, "--heads", "none")
    for argv, words in [
        (
            ["--draft", "lookup", "--gamma", "4", "--matches", "2"],
            "lookup: n-grams 3..1, up to 4 tokens, 2 matches",
        ),
        (
            ["--draft", "heads+lookup", "--heads", heads_dir, "--tree", "chain:2"],
            "heads: hydra, tree: 3 nodes + lookup",
        ),
        (["--draft", "layers:20"], "layers:20, 4 tokens a step"),
        (
            ["--draft", "model", "--draft-model", folder, "--gamma", "2"],
            "draft model, 2 tokens a step",
        ),
        (["--draft", "jacobi", "--gamma", "3"], "jacobi: 3 guesses a step"),
        (
            ["--draft", "lookahead", "--window", "3", "--ngram", "4", "--guesses", "2"],
            "lookahead: window 3, 4-grams, up to 2 guesses",
        ),
    ]:
        ids, err = reply_ids(capsys, tmp_path, *argv)
        assert ids == plain, argv
        assert words in err.splitlines()[0]


def test_parallel_drafters_take_the_tuned_settings_under_the_flags(
    loaded, capsys, tmp_path, monkeypatch
):
    """--draft jacobi and lookahead read what bench.py --tune-parallel saved for this model, device
    and dtype (a flag given wins); a damaged file is named, with the fix."""
    model, _ = loaded
    monkeypatch.setattr(catalog, "SHIPPED", str(tmp_path))
    file = catalog.tuned_tree_file(tmp_path, "cpu", model.dtype, "parallel")
    saved = {
        "model": model.cfg.name,
        "jacobi": {"gamma": 2},
        "lookahead": {"window": 2, "ngram": 2, "guesses": 3},
    }
    with open(file, "w") as f:
        json.dump(saved, f)
    for argv, words in [
        (["--draft", "jacobi"], "jacobi: 2 guesses"),
        (["--draft", "lookahead", "--ngram", "3"], "window 2, 3-grams, up to 3 guesses"),
    ]:
        _, err = reply_ids(capsys, tmp_path, *argv)
        assert words in err.splitlines()[0]
    with open(file, "w") as f:
        json.dump(saved | {"model": "another model"}, f)
    assert (
        "jacobi: 4 guesses" in reply_ids(capsys, tmp_path, "--draft", "jacobi")[1].splitlines()[0]
    )  # not for this model: the defaults
    for damage, words in [
        ("{", "not a settings file of bench.py --tune-parallel; run it again or delete the file"),
        (json.dumps(saved | {"jacobi": {"gamma": 0}}), "are not all whole numbers >= 1"),
        (
            json.dumps(saved | {"lookahead": {"window": 600, "ngram": 3, "guesses": 2}}),
            "over MAX_NODES",
        ),
    ]:
        with open(file, "w") as f:
            f.write(damage)
        check_one_line_error(
            *run_cli(
                capsys, "--prompt", "hi", "--draft", "lookahead" if "MAX" in words else "jacobi"
            )[::2],
            file,
            words,
        )


def test_sampling_with_layers_runs(loaded, capsys, tmp_path):
    ids, err = reply_ids(
        capsys, tmp_path, "--draft", "layers:20", "--temperature", "0.8", "--seed", "1"
    )
    assert "sampled" in err.splitlines()[0] and len(ids) > 0


def test_show_marks_the_lookup_tokens(loaded, capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # colours only on a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run_cli(
        capsys,
        "--prompt",
        "Repeat exactly: the cat sat on the mat, the dog sat on the log.",
        "--draft",
        "lookup",
        "--show",
        "--max-new-tokens",
        20,
    )
    assert code == 0, err
    assert f"{terminal.COLOURS[1]}lookup{terminal.COLOURS[0]} = proposed by it" in err
    assert terminal.COLOURS[1] in out  # some of the reply was copied by lookup


# --- the real entry point, in a subprocess -------------------------------------------------------


def test_script_rejects_a_tree_without_evaluating_it():
    t0 = time.time()
    code, out, err = run_script("--prompt", "hi", "--tree", EVIL)
    check_one_line_error(code, err, "is not a tree")
    assert "hi" not in out
    assert time.time() - t0 < 60  # it failed before loading the model
    check_one_line_error(
        *run_script("--prompt", "hi", "--max-new-tokens", "lots")[::2], "invalid int value: 'lots'"
    )


def test_script_model_not_on_the_hub():
    t0 = time.time()
    code, out, err = run_script("--prompt", "hi", "--model", "nobody/nothing-123")
    check_one_line_error(code, err, "'nobody/nothing-123' could not be found or downloaded")
    assert time.time() - t0 < 90


def test_script_prompt_too_long_after_loading_the_model():
    """The model and tokenizer load before this check: nothing else may reach stderr."""
    code, out, err = run_script("--raw", "--prompt", "hello world " * 4600, "--heads", "none")
    check_one_line_error(code, err, "tokens, the model's context holds 8192")
    assert out == ""


# --- text, files and the model's config.json, checked where they enter -------------------------


def test_text_that_is_not_valid_unicode(no_model, capsys, tmp_path):
    """A lone surrogate cannot be tokenized or printed: Python makes one of each command-line byte
    that is not UTF-8 ("caf\\xe9" in Latin-1), and JSON of an unpaired \\ud800 escape."""
    check_one_line_error(
        *run_cli(capsys, "--prompt", "caf\udce9")[::2],
        "--prompt: not valid Unicode text",
        "pass UTF-8 text",
    )
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--system", "\ud800")[::2],
        "--system: not valid Unicode text",
    )
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "fine"}\n{"prompt": "an unpaired \\ud800 escape"}\n')
    check_one_line_error(
        *run_cli(capsys, "--prompts", file)[::2],
        f"--prompts {file}, line 2: not valid Unicode text",
    )


def test_script_prompt_bytes_that_are_not_utf8():
    p = subprocess.run(
        [sys.executable, "generate.py", "--prompt", b"caf\xe9"],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1", LC_ALL="C.UTF-8"),
    )
    check_one_line_error(
        p.returncode, p.stderr.decode("utf-8", "replace"), "--prompt: not valid Unicode text"
    )


def test_out_that_is_the_prompts_file_is_refused(no_model, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    text = '{"prompt": "Name a river."}\n'
    prompts.write_text(text)
    os.symlink(prompts, tmp_path / "link.jsonl")
    os.link(prompts, tmp_path / "hard.jsonl")
    for out in (
        prompts,
        tmp_path / "link.jsonl",
        tmp_path / "hard.jsonl",
        tmp_path / "." / "prompts.jsonl",
    ):
        check_one_line_error(
            *run_cli(capsys, "--prompts", prompts, "--out", out)[::2],
            "is the --prompts file",
            "give another --out",
        )
    code, _, err = run_script("--prompts", prompts, "--out", prompts)  # the real entry point
    check_one_line_error(code, err, "writing it would overwrite the prompts")
    assert prompts.read_text() == text


TINY_CONFIG = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


@pytest.mark.parametrize(
    "change, words",
    [
        ([1, 2], "not a JSON object {...} but a JSON list"),
        ("llama", "not a JSON object {...} but a JSON str"),
        ({"hidden_size": None}, "field 'hidden_size' is missing"),
        ({"hidden_size": "16"}, "field 'hidden_size' must be a positive integer, got '16'"),
        (
            {"num_hidden_layers": 1.5},
            "field 'num_hidden_layers' must be a positive integer, got 1.5",
        ),
        (
            {"num_attention_heads": 0},
            "field 'num_attention_heads' must be a positive integer, got 0",
        ),
        ({"vocab_size": True}, "field 'vocab_size' must be a positive integer, got True"),
        ({"rms_norm_eps": -1e-5}, "field 'rms_norm_eps' must be a positive number"),
        (
            {"hidden_size": 18, "num_attention_heads": 4},
            "hidden_size 18 is not a multiple of num_attention_heads 4",
        ),
        (
            {"num_key_value_heads": 3},
            "num_attention_heads 2 must be a multiple of num_key_value_heads 3",
        ),
        ({"eos_token_id": "</s>"}, "field 'eos_token_id' must be a token id"),
        ({"tie_word_embeddings": "yes"}, "field 'tie_word_embeddings' must be true or false"),
        ({"rope_scaling": [2.0]}, "field 'rope_scaling' must be an object or null"),
        ({"rope_scaling": {"rope_type": "linear"}}, "field 'rope_scaling.factor' is missing"),
    ],
)
def test_model_config_json_damaged(capsys, tmp_path, change, words):
    config = (
        change
        if not isinstance(change, dict)
        else {k: v for k, v in (TINY_CONFIG | change).items() if v is not None}
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--model", tmp_path)[::2],
        f"{tmp_path}/config.json: ",
        words,
        "fix it or pass another model",
    )


def test_model_weights_that_do_not_fit_config_json(capsys, tmp_path, tiny_model_dir):
    import shutil

    folder = shutil.copytree(tiny_model_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": 48}))
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--model", folder)[::2],
        "do not fit its config.json: size mismatch",
    )


# --- temperatures, notices and colour -----------------------------------------------------------


def test_tiny_temperatures_decode_greedily(capsys, tmp_path, tiny_model_dir):
    ids = {}
    # 1e-45: logits / T is inf, softmax NaN, without the threshold
    for t in ("0", "1e-30", "1e-45"):
        out = tmp_path / f"{t}.jsonl"
        code, _, err = run_cli(
            capsys,
            "--model",
            tiny_model_dir,
            "--heads",
            "none",
            "--prompt",
            "hi",
            "--temperature",
            t,
            "--max-new-tokens",
            6,
            "--quiet",
            "--out",
            out,
        )
        assert code == 0, err
        assert (t == "0") != (
            f"notice: --temperature {float(t)} is below 0.0001: decoding greedily" in err
        ), err
        ids[t] = json.loads(out.read_text())["token_ids"]
    assert ids["1e-30"] == ids["1e-45"] == ids["0"]


def test_library_verifiers_at_a_tiny_temperature_are_greedy():
    torch.manual_seed(0)
    model = rows.Model(tiny_config(vocab_size=12)).eval().requires_grad_(False)
    heads = heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=2), model).eval()
    tree = tree_lib.build(tree_lib.cartesian([2, 2]))
    want = decode.generate(model, [1, 2, 3], 20).tokens
    for verify in ("sample", "typical"):
        got = decode.generate(
            model,
            [1, 2, 3],
            20,
            drafters.HeadsDrafter(heads, tree),
            verify,
            1e-40,
            generator=torch.Generator().manual_seed(0),
        )
        assert got.tokens == want, verify


def test_flags_without_effect_get_a_notice_on_stderr(capsys, tiny_model_dir):
    plain = ["--model", tiny_model_dir, "--heads", "none", "--prompt", "hi", "--max-new-tokens", 3]
    code, out, err = run_cli(
        capsys,
        *plain,
        "--top-p",
        0.5,
        "--seed",
        4,
        "--verify",
        "sample",
        "--raw",
        "--system",
        "Be brief.",
    )
    assert code == 0, err
    for words in (
        "--top-p has no effect at --temperature 0",
        "--seed has no effect at --temperature 0",
        "--verify sample at --temperature 0 is greedy verification",
        "--verify has no effect without a drafter",
        "--system has no effect with --raw",
    ):
        assert f"notice: {words}" in err
    # stdout: only the generated text
    assert "notice" not in out and len(out.strip().splitlines()) <= 1
    code, out, err = run_cli(capsys, *plain)
    assert code == 0 and "notice" not in err, err


def test_colour_codes_only_on_a_terminal(capsys, monkeypatch, tmp_path, tiny_model_dir):
    """--show colours drafted tokens on a terminal; into a file or a pipe the text stays plain."""
    model, _ = checkpoint.load(tiny_model_dir)
    checkpoint.save_heads(
        heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=2), model), tmp_path
    )
    argv = [
        "--model",
        tiny_model_dir,
        "--heads",
        tmp_path,
        "--prompt",
        "hi",
        "--max-new-tokens",
        16,
        "--show",
    ]
    code, out, err = run_cli(capsys, *argv)  # capsys: not a terminal
    assert code == 0, err
    assert "\033[" not in out + err and "notice: --show colours only a terminal" in err
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, out, err = run_cli(capsys, *argv)
    # the tiny model repeats: drafts are accepted
    assert code == 0 and "\033[" in out and "notice: --show" not in err


def test_a_model_without_a_chat_template_is_said_so(capsys, tmp_path, tiny_model_dir):
    import shutil

    folder = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    code, _, err = run_cli(
        capsys,
        "--model",
        folder,
        "--heads",
        "none",
        "--prompt",
        "Hi",
        "--max-new-tokens",
        2,
        "--dtype",
        "fp32",
    )
    assert code == 0 and "notice: the model's tokenizer has no chat template" in err, err


def write_prompts(path, texts):
    path.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts))
    )
    return path


@pytest.mark.parametrize("draft", ["heads", "lookup", "jacobi", "lookahead"])  # every one batches
def test_a_batch_writes_what_one_prompt_at_a_time_writes(capsys, tmp_path, tiny_model_dir, draft):
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        ["hi", "a longer prompt, with words", "b", "say it again: say it", "x y"],
    )
    got = {}
    for size in (1, 3):
        out = tmp_path / f"{size}.jsonl"
        code, stdout, err = run_cli(
            capsys, "--model", tiny_model_dir, "--draft", draft, "--prompts", prompts,
            "--max-new-tokens", 9, "--batch-size", size, "--out", out,
        )  # fmt: skip
        assert code == 0, err
        # written as each reply ends: in the order they end, each named by its prompt's id
        got[size] = sorted(
            (json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"]
        )
        assert [r["id"] for r in got[size]] == ["p0", "p1", "p2", "p3", "p4"]
        assert all(r["stopped"] in ("eos", "length") for r in got[size])
    assert [r["token_ids"] for r in got[1]] == [r["token_ids"] for r in got[3]]
    assert sorted(line.split("]")[0] for line in stdout.splitlines()) == [
        f"[p{i}" for i in range(5)
    ]


def test_a_sampled_batch_row_is_its_prompt_alone_at_its_seed(capsys, tmp_path, tiny_model_dir):
    """--batch-size at a temperature, drafts sampled too (a draft model): prompt i's reply is the
    one it gets alone at --seed + i; its drafts come from its own generator, as its verification."""
    texts = ["hi", "a longer prompt, with words", "b"]
    argv = ["--model", tiny_model_dir, "--draft", "model", "--draft-model", tiny_model_dir]
    argv += ["--temperature", "30"]  # the tiny model is sharply peaked: flattened, draws vary
    argv += ["--max-new-tokens", 12, "--dtype", "fp32"]
    out = tmp_path / "batch.jsonl"
    prompts = write_prompts(tmp_path / "p.jsonl", texts)
    code, _, err = run_cli(
        capsys, *argv, "--prompts", prompts, "--batch-size", 3, "--seed", 5, "--out", out
    )
    assert code == 0, err
    batch = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    for i, text in enumerate(texts):
        alone = tmp_path / f"{i}.jsonl"
        one = write_prompts(alone.with_suffix(".in"), [text])
        code, _, err = run_cli(capsys, *argv, "--prompts", one, "--seed", 5 + i, "--out", alone)
        assert code == 0, err
        assert json.loads(alone.read_text())["token_ids"] == batch[f"p{i}"], i


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--batch-size", "0"], ["--batch-size 0", "at least 1"]),
        (["--batch-size", "-3"], ["--batch-size -3", "at least 1"]),
    ],
)
def test_a_batch_size_that_cannot_be_gets_one_line(capsys, tmp_path, tiny_model_dir, argv, words):
    prompts, out = write_prompts(tmp_path / "p.jsonl", ["hi", "yo"]), tmp_path / "out.jsonl"
    code, _, err = run_cli(
        capsys, "--model", tiny_model_dir, "--prompts", prompts, "--out", out, *argv
    )
    check_one_line_error(code, err, *words)
    assert not out.exists()


def test_a_batch_larger_than_the_prompts_is_clamped_with_a_notice(capsys, tmp_path, tiny_model_dir):
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi", "yo"])
    code, out, err = run_cli(
        capsys, "--model", tiny_model_dir, "--heads", "none", "--prompts", prompts,
        "--max-new-tokens", 3, "--batch-size", 8, "--show",
    )  # fmt: skip
    assert code == 0, err
    assert "notice: --batch-size 8: there are only 2 prompts; decoding 2 at a time" in err
    assert "notice: --show has no effect with --batch-size (replies are printed whole" in err
    assert out.startswith("[p0] ") and "\n[p1] " in out


def test_a_batch_whose_cache_would_not_fit_is_refused_before_it_is_made(
    capsys, tmp_path, tiny_model_dir, monkeypatch
):
    prompts, out = write_prompts(tmp_path / "p.jsonl", ["hi", "yo", "oh"]), tmp_path / "out.jsonl"
    monkeypatch.setattr(cli, "free_memory", lambda device: 3 * 1024)  # bytes: room for no batch
    code, _, err = run_cli(
        capsys, "--model", tiny_model_dir, "--prompts", prompts, "--out", out,
        "--max-new-tokens", 8, "--batch-size", 3,
    )  # fmt: skip
    check_one_line_error(code, err, "--batch-size 3", "GB are free", "use --batch-size 1")
    assert not out.exists()


# --- what a user trying the tool ran into (issue 58) ---------------------------------------------


def test_more_threads_than_cores_are_refused_before_the_model_loads(no_model, capsys):
    cores = len(os.sched_getaffinity(0))
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--threads", 999)[::2],
        "--threads 999",
        f"give at most {cores}",
    )


def test_an_existing_out_is_refused_unless_overwrite(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "out.jsonl"
    out.write_text("earlier replies\n")
    argv = ["--model", tiny_model_dir, "--heads", "none", "--prompt", "hi", "--out", out]
    code, _, err = run_cli(capsys, *argv, "--max-new-tokens", 2)
    check_one_line_error(code, err, "--out", "exists", "--overwrite")
    assert out.read_text() == "earlier replies\n"
    code, _, err = run_cli(capsys, *argv, "--max-new-tokens", 2, "--overwrite")
    assert code == 0, err
    assert json.loads(out.read_text())["new_tokens"] == 2
    assert "--overwrite" in command.build_parser().format_help()


def test_heads_none_with_a_drafter_without_heads_is_accepted(capsys, tiny_model_dir):
    code, _, err = run_cli(
        capsys, "--model", tiny_model_dir, "--prompt", "hi", "--max-new-tokens", 3,
        "--draft", "lookup", "--heads", "none",
    )  # fmt: skip
    assert code == 0, err
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--draft", "lookup", "--heads", "medusa")[::2],
        "drafts without heads",
    )


def test_dtype_help_says_where_auto_is_bf16():
    """kernels.pick_dtype: bf16 wherever kernels.c runs (AVX2 too), not only on AVX-512."""
    text = " ".join(command.build_parser().format_help().split())
    assert "bf16 where kernels.c runs" in text and "AVX-512 and newer" not in text


@pytest.mark.parametrize("name", ["./no-such-model", "~/no-such-model", "{tmp}/no/such"])
def test_a_missing_local_model_folder_is_no_such_folder(capsys, tmp_path, name):
    """A path that looks local is not looked up on the hub: no word of network or HF_TOKEN."""
    name = name.format(tmp=tmp_path)
    line = check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--model", name)[::2], "no such folder"
    )
    assert "HF_TOKEN" not in line and "network" not in line


def test_the_banner_names_the_heads_folder(capsys, tmp_path, tiny_model_dir):
    base = checkpoint.load(tiny_model_dir, "cpu", torch.float32)[0]
    folder = tmp_path / "my-heads"
    checkpoint.save_heads(heads_lib.build(heads_lib.HeadsConfig("medusa", 2), base), folder)
    code, _, err = run_cli(
        capsys, "--model", tiny_model_dir, "--heads", folder, "--prompt", "hi",
        "--max-new-tokens", 3,
    )  # fmt: skip
    assert code == 0, err
    assert "heads: medusa" in err and f"heads from {folder}" in err


def test_counts_are_singular_for_one():
    assert cli.plural(1, "message") == "1 message" and cli.plural(2, "repeat") == "2 repeats"
    assert cli.plural(0, "[LA] token") == "0 [LA] tokens"


def test_a_batch_calls_on_done_with_each_final_result(tiny):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]
    seen = {}

    def on_done(i, r):
        assert i not in seen
        seen[i] = (list(r.tokens), list(r.accepted), r.steps, r.stopped)

    results = engine.generate_batch(tiny, prompts, [5, 3, 6, 4, 2], batch_size=2, on_done=on_done)
    assert seen == {i: (r.tokens, r.accepted, r.steps, r.stopped) for i, r in enumerate(results)}


def test_ctrl_c_in_a_batch_keeps_the_replies_that_ended(
    capsys, tmp_path, tiny_model_dir, monkeypatch
):
    """Each reply is printed and written as it ends: a Ctrl-C after two of them keeps both."""
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi", "a longer prompt", "b", "say it", "x"])
    out = tmp_path / "out.jsonl"
    real = engine.generate_batch

    def interrupted(*args, on_done=None, **kw):
        ended = []

        def done(i, r):
            on_done(i, r)
            ended.append(i)
            if len(ended) == 2:
                raise KeyboardInterrupt

        return real(*args, on_done=done, **kw)

    monkeypatch.setattr(engine, "generate_batch", interrupted)
    code, stdout, err = run_cli(
        capsys, "--model", tiny_model_dir, "--draft", "lookup", "--prompts", prompts,
        "--max-new-tokens", 6, "--batch-size", 2, "--out", out,
    )  # fmt: skip
    assert code == 130, err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 2 and len(stdout.splitlines()) == 2
    assert {r["id"] for r in lines} <= {f"p{i}" for i in range(5)}


@pytest.mark.parametrize("draft", [["--heads", "none"], ["--draft", "lookup"]])
def test_cuda_graphs_on_a_cpu_runs_the_static_step_with_the_same_reply(
    capsys, tiny_model_dir, draft
):
    """--cuda-graphs on where there is no CUDA: graphs.py's static step runs uncaptured (said in a
    notice), the reply is the readable forward's, and what ran eagerly (the prefill) is named."""
    argv = ["--model", tiny_model_dir, "--prompt", "hi there", "--max-new-tokens", 12, *draft]
    code, readable, err = run_cli(capsys, *argv, "--cuda-graphs", "off")
    assert code == 0, err
    assert "static steps" not in err
    code, static, err = run_cli(capsys, *argv, "--cuda-graphs", "on")
    assert code == 0, err
    assert static == readable
    assert "has no CUDA graphs" in err and "static steps, cuda graphs off: " in err
    assert "outside them: 1 prompt prefill]" in err, err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--quantize", "int8"], "--exact computes bf16 weights, not --quantize int8"),
        (["--device", "cpu"], "--exact: exact.py's kernels run on a CUDA GPU, not on cpu"),
    ],
)
def test_exact_is_refused_before_the_model_loads(no_model, capsys, monkeypatch, argv, words):
    monkeypatch.setattr(exact, "triton", None)  # as where triton is not installed
    code, _, err = run_cli(capsys, "--prompt", "hi", "--exact", *argv)
    check_one_line_error(code, err, words)


def test_a_conversation_in_prompts_is_checked_before_the_model_loads(no_model, capsys, tmp_path):
    """Its answered message empty, or --raw (no template to lay it out): refused in one line."""
    file = tmp_path / "prompts.jsonl"
    empty = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    }
    empty["messages"].append({"role": "user", "content": " "})
    file.write_text(json.dumps(empty) + "\n")
    check_one_line_error(
        *run_cli(capsys, "--prompts", file)[::2],
        "line 1: the last message, the one answered, is empty",
    )
    file.write_text(json.dumps({"messages": empty["messages"][:1], "id": "c"}) + "\n")
    check_one_line_error(
        *run_cli(capsys, "--prompts", file, "--raw")[::2], "--raw", "(id 'c'", "drop --raw"
    )
