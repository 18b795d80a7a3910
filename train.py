"""
Train draft heads (Medusa, Hydra, Hydra++) on a frozen base model, offline.

    python train.py --heads hydra++                      # self-distilled data, teacher loss
    python train.py --heads medusa --loss next-token     # Medusa-1's loss on the data tokens
    python train.py --heads hydra --data chats.jsonl     # your ShareGPT-style conversations
    python train.py --heads hydra++ --resume             # continue after Ctrl-C, a crash or kill -9
    torchrun --nproc_per_node 4 train.py --heads hydra++ # one process per GPU
    (DistributedDataParallel)

Pipeline, each stage cached on disk and reused (stages 1 and 2 live in dataset.py):
1. data: the base model writes user prompts itself (Magpie-style: the chat template up to the
   start of a user turn, then sample), they are filtered for length and near-duplicates, and the
   model answers them (self-distillation). Or a user's ShareGPT-style JSONL.
2. features: one pass of the frozen base model stores, per token, its final hidden state and its
   top-k next-token probabilities (the teacher); later epochs never run the base model again.
3. heads (this file): trained on those features over the most frequent tokens of the data.
   Checkpoints (state.pt) hold everything a resumed run needs to continue exactly as if it had
   never stopped; Ctrl-C finishes the step, writes one and exits 130. Under torchrun, rank 0 builds
   the data, every rank trains on its share of the batches, rank 0 evaluates, saves and prints.

The command line (tests/test_train_cli.py) follows cli.py's convention; an --out folder holding a
run is refused unless --resume or --overwrite; cached features are keyed by what shapes them and
rebuilt, with a notice, when stale or damaged; Ctrl-C or SIGTERM while the data is built keeps the
finished shards.

Test: `python -m pytest -q tests/test_train.py tests/test_train_cli.py`. Shapes: B batch, T time,
D hidden, K heads, V' head vocabulary, M predictions (valid (b, t, head) triples), k teacher top-k.
"""

import hashlib
import json
import math
import os
import re
import signal
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn as nn
from tqdm import tqdm

from specdec.loading import checkpoint
from specdec import cli
from specdec.training import dataset
from specdec.fast import kernels
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
from specdec.training.losses import (
    TrainForward,
    collate,
    head_states,
    logits_of,
    to_kept_map,
    train_step,
)

HERE = os.path.dirname(os.path.abspath(__file__))


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
        choices=["medusa", "hydra", "hydra++"],
        help="which draft heads to train",
    )
    number("--num-heads", int, 3, "K, number of draft heads")
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
        help="how the loss is computed: readable (the heads' LM head, then teacher_loss / "
        "next_token_loss) or fused (kernels.fused_batch_loss: both in blocks of rows, faster "
        "and in less memory); they give the same values and gradients (tests/test_kernels.py)",
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
        "alone); without it such a folder is refused",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint in --out, exactly where it stopped; "
        "flags that shape the training must be the checkpoint's (refused otherwise); "
        "--eval-every, --save-every and --epochs may change",
    )
    number("--seed", int, 0, "random seed (data, initialisation, batch order, noise)")
    return p


# --- batches
# ---------------------------------------------------------------------------------------


def split(n_conv, seed):
    """(held out, trained on): 5% of the conversations (at least one) held out for evaluation, drawn
    by the seed; the same data and seed give the same split in every run."""
    g = torch.Generator().manual_seed(seed)
    held_out = torch.randperm(n_conv, generator=g)[: max(1, n_conv // 20)].tolist()
    return held_out, sorted(set(range(n_conv)) - set(held_out))


def make_batches(lengths, conv_ids, batch_tokens, seed, epoch):
    """Conversations grouped by similar length into batches of about batch_tokens padded tokens,
    in an order fixed by (seed, epoch) so that a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = sorted(conv_ids, key=lambda i: (int(lengths[i]), i))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * int(lengths[i]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


# --- evaluation
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(heads, data, convs, to_kept, args, device, bf16=False):
    """Per head: how often its top-1 / top-5 holds the base model's greedy token, the histogram of
    that token's rank (for sparse-tree search), and the expected tau of a chain draft: at each
    position, 1 + the number of leading heads whose top-1 is right (exact for greedy data).
    bf16: the products in bf16, as training's. The counts stay on the device until the end."""
    K = heads.cfg.num_heads
    top1, top5, count = (
        torch.zeros(K, device=device) for _ in range(3)
    )  # on the device: one transfer at the end
    ranks = torch.zeros(K, 10, device=device)
    run_sum, run_n = torch.zeros((), device=device), 0
    for convs_b in make_batches(data["offsets"].diff(), convs, args.batch_tokens, args.seed, 0):
        batch = collate(data, convs_b, to_kept, K, device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            z, j, top_ids, top_p, _, (b, t) = head_states(heads, batch)
            logits = logits_of(heads, z, j)  # (M, V')
        greedy = top_ids[:, 0]  # the base model's own top-1
        order = logits.topk(
            min(10, logits.shape[-1]), dim=-1
        ).indices  # (M, 10), fewer with fewer kept tokens
        hit = order == greedy[:, None]  # (M, 10)
        for jj in range(K):
            sel = j == jj
            count[jj] += sel.sum()
            top1[jj] += hit[sel, 0].sum()
            top5[jj] += hit[sel, :5].any(-1).sum()
            ranks[jj, : hit.shape[1]] += hit[sel].sum(0).float()
        # chain acceptance: at positions where all K heads are valid, leading run of correct top-1s
        valid = batch["valid"]
        right = torch.zeros_like(valid)
        right[b, t, j] = hit[:, 0]
        full = valid.all(-1)
        run = right[full].long().cumprod(-1).sum(-1)  # (positions,)
        run_sum, run_n = run_sum + run.sum(), run_n + len(run)
    count = count.clamp(min=1)
    return dict(
        top1=(top1 / count).tolist(),
        top5=(top5 / count).tolist(),
        rank_acceptance=(ranks / count[:, None]).tolist(),
        chain_tau=1 + run_sum.item() / max(run_n, 1),
    )


# --- checkpoints
# -------------------------------------------------------------------------------------
# Invariant: state.pt alone is the checkpoint. It holds the heads' weights, the optimizer state and
# the step they belong to, in one file written to state.pt.tmp (flushed to disk) and renamed over
# the old one, so after a kill -9 it is the old checkpoint or the new one, whole, never a mix.
# heads.safetensors + heads.json next to it (checkpoint.save_heads, what generate.py loads) are
# written after
# it: a crash between the two leaves them one checkpoint older than state.pt, and --resume never
# reads them. Nothing else needs saving: batches are fixed by (seed, epoch), the noise by (seed,
# step, rank), the learning rate by the step. `identity` (heads config, data size and digest, the
# flags) must match on resume, so that a checkpoint is never continued with other heads, other data
# or another recipe; only flags that never touch the weights may change, and a notice says so.

STATE = "state.pt"
# heads.json's base_name is how --model was typed or what the model's config calls itself, not
# which model it is: a resumed run is checked against base_fingerprint and the weights' digest.
NOT_COMPARED = ("base_name",)
# the new value is used (epochs: the schedule stretches)
RESUME_MAY_CHANGE = (
    "eval_every",
    "save_every",
    "epochs",
)
NOT_RECORDED = (
    "resume",
    "overwrite",
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
    say = lambda k: f"--{k.replace('_', '-')} {now[k]} (checkpoint: {saved[k]})"
    return [say(k) for k in differ if k not in RESUME_MAY_CHANGE], [
        say(k) for k in differ if k in RESUME_MAY_CHANGE
    ]


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


def save_checkpoint(folder, heads, opt, step, identity, progress=None):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE)
    with open(path + ".tmp", "wb") as f:
        torch.save(
            {
                "heads": heads.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "progress": progress,
                **identity,
            },
            f,
        )
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    checkpoint.save_heads(heads, folder)


def load_checkpoint(folder, heads, opt, identity):
    """Load state.pt into heads and opt (built as for a fresh run); returns the step to continue at
    and the progress so far (assistant tokens trained on, the learning curve)."""
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
    heads.load_state_dict(state["heads"])
    opt.load_state_dict(state["opt"])
    return state["step"], state.get("progress") or {"tokens": 0, "curve": []}


# --- training
# -----------------------------------------------------------------------------------------
# One step: forward on one batch, loss, backward, clip, AdamW. A non-finite loss or gradient stops
# training before the weights change. Ctrl-C (SIGINT) or SIGTERM (a scheduler's preemption, or
# torchrun passing a signal on) only raise a flag: the loop finishes its step, saves and exits with
# 128 + the signal number (130 for Ctrl-C). Stopping mid-step could save a half-updated optimizer.


class StopFlag:
    """Within `with StopFlag() as stop:`, SIGINT and SIGTERM set stop.signum instead of stopping."""

    def __enter__(self):
        self.signum = 0
        self.previous = {s: signal.signal(s, self.catch) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def catch(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def kept_vocabulary(data, vocab_size, n):
    """The heads' vocabulary: the n most frequent assistant tokens and teacher top-1s (sorted ids),
    or None for all. Returns (kept, to_kept: base id -> head id or -1, share of those tokens
    kept)."""
    counts = torch.bincount(data["ids"][data["loss"]].long(), minlength=vocab_size)
    top1 = data["teacher_top1"]
    counts += torch.bincount(top1[top1 >= 0].long(), minlength=vocab_size)
    kept = counts.topk(n).indices.sort().values if 0 < n < vocab_size else None
    ids = kept if kept is not None else torch.arange(vocab_size)
    return kept, to_kept_map(kept, vocab_size), float(counts[ids].sum() / counts.sum().clamp(min=1))


def curve_point(step, tokens, report):
    """One point of the learning curve that eval.json keeps (held-out tau against tokens trained
    on)."""
    return dict(
        step=step,
        tokens=tokens,
        chain_tau=round(report["chain_tau"], 4),
        top1=[round(a, 4) for a in report["top1"]],
    )


def eval_line(step, r):
    return (
        f"[eval step {step}] top1 {' '.join(f'{a:.2f}' for a in r['top1'])} | top5 "
        f"{' '.join(f'{a:.2f}' for a in r['top5'])} | chain tau {r['chain_tau']:.2f}"
    )


def train(model, data, out, args):
    """Train heads for the frozen `model` on `data` (load_data's dict) as `args` say, checkpointing
    to `out`; returns the heads. Under torch.distributed each rank trains on every world-th batch
    and rank 0 alone evaluates, saves and prints."""
    import heads as heads_lib

    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda msg: None)
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
    opt = torch.optim.AdamW(
        [p for p in heads.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0
    )
    n_conv = len(data["offsets"]) - 1
    bf16 = kernels.pick_dtype(args.train_dtype, device.type, native=False) == torch.bfloat16
    # what shapes the run beyond the flags: the number of processes (it sets the batches of a step
    # and the schedule's length) and what --train-dtype auto chose on this machine; the base model
    # by its weights (and its LM head, in the config), whatever --model's spelling
    identity = {
        "config": asdict(heads.cfg),
        "data": [n_conv, len(data["ids"]), data_digest(data)],
        "flags": {**recorded_flags(args), "processes": world, "bf16_products": bf16},
        "weights": dataset.weights_digest(model),
    }
    step = saved_step = 0
    # assistant tokens trained on (head 1's targets, all ranks) and the held-out evaluations so far
    progress = {"tokens": 0, "curve": []}
    # every rank reads it: --out must be shared
    if args.resume and os.path.exists(os.path.join(out, STATE)):
        step, progress = load_checkpoint(out, heads, opt, identity)
        saved_step = step
        log(f"[train] resumed from step {step} in {out}")
    elif args.resume:
        log(f"[train] no checkpoint in {out}; starting from step 0")
    forward = TrainForward(heads, args.loss_impl)
    # its backward averages gradients over ranks; the frozen shared buffers are never sent
    if world > 1:
        # (torch 2.13 calls broadcast_buffers deprecated; its replacement would still copy them
        # once)
        forward = nn.parallel.DistributedDataParallel(forward, broadcast_buffers=False)

    # the data order: 5% held out for evaluation; batches fixed by (seed, epoch); rank r takes r, r
    # + world, ...
    held_out, train_convs = split(n_conv, args.seed)
    lengths = data["offsets"].diff()
    in_train = torch.zeros(n_conv, dtype=torch.bool)
    in_train[train_convs] = True
    # within its conversation
    position = torch.arange(len(data["ids"])) - data["offsets"][:-1].repeat_interleave(lengths)
    if not (
        data["loss"] & (position >= 2) & in_train.repeat_interleave(lengths)
    ).any():  # head 1 at t predicts t+2
        raise ValueError(
            "nothing to learn from: no assistant token in the training data (no assistant turns, "
            "or only "
            "in the 5% held out); heads learn the assistant's replies, so give data that has them"
        )
    if args.epochs < 1:
        raise ValueError(f"--epochs {args.epochs} trains nothing; use 1 or more")
    n_batches = len(make_batches(lengths, train_convs, args.batch_tokens, args.seed, 0))
    per_epoch = n_batches // world  # steps per epoch
    if per_epoch == 0:
        raise ValueError(
            f"{n_batches} {'batch' if n_batches == 1 else 'batches'} of training data for "
            f"{world} ranks: add data or lower "
            "--batch-tokens"
        )
    total = per_epoch * args.epochs
    lr_at = lambda s: (
        args.lr * min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / max(total, 1)))
    )

    bar = tqdm(
        total=total,
        initial=step,
        desc=f"train {args.heads}",
        unit="step",
        disable=None if rank == 0 else True,
    )
    t0, tokens0, last_save, batches_epoch = time.time(), progress["tokens"], time.time(), None
    with StopFlag() as stop:
        while step < total:
            epoch, i = divmod(step, per_epoch)
            if epoch != batches_epoch:
                batches, batches_epoch = (
                    make_batches(lengths, train_convs, args.batch_tokens, args.seed, epoch),
                    epoch,
                )
            batch = collate(data, batches[i * world + rank], to_kept, K, device)
            noise_gen = (
                torch.Generator(device=device).manual_seed(args.seed * 10**9 + step * world + rank)
                if args.noise > 0
                else None
            )
            try:
                loss = train_step(
                    forward, opt, batch, lr_at(step), args.loss, args.noise, noise_gen, bf16
                )
            except FloatingPointError as e:
                kept_msg = (
                    f"the last checkpoint (step {saved_step}) in {out} is kept"
                    if saved_step
                    else "no checkpoint was written"
                )
                raise FloatingPointError(
                    f"step {step + 1}: {e}; training stopped, {kept_msg}"
                ) from None
            step += 1
            n_tokens = torch.tensor([int(batch["valid"][..., 0].sum())], device=device)
            if world > 1:
                dist.all_reduce(n_tokens)
            progress["tokens"] += int(n_tokens)
            # assistant tokens/s, all ranks
            rate = (progress["tokens"] - tokens0) / (time.time() - t0)
            bar.update(1)
            bar.set_postfix_str(f"loss {loss:.3f}, {rate:.0f} tok/s")
            signum = torch.tensor([stop.signum], device=device)
            if world > 1:  # a signal on any rank stops every rank after this same step
                dist.all_reduce(signum, op=dist.ReduceOp.MAX)
            signum = int(signum)
            if rank == 0 and step % args.eval_every == 0 and step < total and not signum:
                report = evaluate(heads.eval(), data, held_out, to_kept, args, device, bf16)
                progress["curve"].append(curve_point(step, progress["tokens"], report))
                log("\n" + eval_line(step, report))
                heads.train()
            if rank == 0 and (
                signum or step == total or time.time() - last_save >= args.save_every
            ):
                save_checkpoint(out, heads, opt, step, identity, progress)
                last_save, saved_step = time.time(), step
                # no progress bar (output not a terminal, e.g. a log file): a line per checkpoint
                if bar.disable:
                    log(
                        f"[train] step {step}/{total}, loss {loss:.3f}, {rate:.0f} assistant "
                        "tok/s; checkpoint written"
                    )
            if signum:
                if world > 1:
                    # nobody exits (and gets the others killed) before rank 0 has saved
                    dist.barrier()
                log(
                    f"\n[train] stopped by signal {signum} at step {step}; checkpoint written to "
                    f"{out} (--resume continues)"
                )
                sys.exit(128 + signum)
    bar.close()
    if rank == 0:
        report = evaluate(heads.eval(), data, held_out, to_kept, args, device, bf16)
        report["curve"] = progress["curve"] + [curve_point(step, progress["tokens"], report)]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "eval.json"), "w") as f:
            json.dump(report, f, indent=1)
        log(eval_line(step, report))
        log(
            f"[train] done: {cli.plural(step, 'step')}, {time.time() - t0:.0f} s; heads in "
            f"{out}; chain tau {report['chain_tau']:.2f}"
        )
    return heads


# --- main
# ----------------------------------------------------------------------------------------------
# Plain `python train.py` is rank 0 of 1. Under torchrun (WORLD_SIZE > 1) every process joins a
# process group; rank 0 converts the model and builds the data while the others wait at a barrier,
# then they find both on disk.


def init_distributed(device):
    """Returns (rank, world size, torch.device). Under torchrun: NCCL and one GPU per rank
    (LOCAL_RANK) on CUDA, gloo on CPU."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device(device)
    import datetime

    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    # a long timeout: the other ranks wait at the first barrier while rank 0 builds the data
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo", timeout=datetime.timedelta(hours=12)
    )
    return dist.get_rank(), world, torch.device(device)


def data_model(model, dtype):
    """The base model for generating data: `model` (fp32, what training reads) or a copy in bf16."""
    import copy

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


# Bad input is caught as early as what it needs allows: flags and paths before anything loads.


class Terminated(KeyboardInterrupt):
    """SIGTERM while the data is built: stops it as Ctrl-C does (the finished shards are kept)."""


def raise_terminated(signum, frame):
    raise Terminated


def check_args(args):
    """Every check that needs no model: ranges, the device, the folders, a --resume checkpoint."""
    for flag, (low, high) in RANGES.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if not low <= value <= high:  # NaN fails too
            raise UsageError(f"{flag} {value}: out of range; use {low} to {high}")
    pick_device(args.device)
    kernels.pick_dtype(args.dtype, "cpu", native=False)
    if args.data == "self":
        dataset.read_seeds(args.seeds)
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
                "--data self, "
                "or train on the file itself with --data FILE"
            )
        # a UsageError if it is not a conversations file
        dataset.read_conversations(args.continue_from, "--continue-from")
    if args.out is not None:
        check_out(args.out, args)
    default = build_parser().get_default
    if args.data != "self":
        for name in SELF_DISTILL_FLAGS:
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
                f"{vocab}: its "
                "conversations were written with another tokenizer; use that model, or other data"
            )


# What train.py writes into --out; --overwrite removes them before a fresh run, so that nothing of a
# previous run (a tuned tree above all) outlives the heads it belonged to.
def check_out(out, args):
    """--out: a folder without a previous run's files; or --resume with a checkpoint there (refused
    now, before the data is built, if its flags differ); or --overwrite (clear_run() then clears
    the previous run)."""
    files = checkpoint.run_files(out)
    if args.resume and STATE in files:
        refuse_other_flags(
            out, resume_differences(read_checkpoint(out).get("flags", {}), recorded_flags(args))[0]
        )
    elif files and not args.overwrite:
        held = ", ".join(files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
        why = f"--resume finds no checkpoint ({STATE}) in it, and it" if args.resume else "it"
        resume = "--resume to continue the run in it, " if STATE in files else ""
        raise UsageError(
            f"--out {out}: {why} holds a previous run's {held}, which training would "
            f"overwrite; give a new --out, {resume}or --overwrite to start afresh"
        )


def clear_run(out):
    """--overwrite: remove a previous run's files from --out, right before training writes its
    own."""
    for name in checkpoint.run_files(out):
        os.remove(os.path.join(out, name))


def model_path(name):
    """--model as checkpoint.load should see it: a local folder by its real path, so that however it
    is typed (m, ./m, /abs/m, a link to it) a model without a name of its own in its config.json is
    named alike (its default --work folder, the heads' base_name)."""
    return os.path.realpath(name) if name != checkpoint.DEFAULT and os.path.isdir(name) else name


def setup(args, digest, device, made):
    """The model, the heads folder and the data folder this run uses: (model, tokenizer, out,
    writer, key, folder). The writer is the model that writes the data and computes the features.
    Folders it creates are added to `made`."""
    model, tokenizer = checkpoint.load(model_path(args.model), device, torch.float32)
    check_model_args(args, model)
    work = args.work or os.path.join(
        cli.cache_root(), "train", re.sub(r"[^\w.-]", "_", model.cfg.name)
    )
    out = args.out or os.path.join(work, "heads-" + args.heads)
    if args.out is None:  # the default folders, known now that the model has a name
        made += cli.new_folders(work, out)
        writable_folder("--work", work)
        writable_folder("--out", out)
        check_out(out, args)
    writer = data_model(model, args.dtype)
    key = dataset.data_key(writer, args.teacher_k, digest)
    if args.data == "self":
        folder = os.path.join(work, "self_distill")
    else:
        folder = os.path.join(
            work, "features-" + re.sub(r"[^\w.-]", "_", os.path.basename(args.data))
        )
    return model, tokenizer, out, writer, key, folder


def build_data(args, tokenizer, writer, key, folder):
    """Rank 0's data stage: self-distilled data or a user's file's features, on disk (resumable).
    Returns an exit code when the run ends here (--export-conversations, Ctrl-C), else None."""
    on_sigterm = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        if args.data == "self":
            dataset.check_self_data(folder, key)
            if args.continue_from:
                dataset.continue_from(writer, folder, args.continue_from, key)
            print(
                f"[train] self-distilled data in {folder} (Ctrl-C keeps the shards written)",
                file=sys.stderr,
                flush=True,
            )
            dataset.self_distill(writer, tokenizer, folder, args)
        elif problem := dataset.features_problem(folder, key):
            if os.path.isdir(folder):
                notice(f"the features in {folder} cannot be used: {problem}; computing them again")
            convs = (
                dataset.read_conversations(args.data)
                if args.data.endswith(".safetensors")
                else dataset.read_sharegpt(args.data, tokenizer, args.skip_bad)
            )
            print(
                f"[train] computing the features of {args.data} into {folder}",
                file=sys.stderr,
                flush=True,
            )
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


def main(args):
    # check_args makes them, to find an unwritable one now
    made = cli.new_folders(args.work, args.out)
    try:
        return train_main(args, made)
    finally:
        cli.remove_empty(made)


def train_main(args, made):
    check_args(args)
    digest = dataset.file_digest(args.data) if args.data != "self" else None
    rank, world, device = init_distributed(args.device)
    # torchrun sets each rank's threads itself
    if torch.device(device).type == "cpu" and world == 1:
        cli.use_threads(args.threads)
    # Rank 0 converts the model and builds the data while the others wait; whatever happens to it
    # (done early, an error, Ctrl-C), it tells them, so that no rank waits for ever.
    outcome = ["failed"]
    if rank == 0:
        try:
            model, tokenizer, out, writer, key, folder = setup(args, digest, device, made)
            code = build_data(args, tokenizer, writer, key, folder)
            outcome = ["train" if code is None else "done"]
        finally:
            if world > 1:
                dist.broadcast_object_list(outcome, src=0)
        if code is not None:
            return code
    else:
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] != "train":
            dist.destroy_process_group()
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
    if (
        args.overwrite
        and rank == 0
        and not (args.resume and os.path.exists(os.path.join(out, STATE)))
    ):
        clear_run(out)
    train(model, data, out, args)
    if world > 1:
        dist.destroy_process_group()


def cli_main(argv=None) -> int:
    """Bad input or data: one line on stderr naming it and the fix, exit code 2. A NaN loss: one
    line, exit code 1. Ctrl-C: what is kept, exit code 130 (during training the loop itself saves a
    checkpoint and exits 130; while the data is built, main returns 128 + the signal)."""
    return run(main, build_parser(), argv, "[train] interrupted by Ctrl-C")


if __name__ == "__main__":
    sys.exit(cli_main())
