"""online.py's contracts, on tiny random models (CPU, seeded): greedy output with heads that adapt
between replies is token-identical to plain greedy decoding; a reply changes the heads' weights and
never the base model's; the learner's loss falls on a stream that repeats itself; the accepted
path's nodes are found by their tokens; the adapted heads saved by --online-save load with --heads;
bad input to --online gets one line, exit code 2, and nothing of the user's is overwritten.
Run: `python -m pytest -q tests/test_online.py`.
"""

import io
import os
import stat
import sys

import pytest
import torch

from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import drafters as D
from specdec.engines import decode
import heads as heads_lib
from specdec import rows
from specdec.training import online
import tree as tree_lib
from conftest import tiny_config
from test_cli import check_one_line_error, run_cli
from test_generate import random_heads

PROMPTS = [[1, 5, 3, 7], [2, 2, 9, 4, 1], [6, 3], [1, 5, 3, 7]]


@pytest.fixture
def small():
    """A 12-token vocabulary: random drafts are often accepted, so paths are long and varied."""
    torch.manual_seed(0)
    return rows.Model(tiny_config(vocab_size=12)).eval().requires_grad_(False)


def online_drafter(base, kind="hydra++", lr=1e-2, buffer=4, every=1, steps=2):
    heads = random_heads(base, kind)
    learner = online.Learner(heads, base, lr, buffer, every, steps)
    tree = tree_lib.build(tree_lib.cartesian([2, 2, 1]))
    return online.OnlineHeads(D.HeadsDrafter(heads, tree), learner), learner


def weights(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("kind", heads_lib.KINDS)
def test_greedy_with_adapting_heads_equals_plain(small, kind):
    drafter, learner = online_drafter(small, kind)
    for prompt in PROMPTS:
        plain = decode.generate(small, prompt, 24).tokens
        assert decode.generate(small, prompt, 24, drafter).tokens == plain
        assert learner.reply_done() is not None  # an update after every reply
    assert learner.updates == len(PROMPTS)


def test_a_reply_changes_the_heads_and_never_the_base(small):
    drafter, learner = online_drafter(small)
    base = weights(small)
    before = weights(learner.heads)
    decode.generate(small, PROMPTS[0], 24, drafter)
    learner.reply_done()
    after = weights(learner.heads)
    assert any(
        not torch.equal(before[k], after[k]) for k in before if before[k].is_floating_point()
    )
    assert all(torch.equal(base[k], v) for k, v in small.state_dict().items())
    for name, p in learner.heads.named_parameters():  # the drafting heads are the master's copy
        assert torch.allclose(p, dict(learner.master.named_parameters())[name])


def test_the_loss_falls_on_a_repeated_stream(small):
    with torch.no_grad():  # confident distributions (a random model's are near uniform): a loss
        small.lm_head.weight.mul_(4)  # far above its floor, the teacher's entropy
    drafter, learner = online_drafter(small, lr=1e-2, buffer=2, every=1, steps=1)
    for _ in range(12):  # the same two replies again and again
        for prompt in PROMPTS[:2]:
            decode.generate(small, prompt, 24, drafter)
        learner.reply_done()
    assert learner.losses[-1] < 0.85 * learner.losses[0], learner.losses


def test_records_hold_the_accepted_path(small):
    """Each step records the committed tokens at consecutive positions, with the teacher taken
    at the path's nodes: its top-1 is the token greedy decoding committed next."""
    drafter, learner = online_drafter(small)
    prompt = PROMPTS[1]
    out = decode.generate(small, prompt, 20, drafter)
    record = learner.buffer[-1]
    reply = record.ids[record.prompt :]
    assert reply == out.tokens[: len(reply)] and len(reply) >= len(out.tokens) - 4
    top1 = torch.cat(record.top_ids)[:, 0].tolist()  # the teacher at reply token i says i + 1
    assert top1[: len(reply) - 1] == reply[1:]
    assert sum(len(h) for h in record.hidden) == len(record)


def test_collate_marks_the_heads_that_have_a_teacher():
    """Head j at t is trained where the teacher sits at t + j, a reply position, inside the
    sequence."""
    r = online.Record([1, 2, 3], [torch.zeros(3, 4)], prompt=3)
    r.add([4, 5, 6, 7], torch.zeros(1, 4, 4), torch.randn(4, 20), k=online.TEACHER_K)
    batch = online.collate([r], torch.arange(20), 2, "cpu")
    valid = batch["valid"][0]  # (T, K)
    for t in range(7):
        for j in (1, 2):
            assert valid[t, j - 1] == (3 <= t + j and t + 1 + j < 7), (t, j)


# --- the command line ----------------------------------------------------------------------------


@pytest.fixture
def tiny_heads(tiny_model_dir, tmp_path):
    """Random hydra++ heads for the tiny model, saved with a tree beside them."""
    base = checkpoint.load(tiny_model_dir, "cpu", torch.float32)[0]
    folder = tmp_path / "heads"
    checkpoint.save_heads(random_heads(base, "hydra++"), folder)
    (folder / "tree.json").write_text('{"paths": [[0], [1], [0, 0]]}')
    return base, str(folder)


def test_online_save_writes_heads_that_load(tiny_model_dir, tiny_heads, tmp_path, capsys):
    base, heads = tiny_heads
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "hello there"}\n')
    out = tmp_path / "adapted"
    argv = ["--model", tiny_model_dir, "--prompts", prompts, "--max-new-tokens", 8, "--quiet"]
    code, _, err = run_cli(
        capsys, *argv, "--heads", heads, "--online", "--online-every", 1, "--online-save", out
    )
    assert code == 0, err
    assert "[online: 2 updates" in err
    assert sorted(os.listdir(out)) == ["heads.json", "heads.safetensors", "tree.json"]
    adapted = checkpoint.load_heads(out, base)
    shipped = checkpoint.load_heads(heads, base)
    assert any(not torch.equal(p, q) for p, q in zip(adapted.parameters(), shipped.parameters()))
    code, _, err = run_cli(capsys, *argv, "--heads", out)
    assert code == 0, err
    # saving again onto the adapted heads is refused, and they are left as they were
    before = (out / "heads.safetensors").read_bytes()
    code, _, err = run_cli(capsys, *argv, "--heads", heads, "--online", "--online-save", out)
    check_one_line_error(code, err, "--online-save", "heads.json", "new folder")
    assert (out / "heads.safetensors").read_bytes() == before


BAD = [
    (["--online", "--heads", "none"], "--online trains draft heads"),
    (["--online", "--draft", "lookup"], "--online trains draft heads"),
    (["--online", "--online-lr", "0"], "--online-lr"),
    (["--online", "--online-lr", "-1e-3"], "--online-lr"),
    (["--online", "--online-lr", "nan"], "--online-lr"),
    (["--online", "--online-lr", "fast"], "invalid float"),
    (["--online", "--online-buffer", "0"], "at least 1"),
    (["--online", "--online-every", "0"], "at least 1"),
    (["--online-save", "x"], "add --online"),
    (["--online", "--online-save", os.path.join(catalog.SHIPPED, "hydra++")], "shipped"),
    (["--online", "--online-save", os.path.join(catalog.SHIPPED, "new")], "shipped"),
    (["--online", "--online-save", os.path.dirname(catalog.SHIPPED)], "not empty"),  # weights/
]


@pytest.mark.parametrize("argv, words", BAD)
def test_bad_online_flags(no_model, capsys, argv, words):
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", *argv)[::2], words)


def test_online_save_onto_a_run_is_refused_before_the_model_loads(no_model, capsys, tmp_path):
    (tmp_path / "heads.json").write_text("{}")
    (tmp_path / "eval.json").write_text("[1]")
    code, _, err = run_cli(capsys, "--prompt", "hi", "--online", "--online-save", tmp_path)
    check_one_line_error(code, err, "eval.json", "heads.json")
    assert (tmp_path / "heads.json").read_text() == "{}"


def test_online_without_heads_for_the_model(tiny_model_dir, capsys):
    code, _, err = run_cli(capsys, "--model", tiny_model_dir, "--prompt", "hi", "--online")
    check_one_line_error(code, err, "--online", "no heads", "--heads FOLDER")


def test_online_save_into_a_folder_holding_anything_is_refused(no_model, capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "--prompt", "hi", "--online", "--online-save", tmp_path)
    check_one_line_error(code, err, "--online-save", "not empty", "new or empty")
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_a_chat_with_online_save_saves_the_heads(
    tiny_model_dir, tiny_heads, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi!\nTell me more.\n"))
    out = tmp_path / "adapted"
    code, _, err = run_cli(
        capsys, "--chat", "--model", tiny_model_dir, "--heads", tiny_heads[1], "--max-new-tokens",
        6, "--online", "--online-every", 1, "--online-save", out,
    )  # fmt: skip
    assert code == 0, err
    assert "[online: 2 updates" in err and f"[online: the adapted heads are in {out}]" in err
    checkpoint.load_heads(out, tiny_heads[0])


def test_ctrl_c_keeps_what_the_heads_learned(
    tiny_model_dir, tiny_heads, tmp_path, capsys, monkeypatch
):
    """Ctrl-C in the second reply: the heads after the first reply's update are saved, and said."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "hello there"}\n{"prompt": "yo"}\n')
    real, calls = decode.generate, []

    def interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(decode, "generate", interrupted)
    out = tmp_path / "adapted"
    code, _, err = run_cli(
        capsys, "--model", tiny_model_dir, "--prompts", prompts, "--max-new-tokens", 6, "--quiet",
        "--heads", tiny_heads[1], "--online", "--online-every", 1, "--online-save", out,
    )  # fmt: skip
    assert code == 130, err
    assert f"[online: stopped by Ctrl-C; the heads after 1 update are in {out}]" in err
    assert sorted(os.listdir(out)) == ["heads.json", "heads.safetensors", "tree.json"]
    checkpoint.load_heads(out, tiny_heads[0])


def test_saved_heads_have_the_mode_of_their_siblings(small, tmp_path):
    """safetensors writes its files for their owner alone; saved heads get the umask's mode."""
    checkpoint.save_heads(random_heads(small, "medusa"), tmp_path)
    mode = {n: stat.S_IMODE(os.stat(tmp_path / n).st_mode) for n in os.listdir(tmp_path)}
    assert mode["heads.safetensors"] == mode["heads.json"], mode
