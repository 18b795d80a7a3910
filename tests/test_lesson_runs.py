"""What you read is what runs: an edit to the lesson changes what `python generate.py` does.

    - verify.greedy made to accept no draft: the shipped heads' reply through the command line
      reports tau 1.00 (every step emits its bonus token alone);
    - generate.step recording its calls: one prompt through the command line calls it once a step;
    - a reader's print in step() shows on the command line's output;
    - bench.py times that same step: its plain and heads methods call generate.step.

Test: `python -m pytest -q tests/test_lesson_runs.py`.
"""

import json
import os
import re
import subprocess
import sys

import generate as G

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = ["--prompt", "Give me three tips for staying focused while studying."]
# generate.py run as `python generate.py ARGS` would, after `patch` (Python code) has run
AS_THE_COMMAND = "import runpy, sys\n{patch}\nsys.argv[0] = 'generate.py'\n" + (
    "runpy.run_path('generate.py', run_name='__main__')"
)
REJECT_EVERY_DRAFT = """import torch, verify
def greedy(logits, tokens, tree):
    return torch.tensor([0]), int(logits[0].argmax())
verify.greedy = greedy"""


def run(patch, *argv, cwd=ROOT):
    """The command's stdout and stderr, after `patch`; it must exit 0."""
    code = AS_THE_COMMAND.format(patch=patch)
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    return p.stdout + p.stderr


def test_verify_greedy_accepting_nothing_gives_tau_1_on_the_command_line(default_model):
    argv = [*PROMPT, "--max-new-tokens", "16", "--quiet"]
    rejected = run(REJECT_EVERY_DRAFT, *argv)
    assert "heads: hydra++" in rejected  # the shipped heads drafted
    assert re.search(r"tau 1\.00\b", rejected)
    assert not re.search(r"tau 1\.00\b", run("", *argv))  # unpatched, they are accepted


def test_one_prompt_calls_generate_step_once_a_step(tiny_model_dir, monkeypatch, capsys):
    calls = []
    step = G.step

    def recorded(*args):
        calls.append(args)
        return step(*args)

    monkeypatch.setattr(G, "step", recorded)
    argv = ["--model", tiny_model_dir, "--prompt", "hello", "--max-new-tokens", "9", "--raw"]
    assert G.cli_main([*argv, "--quiet", "--heads", "none"]) == 0
    forwards = int(re.search(r"(\d+) forward passes", capsys.readouterr().err).group(1))
    assert len(calls) == forwards - 1 > 0  # the prefill is a forward pass, not a step


def test_a_print_in_step_shows(tiny_model_dir, tmp_path):
    source = open(os.path.join(ROOT, "generate.py"), encoding="utf-8").read()
    body = "    tokens = fill_tree(heads, seq.h, seq.root, tree)"
    assert source.count(body) == 1
    edited = source.replace(body, '    print("a reader was here")\n' + body)
    (tmp_path / "generate.py").write_text(edited, encoding="utf-8")
    argv = ["--model", tiny_model_dir, "--prompt", "hi", "--max-new-tokens", "4", "--raw"]
    out = run("", *argv, "--heads", "none", cwd=str(tmp_path))
    assert "a reader was here" in out


def test_bench_times_the_step_generate_py_runs(tiny_model_dir, monkeypatch, capsys, tmp_path):
    """bench.py's plain decoding and heads methods decode through generate.generate: the steps
    they report are generate.step's calls (the warm-up's too)."""
    import bench as B
    from test_bench_cli import saved_heads, short_run

    calls = []
    step = G.step

    def recorded(model, cache, heads, *rest):
        calls.append("plain" if heads is None else "heads")
        return step(model, cache, heads, *rest)

    monkeypatch.setattr(G, "step", recorded)
    saved_heads(tmp_path / "heads-hydra++", tiny_model_dir)
    record = tmp_path / "bench.json"
    argv = [*short_run(tmp_path, tiny_model_dir), "--methods", "plain,hydra++"]
    argv += ["--heads-dir", tmp_path, "--json", record]
    assert B.cli_main([str(a) for a in argv]) == 0, capsys.readouterr().err
    for name, kind in (("plain", "plain"), ("hydra++", "heads")):
        steps = json.loads(record.read_text())["methods"][name]["per_prompt"][0]["steps"]
        assert calls.count(kind) >= steps - 1 > 0  # the prefill is a forward, not a step
