"""
PaSS (Monea et al. 2023): K learned [LA] tokens with which the base model drafts for itself.

Appended after a sequence x_1..x_t at positions t+1..t+K, the frozen model's outputs at
[LA]_1..[LA]_K are trained to be x_{t+2}..x_{t+K+1} (its output at x_t is x_{t+1} itself). Only the
K embeddings (K x D numbers) learn; drafters.PaSS decodes with them, `generate.py --draft pass`.

Training reads the self-distilled conversations (the base model's own greedy answers). A
conversation of T tokens runs through the model once into a KV cache, without a gradient (nothing
there depends on the embeddings); then the [LA] groups of many cut points c in its answer run as one
batch of rows:

    row (c, j), j = 1..K:  at position c + j, sees cache slots 0..c and rows (c, 1..j);
                           loss: cross-entropy against x_{c+j+1}

so a conversation costs one forward over its tokens, and a forward and backward over its [LA] rows.

    python -m specdec.training.pass_tokens --out weights/smollm2-135m-instruct/pass

Test: `python -m pytest -q tests/test_pass.py`. Shapes: T tokens, M cuts, K [LA] tokens, D hidden, V
vocabulary.
"""

import specdec.ctrl_c  # noqa: F401 (first: a Ctrl-C while torch imports is one line, exit 130)
import math
import sys
import time

import torch
import torch.nn.functional as F

from specdec.loading import checkpoint
from specdec import cli
from specdec.training import dataset
from specdec.fast import kernels
from specdec.training.batches import split
from specdec.training.session import StopFlag


def cuts_of(ids, loss, K, stride, offset):
    """Every stride-th position c from `offset` whose next token is the answer's and that K more
    tokens follow; and the tokens (M, K) each cut's [LA]s should be, -100 where not the answer's."""
    cuts = [c for c in range(offset, len(ids) - K - 1, stride) if loss[c + 1]]
    targets = [[ids[c + j + 1] if loss[c + j + 1] else -100 for j in range(1, K + 1)] for c in cuts]
    return torch.tensor(cuts, dtype=torch.long), torch.tensor(targets, dtype=torch.long).view(
        len(cuts), K
    )


def la_logits(model, ids, cuts, extra):
    """ids (T,); cuts (M,); extra (K, D): the [LA] embeddings -> logits (M, K, V) at every cut's
    [LA] group."""
    T, M, K, dev = len(ids), len(cuts), len(extra), model.device
    cache = model.new_cache(T + M * K)
    with torch.no_grad():
        model(torch.tensor([ids], device=dev), torch.arange(T, device=dev), None, cache)
    cut, j = cuts.to(dev).repeat_interleave(K), torch.arange(K, device=dev).repeat(M)  # (MK,)
    group = torch.arange(M, device=dev).repeat_interleave(K)  # (MK,)
    sees = torch.cat(
        [
            torch.arange(T, device=dev) <= cut[:, None],  # (MK, T)
            (group[:, None] == group) & (j <= j[:, None]),
        ],
        dim=1,
    )  # (MK, MK)
    cos, sin = model.rope(cut + 1 + j, model.dtype)
    x = extra.to(model.dtype).repeat(M, 1)[None]  # (1, MK, D)
    for i, layer in enumerate(model.layers):
        # its own tensor: the write must not touch what backward reads
        kv = (
            cache.k[i].clone(),
            cache.v[i].clone(),
            T,
        )
        x = layer(x, cos, sin, sees[None, None], kv)
    return model.lm_head(model.norm(x)).view(M, K, -1)


@torch.no_grad()
def evaluate(model, convs, extra, stride):
    """Top-1 of each [LA] against the conversations' tokens, and the tau a chain of K would reach
    (1 + the expected number of leading [LA]s right), over cuts whose K targets are all the
    answer's."""
    K, hits, chain, n = len(extra), torch.zeros(len(extra)), 0.0, 0
    for ids, loss in convs:
        cuts, targets = cuts_of(ids, loss, K, stride, 0)
        whole = (targets >= 0).all(1)
        if whole.any():
            # (M, K)
            right = la_logits(model, ids, cuts[whole], extra).argmax(-1).cpu() == targets[whole]
            hits, chain, n = (
                hits + right.sum(0),
                chain + right.cumprod(1).sum().item(),
                n + len(right),
            )
    return {
        "top1": [round(h, 4) for h in (hits / max(n, 1)).tolist()],
        "chain_tau": round(1 + chain / max(n, 1), 4),
        "cuts": n,
    }


def run(args):
    """Check the flags, train as they say; writes --out (tokens.safetensors, tokens.json) and
    returns the exit code."""
    check_args(args)
    device = torch.device(cli.pick_device(args.device))
    if device.type == "cpu":
        cli.use_threads(args.threads)
    model, _ = checkpoint.load(
        args.model, device, kernels.pick_dtype(args.dtype, device.type, native=False)
    )
    # the readable path: it has a backward
    kernels.use(model.requires_grad_(False), kernels.Kernels())
    convs = dataset.read_conversations(args.data)
    held_out, trained = split(len(convs), args.seed)  # train.py's split
    held_out, trained = (
        [convs[i] for i in held_out[: args.eval_conversations]],
        [convs[i] for i in trained[: args.conversations]],
    )
    torch.manual_seed(args.seed)
    E = model.embed_tokens.weight.detach().float()
    extra = torch.nn.Parameter(
        E.mean(0) + 0.1 * E.std() * torch.randn(args.tokens, E.shape[1], device=device)
    )  # (K, D)
    opt = torch.optim.Adam([extra], lr=args.lr)
    total = math.ceil(len(trained) * args.epochs / args.batch)
    order = [
        i
        for e in range(args.epochs)
        for i in torch.randperm(
            len(trained), generator=torch.Generator().manual_seed(args.seed + e)
        ).tolist()
    ]
    r = evaluate(model, held_out, extra, args.stride)
    curve, t0, rows = [dict(step=0, **r)], time.time(), 0
    print(
        f"[pass] {len(trained)} + {len(held_out)} conversations, "
        f"{cli.plural(args.tokens, '[LA] token')}; step "
        "0: held-out chain tau "
        f"{r['chain_tau']:.3f}, top-1 {r['top1']}",
        file=sys.stderr,
        flush=True,
    )
    with StopFlag() as stop:
        for step in range(1, total + 1):
            batch = [trained[i] for i in order[(step - 1) * args.batch : step * args.batch]]
            parts = [
                (ids, *cuts_of(ids, loss, args.tokens, args.stride, step % args.stride))
                for ids, loss in batch
            ]
            n = sum(int((t >= 0).sum()) for _, _, t in parts)
            for g in opt.param_groups:  # warm-up over 20 steps, then cosine down to 0
                g["lr"] = (
                    args.lr * min(1.0, step / 20) * 0.5 * (1 + math.cos(math.pi * step / total))
                )
            opt.zero_grad(set_to_none=True)
            for ids, cuts, targets in parts:
                if len(cuts):
                    logits = la_logits(model, ids, cuts, extra).float()  # (M, K, V)
                    (
                        F.cross_entropy(
                            logits.flatten(0, 1),
                            targets.to(device).flatten(),
                            ignore_index=-100,
                            reduction="sum",
                        )
                        / max(n, 1)
                    ).backward()
            opt.step()
            rows += n
            if step % args.eval_every == 0 or step == total or stop.signum:
                r = evaluate(model, held_out, extra, args.stride)
                curve.append(dict(step=step, **r))
                print(
                    f"[pass] step {step}/{total}, {cli.plural(rows, '[LA] row')}, "
                    f"{time.time() - t0:.0f} s: held-out chain tau "
                    f"{r['chain_tau']:.3f}, top-1 {r['top1']}",
                    file=sys.stderr,
                    flush=True,
                )
            if stop.signum:
                break
    checkpoint.save_tokens(
        args.out,
        extra,
        model,
        {
            "eval": r,
            "curve": curve,
            "seconds": round(time.time() - t0),
            "rows": rows,
            "command": "python -m specdec.training.pass_tokens " + " ".join(sys.argv[1:]),
            "flags": vars(args),
        },
    )
    print(f"[pass] [LA] tokens in {args.out}", file=sys.stderr)
    return 130 if stop.signum else 0


def build_parser():
    p = cli.Parser(
        description="Train PaSS's [LA] tokens: K embeddings with which the frozen base model "
        "drafts K tokens a step."
    )
    dataset.conversation_flags(p, "the model's own answers", 100)
    p.add_argument(
        "--tokens",
        type=int,
        default=4,
        help="K, the [LA] tokens (generate.py --draft pass --gamma may use fewer)",
    )
    p.add_argument(
        "--stride",
        type=int,
        default=4,
        help="a cut every this many answer positions (shifted every step)",
    )
    p.add_argument("--batch", type=int, default=8, help="conversations a step")
    p.add_argument("--epochs", type=int, default=1, help="passes over the conversations")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (Adam)")
    p.add_argument(
        "--eval-every", type=int, default=50, help="held-out evaluation every this many steps"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bf16 on CPUs with bf16 kernels and on GPUs, else fp32) | fp32 | bf16 | fp16",
    )
    dataset.run_flags(
        p,
        "train.py's split, the start and the order",
        "the folder to write (tokens.safetensors, tokens.json); must be new or empty",
    )
    return p


def check_args(args):
    cli.check_counts(
        args,
        "conversations",
        "eval_conversations",
        "tokens",
        "stride",
        "batch",
        "epochs",
        "eval_every",
    )
    if args.tokens > 16:
        raise cli.UsageError(
            f"--tokens {args.tokens}: a chain of more than 16 guesses is almost never accepted "
            "whole; use 1 to 16"
        )
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise cli.UsageError(f"--lr {args.lr}: must be a number > 0")
    cli.check_seed(args.seed)
    kernels.pick_dtype(args.dtype, cli.pick_device(args.device), native=False)
    dataset.check_conversations_file(args.data)
    cli.empty_folder("--out", args.out)


def cli_main(argv=None) -> int:
    return cli.run(run, build_parser(), argv, "[pass] interrupted by Ctrl-C")


if __name__ == "__main__":
    sys.exit(cli_main())
