"""Ctrl-C at every moment, and the last ways a run loses the user's work (issue 65): one line on
stderr and exit code 130 while torch imports and while the model loads, the old --out file whole;
a press whose KeyboardInterrupt a finalizer swallowed still stops the run; bench.py writes --json
and --plots of what it measured, marked partial; a full disk is named with its flag and file; and
the words a user reads around them.

The Ctrl-C sweep runs `python generate.py` in subprocesses on a tiny random model (a few seconds
each); the rest run the scripts in-process.

Test: `python -m pytest -q tests/test_interrupts.py`.
"""

import collections
import errno
import io
import json
import os
import re
import signal

import pytest

from specdec import cli
from specdec.benching import batches
from specdec.commands import bench as bench_command
from specdec.commands import generate as command
from specdec import ctrl_c
from specdec import terminal
from specdec.engines import decode
from conftest import ctrl_c_after
from test_bench_cli import run_bench, short_run
from test_cli import check_one_line_error, run_cli

OLD = '{"id": "kept", "text": "a reply the user keeps"}\n'


def write_prompts(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "prompt": f"Count to {i + 3}."}) + "\n")
    return path


# --- Ctrl-C while the script starts and while the model loads ------------------------------------


def interrupted_run(tiny_model_dir, tmp_path, marker, delay, importtime=False):
    """generate.py on the tiny model, 8 prompts into an --out that holds OLD (--overwrite), Ctrl-C
    `delay` seconds after a stderr line holding `marker`. Returns (exit code, stderr without
    -X importtime's lines, whether the model had loaded: its banner printed, --out then open)."""
    out = tmp_path / "kept.jsonl"
    out.write_text(OLD)
    argv = ["-X", "importtime"] if importtime else []
    argv += [
        "generate.py",
        "--model",
        tiny_model_dir,
        "--prompts",
        write_prompts(tmp_path / "p.jsonl", 8),
    ]
    argv += [
        "--batch-size",
        16,
        "--out",
        out,
        "--overwrite",
        "--max-new-tokens",
        400,
        "--dtype",
        "fp32",
    ]
    code, _, err = ctrl_c_after(argv, marker, delay)
    lines = [line for line in err.splitlines() if not line.startswith("import time:")]
    loaded = any(line.startswith("[tiny-random-llama on cpu") for line in lines)
    if not loaded:
        assert out.read_text() == OLD, f"--out replaced by a run stopped while it loaded: {err}"
    return code, lines, loaded


def check_stopped(code, lines):
    """Exit 130, no traceback and no "Exception ignored", and the interrupt's line last."""
    text = "\n".join(lines)
    assert code == 130, text
    assert "Traceback" not in text and "Exception ignored" not in text, text
    assert lines[-1].startswith("[interrupted by Ctrl-C"), text


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_ctrl_c_while_torch_imports_is_one_line(tiny_model_dir, tmp_path, delay):
    """From the script's first import (specdec.ctrl_c, before torch) on, Ctrl-C is one line and
    exit 130: not Python's forty-line traceback from inside torch's import."""
    code, lines, loaded = interrupted_run(
        tiny_model_dir, tmp_path, "| specdec.ctrl_c", delay, importtime=True
    )
    check_stopped(code, lines)
    assert not loaded
    assert [line for line in lines if line.strip()] == [lines[-1]], lines  # the one line


@pytest.mark.parametrize(
    "script",
    [["train.py"], ["bench.py"], ["-m", "specdec.export"], ["-m", "specdec.training.joint"]],
)
def test_every_entry_script_imports_the_ctrl_c_handler_before_torch(script):
    """train.py, bench.py and the package's own commands (python -m ...) too: Ctrl-C as torch
    imports is the one line and exit 130, never torch's traceback."""
    argv = ["-X", "importtime", *script, "--help"]
    code, _, err = ctrl_c_after(argv, "| specdec.ctrl_c", 0.0)
    lines = [line for line in err.splitlines() if not line.startswith("import time:")]
    check_stopped(code, lines)
    assert [line for line in lines if line.strip()] == [lines[-1]], lines


def test_ctrl_c_at_any_moment_of_the_load_stops_the_run_and_keeps_the_old_out(
    tiny_model_dir, tmp_path
):
    """SIGINT at many moments from just before the model loads (the --batch-size notice) to after:
    each run exits 130 with one line, and one stopped before its model loaded leaves the --out
    file it would have replaced as it was."""
    during = 0
    for delay in (0.0, 0.3, 0.8, 1.5, 2.5):
        code, lines, loaded = interrupted_run(
            tiny_model_dir, tmp_path, "--batch-size 16: there are only 8 prompts", delay
        )
        check_stopped(code, lines)
        during += not loaded
    assert during >= 1  # the first, at least, landed inside the load


class Finalized:
    """An object whose finalizer runs while Ctrl-C arrives, as a tokenizer's may while it loads:
    Python raises KeyboardInterrupt inside __del__, where it is printed and dropped."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs here, between two bytecodes of the finalizer
            pass


def test_a_ctrl_c_swallowed_by_a_finalizer_during_the_load_still_stops_the_run(
    capsys, tmp_path, tiny_model_dir, monkeypatch
):
    """The issue's case, made certain: the KeyboardInterrupt is lost in a finalizer while the
    tokenizer loads; the run stops when the load returns (exit 130, one line), --out untouched."""
    import transformers

    real = transformers.AutoTokenizer.from_pretrained

    def loads_and_frees(*args, **kw):
        tokenizer = real(*args, **kw)
        Finalized()  # freed at once: its __del__ runs as Ctrl-C comes
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", loads_and_frees)
    out = tmp_path / "kept.jsonl"
    out.write_text(OLD)
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    code, stdout, err = run_cli(
        capsys, "--model", tiny_model_dir, "--prompts", prompts, "--out", out, "--overwrite",
        "--max-new-tokens", 4, "--quiet",
    )  # fmt: skip
    assert code == 130, err
    assert len(err.strip().splitlines()) == 1, err  # no "Exception ignored in ..." either
    assert err.strip().startswith("[interrupted by Ctrl-C"), err
    assert out.read_text() == OLD and stdout == ""
    assert ctrl_c.pressed == 1


def test_a_chat_that_caught_ctrl_c_ends_with_exit_0(capsys, tiny_model_dir, monkeypatch):
    """The chat's Ctrl-C stops a reply and the conversation goes on: handled, it does not make
    the end of the chat an interruption."""
    import sys

    lines = iter(["hi", None])
    real = decode.Conversation.reply

    def stopped(self, *args, **kw):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during the reply
        return real(self, *args, **kw)

    monkeypatch.setattr(decode.Conversation, "reply", stopped)
    monkeypatch.setattr(command.terminal, "read_message", lambda interactive: next(lines))
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False, raising=False)
    code, _, err = run_cli(capsys, "--model", tiny_model_dir, "--chat", "--max-new-tokens", 4)
    assert code == 0, err
    assert "[stopped" in err and "interrupted" not in err


# --- bench.py: Ctrl-C keeps --json and --plots of what was measured ------------------------------
# Ctrl-C while one prompt at a time is measured: test_bench_cli's
# test_ctrl_c_prints_what_was_measured_and_writes_it_marked_partial.


def test_ctrl_c_while_measuring_batch_sizes_keeps_the_sizes_done(
    capsys, tmp_path, tiny_model_dir, monkeypatch
):
    """Stopped after --batch-size's first size: the one-at-a-time results and that size are in
    --json, marked partial, and the exit code is 130."""
    real = batches.batch_rows

    def first_size_only(methods, prompts, sizes, args, device, res):
        real(methods, prompts, sizes[:1], args, device, res)
        raise KeyboardInterrupt

    monkeypatch.setattr(batches, "batch_rows", first_size_only)
    record = tmp_path / "bench.json"
    code, out, err = run_bench(
        capsys, *short_run(tmp_path, tiny_model_dir, limit=3), "--methods", "plain",
        "--batch-size", "2,3", "--json", record,
    )  # fmt: skip
    assert code == 130, err
    written = json.loads(record.read_text())
    assert "while measuring --batch-size" in written["partial"]
    assert list(written["batched"]["plain"]) == ["2"] and written["methods"]["plain"]
    assert "| plain | 2 |" in out


def test_a_whole_run_says_it_is_not_partial(capsys, tmp_path, tiny_model_dir):
    record = tmp_path / "bench.json"
    code, _, err = run_bench(
        capsys, *short_run(tmp_path, tiny_model_dir), "--methods", "plain", "--json", record
    )
    assert code == 0, err
    assert json.loads(record.read_text())["partial"] is None
    assert not os.path.exists(f"{record}.tmp")


# --- a full disk ---------------------------------------------------------------------------------


class Full(io.StringIO):
    """A file on a full disk: the first `room` writes fit, the next fails with ENOSPC."""

    def __init__(self, name, room):
        super().__init__()
        self.name = name
        self.room = room

    def write(self, text):
        if self.room == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= 1
        return super().write(text)


def test_a_full_disk_under_out_names_the_flag_the_file_and_the_reply(
    capsys, tmp_path, tiny_model_dir, monkeypatch
):
    out = str(tmp_path / "replies.jsonl")
    monkeypatch.setattr(command, "open", lambda path, *a, **k: Full(path, room=1), raising=False)
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    code, _, err = run_cli(
        capsys, "--model", tiny_model_dir, "--prompts", prompts, "--out", out,
        "--max-new-tokens", 3, "--quiet",
    )  # fmt: skip
    last = err.strip().splitlines()[-1]  # after the replies' statistics lines
    assert code == 2 and "Traceback" not in err, err
    assert last.startswith(
        f"error: --out {out}: writing the reply to prompt 'p1' failed (No space left on device)"
    ), last
    assert "the replies before it are in the file" in last


class Cut:
    """A real file on a disk that fills up in the middle of the `room`+1-th write: half of its text
    reaches the file, then ENOSPC."""

    def __init__(self, path, room):
        self.file = open(path, "w", encoding="utf-8")
        self.name = path
        self.room = room

    def write(self, text):
        if self.room == 0:
            self.file.write(text[: len(text) // 2])
            self.file.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= 1
        return self.file.write(text)

    def __getattr__(self, name):  # flush, tell, close, the with statement's
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def without_times(path):
    """An --out file's rows without their "seconds" (which differ from run to run)."""
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def test_a_full_disk_in_mid_row_leaves_the_whole_rows_and_no_cut_one(
    capsys, tmp_path, tiny_model_dir, monkeypatch
):
    out = str(tmp_path / "replies.jsonl")
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    flags = ["--model", tiny_model_dir, "--prompts", prompts, "--max-new-tokens", 3, "--quiet"]
    assert run_cli(capsys, *flags, "--out", tmp_path / "whole.jsonl")[0] == 0
    with monkeypatch.context() as mp:
        mp.setattr(command, "open", lambda path, *a, **k: Cut(path, room=1), raising=False)
        code, _, err = run_cli(capsys, *flags, "--out", out)
    assert code == 2 and "reply to prompt 'p1' failed (No space left on device)" in err, err
    assert open(out).read().endswith("\n")
    assert without_times(out) == without_times(tmp_path / "whole.jsonl")[:1]


def test_every_out_row_names_its_prompt_by_its_id_or_its_line(capsys, tmp_path, tiny_model_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "id": "q1"}\n\n{"prompt": "b"}\n{"prompt": "c", "id": 7}\n')
    out = tmp_path / "out.jsonl"
    for batch in ("1", "2"):
        code, _, err = run_cli(
            capsys, "--model", tiny_model_dir, "--prompts", prompts, "--max-new-tokens", 2,
            "--quiet", "--batch-size", batch, "--out", out, "--overwrite",
        )  # fmt: skip
        assert code == 0, err
        assert sorted(map(str, (row["id"] for row in without_times(out)))) == ["3", "7", "q1"]


def test_resume_out_gives_the_prompts_done_and_the_rerun_ends_as_an_uninterrupted_run(
    capsys, tmp_path, tiny_model_dir
):
    """What generate.py --resume does with it: the prompts done are left out, the rest appended."""
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    flags = ["--model", tiny_model_dir, "--max-new-tokens", 3, "--quiet", "--overwrite"]
    whole = tmp_path / "whole.jsonl"
    assert run_cli(capsys, *flags, "--prompts", prompts, "--out", whole)[0] == 0
    lines = whole.read_text().splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    out.write_text(lines[0] + lines[1] + lines[2][:25])  # killed while writing the third row
    ids = [pid for pid, _, _ in cli.read_prompts(prompts)]
    done = terminal.resume_out(str(out), ids)
    assert done == {"p0", "p1"} and out.read_text() == lines[0] + lines[1]
    assert "ended in a row cut short" in capsys.readouterr().err
    rest = tmp_path / "rest.jsonl"
    rest.write_text("".join(line for line in open(prompts) if json.loads(line)["id"] not in done))
    assert run_cli(capsys, *flags, "--prompts", rest, "--out", tmp_path / "more.jsonl")[0] == 0
    with open(out, "a") as f:  # the rerun's rows, appended
        f.write((tmp_path / "more.jsonl").read_text())
    assert without_times(out) == without_times(whole)
    assert terminal.resume_out(str(out), ids) == set(ids)  # a finished run: nothing left to do


@pytest.mark.parametrize(
    "content, words",
    [
        ('{"id": "elsewhere", "text": "x"}\n', "line 1: not a row of these --prompts (no id"),
        ('{"id": "p0"}\n{"id": "p0"}\n', "line 2: not a row of these --prompts (a second row"),
        ("not json\n", "line 1: not a row of these --prompts"),
    ],
)
def test_resume_out_refuses_a_file_of_other_prompts(tmp_path, content, words):
    out = tmp_path / "out.jsonl"
    out.write_text(content)
    with pytest.raises(cli.UsageError, match=re.escape(words)):
        terminal.resume_out(str(out), ["p0", "p1"])
    assert out.read_text() == content


def test_a_full_disk_under_json_names_the_flag_and_keeps_the_old_file(
    capsys, tmp_path, tiny_model_dir, monkeypatch
):
    record = tmp_path / "bench.json"
    record.write_text('{"old": true}')
    real = open
    monkeypatch.setattr(
        bench_command,
        "open",
        lambda path, *a, **k: Full(path, 0) if str(path).endswith(".tmp") else real(path, *a, **k),
        raising=False,
    )
    code, out, err = run_bench(
        capsys, *short_run(tmp_path, tiny_model_dir), "--methods", "plain", "--json", record,
        "--overwrite",
    )  # fmt: skip
    assert code == 2 and "| plain |" in out
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"error: --json {record}: cannot write it (No space left on device)")
    )
    assert record.read_text() == '{"old": true}'


# --- --exact on a CPU, and the words around the rest ---------------------------------------------


def test_exact_on_a_cpu_is_refused_saying_the_interpreter_is_for_tests(no_model, capsys):
    """Not a hint to set TRITON_INTERPRET=1, which runs the kernels minutes a token."""
    line = check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--exact", "--device", "cpu")[::2],
        "--exact: exact.py's kernels run on a CUDA GPU, not on cpu",
        "for the tests only",
        "drop --exact",
    )
    assert "TRITON_INTERPRET" not in line
    check_one_line_error(
        *run_bench(capsys, "--exact", "--device", "cpu")[::2], "run on a CUDA GPU, not on cpu"
    )


@pytest.mark.parametrize("quiet, words", [(True, "[interrupted by Ctrl-C]"), (False, "so far]")])
def test_the_interrupt_line_speaks_of_text_only_where_text_was_shown(
    capsys, tiny_model_dir, monkeypatch, quiet, words
):
    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(decode, "reply", interrupted)
    argv = ["--model", tiny_model_dir, "--prompt", "hi"] + ["--quiet"] * quiet
    code, _, err = run_cli(capsys, *argv)
    assert code == 130 and err.strip().endswith(words), err


def test_a_prompt_id_is_quoted_in_messages(capsys, tmp_path, tiny_model_dir):
    """`prompt long has 9031 tokens` read as English; `prompt 'long' has` names the id."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "long", "prompt": "word " * 600}) + "\n")
    check_one_line_error(
        *run_cli(capsys, "--model", tiny_model_dir, "--prompts", prompts)[::2], "prompt 'long' has"
    )


def test_the_graphs_footer_is_in_a_users_words(capsys, tiny_model_dir):
    code, _, err = run_cli(
        capsys, "--model", tiny_model_dir, "--prompt", "hi", "--max-new-tokens", 4,
        "--heads", "none", "--cuda-graphs", "on",
    )  # fmt: skip
    assert code == 0, err
    footer = [line for line in err.splitlines() if "cuda graphs off" in line and "steps" in line]
    assert footer == [
        "[static steps, cuda graphs off: 3 steps (1 shape); outside them: 1 prompt prefill]"
    ], err
    assert "last_only" not in err and "eager" not in err


def test_graphs_line_names_each_reason_for_a_user():
    class Graphed:  # a GraphedForward's counters, on a GPU
        enabled = True
        replays = 1
        shapes = {1: type("Shape", (), {"graph": object()})()}
        fallbacks = collections.Counter({"last_only": 2, "layers": 1})

    assert command.terminal.graphs_line(Graphed()) == (
        "[cuda graphs: 1 step replayed (1 of 1 shape captured); outside them: 2 prompt prefills, "
        "1 draft by the model's own layers]"
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--heads", "none"], "--online trains draft heads, and --heads none loads none"),
        (["--draft", "lookup"], "--online trains draft heads, and --draft lookup drafts without"),
    ],
)
def test_online_without_heads_says_why_in_words(no_model, capsys, argv, words):
    line = check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--online", *argv)[::2], words)
    assert "has none" not in line


def test_the_seed_help_says_at_the_same_batch_size():
    seed = next(a for a in command.build_parser()._actions if a.dest == "seed")
    assert "at the same --batch-size" in seed.help


def pressed(*args, **kw):
    raise KeyboardInterrupt


def test_ctrl_c_while_the_model_loads_claims_no_text(capsys, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(command.catalog, "load_model", pressed)
    code, out, err = run_cli(capsys, "--model", tiny_model_dir, "--prompt", "hi")
    assert code == 130 and out == "" and err.strip().endswith("[interrupted by Ctrl-C]"), err


def test_ctrl_c_before_the_first_reply_leaves_no_empty_out(capsys, tmp_path, tiny_model_dir):
    """--out is opened once the model has loaded; stopped before a reply is written, the empty
    file is removed, so the same command runs again (it refuses an existing --out)."""
    out = tmp_path / "replies.jsonl"
    argv = ["--model", tiny_model_dir, "--prompts", write_prompts(tmp_path / "p.jsonl", 2)]
    argv += ["--out", out, "--max-new-tokens", 3, "--quiet"]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(decode, "reply", pressed)
        code, _, _ = run_cli(capsys, *argv)
    assert code == 130 and not out.exists()
    code, _, err = run_cli(capsys, *argv)
    assert code == 0 and len(out.read_text().splitlines()) == 2, err


@pytest.mark.parametrize("where", ["tables", "write_json"])
def test_ctrl_c_after_measuring_keeps_the_table_and_the_json(
    capsys, tmp_path, tiny_model_dir, monkeypatch, where
):
    """A press while bench reports (its tables printed, --json written: the late window of a long
    run) cuts neither: the table is printed, the JSON whole, exit 130. The machine's probe (memory
    bandwidth, a step) runs before measuring, where a press leaves nothing to report."""
    from specdec.benching import report

    module = report if where == "tables" else bench_command
    real = getattr(module, where)

    def pressed_meanwhile(*args, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kw)

    monkeypatch.setattr(module, where, pressed_meanwhile)
    record = tmp_path / "bench.json"
    argv = [*short_run(tmp_path, tiny_model_dir), "--methods", "plain", "--json", record]
    code, out, err = run_bench(capsys, *argv)
    assert code == 130, err
    assert "| plain |" in out
    assert json.loads(record.read_text())["methods"]["plain"]["new_tokens"] > 0


@pytest.mark.parametrize("batch", [1, 2])
def test_generate_resume_continues_an_interrupted_run_to_the_uninterrupted_file(
    capsys, tmp_path, tiny_model_dir, monkeypatch, batch
):
    """generate.py --prompts --out, stopped by Ctrl-C after two replies, then the same command with
    --resume: the file holds what one uninterrupted run writes (seconds aside), sampled too (a
    batch seeds each prompt by its line, whichever prompts are left)."""
    prompts = write_prompts(tmp_path / "p.jsonl", 5)
    flags = ["--model", tiny_model_dir, "--prompts", prompts, "--max-new-tokens", 3, "--quiet"]
    flags += ["--batch-size", batch] + (["--temperature", 0.8, "--seed", 3] if batch > 1 else [])
    whole = tmp_path / "whole.jsonl"
    assert run_cli(capsys, *flags, "--out", whole)[0] == 0
    out = tmp_path / "out.jsonl"
    done = terminal.Replies.done
    written = []

    def stopping(self, i, r):  # Ctrl-C as the third reply ends
        if len(written) == 2:
            raise KeyboardInterrupt
        done(self, i, r)
        written.append(i)

    with monkeypatch.context() as m:
        m.setattr(terminal.Replies, "done", stopping)
        assert run_cli(capsys, *flags, "--out", out)[0] == 130
    assert len(out.read_text().splitlines()) == 2
    code, _, err = run_cli(capsys, *flags, "--out", out, "--resume")
    assert code == 0, err
    assert sorted(without_times(out), key=str) == sorted(without_times(whole), key=str)
    code, _, err = run_cli(capsys, *flags, "--out", out, "--resume")
    assert code == 0 and "holds a row for every prompt; nothing to do" in err


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--prompt", "hi"], "--resume continues the --out file of a --prompts run"),
        (["--out", "o.jsonl", "--overwrite"], "--resume keeps the rows --out holds"),
    ],
)
def test_resume_needs_prompts_and_out_and_no_overwrite(capsys, tmp_path, no_model, flags, words):
    prompts = write_prompts(tmp_path / "p.jsonl", 1)
    if "--prompt" not in flags:
        flags = ["--prompts", prompts, *flags]
    code, _, err = run_cli(capsys, *flags, "--resume")
    assert code == 2 and words in err, err
