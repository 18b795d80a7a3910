"""Tests for train.py, on a tiny random base model and features it computed (CPU, seeded).

A few steps lower the loss for every head kind, loss and loss implementation; the teacher and
next-token losses equal values worked out by hand, and the teacher loss is smallest at the teacher's
own probabilities, residual mass included; a run stopped by a crash (kill -9), by a crash between
the checkpoint's two writes, or by Ctrl-C (exit 130) resumes to the very batches and weights of an
uninterrupted run; a NaN stops training at a named step and keeps the last good checkpoint; a
malformed ShareGPT line is reported with its number; two CPU processes (gloo) train one set of heads
with DDP. Run: `python -m pytest -q tests/test_train.py`. Shapes: M predictions, V vocabulary, k
teacher top-k.
"""

import errno
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from specdec import cli
from specdec.loading import checkpoint as checkpoint_lib
from specdec.training import dataset as D
import heads as heads_lib
from specdec.fast import kernels
from specdec.training import losses
from specdec import rows
import train as T
from specdec.cli import UsageError
from specdec.commands import train as command
from specdec.training import batches, distributed, prepare, resume
from conftest import tiny_config, torchrun_env

KINDS = ["medusa", "hydra", "hydra++"]
V = 64  # tiny_config's vocabulary


# --- helpers ------------------------------------------------------------------------------------


def experiment(name):
    """experiments/NAME.py: its path, and the script imported as a module."""
    script = os.path.join(os.path.dirname(__file__), "..", "experiments", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return script, module


def run_script(script, *argv):
    """`python SCRIPT ARGV...` in a subprocess: its exit code and stderr."""
    done = subprocess.run([sys.executable, script, *map(str, argv)], capture_output=True, text=True)
    return done.returncode, done.stderr


def tiny_base(seed=0):
    """A tiny random Llama whose LM head is scaled up 4x, so that its next-token distributions are
    as peaked as a trained model's (top-8 mass ~0.8) and the teacher loss has something to teach."""
    torch.manual_seed(seed)
    base = rows.Model(tiny_config()).eval().requires_grad_(False)
    base.lm_head.weight.mul_(4)
    return base


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """(base, folder): 24 random conversations (prompt 3-8 tokens, answer 4-12) and the tiny base
    model's features of them, written by train.features_of as for a user's data set."""
    base = tiny_base()
    g = torch.Generator().manual_seed(0)
    convs = []
    for _ in range(24):
        p, a = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((3, 9), (4, 13)))
        convs.append(
            (torch.randint(1, V, (p + a,), generator=g).tolist(), [False] * p + [True] * a)
        )
    folder = str(tmp_path_factory.mktemp("data") / "features")
    D.features_of(base, convs, folder, top_k=8, batch_tokens=64)
    return base, folder


def args_for(out, *flags):
    """Command-line flags for a tiny run: 2 epochs of ~8 batches, a checkpoint after every step."""
    return command.build_parser().parse_args(
        [
            "--heads",
            "hydra++",
            "--num-heads",
            "2",
            "--kept-tokens",
            "32",
            "--epochs",
            "2",
            "--batch-tokens",
            "48",
            "--lr",
            "3e-3",
            "--save-every",
            "0",
            "--eval-every",
            "5",
            "--noise",
            "5",
            "--out",
            str(out),
            *flags,
        ]
    )


def lesson():
    """train.py's functions, as its cli_main passes them to the package."""
    return command.Lesson(train=T.train, Recipe=T.Recipe, batch_loss=T.batch_loss)


def run(features, out, *flags):
    base, folder = features
    return command.train_heads(base, D.load_data(folder), str(out), args_for(out, *flags), lesson())


def record_steps(monkeypatch, before=None):
    """Wrap batches.Plan.batch, which the loop calls once a step: record each batch's ids;
    before(n, batch) runs first at the n-th call (1-based), before the step, and may raise to stop
    training (then the batch is not recorded)."""
    real, done, calls = batches.Plan.batch, [], [0]

    def batch_of(plan, step):
        calls[0] += 1
        batch = real(plan, step)
        if before:
            before(calls[0], batch)
        done.append(batch["ids"].clone())
        return batch

    monkeypatch.setattr(batches.Plan, "batch", batch_of)
    return done


def checkpoint(out):
    return torch.load(os.path.join(out, resume.STATE), weights_only=True)


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs: max |a - b| = {(a[k] - b[k]).abs().max()}"


@pytest.fixture(scope="module")
def reference(features, tmp_path_factory):
    """An uninterrupted run: the ids of every batch it trained on, and its final checkpoint."""
    out = tmp_path_factory.mktemp("reference")
    mp = pytest.MonkeyPatch()
    try:
        done = record_steps(mp)
        run(features, out)
    finally:
        mp.undo()
    return done, checkpoint(out)


class Crash(Exception):
    """Stands for kill -9: nothing of the run is written after it."""


# --- losses -------------------------------------------------------------------------------------

# Three predictions over a 4-token head vocabulary; each logits row is log q, so softmax(row) = q.
Q = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
TOP_IDS = torch.tensor([[0, 2], [3, -1], [1, 2]])  # -1: a top-k token outside the heads' vocabulary
TOP_P = torch.tensor([[0.6, 0.3], [0.5, 0.25], [0.75, 0.25]])
TARGET = torch.tensor([1, -1, 3])  # data tokens; -1 is not kept
J = torch.tensor([0, 1, 2])  # head - 1, as the fused twin takes it; train.py counts from 1


def check_batch_loss(loss, want):
    """The batch loss over Q's rows is `want`, as train.batch_loss computes it and as the fused one
    does with z = log q through an identity LM head, shared or one per head."""
    got = T.batch_loss(loss, Q.log(), J + 1, TOP_IDS, TOP_P, TARGET).item()
    assert math.isclose(got, want, abs_tol=1e-6)
    for lm_head in (torch.eye(4), torch.eye(4).repeat(3, 1, 1)):
        got = kernels.fused_batch_loss(loss, Q.log(), lm_head, J, TOP_IDS, TOP_P, TARGET).item()
        assert math.isclose(got, want, abs_tol=1e-6)


def test_teacher_loss_by_hand():
    # row 0: r = 1 - 0.9 = 0.1, head mass outside {0, 2} = 1 - 0.625 = 0.375
    #   -(0.6 ln 0.5 + 0.3 ln 0.125 + 0.1 ln 0.375) = 0.4158883 + 0.6238325 + 0.0980829 = 1.1378037
    # row 1: token -1 is dropped; r = 1 - 0.75 = 0.25, head mass outside {3} = 0.75
    #   -(0.5 ln 0.25 + 0.25 ln 0.75) = 0.6931472 + 0.0719205 = 0.7650677
    # row 2: r = 0, no residual term: -(0.75 ln 0.2 + 0.25 ln 0.3) = 1.2070784 + 0.3009932 =
    # 1.5080716
    want = torch.tensor([1.1378037, 0.7650677, 1.5080716])
    assert torch.allclose(T.teacher_loss(Q.log(), TOP_IDS, TOP_P), want, atol=1e-6)
    # the batch loss is their mean: 3.4109430 / 3
    check_batch_loss("teacher", 1.1369810)


def test_next_token_loss_by_hand():
    # -ln q(target): -ln 0.25 = 1.3862944; target -1 (not kept) counts 0; -ln 0.4 = 0.9162907
    want = torch.tensor([1.3862944, 0.0, 0.9162907])
    assert torch.allclose(T.next_token_loss(Q.log(), TARGET), want, atol=1e-6)
    # weights 0.8^head: (0.8 * 1.3862944 + 0.64 * 0 + 0.512 * 0.9162907) / 3 = (1.1090355 +
    # 0.4691408) / 3
    check_batch_loss("next-token", 0.5260588)


def test_teacher_loss_is_smallest_at_the_teachers_probabilities_with_the_residual():
    # teacher: top-2 = {0: 0.6, 2: 0.3}, residual 0.1 spread over tokens 1 and 3 in some unrecorded
    # way
    ids, p = torch.tensor([[0, 2]]), torch.tensor([[0.6, 0.3]])
    # any split of the residual is optimal
    for q in ([0.6, 0.05, 0.3, 0.05], [0.6, 0.1, 0.3, 0.0001]):
        logits = torch.tensor([q]).log().requires_grad_()
        T.teacher_loss(logits, ids, p).sum().backward()
        assert logits.grad.abs().max() < 1e-4, logits.grad
    # renormalising over the top-k (q = 2/3, 1/3 on the two) is worse, and a gradient step leaves it
    renormalised = torch.tensor([[2 / 3, 1e-6, 1 / 3, 1e-6]]).log()
    best = torch.tensor([[0.6, 0.05, 0.3, 0.05]]).log()
    assert T.teacher_loss(renormalised, ids, p) > T.teacher_loss(best, ids, p) + 0.1
    # a batch with no predictions (e.g. answers too short for any head) costs 0, not NaN
    none = (
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, 2, dtype=torch.long),
        torch.zeros(0, 2),
        torch.zeros(0, dtype=torch.long),
    )
    assert T.batch_loss("teacher", torch.zeros(0, 4), *none) == 0
    assert kernels.fused_batch_loss("teacher", torch.zeros(0, 4), torch.eye(4), *none) == 0


@pytest.mark.parametrize("impl", ["fused", "readable"])
@pytest.mark.parametrize("loss", ["teacher", "next-token"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_few_steps_lower_the_loss(features, kind, loss, impl):
    base, folder = features
    data = D.load_data(folder)
    kept, to_kept, _ = batches.kept_vocabulary(data, V, 32)
    torch.manual_seed(0)
    heads = heads_lib.build(heads_lib.HeadsConfig(kind, num_heads=3), base, kept).train()
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    batch = losses.collate(data, list(range(6)), to_kept, 3, "cpu")
    assert batch["valid"].any(), "the batch must hold something to predict"
    readable = {"fused": None, "readable": T.batch_loss}
    seen = [
        losses.train_step(losses.TrainForward(heads, readable[impl]), opt, batch, 1e-2, loss)
        for _ in range(12)
    ]
    assert seen[-1] < 0.8 * seen[0], seen


class Steps:
    """A plan and a session for train.train by hand: the same batch every step, no noise; the
    losses seen."""

    def __init__(self, batch, total):
        self.total, self.the_batch, self.seen = total, batch, []

    def batch(self, step):
        return self.the_batch

    def noise(self, step):
        return None

    def after_step(self, step, loss, batch):
        self.seen.append(loss)


@pytest.mark.parametrize("bf16", [False, True])
def test_the_loops_step_is_losses_train_step(features, bf16):
    """online.py's optimizer step (losses.train_step) and train.py's loop take the very same steps:
    equal losses and bit-identical weights, fused and readable."""
    base, folder = features
    data = D.load_data(folder)
    kept, to_kept, _ = batches.kept_vocabulary(data, V, 32)
    batch = losses.collate(data, list(range(6)), to_kept, 3, "cpu")
    total, recipe = 4, T.Recipe(loss="teacher", lr=1e-2, noise=0.0, bf16=bf16)
    for readable in (None, T.batch_loss):
        weights, seen = [], []
        for how in ("loop", "train_step"):
            torch.manual_seed(0)
            heads = heads_lib.build(heads_lib.HeadsConfig("hydra++", num_heads=3), base, kept)
            opt = torch.optim.AdamW(heads.train().parameters(), lr=1e-2)
            forward = losses.TrainForward(heads, readable)
            if how == "loop":
                steps = Steps(batch, total)
                assert T.train(forward, opt, steps, recipe, 0, steps) == total
                seen.append(steps.seen)
            else:
                lrs = [T.learning_rate(s, total, 1e-2) for s in range(total)]
                step = lambda lr: losses.train_step(forward, opt, batch, lr, "teacher", bf16=bf16)
                seen.append([step(lr) for lr in lrs])
            weights.append(heads.state_dict())
        assert seen[0] == seen[1]
        assert_same_weights(*weights)


# --- checkpoints and resuming -------------------------------------------------------------------


def crash_during_step(monkeypatch, n):
    def before(calls, batch):
        if calls == n:
            raise Crash

    return record_steps(monkeypatch, before), Crash


def crash_between_writes(monkeypatch, n):
    """The n-th checkpoint dies after state.pt is renamed into place, before the heads files."""
    real, saves = checkpoint_lib.save_heads, [0]

    def save(heads, folder):
        saves[0] += 1
        if saves[0] == n:
            raise Crash
        real(heads, folder)

    monkeypatch.setattr(checkpoint_lib, "save_heads", save)
    return record_steps(monkeypatch), Crash


def ctrl_c_during_step(monkeypatch, n):
    def before(calls, batch):
        if calls == n:
            os.kill(os.getpid(), signal.SIGINT)  # delivered now, in the middle of the step

    return record_steps(monkeypatch, before), SystemExit


@pytest.mark.parametrize("stop", [crash_during_step, crash_between_writes, ctrl_c_during_step])
def test_resume_continues_exactly(features, reference, tmp_path, monkeypatch, stop):
    ref_batches, ref_state = reference
    n = 11  # in the second epoch
    assert len(ref_batches) == ref_state["step"] > n
    with monkeypatch.context() as mp:
        done, raised = stop(mp, n)
        with pytest.raises(raised) as e:
            run(features, tmp_path)
    if raised is SystemExit:
        assert e.value.code == 130  # Ctrl-C: checkpoint of the finished step, 130
    state = checkpoint(tmp_path)
    assert state["step"] == len(done) in (n - 1, n)  # the checkpoint is of the last step done
    if stop is crash_between_writes:  # the heads files lag state.pt by one step...
        lagging = checkpoint_lib.load_heads(str(tmp_path), features[0]).state_dict()
        assert not all(torch.equal(lagging[k], state["heads"][k]) for k in lagging)
    after = record_steps(monkeypatch)  # ...and resuming ignores them
    run(features, tmp_path, "--resume")
    done = done + after
    assert len(done) == len(ref_batches)
    assert all(torch.equal(a, b) for a, b in zip(done, ref_batches)), (
        "the resumed run saw other batches"
    )
    final = checkpoint(tmp_path)
    assert final["step"] == ref_state["step"]
    assert_same_weights(final["heads"], ref_state["heads"])
    # the learning curve (held-out tau every 5 steps, tokens trained on) continues as if never
    # stopped
    assert final["progress"] == ref_state["progress"] and len(ref_state["progress"]["curve"]) >= 3
    exported = {
        k: v.half().float() if v.is_floating_point() else v for k, v in ref_state["heads"].items()
    }
    assert_same_weights(
        checkpoint_lib.load_heads(str(tmp_path), features[0]).state_dict(), exported
    )  # heads files: fp16


def test_resume_refuses_a_checkpoint_of_other_heads(features, tmp_path):
    heads = heads_lib.build(heads_lib.HeadsConfig("medusa", num_heads=2), features[0])
    resume.save_checkpoint(
        str(tmp_path),
        heads,
        torch.optim.AdamW(heads.parameters()),
        3,
        {"config": asdict(heads.cfg), "data": [24, 0]},
    )
    with pytest.raises(ValueError, match="other heads or data"):
        run(features, tmp_path, "--resume")


def test_resume_refuses_a_checkpoint_of_another_number_of_processes(features, tmp_path):
    # the processes set a step's batches and the schedule's length: resuming with others would not
    # continue the run
    run(features, tmp_path, "--epochs", "1")
    state = resume.read_checkpoint(str(tmp_path))
    assert state["flags"]["processes"] == 1 and isinstance(state["flags"]["bf16_products"], bool)
    state["flags"]["processes"] = 4
    torch.save(state, tmp_path / resume.STATE)
    with pytest.raises(ValueError, match=r"--processes 1 \(checkpoint: 4\)"):
        run(features, tmp_path, "--epochs", "1", "--resume")


def test_nan_stops_training_and_keeps_the_last_good_checkpoint(features, tmp_path, monkeypatch):
    def poison(calls, batch):
        if calls == 5:  # NaN hidden states where heads predict
            batch["hidden"][batch["valid"].any(-1)] = float("nan")

    record_steps(monkeypatch, poison)
    with pytest.raises(FloatingPointError, match=r"step 5: loss nan.*last checkpoint \(step 4\)"):
        run(features, tmp_path)
    state = checkpoint(tmp_path)
    assert state["step"] == 4
    assert all(torch.isfinite(w).all() for w in state["heads"].values())
    exported = checkpoint_lib.load_heads(str(tmp_path), features[0]).state_dict()
    half = {k: v.half().float() if v.is_floating_point() else v for k, v in state["heads"].items()}
    assert_same_weights(exported, half)  # nothing of step 5 reached the disk


def full_disk(monkeypatch, n, how):
    """The n-th checkpoint meets a full disk: state.pt.tmp gets some bytes, then ENOSPC, as an
    OSError from the write (how="oserror") or, as torch's writer reports a real one, a RuntimeError
    over it (how="torch"). Returns the checkpoints written before."""
    real, saves = torch.save, [0]

    def save(obj, f):
        saves[0] += 1
        if saves[0] < n:
            return real(obj, f)
        f.write(b"PK partial")
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if how == "oserror":
            raise full
        try:
            raise full
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")

    monkeypatch.setattr(resume.torch, "save", save)
    return saves


@pytest.mark.parametrize("how", ["oserror", "torch"])
def test_a_full_disk_at_a_checkpoint_is_one_line_and_leaves_no_temporary_file(
    features, tmp_path, monkeypatch, how
):
    with monkeypatch.context() as mp:
        full_disk(mp, 4, how)
        with pytest.raises(cli.UsageError) as e:
            run(features, tmp_path)
    assert str(e.value) == (
        f"--out {tmp_path}: writing the checkpoint of step 4 failed (No space left on device); "
        f"the last checkpoint (step 3) in {tmp_path} is kept; free some space and run again with "
        "--resume, or give an --out on another disk"
    )
    assert sorted(os.listdir(tmp_path)) == ["heads.json", "heads.safetensors", "state.pt"]
    assert checkpoint(tmp_path)["step"] == 3


def test_a_full_disk_under_the_heads_files_leaves_no_temporary_file(features, tmp_path):
    """safetensors says only "os error 28": an OSError all the same, and neither temporary file."""
    heads = heads_lib.build(heads_lib.HeadsConfig("medusa", num_heads=2), features[0])
    real = checkpoint_lib.save_file

    def full(tensors, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    checkpoint_lib.save_file = full
    try:
        with pytest.raises(OSError) as e:
            checkpoint_lib.save_heads(heads, str(tmp_path))
    finally:
        checkpoint_lib.save_file = real
    assert e.value.errno == errno.ENOSPC and os.listdir(tmp_path) == []


# --- user data ----------------------------------------------------------------------------------

GOOD = {
    "conversations": [
        {"from": "human", "value": "Hi there"},
        {"from": "gpt", "value": "Hello, friend!"},
    ]
}


@pytest.mark.parametrize(
    "bad",
    [
        '{"conversations": [{"from": "human", "value": "unterminated}',  # not JSON
        '{"messages": []}',  # no "conversations"
        '{"conversations": []}',  # empty
        '{"conversations": [{"from": "robot", "value": "beep"}]}',  # unknown role
        '{"conversations": [{"role": "user", "content": 42}]}',  # content not text
        '["a", "list"]',  # not an object
    ],
)
def test_malformed_sharegpt_line_is_reported_with_its_number(default_model, tmp_path, bad):
    _, tokenizer = default_model
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + bad + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(ValueError, match=r"chats\.jsonl, line 3:"):
        D.read_sharegpt(str(path), tokenizer)
    path.write_text(
        json.dumps(GOOD)
        + "\n\n"
        + json.dumps(
            {
                "conversations": [
                    {"role": "user", "content": "Hi there"},
                    {"role": "assistant", "content": "Hello, friend!"},
                ]
            }
        )
        + "\n"
    )
    (ids, loss), (ids2, loss2) = D.read_sharegpt(str(path), tokenizer)
    assert (ids, loss) == (ids2, loss2)  # from/value and role/content alike
    # the assistant's tokens, from its first word (the template's header belongs to the prompt, as
    # in decoding)
    assert tokenizer.decode([t for t, m in zip(ids, loss) if m]).startswith("Hello, friend!")
    assert ids[: loss.index(True)] == checkpoint_lib.encode(tokenizer, "Hi there")


@pytest.mark.parametrize(
    "content, skip_bad, words",
    [
        ("", False, ": no conversations in the file"),
        ("\n \n", True, ": no conversations in the file"),
        (
            json.dumps(GOOD) + "\n{not json\n",
            False,
            "1 of 2 conversations cannot be read, the first: {path}, line 2: not valid JSON",
        ),
        (json.dumps(GOOD) + "\n{not json\n", False, "; fix it, or add --skip-bad to leave out"),
        ('{"messages": []}\n', True, "1 of 1 conversation cannot be read, the first: "),
        ('{"messages": []}\n', False, "; fix the file"),
        ('{"conversations": [{"from": "human", "value": "Hi"}]}\n', False, "no conversation has"),
        (b'{"messages": "caf\xe9"}', False, "not valid UTF-8 text"),
    ],
)
def test_bad_data_is_reported_before_the_model_loads(tmp_path, content, skip_bad, words):
    """dataset.check_data reads --data as read_sharegpt does, without the tokenizer."""
    path = tmp_path / "chats.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(cli.UsageError) as e:
        D.check_data(str(path), skip_bad)
    assert str(e.value).startswith(f"--data {path}") and words.format(path=path) in str(e.value)


def test_a_data_path_that_is_no_file_is_said_as_train_py_says_it(tmp_path):
    for path, words in ((tmp_path / "nope.jsonl", "cannot read it"), (tmp_path, "is a folder")):
        with pytest.raises(cli.UsageError, match=f"--data {path}: {words}.*or 'self'"):
            D.check_data(str(path), skip_bad=False)


def test_good_data_and_skipped_lines_pass_the_check_before_the_model_loads(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n")
    D.check_data(str(path), skip_bad=True)
    path.write_text(json.dumps([GOOD, GOOD]))
    D.check_data(str(path), skip_bad=False)


def test_data_files_people_have_json_arrays_messages_and_bad_lines_skipped(
    default_model, tmp_path, capsys
):
    """The usual ShareGPT .json (one array), OpenAI-style {"messages": ...}, and --skip-bad, which
    leaves bad records out with a count instead of stopping at the first."""
    _, tokenizer = default_model
    openai = {
        "messages": [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello, friend!"},
        ]
    }
    array = tmp_path / "chats.json"
    array.write_text(json.dumps([GOOD, openai], indent=2))
    first, second = D.read_sharegpt(str(array), tokenizer)
    assert first == second  # the same conversation in both formats
    array.write_text(json.dumps([GOOD, {"messages": "no"}]))
    with pytest.raises(ValueError, match=r"chats\.json, record 1: expected"):
        D.read_sharegpt(str(array), tokenizer)
    array.write_text('[{"conversations": [\n  oops]}]')
    with pytest.raises(ValueError, match=r"not valid JSON at line 2"):
        D.read_sharegpt(str(array), tokenizer)
    lines = tmp_path / "chats.jsonl"
    lines.write_text(
        "\n".join([json.dumps(GOOD), "{not json", json.dumps(openai), '{"conversations": 3}'])
        + "\n"
    )
    with pytest.raises(ValueError, match=r"line 2: not valid JSON .*; fix it, or add --skip-bad"):
        D.read_sharegpt(str(lines), tokenizer)
    assert len(D.read_sharegpt(str(lines), tokenizer, skip_bad=True)) == 2
    assert "2 of 4 conversations left out (--skip-bad); the first: " in capsys.readouterr().err
    no_template = Template(lambda ms: "")
    no_template.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        D.read_sharegpt(str(lines), no_template)


@pytest.mark.parametrize(
    "record, words",
    [
        (
            {
                "messages": [
                    {"role": "narrator", "content": "Once"},
                    {"role": "assistant", "content": "Hi"},
                ]
            },
            'turn 1 has "role": "narrator", which is not a role here',
        ),
        (
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "Yo"}]},
            'turn 2 has "from": "bot", which is not a role here',
        ),
    ],
)
def test_an_unknown_role_is_named_with_its_line_and_the_roles_accepted(tmp_path, record, words):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError) as e:
        D.read_sharegpt(str(path), Template(lambda ms: "".join(m["content"] for m in ms)))
    assert str(e.value).startswith(f"{path}, line 2: {words}"), e.value
    assert "human, user, gpt, assistant, system" in str(e.value), e.value


class Template:
    """A stand-in tokenizer: a chat template `render(messages) -> text`, one token per character."""

    chat_template = "render"

    def __init__(self, render):
        self.render = render

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return self.render(messages)

    def __call__(self, text, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": [ord(c) for c in text]})


class ChatML(Template):
    """A stand-in chat template: <role>text| per turn ("|" ends a turn), one token per character."""

    def __init__(self):
        pass

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def test_a_reply_cut_short_is_not_trained_as_finished(default_model, tmp_path):
    """chat's /save marks replies cut by --max-new-tokens or Ctrl-C ("cut": [i]): their text is
    trained on, the end-of-turn the template closes them with is not (the model never said it);
    replies not cut keep theirs. A "cut" that is not a list of assistant turns is named."""
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "A story?"},
        {"role": "assistant", "content": "Once upon a"},
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text(
        json.dumps({"messages": messages}) + "\n" + json.dumps({"messages": messages, "cut": [3]})
    )
    (ids, whole), (same, cut) = D.read_sharegpt(str(path), ChatML())
    trained = lambda mask: "".join(chr(i) for i, m in zip(ids, mask) if m)
    assert ids == same and trained(whole) == "Hello|Once upon a|"
    assert trained(cut) == "Hello|Once upon a"
    # the real template: <|im_end|> closes each reply; not the cut one
    _, tokenizer = default_model
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (ids, whole), (_, cut) = D.read_sharegpt(str(path), tokenizer)
    closing = [t for t, (w, c) in enumerate(zip(whole, cut)) if w != c]
    assert ids[closing[0]] == end and all(not cut[t] for t in closing)
    assert tokenizer.decode([i for i, m in zip(ids, cut) if m]).endswith("Once upon a")
    assert sum(ids[t] == end and m for t, m in enumerate(cut)) == 1  # "Hello"'s, not the cut one's
    for bad in ([2], [9], "3", [True]):
        path.write_text(json.dumps({"messages": messages, "cut": bad}))
        with pytest.raises(
            ValueError, match=r"line 1: \"cut\": .* should list indices of assistant"
        ):
            D.read_sharegpt(str(path), ChatML())


def refuse(messages):
    raise Exception("Conversation roles must alternate\nuser/assistant")


@pytest.mark.parametrize(
    "render, words",
    [
        (
            refuse,
            "the model's chat template refuses this conversation (Conversation roles must "
            "alternate user/assistant)",
        ),
        (
            lambda ms: "".join(m["content"] for m in ms[::-1]),
            "renders the earlier turns differently once turn 2 follows",
        ),
    ],
)
def test_a_chat_template_that_cannot_split_turns_is_reported_with_the_line(tmp_path, render, words):
    path = tmp_path / "chats.jsonl"
    path.write_text(
        json.dumps(
            {
                "conversations": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Yo"},
                ]
            }
        )
    )
    with pytest.raises(ValueError, match=r"chats\.jsonl, line 1: ") as e:
        D.read_sharegpt(str(path), Template(render))
    assert words in str(e.value)


# --- several processes --------------------------------------------------------------------------


def ddp_worker(rank, port, folder, out, results):
    torchrun_env(rank, port)
    assert distributed.init_distributed("cpu")[:2] == (rank, 2)
    mp = pytest.MonkeyPatch()
    done = record_steps(mp)
    heads = command.train_heads(tiny_base(), D.load_data(folder), out, args_for(out), lesson())
    torch.save({"heads": heads.state_dict(), "done": done}, os.path.join(results, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_two_cpu_processes_train_one_set_of_heads(features, reference, tmp_path):
    """torchrun's setup by hand (fork, gloo): each rank takes every other batch of the
    single-process order, DDP keeps the two ranks' heads identical, and only rank 0 writes the
    checkpoint."""
    ref_batches, ref_state = reference
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "heads"
    torch.multiprocessing.start_processes(
        ddp_worker, args=(port, features[1], str(out), str(tmp_path)), nprocs=2, start_method="fork"
    )
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    per_epoch = len(ref_batches) // 2  # single-process steps per epoch
    for rank, r in enumerate((r0, r1)):
        want = [
            ref_batches[e * per_epoch + 2 * i + rank]
            for e in range(2)
            for i in range(per_epoch // 2)
        ]
        assert len(r["done"]) == len(want) and all(
            torch.equal(a, b) for a, b in zip(r["done"], want)
        )
    assert_same_weights(r0["heads"], r1["heads"])
    state = checkpoint(out)
    assert state["step"] == len(r0["done"])
    assert_same_weights(state["heads"], r0["heads"])
    assert state["heads"]["mlps.0.2.weight"].abs().sum() > 0  # trained: it starts at zero


# --- the data stage's batched decoding ----------------------------------------------------------


def plain_answers(model, prompts, max_new, stop):
    from specdec.engines import decode

    return [decode.generate(model, p, max_new, eos_ids=stop).tokens for p in prompts]


def test_batched_answers_equal_plain_greedy_decoding_and_features_equal_a_forward():
    """decode with fewer rows than prompts (so finished rows are refilled and the batch
    compacted) gives every prompt the greedy answer of one-sequence plain decoding, in fp32; its
    features are what one forward over prompt + answer computes."""
    base = tiny_base()
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(1, V, (int(torch.randint(2, 14, (), generator=g)),), generator=g).tolist()
        for _ in range(11)
    ]
    stop = {3, 7}
    got = D.decode(base, prompts, 12, stop, 4, top_k=5)
    assert len(got) == 11
    want = plain_answers(base, prompts, 12, stop)
    assert [got[i][0] for i in range(11)] == want
    # both ways to stop happen
    assert any(len(a) < 12 for a in want) and any(len(a) == 12 for a in want)
    for i, p in enumerate(prompts):
        answer, f = got[i]
        ids = torch.tensor([p + answer])
        logits, hidden = base(ids[:, :-1], torch.arange(ids.shape[1] - 1))
        # stored in fp16
        torch.testing.assert_close(f["hidden"].float(), hidden[0], atol=2e-3, rtol=2e-3)
        top = logits[0, len(p) - 1 :].softmax(-1).topk(5)
        assert torch.equal(f["top_ids"].long(), top.indices)
        torch.testing.assert_close(f["top_p"].float(), top.values, atol=1e-3, rtol=1e-3)


def test_batched_answers_of_the_default_model_equal_plain_decoding(default_model):
    # a real model, where attending to a wrong slot changes the answer (a tiny random one barely
    # notices)
    model, tok = default_model
    prompts = [
        checkpoint_lib.encode(tok, p)
        for p in (
            "What is the capital of France?",
            "Write a haiku about the sea.",
            "Explain photosynthesis in two sentences.",
            "What is 15% of 240?",
            "Name three primary colours.",
            "Say hello in German.",
            "What is 2 + 2?",
        )
    ]
    stop = set(model.cfg.eos_ids) | {tok.eos_token_id}
    got = D.decode(model, prompts, 32, stop, 2)  # short and long answers: refills
    assert [answer for answer, _ in got] == plain_answers(model, prompts, 32, stop)


def test_exported_conversations_rebuild_the_same_features(features, tmp_path):
    """--export-conversations keeps ids and loss masks only; features_of over what
    read_conversations returns reproduces the features of the data set it came from."""
    base, folder = features
    path = str(tmp_path / "convs.safetensors")
    n, tokens, answers = D.export_conversations(folder, path)
    data = D.load_data(folder)
    assert (n, tokens, answers) == (
        len(data["offsets"]) - 1,
        len(data["ids"]),
        int(data["loss"].sum()),
    )
    assert os.path.getsize(path) < tokens * 8 + 4096  # ids and masks, no features
    D.features_of(
        base, D.read_conversations(path), str(tmp_path / "again"), top_k=8, batch_tokens=64
    )
    again = D.load_data(str(tmp_path / "again"))
    for k in ("ids", "loss", "offsets", "teacher_top1"):
        assert torch.equal(again[k], data[k]), k
    # memory-mapped columns, read conversation by conversation
    for k in ("hidden", "top_ids", "top_p"):
        for a, e in zip(data["offsets"][:-1].tolist(), data["offsets"][1:].tolist()):
            assert torch.equal(again[k][a:e], data[k][a:e]), k


def test_continue_from_seeds_a_self_distilled_folder_with_the_exported_conversations(
    features, tmp_path, capsys, monkeypatch
):
    """--continue-from: an empty self-distillation folder gets the file's conversations, prompts and
    features (equal to features_of's over the same conversations); a second call changes nothing; a
    seeding stopped in its second shard keeps the first and is completed; a folder of other data is
    refused."""
    base, folder = features
    convs = D.load_data(folder)
    prompts = [f"prompt {i}" for i in range(len(convs["offsets"]) - 1)]
    named, plain = str(tmp_path / "named"), str(tmp_path / "plain.safetensors")
    D.export_conversations(folder, plain)  # a user's data set: no prompts recorded
    D.features_of(
        base, D.read_conversations(plain), named, top_k=8, batch_tokens=64, prompts=prompts
    )
    assert D.folder_prompts(named) == prompts
    path = str(tmp_path / "convs.safetensors")
    D.export_conversations(named, path)
    assert D.conversation_prompts(path) == prompts
    key = {"teacher_k": 8, "dim": base.cfg.dim}
    seeded = str(tmp_path / "self_distill")
    D.check_self_data(seeded, key)
    features_of, calls = D.features_of, []

    def stopped_in_the_second_shard(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return features_of(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(D, "features_of", stopped_in_the_second_shard)
        with pytest.raises(KeyboardInterrupt):
            D.continue_from(base, seeded, path, key, per_shard=2)
    assert D.folder_prompts(seeded) == prompts[:2]  # the first shard was kept
    D.continue_from(base, seeded, path, key, per_shard=2)  # the same call continues from it
    again = D.load_data(seeded)
    assert D.folder_prompts(seeded) == prompts and not os.path.exists(seeded + ".seed")
    for k in ("ids", "loss", "offsets", "teacher_top1"):
        assert torch.equal(again[k], convs[k]), k
    files = {f: os.path.getmtime(os.path.join(seeded, f)) for f in os.listdir(seeded)}
    D.continue_from(base, seeded, path, key)  # already seeded: nothing is touched
    assert {f: os.path.getmtime(os.path.join(seeded, f)) for f in os.listdir(seeded)} == files
    for f in D.shards_in(seeded)[1:]:  # a seeding cut short after one shard
        os.remove(os.path.join(seeded, f))
    D.continue_from(base, seeded, path, key)
    assert D.folder_prompts(seeded) == prompts and torch.equal(
        D.load_data(seeded)["ids"], convs["ids"]
    )
    other = str(tmp_path / "other")
    D.features_of(
        base, D.read_conversations(path)[:3], other, top_k=8, prompts=["something else"] * 3
    )
    with pytest.raises(UsageError, match="did not begin with these conversations"):
        D.continue_from(base, other, path, key)
    assert D.folder_prompts(other) == ["something else"] * 3
    capsys.readouterr()


def test_continue_from_refuses_conversations_without_their_prompts(features, tmp_path):
    base, folder = features
    plain, seeded = str(tmp_path / "plain.safetensors"), str(tmp_path / "self_distill")
    D.export_conversations(folder, plain)  # a user's data set: no prompts recorded
    key = {"teacher_k": 8, "dim": base.cfg.dim}
    D.check_self_data(seeded, key)
    with pytest.raises(UsageError, match="no prompts recorded"):
        D.continue_from(base, seeded, plain, key)
    assert D.shards_in(seeded) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_training_data_keeps_one_open_file_per_shard(features):
    # thousands of shards must not exhaust a 1,024-file limit: one mapping per file, not per tensor
    _, folder = features
    before = len(os.listdir("/proc/self/fd"))
    data = D.load_data(folder)
    opened = len(os.listdir("/proc/self/fd")) - before
    assert 0 < opened <= len(D.shards_in(folder)) and len(data["hidden"]) == len(data["ids"])


def test_short_conversations_with_many_heads_have_no_valid_positions():
    data = {
        "offsets": torch.tensor([0, 3]),
        "ids": torch.tensor([1, 2, 3]),
        "loss": torch.tensor([False, True, True]),
        "hidden": torch.zeros(3, 4),
        "top_ids": torch.zeros(3, 2, dtype=torch.long),
        "top_p": torch.zeros(3, 2),
    }
    # head j needs token t+1+j: none beyond head 1
    batch = losses.collate(data, [0], torch.arange(V), 5, "cpu")
    # 3 positions padded to 16
    assert batch["valid"].shape == (1, 16, 5) and batch["valid"][0, :, 1:].sum() == 0
    assert batch["valid"][0, :, 0].tolist() == [True] + [False] * 15


def test_fewer_kept_tokens_than_the_ten_ranks_evaluated(features, tmp_path):
    run(features, tmp_path, "--kept-tokens", "5")
    with open(tmp_path / "eval.json") as f:
        assert len(json.load(f)["curve"]) > 0


def test_exported_ids_are_two_bytes_when_the_vocabulary_fits(features, tmp_path):
    _, folder = features
    path = str(tmp_path / "convs.safetensors")
    n, tokens, _ = D.export_conversations(folder, path)
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        assert f.get_slice("ids").get_dtype() == "U16"
    assert os.path.getsize(path) < tokens * 3 + 8 * (n + 1) + 4096
    data = D.load_data(folder)
    bounds = data["offsets"].tolist()
    assert [ids for ids, _ in D.read_conversations(path)] == [
        data["ids"][a:b].tolist() for a, b in zip(bounds, bounds[1:])
    ]


def test_prompt_diversity_counts_openings_and_repeated_phrases():
    d = D.prompt_diversity(["A b c d.", "a b C e", "x y z"])
    # first words {a, x}: 2 of 3; openings {abc, xyz}: 2 of 3; trigrams abc bcd abc bce xyz: 4 of 5
    # distinct
    assert d == dict(prompts=3, first_words=2 / 3, openings=2 / 3, distinct_trigrams=4 / 5)
    assert "66.7% distinct first words" in D.diversity_line(["A b c d.", "a b C e", "x y z"])


def test_prompt_filter_compares_the_words_after_the_opener():
    f = D.PromptFilter(["Read the passage and answer the question.", "Read"])
    long = (
        "Read the passage and answer the question."  # seven words: the model's own words come after
    )
    assert f.keep(f"{long} Bees dance to tell the hive where flowers grow. Why do they dance?")
    assert f.keep(
        f"{long} The Nile floods each summer and farmers plant after it. When do they plant?"
    )
    # same six words after it
    assert not f.keep(f"{long} Bees dance to tell the hive about water. Who dances?")
    # no opener: its first six words
    assert f.keep("An apple a day keeps the doctor away, they say.")
    # 8 of 10 trigrams shared
    assert not f.keep("Everyone knows an apple a day keeps the doctor away, they say")
    # the shorter opener; under 3 words
    assert f.keep("Read this: a very short one") and not f.keep("Hi")
    assert (f.tried, f.rejected_duplicate) == (7, 2)
    plain = D.PromptFilter()  # without openers: the first six words, as for any text
    assert plain.keep(f"{long} Bees dance.") and not plain.keep(f"{long} Nile floods.")


def test_tasks_behind_are_drawn_more():
    """A task is drawn with weight 1 / (its conversations + 1); its conversations are counted by the
    longest seed opener a prompt begins with."""
    import random
    from types import SimpleNamespace

    tasks = {"qa": ["Answer", "Answer this:"], "sum": ["Summarise"], "math": ["Solve"]}
    counts = D.task_counts(["Answer this: why?", "Answer me", "Summarise it", "Hello there"], tasks)
    assert counts == {"qa": 2, "sum": 1, "math": 0}
    counts = {"qa": 99, "sum": 99, "math": 0}  # math weighs 1, the others 1/100 each

    class Tokenizer:
        def apply_chat_template(self, messages, tokenize=False):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages)

        def __call__(self, text, add_special_tokens=False):
            return SimpleNamespace(input_ids=[ord(c) for c in text])

    rng = random.Random(0)
    openers = [D.seeded_prefix(Tokenizer(), rng, tasks, ["bees"], counts)[1] for _ in range(1000)]
    # 1 / 1.02 = 98% expected; uniform draws would give a third
    assert 960 < openers.count("Solve") < 1000


@pytest.mark.parametrize("gen_batch", [2, 0])
def test_self_distillation_keeps_long_prompts_that_finish_last(tmp_path, monkeypatch, gen_batch):
    """Short prompts are written first; the prompts kept must not depend on that order (a round
    that took the first ones done would keep only short prompts). --gen-batch 0 decodes in batches
    of the size kernels.sizes gives the model's device."""
    from types import SimpleNamespace

    class Tokenizer:  # a token t is the word f"w{t}"; 2 ends a turn
        eos_token_id, chat_template = 2, "<role>content"

        def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
            return (
                "".join(f"<{m['role']}>{m['content']}" for m in messages)
                if not tokenize
                else [1, 1, 1]
            )

        def __call__(self, text, add_special_tokens=False):
            return SimpleNamespace(input_ids=[1] * len(text.split()))

        def decode(self, ids, skip_special_tokens=True):
            return "".join(f" w{t}" for t in ids)

    length = lambda i: 40 if i % 2 == 0 else 3  # candidate i writes this many words

    def decode(model, prompts, max_new, stop, batch, temperature, top_p, seeds, top_k=0):
        assert batch == 2 and len(seeds) == len(prompts)
        if not top_k:  # prompts
            return [
                ([1000 * i + j for j in range(length(i))] + [2], None) for i in range(len(prompts))
            ]
        features = dict(
            hidden=torch.zeros(4, 8),
            top_ids=torch.zeros(2, top_k, dtype=torch.long),
            top_p=torch.zeros(2, top_k),
        )
        return [([5, 2], features) for _ in prompts]

    monkeypatch.setattr(D, "decode", decode)
    monkeypatch.setattr(
        D.kernels,
        "sizes",
        lambda device, native=False: D.kernels.Sizes(
            2 if torch.device(device).type == "cpu" else 64, 1
        ),
    )
    seeds = tmp_path / "seeds.json"
    seeds.write_text(json.dumps({"tasks": {"qa": ["Answer this:"]}, "topics": ["bees"]}))
    args = SimpleNamespace(
        num_prompts=6,
        gen_batch=gen_batch,
        seed=0,
        seeds=str(seeds),
        max_prompt_tokens=64,
        max_answer_tokens=8,
        answer_temperature=0.0,
        teacher_k=4,
    )
    D.self_distill(
        SimpleNamespace(cfg=SimpleNamespace(eos_ids=[2]), device="cpu", modules=lambda: []),
        Tokenizer(),
        str(tmp_path / "d"),
        args,
    )
    kept = D.folder_prompts(str(tmp_path / "d"))
    assert sorted(len(p.split()) for p in kept) == [
        5,
        5,
        5,
        42,
        42,
        42,
    ]  # opener + 3 or 40 words, half each
    assert len(set(kept)) == 6


def test_no_prompt_that_fits_max_prompt_tokens_names_the_flag(tmp_path, monkeypatch):
    """A --max-prompt-tokens shorter than any prompt the model writes: no prompt ends within it, so
    none is kept, nothing is answered (the engine refuses an empty batch), and the run stops at once
    naming the flag."""
    from types import SimpleNamespace

    class Tokenizer:
        eos_token_id, chat_template = 2, "<role>content"

        def decode(self, ids, skip_special_tokens=True):
            return "".join(f" w{t}" for t in ids)

    def decode(model, prompts, max_new, stop, batch, temperature, top_p, seeds, top_k=0):
        assert prompts, "max() arg is an empty sequence"  # engine.generate_batch's
        assert not top_k, "nothing to answer"
        return [([7] * max_new, None) for _ in prompts]  # cut at the limit, never ended

    monkeypatch.setattr(D, "decode", decode)
    monkeypatch.setattr(D, "seeded_prefix", lambda *a: ([1], "Answer this:"))
    seeds = tmp_path / "seeds.json"
    seeds.write_text(json.dumps({"tasks": {"qa": ["Answer this:"]}, "topics": ["bees"]}))
    args = SimpleNamespace(
        num_prompts=6, gen_batch=2, seed=0, seeds=str(seeds), max_prompt_tokens=3,
        max_answer_tokens=8, answer_temperature=0.0, teacher_k=4,
    )  # fmt: skip
    model = SimpleNamespace(cfg=SimpleNamespace(eos_ids=[2]), device="cpu", modules=lambda: [])
    with pytest.raises(cli.UsageError) as e:
        D.self_distill(model, Tokenizer(), str(tmp_path / "d"), args)
    assert str(e.value).startswith(
        "--max-prompt-tokens 3: none of the 36 user prompts the model wrote ended within it"
    )
    assert "give a larger --max-prompt-tokens" in str(e.value)


def test_eval_json_keeps_the_learning_curve(features, tmp_path):
    run(features, tmp_path)
    with open(tmp_path / "eval.json") as f:
        report = json.load(f)
    curve = report["curve"]
    assert [p["step"] for p in curve[:-1]] == list(range(5, curve[-1]["step"], 5))
    assert all(a["tokens"] < b["tokens"] for a, b in zip(curve, curve[1:]))
    assert curve[-1]["chain_tau"] == round(report["chain_tau"], 4) and len(curve[-1]["top1"]) == 2


def test_plot_curves_reads_eval_json_curves(features, tmp_path):
    import xml.dom.minidom

    out = tmp_path / "hydra++"
    run(features, out)
    _, plot = experiment("plot_curves")
    curves = plot.read_curves(str(tmp_path))
    with open(out / "eval.json") as f:
        assert curves == {"hydra++": json.load(f)["curve"]}
    assert plot.table(curves).count("| hydra++ |") == len(curves["hydra++"])
    xml.dom.minidom.parseString(plot.svg(curves))  # well-formed


def test_ablations_table_reads_each_run(features, tmp_path):
    import xml.dom.minidom

    run(features, tmp_path / "run")
    script, abl = experiment("ablations")
    r = abl.read_run(str(tmp_path / "run"))
    with open(tmp_path / "run" / "eval.json") as f:
        assert r["chain_tau"] == json.load(f)["chain_tau"] and r["kind"] == "hydra++"
    runs = {"K=2 (base)": r, "same again": r}
    assert abl.table(runs).count(f"| {r['chain_tau']:.3f} |") == 2
    xml.dom.minidom.parseString(abl.svg(runs))  # well-formed
    code, err = run_script(script, tmp_path / "out", f"x={tmp_path / 'nothing'}")
    assert code == 2 and "train that run first" in err and not (tmp_path / "out.md").exists()


def test_export_replaces_a_file_only_with_more_of_its_own_conversations(features, tmp_path):
    """--export-conversations over an existing file: the same or grown data replaces it; a file
    of other conversations, or of another kind, is refused and left as it is."""
    from safetensors.torch import save_file

    base, folder = features
    path = str(tmp_path / "convs.safetensors")
    n, tokens, _ = D.export_conversations(folder, path)
    first = D.read_conversations(path)
    save_file(
        {
            "ids": torch.tensor([i for c, _ in first[:2] for i in c], dtype=torch.int32),
            "loss": torch.tensor([m for _, l in first[:2] for m in l]),
            "offsets": torch.tensor([0, len(first[0][0]), len(first[0][0]) + len(first[1][0])]),
        },
        path,
    )
    assert D.export_conversations(folder, path)[:2] == (
        n,
        tokens,
    )  # two of them, grown to all: replaced
    assert D.read_conversations(path) == first
    other = str(tmp_path / "other.safetensors")
    ids, mask = first[1]
    save_file(
        {
            "ids": torch.tensor(ids, dtype=torch.int32),
            "loss": torch.tensor(mask),
            "offsets": torch.tensor([0, len(ids)]),
        },
        other,
    )
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not safetensors")
    for target, words in (
        (other, "it holds 1 conversation that the data in"),
        (str(junk), "that file is not a conversations file"),
    ):
        before = open(target, "rb").read()
        with pytest.raises(D.UsageError, match=words):
            D.export_conversations(folder, target)
        assert open(target, "rb").read() == before


def test_data_size_measures_heads_on_the_held_out_split_train_uses(features, tmp_path):
    """experiments/data_size.py on all held-out conversations (FIRST_FRESH 0) gives the chain tau
    that train.py measured on its own held-out split at the end of the run; bad input exits 2."""
    import xml.dom.minidom

    base, folder = features
    run(features, tmp_path / "run")
    script, ds = experiment("data_size")
    what, reports = ds.measure(base, D.load_data(folder), 0, [("a", str(tmp_path / "run"))])
    with open(tmp_path / "run" / "eval.json") as f:
        report = json.load(f)
    assert reports["a"]["chain_tau"] == pytest.approx(report["chain_tau"], abs=1e-3)
    assert ds.table(what, reports).count(f"| a | {reports['a']['chain_tau']:.3f} |") == 1
    xml.dom.minidom.parseString(ds.ablations.svg(reports))  # well-formed
    with pytest.raises(SystemExit):  # nothing held out after them all
        ds.measure(base, D.load_data(folder), 24, [("a", str(tmp_path / "run"))])
    code, err = run_script(script, folder, "0", tmp_path / "out", f"x={tmp_path / 'nothing'}")
    assert code == 2 and "has no heads.json" in err and not (tmp_path / "out.md").exists()


def test_tau_by_position_windows_split_the_held_out_measurement(features, tmp_path):
    """experiments/tau_by_position.py: answer positions restart at each assistant turn; the window
    of every position gives train.py's own held-out chain tau, and a window past every answer has no
    chain to count (tau 1); bad input exits 2."""
    base, folder = features
    run(features, tmp_path / "run", "--train-dtype", "fp32")
    script, tp = experiment("tau_by_position")
    loss = torch.tensor([False, True, True, False, False, True, True, True, False])
    assert tp.answer_positions(loss)[loss].tolist() == [0, 1, 0, 1, 2]
    tp.WINDOWS = [(0, 1 << 30), (1 << 20, 1 << 30)]
    n, rows = tp.measure(base, D.load_data(folder), [("a", str(tmp_path / "run"))], bf16=False)
    with open(tmp_path / "run" / "eval.json") as f:
        assert rows["a"][0]["chain_tau"] == pytest.approx(json.load(f)["chain_tau"], abs=1e-3)
    assert rows["a"][1]["chain_tau"] == 1.0 and rows["a"][1]["trees"][0] == 1.0
    assert tp.table(n, rows).count("| a | ") == 2
    code, err = run_script(script, folder, tmp_path / "out.md", f"x={tmp_path / 'nothing'}")
    assert code == 2 and "has no heads.json" in err and not (tmp_path / "out.md").exists()


def test_profile_train_refuses_bad_arguments(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "profile_train.py")
    for argv, words in (
        ([str(tmp_path), "eagle"], "usage: python experiments/profile_train.py"),
        ([str(tmp_path / "nothing"), "hydra++"], "is not a folder"),
    ):
        code, err = run_script(script, *argv)
        assert code == 2 and words in err and err.count("\n") == 1


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_a_features_pass_stopped_leaves_no_temporary_folder(tmp_path, stop):
    """Ctrl-C (or a full disk) in the features pass, after a shard was written: neither the
    features folder nor its .tmp is left."""
    base = tiny_base()
    real, calls = base.forward, [0]

    def forward(*a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise stop
        return real(*a, **k)

    base.forward = forward
    convs = [([1, 2, 3, 4, 5], [False, False, True, True, True])] * 4
    with pytest.raises(stop):
        D.features_of(base, convs, str(tmp_path / "features-chats"), top_k=4, batch_tokens=5)
    assert os.listdir(tmp_path) == []


def test_the_bf16_data_model_is_a_copy_of_a_prepacked_fp32_base():
    """--dtype bf16 (auto on a CPU with native bf16) writes data with a bf16 copy of the fp32 base.
    The base's oneDNN-prepacked weights are opaque tensors that cannot be deep-copied: the copy is
    made without them (and prepacks its own), and the base keeps its kernels."""
    torch.manual_seed(0)
    # prepacked
    base = kernels.use(rows.Model(tiny_config()).eval().requires_grad_(False))
    fast = kernels.in_use(base)
    writer = prepare.data_model(base, "bf16")
    assert (
        writer.dtype == torch.bfloat16
        and base.dtype == torch.float32
        and kernels.in_use(base) == fast
    )
    assert kernels.in_use(writer) == kernels.Kernels.choose("cpu", torch.bfloat16, 0)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    want, got = base(ids, torch.arange(5))[0], writer(ids, torch.arange(5))[0].float()
    assert torch.allclose(got, want, atol=0.05, rtol=0.05)
    assert prepare.data_model(base, "fp32") is base


def test_the_features_pass_reports_progress_without_a_terminal(capsys, tmp_path):
    """Under a log file (no progress bar) the features pass prints a line every tenth of the way."""
    base = tiny_base()
    convs = [([1, 2, 3, 4, 5, 6], [False, False, True, True, True, True]) for _ in range(20)]
    D.features_of(base, convs, str(tmp_path / "f"), top_k=4)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[features]")]
    assert len(lines) == 9 and lines[0].startswith("[features] 2/20 conversations")
