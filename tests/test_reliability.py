"""Reliability: Ctrl-C keeps the text so far and exits 130; the KV caches are allocated once and
generation stops at the context; nothing the project loads can run code; the same seed gives the
same output through the command line, for plain and for speculative sampling.

The Ctrl-C and seed tests run `python generate.py` in subprocesses (about 5 s each to load the
default model); the cache test uses a tiny random model in-process.
"""

import ast
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from specdec.loading import checkpoint
from specdec import drafters
from specdec.engines import decode
import heads as heads_lib
from specdec import rows
import tree as tree_lib
from conftest import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def start_script(*argv):
    """`python generate.py argv` in the background, with Ctrl-C doing what it does in a terminal
    (a shell may have started us with SIGINT ignored, and children inherit that)."""
    return subprocess.Popen(
        [sys.executable, "generate.py", *map(str, argv)],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


# --- Ctrl-C -------------------------------------------------------------------------------------


def test_ctrl_c_keeps_the_text_and_exits_130():
    p = start_script(
        "--prompt",
        "Tell me a very long story about a dragon and a lighthouse.",
        "--max-new-tokens",
        4000,
        "--heads",
        "none",
        "--dtype",
        "fp32",
    )
    watchdog = threading.Timer(180, p.kill)
    watchdog.start()
    try:
        first = p.stdout.read1(1 << 16)  # blocks until the first streamed text arrives
        assert first, "no text was streamed: " + p.stderr.read().decode()
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=120)
    finally:
        watchdog.cancel()
    out, err = (first + rest).decode("utf-8"), err.decode("utf-8")
    assert p.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    # the text so far is there; no stats: it did not finish
    assert out.strip() and "new tokens" not in err


# --- memory: the KV caches are allocated once ---------------------------------------------------


def spy_on_caches(monkeypatch, owner):
    """Record every cache owner.new_cache() makes, with its storage pointers and shape at birth."""
    made, real = [], owner.new_cache

    def new_cache(*a, **k):
        c = real(*a, **k)
        made.append((c, c.k.data_ptr(), c.v.data_ptr(), c.k.shape))
        return c

    monkeypatch.setattr(owner, "new_cache", new_cache)
    return made


def assert_untouched(made):
    assert len(made) == 1, f"{len(made)} caches allocated, want 1"
    c, k_ptr, v_ptr, shape = made[0]
    assert (c.k.data_ptr(), c.v.data_ptr(), c.k.shape, c.v.shape) == (k_ptr, v_ptr, shape, shape)
    assert c.length <= c.max_len == shape[3]
    return c


def test_thousands_of_tokens_stay_in_the_preallocated_cache(monkeypatch):
    torch.manual_seed(0)
    model = rows.Model(tiny_config(max_seq_len=2000)).eval().requires_grad_(False)
    made = spy_on_caches(monkeypatch, model)
    prompt = [1, 2, 3, 4, 5]
    r = decode.generate(model, prompt, 2000 - len(prompt))  # exactly up to the context
    assert len(r.tokens) == 1995 and r.stopped == "length"
    c = assert_untouched(made)
    assert c.length == len(prompt) + len(r.tokens) - 1  # every token but the last was fed back
    with pytest.raises(ValueError, match="context of 2000"):
        decode.generate(model, prompt, 2000 - len(prompt) + 1)


def test_speculative_decoding_stays_in_its_caches_too(monkeypatch):
    torch.manual_seed(0)
    model = rows.Model(tiny_config(vocab_size=12, max_seq_len=600)).eval().requires_grad_(False)
    heads = heads_lib.build(heads_lib.HeadsConfig("hydra++", num_heads=2), model).eval()
    tree = tree_lib.build(tree_lib.cartesian([3, 2]))
    made, made_heads = spy_on_caches(monkeypatch, model), spy_on_caches(monkeypatch, heads)
    prompt = [1, 2, 3]
    r = decode.generate(model, prompt, 600 - len(prompt), drafters.HeadsDrafter(heads, tree))
    assert len(r.tokens) == 597 and r.stopped == "length"
    assert sum(r.accepted) > 0  # drafts were accepted: the cache copies of keep() were exercised
    assert_untouched(made)
    assert_untouched(made_heads)


# --- safe loading -------------------------------------------------------------------------------


def python_files():
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        yield from (os.path.join(folder, f) for f in files if f.endswith(".py"))


def unsafe_calls(path):
    """Lines that could run code from a file or a flag: eval/exec/compile/__import__, torch.load
    without weights_only=True, trust_remote_code not False, pickle."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        where = f"{os.path.relpath(path, ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            func, kw = node.func, {k.arg: k.value for k in node.keywords}
            if isinstance(func, ast.Name) and func.id in ("eval", "exec", "compile", "__import__"):
                found.append(f"{where} {func.id}()")
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "load"
                and ast.unparse(func.value) == "torch"
            ):
                if not (
                    isinstance(kw.get("weights_only"), ast.Constant)
                    and kw["weights_only"].value is True
                ):
                    found.append(f"{where} torch.load without weights_only=True")
            for name in ("trust_remote_code", "allow_pickle"):
                if name in kw and not (
                    isinstance(kw[name], ast.Constant) and kw[name].value is False
                ):
                    found.append(f"{where} {name}={ast.unparse(kw[name])}")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            if any(n.split(".")[0] in ("pickle", "dill", "marshal") for n in names):
                found.append(f"{where} imports {names}")
    return found


def test_nothing_loaded_can_run_code():
    files = list(python_files())
    assert any(f.endswith("generate.py") for f in files) and len(files) >= 8
    found = [line for f in files for line in unsafe_calls(f)]
    assert not found, "unsafe loading:\n" + "\n".join(found)


def test_the_scan_catches_what_it_should(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch, pickle\nx = torch.load('a.pt')\ny = eval('1')\n"
        "z = f(trust_remote_code=True)\nw = torch.load('b.pt', weights_only=True)\nv = m.eval()\n"
    )
    found = unsafe_calls(str(bad))
    assert [s.split(" ", 1)[1] for s in found] == [
        "imports ['torch', 'pickle']",
        "torch.load without weights_only=True",
        "eval()",
        "trust_remote_code=True",
    ]


# --- the same seed, the same output -------------------------------------------------------------


@pytest.fixture(scope="module")
def random_heads_dir(default_model, tmp_path_factory):
    """Hydra heads for the default model with random weights, so that sampling verification both
    accepts and rejects drafts."""
    torch.manual_seed(0)
    heads = heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=3), default_model[0])
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    folder = tmp_path_factory.mktemp("random_heads")
    checkpoint.save_heads(heads, folder)
    return folder


def test_same_seed_same_output_through_the_cli(random_heads_dir):
    """Two processes each for plain sampling and for speculative sampling, run pairwise at once."""
    common = [
        "--prompt",
        "Name three colours 🎨 and a fruit.",
        "--temperature",
        0.8,
        "--seed",
        3,
        "--max-new-tokens",
        16,
        "--dtype",
        "fp32",
    ]
    for heads in ("none", random_heads_dir):
        runs = [start_script(*common, "--heads", heads) for _ in range(2)]
        results = [p.communicate(timeout=180) for p in runs]
        for p, (out, err) in zip(runs, results):
            assert p.returncode == 0, err.decode()
        (out1, err1), (out2, _) = results
        assert out1 == out2 and out1.strip(), (heads, out1, out2)
        if heads != "none":
            assert b"heads: hydra" in err1
