"""train.py's command line on bad input: each case ends with one line on stderr, "error: <what> ...;
<fix>", exit code 2 and no traceback, before the model loads where it can; cached features are
keyed by the data's content and the settings that shape them, and rebuilt with a notice when stale
or damaged; --resume refuses flags other than the checkpoint's; Ctrl-C while the model writes its
own data keeps the shards written and exits 130.

Most cases call train.cli_main(argv) in-process, with model.load replaced by a tripwire (checks that
must fail before the model loads) or on a tiny random Llama saved to a folder
(conftest.tiny_model_dir); two run `python train.py` in a subprocess, as a user meets it.
"""

import io
import json
import re
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from specdec.loading import checkpoint
from specdec import rows
from specdec.training import dataset as D
import train as T
from specdec.cli import UsageError
from specdec.commands import train as command
from specdec import terminal
from specdec.loading import catalog
from specdec.training import resume
from conftest import ctrl_c_after, save_tiny_model, tiny_config, torchrun_env
from test_cli import check_one_line_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(capsys, *argv):
    code = T.cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def conversations(path, n=30, seed=0, assistant=True):
    """A ShareGPT-style JSONL file of n short random conversations."""
    g = torch.Generator().manual_seed(seed)
    words = "the cat sat on a mat and then it ran to see the dog who was very happy".split()
    say = lambda k: " ".join(words[int(i)] for i in torch.randint(len(words), (k,), generator=g))
    with open(path, "w") as f:
        for _ in range(n):
            turns = [{"from": "human", "value": say(6)}] + (
                [{"from": "gpt", "value": say(12)}] if assistant else []
            )
            f.write(json.dumps({"conversations": turns}) + "\n")
    return path


def model_data_work(model, data, work):
    """The flags of what a train.py run reads (--model, --data) and where it caches (--work)."""
    return ["--model", model, "--data", data, "--work", work]


TINY_RUN = [
    "--epochs",
    1,
    "--batch-tokens",
    256,
    "--num-heads",
    2,
    "--kept-tokens",
    64,
    "--eval-every",
    1000,
]


# --- checks that need no model ------------------------------------------------------------------

OUT_OF_RANGE = [
    (flag, value) for flag, (low, high) in command.RANGES.items() for value in (low - 1, high + 1)
] + [(flag, "nan") for flag, (low, _) in command.RANGES.items() if isinstance(low, float)]


@pytest.mark.parametrize("flag, value", OUT_OF_RANGE, ids=[f"{f} {v}" for f, v in OUT_OF_RANGE])
def test_numeric_flags_outside_their_range(no_model, capsys, flag, value):
    low, high = command.RANGES[flag]
    check_one_line_error(
        *run_train(capsys, flag, value)[::2], f"{flag} ", f"out of range; use {low} to {high}"
    )


def test_help_states_every_range():
    text = " ".join(command.build_parser().format_help().split())  # undo the line wrapping
    for flag, (low, high) in command.RANGES.items():
        # in the flag's own help, after its usage
        assert f"{low} to {high}" in text.split(flag, 2)[2], flag


BAD_FLAGS = {
    "--heads eagle": "invalid choice",
    "--epochs two": "invalid int value",
    "--train-dtype fp16": "invalid choice",
    "--device tpu": "unknown device",
    "--bogus": "unrecognized arguments",
}


@pytest.mark.parametrize("argv", BAD_FLAGS)
def test_bad_flags(no_model, capsys, argv):
    check_one_line_error(*run_train(capsys, *argv.split())[::2], BAD_FLAGS[argv])


def test_data_missing_or_a_folder(no_model, capsys, tmp_path):
    check_one_line_error(
        *run_train(capsys, "--data", tmp_path / "nope.jsonl")[::2], "cannot read it", "or 'self'"
    )
    check_one_line_error(
        *run_train(capsys, "--data", tmp_path)[::2], "is a folder", "ShareGPT-style JSONL file"
    )


@pytest.mark.parametrize("flag", ["--work", "--out"])
def test_work_and_out_must_be_writable_folders(no_model, capsys, tmp_path, unwritable, flag):
    file = tmp_path / "a-file"
    file.write_text("x")
    check_one_line_error(
        *run_train(capsys, flag, file)[::2], f"{flag} {file}: is a file, not a folder"
    )
    check_one_line_error(
        *run_train(capsys, flag, unwritable)[::2], f"{flag} {unwritable}: cannot write there"
    )
    check_one_line_error(
        *run_train(capsys, flag, os.path.join(unwritable, "sub"))[::2], "cannot write there"
    )
    assert file.read_text() == "x"


def test_script_usage_errors_exit_2():
    """The real entry point: exit code 2 (it was 1), one line, no traceback, before the model
    loads."""
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "train.py", "--epochs", "0"],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    check_one_line_error(p.returncode, p.stderr, "--epochs 0: out of range; use 1 to 1000")
    assert time.time() - t0 < 30 and p.stdout == ""


# --- on a tiny model ----------------------------------------------------------------------------


def test_epochs_0_and_data_without_assistant_turns_train_nothing_and_are_refused(
    capsys, tmp_path, tiny_model_dir
):
    chats = conversations(tmp_path / "chats.jsonl", assistant=False)
    out = tmp_path / "heads"
    check_one_line_error(
        *run_train(
            capsys, *model_data_work(tiny_model_dir, chats, tmp_path), "--out", out, *TINY_RUN
        )[::2],
        "no conversation has an assistant turn",
    )
    assert not os.path.exists(out / "heads.safetensors")
    check_one_line_error(
        *run_train(capsys, "--epochs", 0, "--data", chats)[::2], "--epochs 0: out of range"
    )


def test_assistant_tokens_only_in_held_out_data_are_refused(tmp_path):
    """train() itself refuses data it could learn nothing from, rather than exit 0 with no heads."""
    torch.manual_seed(0)
    base = rows.Model(tiny_config()).eval().requires_grad_(False)
    convs = [(list(range(1, 12)), [False] * 11) for _ in range(20)]
    D.features_of(base, convs, str(tmp_path / "f"), top_k=4)
    args = command.build_parser().parse_args(
        ["--num-heads", "2", "--kept-tokens", "0", "--out", str(tmp_path / "h")]
    )
    lesson = command.Lesson(train=T.train, Recipe=T.Recipe, batch_loss=T.batch_loss)
    with pytest.raises(ValueError, match="nothing to learn from: no assistant token"):
        command.train_heads(
            base, D.load_data(str(tmp_path / "f")), str(tmp_path / "h"), args, lesson
        )
    assert not os.path.exists(tmp_path / "h" / resume.STATE)


def test_features_cache_is_keyed_validated_and_rebuilt(capsys, tmp_path, tiny_model_dir):
    chats = conversations(tmp_path / "chats.jsonl")
    folder = tmp_path / "features-chats.jsonl"
    shard = folder / "shard-00000.safetensors"
    run = lambda *flags: run_train(
        capsys, *model_data_work(tiny_model_dir, chats, tmp_path), *TINY_RUN, "--overwrite", *flags
    )

    code, _, err = run("--gen-batch", 4)
    assert code == 0, err
    assert "computing the features" in err and "cannot be used" not in err
    assert "notice: --gen-batch has no effect with --data FILE" in err
    first = D.read_shard(str(shard))["ids"]

    code, _, err = run()  # same data and settings: reused
    assert code == 0 and "computing the features" not in err, err

    conversations(chats, seed=1)  # same name, other content
    code, _, err = run()
    assert (
        code == 0
        and "made from other data or settings: the data file's content; computing them again" in err
    ), err
    assert not torch.equal(D.read_shard(str(shard))["ids"], first)

    code, _, err = run("--teacher-k", 8)  # a flag that shapes the features
    assert code == 0 and "teacher_k 16, now 8" in err, err
    assert D.read_shard(str(shard))["top_ids"].shape[1] == 8

    shard.write_bytes(shard.read_bytes()[:1000])  # damaged (a full disk, a bad copy)
    code, _, err = run("--teacher-k", 8)
    assert code == 0 and "shard-00000.safetensors is unreadable" in err, err
    os.remove(folder / D.KEY_FILE)  # as an older train.py left it
    code, _, err = run("--teacher-k", 8)
    assert code == 0 and "no valid key.json" in err, err
    assert (
        D.features_problem(str(folder), json.loads((folder / D.KEY_FILE).read_text())["key"])
        is None
    )


def test_resume_with_other_flags_is_refused_or_noticed(
    capsys, monkeypatch, tmp_path, tiny_model_dir
):
    chats, out = conversations(tmp_path / "chats.jsonl"), tmp_path / "heads"
    common = [
        *f"--model {tiny_model_dir} --data {chats} --work {tmp_path} --out {out}".split(),
        *TINY_RUN,
    ]
    code, _, err = run_train(capsys, *common)
    assert code == 0, err
    state = (out / resume.STATE).read_bytes()

    real_load = checkpoint.load
    with monkeypatch.context() as mp:  # refused before the model loads
        mp.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("the model was loaded"))
        check_one_line_error(
            *run_train(capsys, *common, "--resume", "--lr", 0.01, "--seed", 3)[::2],
            "written with other flags: --lr 0.01 (checkpoint: 0.001), --seed 3 (checkpoint: 0)",
            "start afresh with another --out",
        )
    assert checkpoint.load is real_load and (out / resume.STATE).read_bytes() == state

    # harmless: the new value is used
    code, _, err = run_train(capsys, *common, "--resume", "--eval-every", 5)
    assert (
        code == 0 and "notice: --eval-every 5 (checkpoint: 1000): the new value is used" in err
    ), err

    # same size, other data: found once it is read
    other = conversations(tmp_path / "other.jsonl", seed=2)
    code, _, err = run_train(capsys, *common[:2], "--data", other, *common[4:], "--resume")
    check_one_line_error(
        code,
        err.strip().splitlines()[-1],
        "written for other heads or data (data: 30 conversations",
    )
    assert (out / resume.STATE).read_bytes() == state

    code, _, err = run_train(capsys, *common, "--resume", "--epochs", 2)  # a finished run trains on
    assert code == 0 and "notice: --epochs 2 (checkpoint: 1): the new value is used" in err, err
    assert (
        resume.read_checkpoint(str(out))["step"]
        > torch.load(io.BytesIO(state), weights_only=True)["step"]
    )


def test_resume_does_not_depend_on_how_the_model_path_is_typed(capsys, monkeypatch, tmp_path):
    """A model folder whose config.json names no model is known by its path: trained with the path
    typed one way and resumed with it typed another (from its parent folder), the run resumes and
    reuses its features; with the default --work and --out too. Another model is still refused:
    another LM head, or the same LM head on other layers (a fine-tune that left the head alone)."""
    from safetensors.torch import load_file, save_file

    model = save_tiny_model(tmp_path / "tiny-qwen3", _name_or_path="")
    chats = conversations(tmp_path / "chats.jsonl")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    for places in (["--work", tmp_path / "work", "--out", tmp_path / "heads"], []):
        code, _, err = run_train(
            capsys, "--model", os.path.abspath(model), "--data", chats, *places, *TINY_RUN
        )
        assert code == 0, err
        with monkeypatch.context() as mp:
            mp.chdir(tmp_path)
            parent = os.path.basename(tmp_path)
            for typed in ("tiny-qwen3", "./tiny-qwen3", f"../{parent}/tiny-qwen3"):
                code, _, err = run_train(
                    capsys, "--model", typed, "--data", chats, *places, *TINY_RUN, "--resume"
                )
                assert code == 0 and "[train] resumed from step" in err, err
                assert "computing the features" not in err, err

    out = tmp_path / "heads"
    state = (out / resume.STATE).read_bytes()
    common = ["--data", chats, "--work", tmp_path / "work", "--out", out, *TINY_RUN, "--resume"]
    other = save_tiny_model(tmp_path / "other", seed=1, _name_or_path="")
    code, _, err = run_train(capsys, "--model", other, *common)
    last = err.strip().splitlines()[-1]
    check_one_line_error(code, last, "written for other heads or data", "base_fingerprint")
    tuned = save_tiny_model(tmp_path / "tuned", _name_or_path="")  # the same LM head, other layers
    weights = load_file(str(tmp_path / "tuned" / "model.safetensors"))
    weights["layers.0.mlp.down_proj.weight"] += 0.01
    save_file(weights, str(tmp_path / "tuned" / "model.safetensors"))
    code, _, err = run_train(capsys, "--model", tuned, *common)
    last = err.strip().splitlines()[-1]
    check_one_line_error(code, last, "written for other heads or data", "base model weights")
    assert (out / resume.STATE).read_bytes() == state


def test_an_earlier_run_in_out_is_refused_unless_resume_or_overwrite(
    capsys, monkeypatch, tmp_path, tiny_model_dir
):
    """train.py --out FOLDER into a folder holding a run: refused (exit 2, nothing touched) unless
    --resume or --overwrite; --overwrite replaces the run's files and its tuned trees, nothing
    else."""
    chats, out = conversations(tmp_path / "chats.jsonl"), tmp_path / "heads"
    common = [
        *f"--model {tiny_model_dir} --data {chats} --work {tmp_path} --out {out}".split(),
        *TINY_RUN,
    ]
    assert run_train(capsys, *common)[0] == 0
    (out / "tree-cpu-float32.json").write_text('{"paths": [[0]]}')  # tuned for these heads
    (out / "notes.txt").write_text("mine")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    with monkeypatch.context() as mp:  # refused before the model loads
        mp.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("the model was loaded"))
        check_one_line_error(
            *run_train(capsys, *common, "--seed", 1)[::2],
            f"--out {out}",
            "heads.json",
            "--resume to continue",
            "--overwrite",
        )
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before

    empty_resume = tmp_path / "other"
    empty_resume.mkdir()
    (empty_resume / "heads.json").write_text("{}")
    check_one_line_error(
        *run_train(
            capsys, *common[: -len(TINY_RUN) - 2], "--out", empty_resume, *TINY_RUN, "--resume"
        )[::2],
        "--resume finds no checkpoint",
    )

    code, _, err = run_train(capsys, *common, "--seed", 1, "--overwrite")
    assert code == 0, err
    assert (
        not (out / "tree-cpu-float32.json").exists() and (out / "notes.txt").read_text() == "mine"
    )
    assert (out / "heads.safetensors").read_bytes() != before["heads.safetensors"]


def test_resume_and_overwrite_together_are_refused(no_model, capsys, tmp_path):
    """--resume continues the run in --out, --overwrite replaces it: both at once used to resume
    silently."""
    check_one_line_error(
        *run_train(capsys, "--out", tmp_path, "--resume", "--overwrite")[::2],
        "--resume --overwrite",
        "give one of them",
    )


@pytest.mark.parametrize("kind", ["hydra", "hydra++/sub", "."])
def test_out_inside_the_shipped_heads_is_refused_without_retrain_shipped(no_model, capsys, kind):
    """The shipped heads are replaced only on purpose: an --out inside their folders is refused
    before the model loads, --overwrite or not, and nothing there is touched."""
    folder = os.path.normpath(os.path.join(catalog.SHIPPED, kind))

    def files():
        return {
            os.path.join(where, f): os.path.getmtime(os.path.join(where, f))
            for where, _, names in os.walk(catalog.SHIPPED)
            for f in names
        }

    before = files()
    for also in ([], ["--overwrite"]):
        check_one_line_error(
            *run_train(capsys, "--heads", "hydra", "--out", folder, *also)[::2],
            f"--out {folder}: inside the shipped heads'",
            "--retrain-shipped",
        )
    assert files() == before and not os.path.exists(os.path.join(catalog.SHIPPED, "hydra++/sub"))


def test_the_shipped_heads_are_recognised_as_shipped():
    """catalog.SHIPPED_WEIGHTS holds the digests of the heads shipped now: the banner names none of
    them as retrained."""
    for kind in catalog.SHIPPED_WEIGHTS:
        folder = os.path.join(catalog.SHIPPED, kind)
        assert not catalog.retrained(folder) and terminal.heads_source("heads", folder) == ""


def test_retrain_shipped_trains_in_place_and_the_banner_says_so(
    capsys, monkeypatch, tmp_path, tiny_model_dir
):
    """With --retrain-shipped a shipped folder takes a run (here a stand-in for the shipped
    folder), and the heads there are named on the banner as retrained, not the shipped ones."""
    shipped = tmp_path / "weights"
    folder = shipped / "hydra"
    folder.mkdir(parents=True)
    (folder / "heads.json").write_text("{}")
    monkeypatch.setattr(catalog, "SHIPPED", str(shipped))
    chats = conversations(tmp_path / "chats.jsonl")
    common = [*model_data_work(tiny_model_dir, chats, tmp_path), *TINY_RUN, "--out", folder]
    check_one_line_error(
        *run_train(capsys, *common, "--overwrite")[::2], "inside the shipped heads'"
    )
    code, _, err = run_train(capsys, *common, "--overwrite", "--retrain-shipped")
    assert code == 0, err
    assert catalog.retrained(str(folder))
    banner = terminal.heads_source("heads", str(folder))
    assert banner == f", retrained in {folder}, not the shipped heads"


def test_out_is_refused_only_for_a_runs_files(capsys, tmp_path, tiny_model_dir):
    """--out holding files of its own (notes, a README) takes a run beside them; heads without a
    checkpoint (train.py's heads.json, no state.pt) are refused without offering --resume."""
    chats = conversations(tmp_path / "chats.jsonl")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    common = [*model_data_work(tiny_model_dir, chats, tmp_path), *TINY_RUN]
    code, _, err = run_train(capsys, *common, "--out", mine)
    assert code == 0, err
    assert (mine / "heads.safetensors").exists() and (mine / "notes.txt").read_text() == "mine"

    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "heads.json").write_text("{}")
    (heads / "notes.txt").write_text("mine")
    for also in ([], ["--resume"]):
        code, _, err = run_train(capsys, *common, "--out", heads, *also)
        line = check_one_line_error(
            code, err, f"--out {heads}", "heads.json, which training would overwrite", "--overwrite"
        )
        assert "notes.txt" not in line and "--resume to continue" not in line, line
    assert sorted(p.name for p in heads.iterdir()) == ["heads.json", "notes.txt"]


def test_a_model_that_fails_to_load_leaves_no_new_folder_behind(capsys, tmp_path):
    """--out and --work are created before the model loads (to find an unwritable place early); a
    model that then fails to load leaves none of the folders this run created, and nothing else
    is removed."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    existing = tmp_path / "existing"
    existing.mkdir()
    new = (tmp_path / "new" / "heads", tmp_path / "new-work" / "sub")
    for out, work in (new, (existing, existing)):
        code, _, err = run_train(capsys, "--model", broken, "--out", out, "--work", work)
        check_one_line_error(code, err, "config.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "existing"]


def self_distilled_shard(folder, n=2, k=16, dim=16):
    """A shard of n short conversations with features as self_distill writes them."""
    os.makedirs(folder, exist_ok=True)
    convs = [
        dict(
            prompt=f"prompt {i}",
            ids=[1, 2, 3, 4, 5],
            loss=[False, False, True, True, True],
            teacher_from=1,
            hidden=torch.zeros(4, dim),
            top_ids=torch.zeros(3, k, dtype=torch.long),
            top_p=torch.zeros(3, k),
        )
        for i in range(n)
    ]
    path = os.path.join(folder, f"shard-{len(D.shards_in(folder)):05d}.safetensors")
    D.write_shard(path, convs)
    return path


def test_self_distilled_data_of_other_settings_is_refused_and_kept(
    capsys, tmp_path, tiny_model_dir
):
    shard = self_distilled_shard(tmp_path / "self_distill", k=16)
    before = open(shard, "rb").read()
    check_one_line_error(
        *run_train(capsys, "--model", tiny_model_dir, "--work", tmp_path, "--teacher-k", 8)[::2],
        "holds features of teacher-k 16 and width 16, this run needs 8 and 16",
        "another --work",
    )
    assert open(shard, "rb").read() == before


def test_broken_self_distilled_shards_are_set_aside_and_the_rest_renumbered(capsys, tmp_path):
    folder = str(tmp_path / "self_distill")
    paths = [self_distilled_shard(folder, n=i + 1) for i in range(3)]  # 1, 2, 3 conversations
    with open(paths[1], "r+b") as f:
        f.truncate(100)
    D.check_self_data(folder, {"teacher_k": 16, "dim": 16})
    assert "shard-00001.safetensors is unreadable" in capsys.readouterr().err
    assert D.shards_in(folder) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert [
        len(D.read_shard(os.path.join(folder, f), meta_only=True)) for f in D.shards_in(folder)
    ] == [1, 3]
    assert os.path.exists(paths[1] + ".broken")
    # key.json now records the settings
    with pytest.raises(UsageError, match="made with other settings"):
        D.check_self_data(folder, {"teacher_k": 16, "dim": 32})


@pytest.mark.parametrize(
    "sig, code, how", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")]
)
def test_ctrl_c_or_sigterm_while_self_distilling_keeps_the_shards(
    tmp_path, tiny_model_dir, sig, code, how
):
    # SIGTERM: what a scheduler, a closing session or `kill` sends; the data stage stops as on
    # Ctrl-C
    shard = self_distilled_shard(tmp_path / "self_distill", n=2)
    before = open(shard, "rb").read()
    # the random model writes prompts that fail the filter: it never finishes on its own
    got, out, err = ctrl_c_after(
        ["train.py", "--model", tiny_model_dir, "--work", tmp_path, "--gen-batch", "4"],
        "self-distilled data in",
        1.0,
        sig,
    )
    assert got == code, err
    assert "Traceback" not in err
    assert (
        f"interrupted by {how} while building the data: 2 conversations saved in" in err
        and "are kept" in err
    )
    assert "[data] 0 conversations" in err  # the summary line, also when stopped
    assert open(shard, "rb").read() == before


def test_a_model_that_writes_no_usable_prompt_stops_with_one_line(
    capsys, tmp_path, tiny_model_dir, monkeypatch
):
    # the random model never ends a prompt: without the guard the data stage would loop for ever
    monkeypatch.setattr(D, "DRY_PROMPTS", 8)
    code, _, err = run_train(
        capsys,
        "--model",
        tiny_model_dir,
        "--work",
        tmp_path,
        "--gen-batch",
        4,
        "--max-prompt-tokens",
        16,
    )
    check_one_line_error(
        code,
        err.strip().splitlines()[-1],
        "so no prompt fit",
        "give a larger --max-prompt-tokens, or your own data with --data",
    )


@pytest.mark.parametrize("flag", ["--max-answer-tokens", "--max-prompt-tokens"])
def test_self_distillation_lengths_beyond_the_context_are_refused(
    capsys, tmp_path, tiny_model_dir, flag
):
    check_one_line_error(
        *run_train(capsys, "--model", tiny_model_dir, "--work", tmp_path, flag, 513)[::2],
        f"{flag} 513: the model's context holds 512 tokens; use less",
    )
    assert not os.path.exists(tmp_path / "self_distill")


def test_conversations_of_another_tokenizer_are_refused(capsys, tmp_path, tiny_model_dir):
    from safetensors.torch import save_file

    big = tmp_path / "big.safetensors"  # an id beyond the tiny model's vocabulary
    save_file(
        {
            "ids": torch.tensor([1, 2, 1 << 20], dtype=torch.int32),
            "loss": torch.tensor([False, True, True]),
            "offsets": torch.tensor([0, 3]),
        },
        str(big),
    )
    for flag in ("--data", "--continue-from"):
        check_one_line_error(
            *run_train(capsys, "--model", tiny_model_dir, "--work", tmp_path, flag, big)[::2],
            f"{flag} {big}: it holds token id {1 << 20}, beyond this model's vocabulary",
            "use that model",
        )


def test_continue_from_is_checked_before_the_model_loads(no_model, capsys, tmp_path):
    fake = tmp_path / "fake.safetensors"
    fake.write_bytes(b"not safetensors")
    check_one_line_error(
        *run_train(capsys, "--continue-from", fake)[::2],
        f"--continue-from {fake}: not a conversations file written by --export-conversations",
    )
    check_one_line_error(
        *run_train(capsys, "--continue-from", tmp_path / "missing.safetensors")[::2],
        "--continue-from",
        "not a conversations file",
    )
    check_one_line_error(
        *run_train(capsys, "--data", conversations(tmp_path / "c.jsonl"), "--continue-from", fake)[
            ::2
        ],
        "it seeds self-distilled data; use it with --data self",
    )
    check_one_line_error(
        *run_train(capsys, "--export-conversations", fake)[::2],
        f"--export-conversations {fake}: that file is not a conversations file; give a new file "
        "name",
    )
    assert fake.read_bytes() == b"not safetensors"


def test_export_conversations_and_train_from_them(capsys, tmp_path, tiny_model_dir):
    """--export-conversations writes ids and masks and stops; --data that file trains; a bad name
    or a file that is not one of them is one line, exit 2."""
    chats = conversations(tmp_path / "chats.jsonl")
    check_one_line_error(
        *run_train(capsys, "--export-conversations", tmp_path / "c.json")[::2],
        "name it FILE.safetensors",
    )
    export = tmp_path / "convs.safetensors"
    code, _, err = run_train(
        capsys, *model_data_work(tiny_model_dir, chats, tmp_path), "--export-conversations", export
    )
    assert code == 0 and "30 conversations" in err and os.path.isfile(export), err
    assert "diversity" not in err  # a --data file's prompts are not kept: no made-up figures
    code, _, err = run_train(
        capsys,
        *model_data_work(tiny_model_dir, export, tmp_path),
        *TINY_RUN,
        "--out",
        tmp_path / "heads",
    )
    assert (
        code == 0
        and "computing the features" in err
        and os.path.isfile(tmp_path / "heads" / "heads.safetensors")
    ), err
    fake = tmp_path / "fake.safetensors"
    fake.write_bytes(b"not safetensors")
    check_one_line_error(
        *run_train(capsys, "--model", tiny_model_dir, "--data", fake, "--work", tmp_path)[::2],
        "not a conversations file written by --export-conversations",
    )


def test_counts_of_one_are_singular(capsys, tmp_path, tiny_model_dir):
    """One batch is "1 step", one conversation "1 conversation": cli.plural, not "1 steps"."""
    chats = conversations(tmp_path / "chats.jsonl", n=3)
    batch_all = ["--batch-tokens", 1_048_576]  # every conversation in one batch: one step
    code, _, err = run_train(
        capsys,
        *model_data_work(tiny_model_dir, chats, tmp_path),
        *TINY_RUN,
        *batch_all,
        "--out",
        tmp_path / "heads",
    )
    assert code == 0 and "[train] done: 1 step," in err, err
    one = conversations(tmp_path / "one.jsonl", n=1)
    code, _, err = run_train(
        capsys,
        *model_data_work(tiny_model_dir, one, tmp_path),
        "--export-conversations",
        tmp_path / "one.safetensors",
    )
    assert code == 0 and "[train] 1 conversation, " in err, err


# --- torchrun: the ranks stop together ----------------------------------------------------------


def rank_worker(rank, port, argv, results):
    torchrun_env(rank, port)
    with open(os.path.join(results, f"rank{rank}"), "w") as f:
        f.write(str(T.cli_main(argv)))


@pytest.mark.parametrize("case", ["export", "bad data"])
def test_two_processes_end_together_when_rank_0_ends_in_the_data_stage(
    tmp_path, tiny_model_dir, case
):
    """Rank 0 builds the data while the others wait; --export-conversations (done) or bad data (an
    error) used to leave them waiting at a barrier for ever. Bad data is now refused by every rank
    before the model loads (exit 2 each), before any barrier."""
    import socket

    chats = conversations(tmp_path / "chats.jsonl")
    if case == "bad data":
        chats.write_text("{not json\n")
    extra = ["--export-conversations", tmp_path / "c.safetensors"] if case == "export" else []
    argv = [*model_data_work(tiny_model_dir, chats, tmp_path), "--device", "cpu", *TINY_RUN, *extra]
    argv = [str(a) for a in argv]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.start_processes(
        rank_worker, args=(port, argv, str(tmp_path)), nprocs=2, start_method="fork", join=False
    )
    deadline = time.time() + 240
    while not ctx.join(timeout=2):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("a rank is still waiting")
    codes = [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]
    assert codes == ([0, 0] if case == "export" else [2, 2]), codes


# --- what you read is what runs -----------------------------------------------------------------


def test_the_readable_loss_is_train_py_s_teacher_loss_at_call_time(
    capsys, monkeypatch, tmp_path, tiny_model_dir
):
    """With --loss-impl readable every training step calls train.teacher_loss as the module holds it
    when the step runs (a patch shows); the fused default does not call it."""
    calls = []

    def recorded(logits, top_ids, top_p):
        calls.append(len(logits))
        return torch.zeros(len(logits)) * logits.sum()  # 0, with a gradient: the heads stay

    monkeypatch.setattr(T, "teacher_loss", recorded)
    chats = conversations(tmp_path / "chats.jsonl")
    common = [*model_data_work(tiny_model_dir, chats, tmp_path), *TINY_RUN, "--out", tmp_path / "h"]
    code, _, err = run_train(capsys, *common, "--loss-impl", "readable")
    assert code == 0, err
    steps = int(re.search(r"\[train\] done: (\d+) steps?,", err).group(1))
    assert len(calls) == steps > 0
    code, _, err = run_train(capsys, *common, "--overwrite")
    assert code == 0, err
    assert len(calls) == steps


def test_a_print_in_teacher_loss_shows_on_python_train_py(tmp_path, tiny_model_dir):
    """An edited copy of train.py run as __main__ (as `python train.py --loss-impl readable` runs)
    from the repository, where `import train` would find the unedited file: the reader's print in
    teacher_loss shows, so what trains is the file that runs, not a second copy the package
    imported."""
    source = open(os.path.join(ROOT, "train.py"), encoding="utf-8").read()
    body = "    logq = logits.float().log_softmax(-1)  # (M, V')\n    kept = top_ids >= 0"
    assert source.count(body) == 1
    edited = tmp_path / "train.py"
    edited.write_text(source.replace(body, '    print("a reader was here")\n' + body), "utf-8")
    chats = conversations(tmp_path / "chats.jsonl")
    argv = [*model_data_work(tiny_model_dir, chats, tmp_path), *TINY_RUN, "--out", tmp_path / "h"]
    as_main = "import runpy, sys\npath = sys.argv.pop(1)\nsys.argv[0] = 'train.py'\n" + (
        "runpy.run_path(path, run_name='__main__')"
    )
    p = subprocess.run(
        [sys.executable, "-c", as_main, edited, *map(str, argv), "--loss-impl", "readable"],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "a reader was here" in p.stdout


@pytest.mark.parametrize(
    "content, words",
    [
        ("", "--data"),
        ("not json\n", "fix the file"),
        (
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": '
            '"hello"}]}\nnot json\n',
            "--skip-bad",
        ),
    ],
)
def test_empty_or_malformed_data_is_refused_before_the_model_loads(
    no_model, capsys, tmp_path, content, words
):
    data = tmp_path / "chats.jsonl"
    data.write_text(content)
    code, _, err = run_train(capsys, "--data", data, "--out", tmp_path / "out")
    assert code == 2 and words in err and "Traceback" not in err, err
