"""A conversation that keeps its KV cache between turns (decode.Conversation, generate.py --chat):
each greedy reply is token-identical to the one-shot reply to the same conversation from an empty
cache (fp32), with and without a drafter, whose state follows the cut; a turn's prefill forwards
only what the cache does not hold; Ctrl-C keeps the conversation; bad input is one line and the
conversation stays. One test drives `python generate.py --chat` through a pseudo-terminal."""

import io
import json
import os
import pty
import select
import shutil
import signal
import sys
import time

import pytest
import torch

from specdec.loading import checkpoint
from specdec.training import dataset
from specdec import drafters
from specdec.engines import decode
import generate as G
from specdec.commands import generate as command
from specdec import terminal
import test_batch
import tree as tree_lib
from conftest import save_tiny_model
from test_generate import random_heads, small  # noqa: F401 (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = {11}


def make_drafter(name, model):
    """test_batch's drafter `name`; lookup proposes up to 2 continuations."""
    return test_batch.make_drafter(name, model, matches=2)


def assert_same_state(a, b):
    """Two drafters of one kind hold the same state: the draft state h, the cache of Hydra++'s
    PrefixMLP or of a draft model (its entries; a draft model feeds what it has not yet, its
    `pending` tokens, on its next draft), lookup's text."""
    if isinstance(a, drafters.HeadsPlusLookup):
        assert_same_state(a.heads, b.heads)
        a, b = a.lookup, b.lookup
    if hasattr(a, "h"):
        torch.testing.assert_close(a.h, b.h)
    if getattr(a, "cache", None) is not None:
        n = min(a.cache.length, b.cache.length)
        if hasattr(a, "pending"):
            assert a.cache.length + len(a.pending) == b.cache.length + len(b.pending)
        else:
            assert a.cache.length == b.cache.length
        torch.testing.assert_close(a.cache.k[..., :n, :], b.cache.k[..., :n, :])
        torch.testing.assert_close(a.cache.v[..., :n, :], b.cache.v[..., :n, :])
    if hasattr(a, "text"):
        assert a.text == b.text


def user_turn(seed, n=6):
    return torch.randint(0, 11, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Forwarded:
    """The positions each forward of `model` gets (a prefill's count is its first entry)."""

    def __init__(self, model):
        self.counts = []
        self.hook = model.register_forward_pre_hook(
            lambda m, args: self.counts.append(args[0].shape[1])
        )


# --- the contract, on token ids ------------------------------------------------------------------
# A "template" that appends each reply as it was generated and the next user turn: the cache holds
# every token but the last reply token, which is forwarded with the new turn.


@pytest.mark.parametrize(
    "name", ["plain", "medusa", "hydra++", "lookup", "heads+lookup", "layers", "lookahead"]
)
def test_each_reply_equals_the_one_shot_reply_and_the_prefill_is_only_what_is_new(small, name):
    chat = decode.Conversation(small, make_drafter(name, small))
    prompt = user_turn(0, 5)
    stops = set()
    for turn, limit in enumerate([30, 8, 40, 25]):
        forwarded = Forwarded(small)
        r = chat.reply(prompt, limit, eos_ids=EOS)
        forwarded.hook.remove()
        fresh = make_drafter(name, small)
        alone = decode.generate(small, prompt, limit, fresh, eos_ids=EOS)
        assert r.tokens == alone.tokens and r.stopped == alone.stopped, f"turn {turn}"
        # the drafter's state followed the cut: it holds and drafts what a fresh one does
        assert r.accepted == alone.accepted, f"turn {turn}"
        assert_same_state(chat.drafter, fresh)
        assert forwarded.counts[0] == (len(prompt) if turn == 0 else 1 + 6)
        assert chat.ids == prompt + r.tokens[:-1]
        stops.add(r.stopped)
        prompt = prompt + r.tokens + user_turn(turn + 1)
    assert stops == {"eos", "length"}, "replies should end at EOS and at the length limit"


def test_an_earlier_token_rendered_differently_is_forwarded_again(small):
    """A template that renders the first reply's third token otherwise: the cache is cut there."""
    chat = decode.Conversation(small, make_drafter("hydra++", small))
    prompt = user_turn(0, 5)
    first = chat.reply(prompt, 20, eos_ids=EOS).tokens
    changed = first[:2] + [(first[2] + 1) % 11] + first[3:]
    prompt = prompt + changed + user_turn(1)
    forwarded = Forwarded(small)
    r = chat.reply(prompt, 20, eos_ids=EOS)
    forwarded.hook.remove()
    assert forwarded.counts[0] == len(prompt) - (5 + 2)
    fresh = make_drafter("hydra++", small)
    alone = decode.generate(small, prompt, 20, fresh, eos_ids=EOS)
    assert r.tokens == alone.tokens and r.accepted == alone.accepted
    assert_same_state(chat.drafter, fresh)


def test_a_reply_stopped_by_ctrl_c_leaves_the_conversation_whole(small):
    chat = decode.Conversation(small, make_drafter("hydra++", small))
    prompt = user_turn(0, 5)
    reply = chat.reply(prompt, 12, eos_ids=EOS).tokens
    prompt = prompt + reply + user_turn(1)

    def ctrl_c(new, sources):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        chat.reply(prompt, 30, eos_ids=EOS, on_tokens=ctrl_c)
    r = chat.reply(prompt, 30, eos_ids=EOS)
    fresh = make_drafter("hydra++", small)
    alone = decode.generate(small, prompt, 30, fresh, eos_ids=EOS)
    assert r.tokens == alone.tokens and r.accepted == alone.accepted
    assert_same_state(chat.drafter, fresh)


# --- the contract, through the chat template -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chat(tiny_model_dir):
    """A tiny random Llama with the default model's tokenizer and chat template, fp32."""
    return checkpoint.load(tiny_model_dir, "cpu", torch.float32)


@pytest.mark.parametrize("heads", [None, "hydra++"])
def test_chat_replies_equal_one_shot_replies_to_the_conversation(tiny_chat, heads, capsys):
    model, tok = tiny_chat
    drafter = None
    if heads:
        tree = tree_lib.build(tree_lib.cartesian([2, 2]))
        drafter = drafters.HeadsDrafter(random_heads(model, heads, k=2), tree)
    decoding = dict(verify="auto", temperature=0.0, top_p=1.0, eos_ids={2})
    dec = command.Decoder(model, tok, drafter, None, decoding, generator=None)
    chat = terminal.Chat(dec, system=None, max_new_tokens=12, show=False, stats=True)
    forwarded = []
    for text in ["Hello there.", "Tell me more.", "And a third thing?"]:
        before = chat.messages
        r = chat.answer(before + [{"role": "user", "content": text}])
        conversation = chat.messages[:-1]
        assert conversation[:-1] == before and chat.messages[-1]["role"] == "assistant"
        one_shot = decode.generate(model, checkpoint.encode(tok, conversation), 12, eos_ids={2})
        assert r.tokens == one_shot.tokens
        forwarded.append(chat.conversation.forwarded)
    assert forwarded[1] < forwarded[0] and forwarded[2] < len(chat.conversation.ids) / 2
    assert "forwarded, first token after" in capsys.readouterr().err


def test_a_messages_line_of_prompts_is_answered_as_the_chat_answers_it(
    tiny_chat, tiny_model_dir, monkeypatch, tmp_path, capsys
):
    model, tok = tiny_chat
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: tiny_chat)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi!\nWhat next?\n/save chat.jsonl\n"))
    monkeypatch.chdir(tmp_path)
    assert G.cli_main(["--chat", "--model", tiny_model_dir, "--max-new-tokens", "9"]) == 0
    saved = json.loads((tmp_path / "chat.jsonl").read_text())["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"] * 2
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": saved[:-1], "id": "c"}) + "\n")
    argv = ["--prompts", prompts, "--out", tmp_path / "out.jsonl", "--max-new-tokens", "9"]
    assert G.cli_main([str(a) for a in argv + ["--model", tiny_model_dir]]) == 0
    reply = json.loads((tmp_path / "out.jsonl").read_text())
    assert reply["text"] == saved[-1]["content"]
    assert (
        reply["token_ids"] == decode.generate(model, checkpoint.encode(tok, saved[:-1]), 9).tokens
    )


# --- bad input: one line each, the conversation stays --------------------------------------------


def chat_session(monkeypatch, capsys, tiny_chat, model_dir, lines, *flags):
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: tiny_chat)
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    code = G.cli_main(["--chat", "--model", model_dir, "--max-new-tokens", "5", *flags])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, err, [line for line in err.splitlines() if line.startswith("error: ")]


def test_bad_input_in_a_chat_is_one_line_and_the_conversation_stays(
    tiny_chat, tiny_model_dir, monkeypatch, capsys, tmp_path
):
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "pirate", "content": "arr"}]}\n')
    (tmp_path / "junk.jsonl").write_text("not json\n")
    lines = [
        "Hi!",
        "/bogus",
        "",
        "   ",
        f"/load {tmp_path / 'missing.jsonl'}",
        f"/load {tmp_path / 'bad.jsonl'}",
        f"/load {tmp_path / 'junk.jsonl'}",
        f"/load {tmp_path}",
        "/save",
        f"/save {tmp_path / 'no' / 'such' / 'folder.jsonl'}",
        "word " * 600,  # more tokens than the context of 512 holds
        f"/save {tmp_path / 'kept.jsonl'}",
    ]
    code, _, errors = chat_session(monkeypatch, capsys, tiny_chat, tiny_model_dir, lines)
    assert code == 0
    words = [
        "unknown command /bogus",
        "empty",
        "empty",
        "missing.jsonl: cannot read it",
        'message 1 needs a "role"',
        'not a {"messages": [...]} object',
        "cannot read it",
        "/save needs a file name",
        "folder.jsonl: cannot write it",
        "shorten it",
    ]
    assert len(errors) == len(words), errors
    for error, word in zip(errors, words):
        assert word in error, (word, error)
    kept = json.loads((tmp_path / "kept.jsonl").read_text())["messages"]
    assert [m["content"] for m in kept if m["role"] == "user"] == ["Hi!"]


def test_a_full_context_drops_the_oldest_turns(
    tiny_chat, tiny_model_dir, monkeypatch, capsys, tmp_path
):
    long = "word " * 150  # about 150 tokens a turn: three turns and their replies fill 512
    save = f"/save {tmp_path / 'c.jsonl'}"
    code, err, errors = chat_session(
        monkeypatch, capsys, tiny_chat, tiny_model_dir, [long + "1", long + "2", long + "3", save]
    )
    assert code == 0 and not errors
    assert err.count("the context is full: dropping the oldest 2 messages") == 1
    kept = json.loads((tmp_path / "c.jsonl").read_text())["messages"]
    assert kept[0]["content"] == long + "2" and len(kept) == 4


def test_save_before_any_turn_writes_nothing(
    tiny_chat, tiny_model_dir, monkeypatch, capsys, tmp_path
):
    lines = [f"/save {tmp_path / 'c.jsonl'}"]
    code, _, errors = chat_session(monkeypatch, capsys, tiny_chat, tiny_model_dir, lines)
    assert code == 0 and len(errors) == 1 and "nothing to save yet" in errors[0]
    assert not (tmp_path / "c.jsonl").exists()


def test_save_appends_after_a_last_line_without_its_newline(
    tiny_chat, tiny_model_dir, monkeypatch, capsys, tmp_path
):
    """A file whose last line lacks its newline (written by hand, another tool) keeps that line
    whole: the saved conversation starts a line of its own, and /load reads it back."""
    earlier = (
        '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}'
    )
    (tmp_path / "c.jsonl").write_text(earlier)
    save = f"/save {tmp_path / 'c.jsonl'}"
    lines = ["Hello there", save, f"/load {tmp_path / 'c.jsonl'}"]
    code, err, errors = chat_session(monkeypatch, capsys, tiny_chat, tiny_model_dir, lines)
    assert code == 0 and not errors, err
    first, second = (tmp_path / "c.jsonl").read_text().splitlines()
    assert first == earlier and json.loads(second)["messages"][0]["content"] == "Hello there"


def test_save_and_load_take_the_home_folder(
    tiny_chat, tiny_model_dir, monkeypatch, capsys, tmp_path
):
    monkeypatch.setenv("HOME", str(tmp_path))
    lines = ["Hi!", "/save ~/c.jsonl", "/load ~/c.jsonl"]
    code, err, errors = chat_session(monkeypatch, capsys, tiny_chat, tiny_model_dir, lines)
    assert code == 0 and not errors, err
    assert json.loads((tmp_path / "c.jsonl").read_text())["messages"][0]["content"] == "Hi!"
    assert "[2 messages loaded from" in err


def test_a_reply_cut_at_max_new_tokens_is_marked_on_screen_and_in_the_save(
    tiny_chat, tiny_model_dir, monkeypatch, capsys, tmp_path
):
    """The tiny model never says EOS in 5 tokens: each reply is cut, said so; /save lists them in
    "cut", which /load keeps for the next /save; train.py reads the line's messages."""
    path = tmp_path / "c.jsonl"
    lines = ["Hi!", "More.", f"/save {path}", f"/load {path}", f"/save {path}"]
    code, err, errors = chat_session(monkeypatch, capsys, tiny_chat, tiny_model_dir, lines)
    assert code == 0 and not errors, err
    assert err.count("[cut at --max-new-tokens 5; /save marks it cut]") == 2
    first, again = [json.loads(line) for line in path.read_text().splitlines()]
    assert first["cut"] == [1, 3] == again["cut"] and first["messages"] == again["messages"]
    assert dataset.messages_of(first, "c.jsonl") == first["messages"]
    (tmp_path / "bad.jsonl").write_text(json.dumps(first | {"cut": [0]}) + "\n")
    lines = [f"/load {tmp_path / 'bad.jsonl'}"]
    _, _, errors = chat_session(monkeypatch, capsys, tiny_chat, tiny_model_dir, lines)
    assert len(errors) == 1 and '"cut"' in errors[0]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--prompts", "p.jsonl"], "drop --prompts"),
        (["--out", "o.jsonl"], "drop --out"),
        (["--prompt", "hi"], "drop --prompt"),
        (["--raw"], "drop --raw"),
        (["--batch-size", "2"], "drop --batch-size"),
    ],
)
def test_chat_with_flags_it_cannot_take_is_refused(no_model, capsys, flags, words):
    assert G.cli_main(["--chat", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and words in err


def test_chat_with_a_model_without_a_chat_template_is_refused(tiny_model_dir, tmp_path, capsys):
    folder = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, folder)
    for name in os.listdir(folder):
        if name.endswith(".jinja"):
            os.remove(folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert G.cli_main(["--chat", "--model", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --chat:") and "no chat template" in err[-1]


# --- a real terminal -----------------------------------------------------------------------------


class Screen(bytearray):
    """What the terminal showed; `at`: where the next read_until looks from (past the last marker
    found: a read may bring the next marker in the same chunk)."""

    at = 0


def read_until(fd, marker, seen, timeout=60):
    """Read the terminal into `seen` (a Screen) until `marker` appears past seen.at; move at past
    it."""
    deadline = time.monotonic() + timeout
    while marker not in seen[seen.at :]:
        left = deadline - time.monotonic()
        assert left > 0, f"{marker!r} never came; the terminal showed {bytes(seen)!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                seen += os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                assert marker in seen[seen.at :], f"{marker!r} never came: {bytes(seen)!r}"
    seen.at = seen.index(marker, seen.at) + len(marker)
    return seen


def test_a_chat_at_a_real_terminal(tmp_path):
    """Two turns, Ctrl-C in the middle of the second reply, /reset, Ctrl-D: exit code 0, no
    traceback, the stopped reply says so."""
    model = save_tiny_model(tmp_path / "m", max_position_embeddings=4096)
    # replies long enough (2,000 tokens, seconds) that the Ctrl-C lands inside the second one;
    # fp32: a tiny model's bf16 runs PyTorch's emulated kernels on AVX2, minutes for such replies
    argv = [sys.executable, "generate.py", "--chat", "--model", model, "--dtype", "fp32"]
    argv += ["--max-new-tokens", "2000"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: a new session whose controlling terminal is the pty
        os.chdir(ROOT)
        os.environ["OMP_NUM_THREADS"] = "1"
        os.execv(sys.executable, argv)
    seen = Screen()
    try:
        read_until(fd, b"> ", seen, timeout=120)
        os.write(fd, b"Hello!\n")
        read_until(fd, b"first token after", seen, timeout=300)
        read_until(fd, b"> ", seen)
        os.write(fd, b"Tell me more.\n")
        read_until(fd, b"Tell me more.\r\n", seen)  # the terminal's echo
        read_until(fd, b" ", seen)  # the reply has begun
        os.write(fd, b"\x03")  # Ctrl-C: the terminal sends SIGINT
        read_until(fd, b"[stopped", seen)
        read_until(fd, b"> ", seen)
        os.write(fd, b"/reset\n")
        read_until(fd, b"[a new conversation]", seen)
        read_until(fd, b"> ", seen)
        os.write(fd, b"\x04")  # Ctrl-D: the end
        _, status = os.waitpid(pid, 0)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    finally:
        try:
            while select.select([fd], [], [], 0.5)[0]:
                seen += os.read(fd, 4096)
        except OSError:
            pass
        os.close(fd)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, bytes(seen)
    assert b"Traceback" not in seen
    assert seen.count(b"first token after") == 1, "the second reply should have been stopped"
