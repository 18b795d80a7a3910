"""train.py's checkpoints and resuming, and what --out may hold.

Invariant: state.pt alone is the checkpoint. It holds the heads' weights, the optimizer state and
the step they belong to, in one file written to state.pt.tmp (flushed to disk) and renamed over
the old one, so after a kill -9 it is the old checkpoint or the new one, whole, never a mix.
heads.safetensors + heads.json next to it (checkpoint.save_heads, what generate.py loads) are
written after it: a crash between the two leaves them one checkpoint older than state.pt, and
--resume never reads them. Nothing else needs saving: batches are fixed by (seed, epoch), the noise
by (seed, step, rank), the learning rate by the step (batches.py). `identity` (heads config, data
size and digest, the flags) must match on resume, so that a checkpoint is never continued with
other heads, other data or another recipe; only flags that never touch the weights may change, and
a notice says so.

    check_out(out, args)                        # before anything loads: refused with one line
    identity = run_identity(heads, data, args, world, bf16, weights)
    step, progress = load_checkpoint(out, heads, opt, identity)
    save_checkpoint(out, heads, opt, step, identity, progress)

More modules than the heads (joint.py's LoRA) travel in the same state.pt: `more`, a dict of them by
name, in save_checkpoint and load_checkpoint.

Tests: tests/test_train.py, tests/test_train_cli.py.
"""

import hashlib
import os
from dataclasses import asdict

import torch

from specdec import cli
from specdec.cli import UsageError, notice
from specdec.loading import catalog, checkpoint

STATE = "state.pt"
# heads.json's base_name is how --model was typed or what the model's config calls itself, not
# which model it is: a resumed run is checked against base_fingerprint and the weights' digest.
NOT_COMPARED = ("base_name",)
# the new value is used (epochs: the schedule stretches)
RESUME_MAY_CHANGE = (
    "eval_every",
    "save_every",
    "epochs",
    "eval_conversations",
)
NOT_RECORDED = (
    "resume",
    "overwrite",
    "retrain_shipped",
    "skip_bad",
    "out",
    "work",
    "device",
    "model",
    "data",
    "export_conversations",
    "continue_from",
)  # places; model and data: by identity
SELF_DISTILL_FLAGS = (
    "num_prompts",
    "max_answer_tokens",
    "max_prompt_tokens",
    "gen_batch",
    "answer_temperature",
    "seeds",
)


def recorded_flags(args):
    """The flags a checkpoint records (those shaping self-distilled data only with --data self)."""
    skip = NOT_RECORDED + (() if args.data == "self" else SELF_DISTILL_FLAGS)
    return {k: v for k, v in vars(args).items() if k not in skip}


def resume_differences(saved, now):
    """Flags recorded in both that differ, as '--flag new (checkpoint: old)': (refused, may
    change)."""
    differ = [k for k in saved if k in now and saved[k] != now[k]]

    def say(k):
        return f"--{k.replace('_', '-')} {now[k]} (checkpoint: {saved[k]})"

    refused = [say(k) for k in differ if k not in RESUME_MAY_CHANGE]
    return refused, [say(k) for k in differ if k in RESUME_MAY_CHANGE]


def read_checkpoint(folder):
    path = os.path.join(folder, STATE)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or not a checkpoint: torch raises several kinds
        raise ValueError(
            f"{path} is unreadable ({type(e).__name__}); start afresh without --resume or with "
            "another --out"
        ) from None


def refuse_other_flags(folder, refused):
    if refused:
        raise ValueError(
            f"{folder}/{STATE} was written with other flags: {', '.join(refused)}; resume with the "
            "checkpoint's values, or start afresh with another --out"
        )


def data_digest(data):
    """A short digest of the training data's tokens, loss mask and conversation bounds."""
    h = hashlib.sha256()
    for name in ("offsets", "ids", "loss"):
        h.update(data[name].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def run_identity(heads, data, args, world, bf16, weights):
    """What a checkpoint must share with the run that resumes it: the heads' config, the data
    (size and digest), the flags, and what shapes the run beyond the flags: the number of processes
    (it sets the batches of a step and the schedule's length) and what --train-dtype auto chose on
    this machine; the base model by its weights' digest (and its LM head, in the config), whatever
    --model's spelling."""
    return {
        "config": asdict(heads.cfg),
        "data": [len(data["offsets"]) - 1, len(data["ids"]), data_digest(data)],
        "flags": {**recorded_flags(args), "processes": world, "bf16_products": bf16},
        "weights": weights,
    }


def save_checkpoint(folder, heads, opt, step, identity, progress=None, more=None):
    """state.pt, then the heads' files. A write that fails (a full disk: an OSError, the one
    behind torch's own error where it raised one) or is stopped leaves no temporary file, and the
    previous checkpoint whole. more: other modules to keep, by name."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE)
    modules = {name: module.state_dict() for name, module in (more or {}).items()}
    try:
        with open(path + ".tmp", "wb") as f:
            torch.save(
                {
                    "heads": heads.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step,
                    "progress": progress,
                    **({"modules": modules} if modules else {}),
                    **identity,
                },
                f,
            )
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        checkpoint.remove_quietly(path + ".tmp")
        if isinstance(e, RuntimeError) and cli.os_error(e):
            raise cli.os_error(e) from None
        raise
    os.replace(path + ".tmp", path)
    checkpoint.save_heads(heads, folder)


def saving_failed(out, step, error, kept):
    """The one line for a checkpoint a disk did not take (an OSError): --out, the step, what is
    kept (a sentence: kept_line's) and the fix."""
    return UsageError(
        f"--out {out}: writing the checkpoint of step {step} failed "
        f"({error.strerror or error}); {kept}; free some space and run again with --resume, or "
        "give an --out on another disk"
    )


def kept_line(out, saved_step):
    """What a run stopped by an error leaves: its last checkpoint (0: none), in a sentence."""
    if saved_step:
        return f"the last checkpoint (step {saved_step}) in {out} is kept"
    return "no checkpoint was written"


def load_checkpoint(folder, heads, opt, identity, more=None):
    """Load state.pt into heads and opt (built as for a fresh run), and into the modules of `more`
    (by name, as saved); returns the step to continue at and the progress so far (assistant tokens
    trained on, the learning curve)."""
    state = read_checkpoint(folder)
    if "heads" not in state:
        raise ValueError(
            f"{folder}/{STATE} was written by an older train.py (no heads inside); "
            "start again without --resume, or with another --out"
        )
    refused, changed = resume_differences(state.get("flags", {}), identity["flags"])
    refuse_other_flags(folder, refused)
    for flag in changed:
        notice(f"{flag}: the new value is used")
    saved, mine = state["heads"].get("kept_ids"), heads.kept_ids
    same_vocab = (
        saved is None if mine is None else saved is not None and torch.equal(saved, mine.cpu())
    )
    config, data = state.get("config") or {}, state.get("data") or []
    differ = [
        f"heads {k} {v} (checkpoint: {config.get(k)})"
        for k, v in identity["config"].items()
        if config.get(k) != v and k not in NOT_COMPARED
    ]
    if state.get("weights", identity["weights"]) != identity["weights"]:  # older ones lack it
        differ.append(f"base model weights {identity['weights']} (checkpoint: {state['weights']})")
    # older checkpoints record the size only, not the digest
    if data != identity["data"][: len(data)]:
        differ.append(
            f"data: {cli.plural(identity['data'][0], 'conversation')}, "
            f"{cli.plural(identity['data'][1], 'token')}, digest "
            f"{identity['data'][2]} (checkpoint: {', '.join(map(str, data))})"
        )
    if differ or not same_vocab:
        raise ValueError(
            f"{folder}/{STATE} was written for other heads or data "
            f"({'; '.join(differ) or 'another kept vocabulary'}); "
            "resume with the same flags and data, or use another --out"
        )
    modules = state.get("modules", {})
    if set(modules) != set(more or {}):
        raise ValueError(
            f"{folder}/{STATE} holds {', '.join(['heads', *modules])}, this run trains "
            f"{', '.join(['heads', *(more or {})])}; resume it with the script that wrote it, or "
            "use another --out"
        )
    heads.load_state_dict(state["heads"])
    opt.load_state_dict(state["opt"])
    for name, module in (more or {}).items():
        module.load_state_dict(modules[name])
    return state["step"], state.get("progress") or {"tokens": 0, "curve": []}


# --- what --out may hold --------------------------------------------------------------------------
# What train.py writes into --out (checkpoint.run_files); --overwrite removes them before a fresh
# run, so that nothing of a previous run (a tuned tree above all) outlives the heads it belonged to.
# The heads shipped with the repository are never written over by mistake: their folders take a
# run only with --retrain-shipped, as --online-save, joint.py and pass_tokens.py refuse them.


def check_out(out, args):
    """--out: outside the shipped heads (or --retrain-shipped), and a folder without a previous
    run's files; or --resume with a checkpoint there (refused now, before the data is built, if its
    flags differ); or --overwrite (clear_run() then clears the previous run)."""
    if catalog.shipped(out) and not args.retrain_shipped:
        raise UsageError(
            f"--out {out}: inside the shipped heads' {catalog.SHIPPED}, which training would "
            "replace; give a new --out, or --retrain-shipped to replace them on purpose"
        )
    files = checkpoint.run_files(out)
    if resumable(out, args):
        return
    if files and not args.overwrite:
        held = ", ".join(files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
        why = f"--resume finds no checkpoint ({STATE}) in it, and it" if args.resume else "it"
        resume = "--resume to continue the run in it, " if STATE in files else ""
        raise UsageError(
            f"--out {out}: {why} holds a previous run's {held}, which training would "
            f"overwrite; give a new --out, {resume}or --overwrite to start afresh"
        )


def resumable(out, args):
    """--resume with a checkpoint in `out`: its flags checked against args' (refused now, before
    the data is built, where they differ), and True; else False."""
    if not (args.resume and os.path.isfile(os.path.join(out, STATE))):
        return False
    saved = read_checkpoint(out).get("flags", {})
    refuse_other_flags(out, resume_differences(saved, recorded_flags(args))[0])
    return True


def clear_run(out):
    """--overwrite: remove a previous run's files from --out, right before training writes its
    own."""
    for name in checkpoint.run_files(out):
        os.remove(os.path.join(out, name))
