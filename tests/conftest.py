"""Shared fixtures: a tiny random Llama (fast, most tests) and the real default model (a few);
for command-line tests, a tripwire for model loading and a folder that cannot be written."""

import os
import signal
import tempfile

import pytest
import torch

from specdec.loading import checkpoint
import model as model_lib
from specdec import rows

torch.set_num_threads(1)  # tests use tiny tensors: one thread avoids contention overhead
# exact.py's Triton kernels run in Triton's interpreter where there is no GPU: triton reads this as
# it decorates them, so it is set before any test imports exact (bench.py imports it too)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Ctrl-C's tests press it in this process and in the scripts it starts. A shell that starts
    pytest as a background job without job control hands it SIGINT ignored, which every child
    inherits: Python's own handler back, as a run in a terminal has it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def threads_as_they_were(monkeypatch):
    """--threads 0 counts the cores other work keeps busy: in tests, none (the same count whatever
    else the machine runs), and each test leaves torch's thread count as it found it."""
    from specdec import cli

    monkeypatch.setattr(cli, "busy_cores", lambda seconds=0.1: 0)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny_config(**kw):
    base = dict(
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        hidden_dim=64,
        max_seq_len=256,
        name="tiny",
    )
    base.update(kw)
    return model_lib.Config(**base)


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return rows.Model(tiny_config()).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32 on CPU."""
    return checkpoint.load(checkpoint.DEFAULT, "cpu", torch.float32)


# a tiny Llama as transformers configures it: save_tiny_model's, and test_model's stand-in for the
# default model
TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    eos_token_id=2,
    _name_or_path="tiny-random-llama",
)


def torchrun_env(rank, port):
    """What torchrun sets for rank `rank` of two CPU processes, set by hand in a forked worker; one
    thread each, as the two share the cores."""
    os.environ.update(
        WORLD_SIZE="2",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)


def save_tiny_model(folder, seed=0, **config):
    """A tiny random Llama saved as a transformers folder (config.json, safetensors) with the
    default model's tokenizer, so that the scripts load it like any model, in well under a
    second."""
    import json
    import shutil
    from safetensors.torch import save_file

    hf = TINY_LLAMA | config
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(seed)
    model = rows.Model(checkpoint.config_from_hf(hf, hf["_name_or_path"]))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
        os.path.join(folder, "model.safetensors"),
    )
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    default = checkpoint.resolve(checkpoint.DEFAULT)
    for name in os.listdir(default):
        if (
            name.startswith("tokenizer")
            or name.endswith(".jinja")
            or name == "special_tokens_map.json"
        ):
            shutil.copy(os.path.join(default, name), folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The folder of a tiny random Llama with the default model's tokenizer (see
    save_tiny_model)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def no_model(monkeypatch):
    """checkpoint.load raises: the checks under test must fail before any model loads."""

    def tripwire(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(checkpoint, "load", tripwire)


@pytest.fixture
def unwritable(tmp_path):
    """A folder in which this process cannot create files: read-only for a user; for root, who
    ignores permission bits, sysfs."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    candidate = str(folder) if os.geteuid() != 0 else "/sys"
    try:
        tempfile.TemporaryFile(dir=candidate).close()
        pytest.skip(f"{candidate} is writable here")
    except OSError:
        yield candidate
    finally:
        folder.chmod(0o700)


def ctrl_c_after(argv, marker, seconds, sig=None):
    """Run `python argv...` from the repository root as a user would, wait for a stderr line holding
    `marker`, let it work `seconds` more, press Ctrl-C (or send `sig`). Returns (exit code, stdout,
    stderr)."""
    import subprocess
    import sys
    import threading
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen(
        [sys.executable, *map(str, argv)],
        cwd=root,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    watchdog = threading.Timer(120, p.kill)  # a hang fails the test instead of the whole run
    watchdog.start()
    try:
        lines = []
        for line in p.stderr:
            lines.append(line)
            if marker in line:
                break
        time.sleep(seconds)
        p.send_signal(sig or signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        watchdog.cancel()
    return p.returncode, out, "".join(lines) + err


def draft_one(drafter, root):
    """A drafter's draft for one sequence: drafter.draft over itself alone."""
    return drafter.draft([drafter], [root])[0]
