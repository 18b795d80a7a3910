"""train.py's data stage, before the loop: the base model for writing data (a bf16 copy where that
is fast), the folders a run uses, and the data built on disk (dataset.py's stages: self-distilled
conversations or a user's file, then their features), resumable and kept on Ctrl-C or SIGTERM.

    writer = data_model(model, "auto")
    out, folder = places(args, model, made)
    key = dataset.data_key(writer, args.teacher_k, digest)     # what the cached data is keyed by
    code = build_data(args, tokenizer, writer, key, folder)     # None: go on and train

Tests: tests/test_train.py, tests/test_train_cli.py.
"""

import copy
import os
import re
import signal
import sys

from specdec import cli
from specdec.cli import notice, writable_folder
from specdec.fast import kernels
from specdec.loading import checkpoint
from specdec.training import dataset
from specdec.training.resume import check_out


def data_model(model, dtype):
    """The base model for generating data: `model` (fp32, what training reads) or a copy in bf16."""
    dtype = kernels.pick_dtype(dtype, model.device.type, native=False)
    if dtype == model.dtype:
        return model
    # oneDNN's prepacked weights cannot be deep-copied: copy without them,
    fast = kernels.in_use(model)
    kernels.use(model, kernels.Kernels())
    # with the copy's own kernels for its dtype
    writer = kernels.use(copy.deepcopy(model).to(dtype=dtype))
    kernels.use(model, fast)
    return writer


def model_path(name):
    """--model as checkpoint.load should see it: a local folder by its real path, so that however it
    is typed (m, ./m, /abs/m, a link to it) a model without a name of its own in its config.json is
    named alike (its default --work folder, the heads' base_name)."""
    return os.path.realpath(name) if name != checkpoint.DEFAULT and os.path.isdir(name) else name


def places(args, model, made):
    """The heads folder and the data folder of this run: (out, folder). Folders it creates are
    added to `made`."""
    work = args.work or os.path.join(
        cli.cache_root(), "train", re.sub(r"[^\w.-]", "_", model.cfg.name)
    )
    out = args.out or os.path.join(work, "heads-" + args.heads)
    if args.out is None:  # the default folders, known now that the model has a name
        made += cli.new_folders(work, out)
        writable_folder("--work", work)
        writable_folder("--out", out)
        check_out(out, args)
    if args.data == "self":
        folder = os.path.join(work, "self_distill")
    else:
        name = re.sub(r"[^\w.-]", "_", os.path.basename(args.data))
        folder = os.path.join(work, "features-" + name)
    return out, folder


class Terminated(KeyboardInterrupt):
    """SIGTERM while the data is built: stops it as Ctrl-C does (the finished shards are kept)."""


def raise_terminated(signum, frame):
    raise Terminated


def say(msg):
    print(msg, file=sys.stderr, flush=True)


def build_data(args, tokenizer, writer, key, folder):
    """Rank 0's data stage: self-distilled data or a user's file's features, on disk (resumable).
    Returns an exit code when the run ends here (--export-conversations, Ctrl-C), else None."""
    on_sigterm = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        if args.data == "self":
            dataset.check_self_data(folder, key)
            if args.continue_from:
                dataset.continue_from(writer, folder, args.continue_from, key)
            say(f"[train] self-distilled data in {folder} (Ctrl-C keeps the shards written)")
            dataset.self_distill(writer, tokenizer, folder, args)
        elif problem := dataset.features_problem(folder, key):
            if os.path.isdir(folder):
                notice(f"the features in {folder} cannot be used: {problem}; computing them again")
            convs = (
                dataset.read_conversations(args.data)
                if args.data.endswith(".safetensors")
                else dataset.read_sharegpt(args.data, tokenizer, args.skip_bad)
            )
            say(f"[train] computing the features of {args.data} into {folder}")
            dataset.features_of(writer, convs, folder, args.teacher_k, key=key)
    except KeyboardInterrupt as e:
        signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        how = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        kept = dataset.saved_so_far(folder, args.data == "self")
        print(f"\n[train] interrupted by {how} while building the data: {kept}", file=sys.stderr)
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, on_sigterm)
    if args.export_conversations:
        n, tokens, answers = dataset.export_conversations(folder, args.export_conversations)
        print(
            f"[train] {cli.plural(n, 'conversation')}, {cli.plural(tokens, 'token')} "
            f"({cli.plural(answers, 'assistant token')}) written to "
            f"{args.export_conversations}; --data {args.export_conversations} rebuilds their "
            "features",
            file=sys.stderr,
        )
        prompts = dataset.folder_prompts(folder)
        # features of a --data file keep no prompts (each is ""): no figures to give then
        if prompts and all(prompts):
            print(f"[train] diversity: {dataset.diversity_line(prompts)}", file=sys.stderr)
        return 0
    return None
