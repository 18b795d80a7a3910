"""train.py's command line: its flags, the checks that need no model (before one loads: a typo
costs a second, not a load), the checks bounded by the loaded model, and main(): the data stage,
then the heads, their optimizer and the loop's helpers built from the flags, then train.py's loop.

What you read is what runs: train.py's cli_main passes in its own loop, its Recipe and its readable
batch_loss (a Lesson), taken from the module that runs when it is called (`python train.py` runs
it as __main__: importing train here would train with a second copy); the package never imports
an entry script. Bad input is caught as early as what it needs allows: flags and paths before
anything loads.

Test: `python -m pytest -q tests/test_train_cli.py tests/test_train.py`.
"""

import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

import heads as heads_lib
from specdec import cli
from specdec.cli import (
    MAX_SEED,
    Parser,
    UsageError,
    notice,
    pick_device,
    run,
    writable_file,
    writable_folder,
)
from specdec.fast import kernels
from specdec.loading import catalog, checkpoint
from specdec.training import dataset, distributed, prepare, resume
from specdec.training import eagle3 as eagle3_training
from specdec.training.batches import Plan, kept_vocabulary
from specdec.training.losses import TrainForward
from specdec.training.session import Session, logger

INTERRUPTED = "[train] interrupted by Ctrl-C"
HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Lesson:
    """What train.py passes in: the lesson's own functions, so that they are the ones that run."""

    train: Callable  # the loop: train(forward, opt, plan, recipe, step, session) -> step reached
    Recipe: type  # the loop's settings: Recipe(loss, lr, noise, bf16)
    batch_loss: Callable  # the readable loss, trained with under --loss-impl readable


# Sane ranges of the numeric flags (inclusive), checked before anything loads and shown in --help;
# once the model is loaded, --teacher-k, --kept-tokens and the lengths must also fit it.
RANGES = {
    "--num-prompts": (2, 10_000_000),  # one conversation is held out, at least one trains
    "--max-answer-tokens": (1, 32768),
    "--max-prompt-tokens": (1, 32768),
    "--gen-batch": (0, 1024),
    "--answer-temperature": (0.0, 10.0),
    "--teacher-k": (1, 256),  # stored for every token: 6 bytes each
    "--num-heads": (1, 16),
    "--num-layers": (1, 16),
    "--kept-tokens": (0, 1_000_000),
    "--noise": (0.0, 100.0),
    "--epochs": (1, 1000),
    "--batch-tokens": (16, 1_048_576),
    "--lr": (1e-7, 1.0),
    "--eval-every": (1, 10**9),
    "--save-every": (0.0, 1e9),
    "--seed": (0, MAX_SEED),  # combined as seed * 10**9 + step into a 64-bit seed
    "--conversations": (0, 10_000_000),  # 0: all of the split's
    "--eval-conversations": (0, 10_000_000),
}


def span(flag):
    low, high = RANGES[flag]
    return f"; {low} to {high}"


def build_parser():
    p = Parser(
        description="Train draft heads on a frozen base model.",
    )

    def number(flag, kind, default, help, limit=""):
        """A number flag; its help ends with the range check_args holds it to, and any limit."""
        p.add_argument(flag, type=kind, default=default, help=help + span(flag) + limit)

    # base model
    p.add_argument("--model", default=checkpoint.DEFAULT, help=checkpoint.MODEL_HELP)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    cli.threads_flag(p)
    # data
    p.add_argument(
        "--data",
        default="self",
        help="'self' (the model writes prompts and answers), a ShareGPT-style JSONL file, or a "
        ".safetensors file of conversations written by --export-conversations",
    )
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="with --data FILE: leave out conversations that cannot be read (bad JSON, "
        "unknown roles, a template that refuses them) and say how many, instead of stopping at "
        "the first",
    )
    p.add_argument(
        "--export-conversations",
        default=None,
        metavar="FILE",
        help="write the data set's conversations (token ids and loss masks, no features: small "
        "enough to commit) to FILE.safetensors and stop; --data FILE rebuilds the features "
        "from it. An existing FILE is replaced only by more of its own conversations (the "
        "data grew)",
    )
    p.add_argument(
        "--continue-from",
        default=None,
        metavar="FILE",
        help="self-distillation: begin the data set with the conversations of FILE.safetensors "
        "(written by --export-conversations, e.g. the one in data/), their features computed "
        "in one pass, and write new ones from there up to --num-prompts",
    )
    p.add_argument(
        "--work",
        default=None,
        help="folder for cached data, features and checkpoints (default: cache folder per model)",
    )
    number(
        "--num-prompts",
        int,
        2000,
        "self-distillation: number of prompts (the data set grows to this size)",
    )
    number(
        "--max-answer-tokens",
        int,
        256,
        "self-distillation: answer length limit",
        limit=", at most the model's context",
    )
    number(
        "--max-prompt-tokens",
        int,
        128,
        "self-distillation: length limit of the user prompts the model writes (one that has "
        "not ended by then is dropped)",
        limit=", at most the model's context",
    )
    number(
        "--gen-batch",
        int,
        0,
        "self-distillation: generation batch size (rows decoded together), 0 = the size "
        "kernels.sizes sets for the device",
    )
    p.add_argument(
        "--seeds",
        default=os.path.join(HERE, "data", "magpie.json"),
        help="self-distillation: JSON of tasks and topics that seed the prompts the model writes",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="the base model's dtype while it writes data or computes features, auto (bf16 where "
        "that is fast, as in generate.py) | fp32 | bf16",
    )
    number(
        "--answer-temperature",
        float,
        0.0,
        "self-distillation: answer sampling temperature (0 = greedy, like decoding)",
    )
    number(
        "--teacher-k",
        int,
        16,
        "teacher targets: keep the base model's top-k probabilities per token",
        limit=", at most the vocabulary",
    )
    # heads and training
    p.add_argument(
        "--heads",
        default="hydra++",
        choices=["medusa", "hydra", "hydra++", "eagle3"],
        help="which draft heads to train; eagle3: an EAGLE-3 layer over the model's fused layers, "
        "their features computed as it trains from --data FILE's conversations",
    )
    number("--num-heads", int, 3, "K, number of draft heads (eagle3: the steps it unrolls)")
    number("--num-layers", int, 1, "residual blocks per Medusa head / hidden layers per Hydra MLP")
    p.add_argument(
        "--own-lm-head",
        action="store_true",
        help="a trainable LM head per head (Medusa-1) instead of the shared frozen one",
    )
    number(
        "--kept-tokens",
        int,
        8192,
        "heads predict over this many most frequent tokens (0 = whole vocabulary)",
        limit=", at most the vocabulary",
    )
    p.add_argument(
        "--loss",
        default="teacher",
        choices=["teacher", "next-token"],
        help="teacher: the base model's distribution (Hydra); next-token: data tokens, weights "
        "0.8^k (Medusa-1)",
    )
    p.add_argument(
        "--loss-impl",
        default="fused",
        choices=["fused", "readable"],
        help="how the loss is computed: readable (the heads' LM head, then train.py's "
        "batch_loss) or fused (kernels.fused_batch_loss: both in blocks of rows, faster and in "
        "less memory); they give the same values and gradients (tests/test_kernels.py)",
    )
    number("--noise", float, 0.0, "NEFTune-style input noise alpha (0 = off)")
    p.add_argument(
        "--train-dtype",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="the heads' matrix products in training: auto (bf16 where it is fast: CUDA, CPUs "
        "with native bf16) | fp32 | bf16; losses, gradients' sums and weights stay fp32",
    )
    number("--epochs", int, 2, "passes over the data")
    number("--batch-tokens", int, 4096, "padded tokens per batch")
    number("--lr", float, 1e-3, "peak learning rate (AdamW, warm-up then cosine)")
    number("--eval-every", int, 200, "held-out evaluation every this many steps")
    number("--save-every", float, 120, "checkpoint every this many seconds (0 = after every step)")
    p.add_argument("--out", default=None, help="heads folder (default: <work>/heads-<kind>)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an --out folder that holds a previous run's files "
        "(its heads, checkpoint, eval.json and tuned trees are replaced; other files are left "
        "alone); without it such a folder is refused; not with --resume",
    )
    p.add_argument(
        "--retrain-shipped",
        action="store_true",
        help="allow an --out inside the heads shipped with the repository (weights/...), to "
        "replace them on purpose; without it such an --out is refused",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint in --out, exactly where it stopped; "
        "flags that shape the training must be the checkpoint's (refused otherwise); "
        "--eval-every, --save-every and --epochs may change",
    )
    number("--seed", int, 0, "random seed (data, initialisation, batch order, noise)")
    number(
        "--conversations",
        int,
        0,
        "eagle3: train on the first this many conversations of the training split (0: all)",
    )
    number(
        "--eval-conversations",
        int,
        200,
        "eagle3: evaluate on the first this many held-out conversations (0: all; each evaluation "
        "runs the base model over them)",
    )
    return p


def check_args(args):
    """Every check that needs no model: ranges, the device, the folders, a --resume checkpoint."""
    for flag, (low, high) in RANGES.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if not low <= value <= high:  # NaN fails too
            raise UsageError(f"{flag} {value}: out of range; use {low} to {high}")
    if args.resume and args.overwrite:
        raise UsageError(
            "--resume --overwrite: one continues the run in --out, the other replaces it; give "
            "one of them"
        )
    pick_device(args.device)
    kernels.pick_dtype(args.dtype, "cpu", native=False)
    if args.heads == "eagle3":
        eagle3_training.check_args(args)
    if args.data == "self":
        dataset.read_seeds(args.seeds)
    else:  # a file, read now: its mistakes cost a second, not a model's load
        dataset.check_data(args.data, args.skip_bad)
    for flag in ("work", "out"):
        if getattr(args, flag) is not None:
            writable_folder(f"--{flag}", getattr(args, flag))
    if args.export_conversations is not None:
        if not args.export_conversations.endswith(".safetensors"):
            raise UsageError(
                f"--export-conversations {args.export_conversations}: name it FILE.safetensors"
            )
        writable_file(
            "--export-conversations", args.export_conversations, "conversations.safetensors"
        )
        if os.path.exists(args.export_conversations):
            # only a conversations file may be replaced (grown)
            dataset.exported_already(args.export_conversations)
    if args.continue_from is not None:
        if args.data != "self":
            raise UsageError(
                f"--continue-from {args.continue_from}: it seeds self-distilled data; use it with "
                "--data self, or train on the file itself with --data FILE"
            )
        # a UsageError if it is not a conversations file
        dataset.read_conversations(args.continue_from, "--continue-from")
    if args.out is not None:
        resume.check_out(args.out, args)
    if args.retrain_shipped and not (args.out and catalog.shipped(args.out)):
        notice("--retrain-shipped has no effect: --out is not inside the shipped heads")
    default = build_parser().get_default
    if args.data != "self":
        for name in resume.SELF_DISTILL_FLAGS:
            if getattr(args, name) != default(name):
                notice(
                    f"--{name.replace('_', '-')} has no effect with --data FILE (it shapes "
                    "self-distilled data)"
                )


def check_model_args(args, model):
    """The flags bounded by the loaded model."""
    vocab, context = model.cfg.vocab_size, model.cfg.max_seq_len
    if args.teacher_k > vocab:
        raise UsageError(
            f"--teacher-k {args.teacher_k}: the model's vocabulary has {vocab} tokens; use at "
            f"most {vocab}"
        )
    if args.kept_tokens > vocab:
        raise UsageError(
            f"--kept-tokens {args.kept_tokens}: the model's vocabulary has {vocab} tokens; "
            f"use at most {vocab} (or 0 for all of them)"
        )
    for flag, tokens in (
        ("--max-answer-tokens", args.max_answer_tokens),
        ("--max-prompt-tokens", args.max_prompt_tokens),
    ):
        if args.data == "self" and tokens > context:
            raise UsageError(
                f"{flag} {tokens}: the model's context holds {context} tokens; use less"
            )
    for flag, path in (("--data", args.data), ("--continue-from", args.continue_from)):
        if (
            path
            and path.endswith(".safetensors")
            and (top := dataset.largest_id(path, flag)) >= vocab
        ):
            raise UsageError(
                f"{flag} {path}: it holds token id {top}, beyond this model's vocabulary of "
                f"{vocab}: its conversations were written with another tokenizer; use that model, "
                "or other data"
            )


def train_heads(model, data, out, args, lesson):
    """Heads for the frozen `model` trained on `data` (dataset.load_data's dict) as `args` say,
    checkpointed to `out`, by the lesson's loop (train.py's train); returns them. Under
    torch.distributed each rank trains on its share of the batches and rank 0 alone evaluates,
    saves and prints."""
    rank, world = distributed.rank_and_world()
    log = logger(rank)
    device, K = model.device, args.num_heads
    kept, to_kept, coverage = kept_vocabulary(data, model.cfg.vocab_size, args.kept_tokens)
    if kept is not None:
        log(
            f"[train] kept {cli.plural(len(kept), 'token')}: {coverage:.1%} of assistant "
            "tokens and teacher top-1s"
        )
    # heads and optimizer, the same on every rank (same seed), then the checkpoint if resuming
    torch.manual_seed(args.seed)
    cfg = heads_lib.HeadsConfig(
        kind=args.heads, num_heads=K, num_layers=args.num_layers, own_lm_head=args.own_lm_head
    )
    heads = heads_lib.build(cfg, model, kept).train()
    trainable = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    bf16 = kernels.pick_dtype(args.train_dtype, device.type, native=False) == torch.bfloat16
    plan = Plan(
        data, to_kept, K, device, args.batch_tokens, args.epochs, args.seed, args.noise, rank, world
    )
    weights = dataset.weights_digest(model)
    session = Session(heads, opt, data, plan, out, args, bf16, weights)  # resumes with --resume
    readable = lesson.batch_loss if args.loss_impl == "readable" else None
    forward = distributed.wrap(TrainForward(heads, readable), world)
    recipe = lesson.Recipe(loss=args.loss, lr=args.lr, noise=args.noise, bf16=bf16)
    with session:
        try:
            lesson.train(forward, opt, plan, recipe, session.step, session)
        except FloatingPointError as e:
            raise FloatingPointError(f"{e}; training stopped, {session.kept()}") from None
    session.finish()
    return heads


def setup(args, digest, device, made):
    """The model, its tokenizer, the heads folder, the data's writer (the model that writes the
    data and computes the features), its key and folder. Folders it creates are added to
    `made`."""
    model, tokenizer = checkpoint.load(prepare.model_path(args.model), device, torch.float32)
    check_model_args(args, model)
    out, folder = prepare.places(args, model, made)
    writer = prepare.data_model(model, args.dtype)
    key = dataset.data_key(writer, args.teacher_k, digest)
    return model, tokenizer, out, writer, key, folder


def main(args, lesson):
    """train_main, leaving no empty --work or --out folder behind a run that stops early."""
    # check_args makes them, to find an unwritable one now
    made = cli.new_folders(args.work, args.out)
    try:
        return train_main(args, made, lesson)
    finally:
        cli.remove_empty(made)


def train_main(args, made, lesson):
    """llama2.c's run.c: the flags checked, the processes joined, the data built (rank 0, the
    others waiting), then the heads trained by the lesson's loop."""
    check_args(args)
    if args.heads == "eagle3":
        return train_eagle3(args, made, lesson)
    digest = dataset.file_digest(args.data) if args.data != "self" else None
    rank, world, device = distributed.init_distributed(args.device)
    # torchrun sets each rank's threads itself
    if torch.device(device).type == "cpu" and world == 1:
        cli.use_threads(args.threads)
    # Rank 0 converts the model and builds the data while the others wait; whatever happens to it
    # (done early, an error, Ctrl-C), it tells them, so that no rank waits for ever.
    outcome = ["failed"]
    if rank == 0:
        try:
            model, tokenizer, out, writer, key, folder = setup(args, digest, device, made)
            code = prepare.build_data(args, tokenizer, writer, key, folder)
            outcome = ["train" if code is None else "done"]
        finally:
            distributed.share(outcome, world)
        if code is not None:
            return code
    else:
        distributed.share(outcome, world)
        if outcome[0] != "train":
            distributed.leave(world)
            return 0 if outcome[0] == "done" else 1
        model, tokenizer, out, writer, key, folder = setup(args, digest, device, made)
    data = dataset.load_data(folder)
    if rank == 0:
        print(
            f"[train] {cli.plural(len(data['offsets']) - 1, 'conversation')}, "
            f"{cli.plural(len(data['ids']), 'token')}, "
            f"{cli.plural(int(data['loss'].sum()), 'assistant token')}",
            file=sys.stderr,
        )
    if args.overwrite and rank == 0:
        resume.clear_run(out)
    train_heads(model, data, out, args, lesson)
    distributed.leave(world)


def train_eagle3(args, made, lesson):
    """--heads eagle3: the model loaded and checked as for heads, then the layer trained by the
    lesson's loop with the base model's features computed batch by batch
    (specdec/training/eagle3.py); no data stage."""
    device = pick_device(args.device)
    if torch.device(device).type == "cpu":
        cli.use_threads(args.threads)
    model, tokenizer = checkpoint.load(prepare.model_path(args.model), device, torch.float32)
    check_model_args(args, model)
    out, _ = prepare.places(args, model, made)
    if args.overwrite:
        resume.clear_run(out)
    eagle3_training.train(model, tokenizer, out, args, lesson)


def cli_main(argv, lesson) -> int:
    """train.py's command line; lesson: its own loop, Recipe and batch_loss (a Lesson). Bad input
    or data: one line on stderr naming it and the fix, exit code 2. A NaN loss: one line, exit
    code 1. Ctrl-C: what is kept, exit code 130 (during training the session saves a checkpoint
    and exits 130; while the data is built, main returns 128 + the signal)."""
    return run(lambda args: main(args, lesson), build_parser(), argv, INTERRUPTED)
