"""
Medusa-2 on a CPU's budget: draft heads trained together with the base model's last layers.

Frozen heads can only read what the base model's last hidden state already says. Medusa-2 (seed
001; Cai et al. 2024) lets the backbone learn to say more, with three cautions so that it stays
the model it was:
  1. the base model's own loss is distillation against the original model's distribution (its
     top-k on the data, recorded before training), never the sampled tokens of the data;
  2. the heads start trained (frozen-backbone heads first, then joint: LP-FT), and their weight in
     the loss ramps up from 0 over --ramp steps, so their early gradients do not shake the backbone;
  3. the backbone changes only through LoRA, W + (alpha / r) B A with B starting at zero, at a
     learning rate below the heads'.

    L = L_distill(base) + lambda_0(step) * sum_k lambda^k L_teacher(head k)

To fit a CPU only the last --layers decoder layers are adapted: the residual stream entering them is
computed once per run, with the teacher's top-k, so a training step runs those layers and the heads,
not the whole model. The result is a heads folder with lora.safetensors and lora.json beside the
heads: catalog.load_heads merges the delta into the base model's weights at load (decoding costs
nothing more), so `--heads FOLDER` decodes with the adapted model and `--heads none` is the original
one. Greedy speculative decoding is lossless against the adapted model (tests/test_joint.py).

    python -m specdec.training.joint --init weights/smollm2-135m-instruct/medusa --out medusa-2
    python -m specdec.training.joint ... --out medusa-2 --resume     # after Ctrl-C or kill -9

It says what it does as it goes (the model loading, the teacher's pass, the steps), and keeps a
checkpoint as train.py does (resume.py's state.pt, with the LoRA weights beside the heads') every
--save-every seconds, at the end, and at Ctrl-C or SIGTERM, after the step in flight (exit 130 or
143); --resume continues it, to the weights an uninterrupted run ends with.

Test: `python -m pytest -q tests/test_joint.py`. Shapes: B batch, T time, D hidden, r LoRA rank.
"""

import specdec.ctrl_c  # noqa: F401 (first: a Ctrl-C while torch imports is one line, exit 130)
import hashlib
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import cli
from specdec.training import dataset
from specdec.fast import kernels
from specdec.training import losses
import model as model_lib
from specdec.training import prepare
from specdec.training import resume
from specdec.training.batches import make_batches, split
from specdec.training.evaluate import evaluate as evaluate_heads
from specdec.training.session import StopFlag

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


# --- LoRA
# ------------------------------------------------------------------------------------------


class LoRA(nn.Module):
    """y = W x + (alpha / r) B A x around a frozen linear layer W; B starts at zero, so y = W x."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.linear = linear.requires_grad_(False)
        # (r, in)
        self.A = nn.Parameter(torch.randn(rank, linear.in_features) / math.sqrt(linear.in_features))
        self.B = nn.Parameter(torch.zeros(linear.out_features, rank))  # (out, r)
        self.scale = alpha / rank

    def forward(self, x):
        return self.linear(x) + (x @ self.A.T @ self.B.T) * self.scale


class Adapted(nn.Module):
    """The base model's last `num_layers` decoder layers with LoRA on every projection, and its
    final norm: the residual stream entering them (B, T, D) -> the final hidden state (B, T, D)."""

    def __init__(self, base, num_layers: int, rank: int, alpha: float):
        super().__init__()
        cfg = base.cfg
        self.first = cfg.n_layers - num_layers  # index of the first adapted layer
        self.layers = nn.ModuleList()
        for layer in base.layers[self.first :]:
            block = model_lib.Block(cfg).to(dtype=torch.float32)
            block.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
            block.requires_grad_(False)
            for path in PROJECTIONS:
                parent, _, name = path.rpartition(".")
                setattr(
                    block.get_submodule(parent), name, LoRA(block.get_submodule(path), rank, alpha)
                )
            self.layers.append(block)
        self.norm = model_lib.RMSNorm(cfg.dim, cfg.norm_eps).requires_grad_(False)
        self.norm.weight.data.copy_(base.norm.weight.float())
        self.rope = model_lib.Rope(cfg)
        self.rank, self.alpha = rank, alpha

    def forward(self, x):
        T = x.shape[1]
        positions = torch.arange(T, device=x.device)
        cos, sin = self.rope(positions, x.dtype)
        # causal; right padding is never seen
        mask = model_lib.attention_mask(T, 0, None, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, None)
        return self.norm(x)  # (B, T, D)

    def deltas(self):
        """{f"{layer}.{projection}": (A, B)} with the base model's layer numbers."""
        return {
            f"{self.first + i}.{path}": block.get_submodule(path)
            for i, block in enumerate(self.layers)
            for path in PROJECTIONS
        }


# --- the delta on disk (checkpoint.merge_delta merges it into a base model at load)
# -----------------


def save_delta(adapted, folder, base):
    tensors = {}
    for key, lora in adapted.deltas().items():
        tensors[key + ".A"], tensors[key + ".B"] = (
            lora.A.detach().half().contiguous(),
            lora.B.detach().half().contiguous(),
        )
    checkpoint.save_tensors(tensors, os.path.join(folder, checkpoint.DELTA))
    with open(os.path.join(folder, checkpoint.DELTA_CONFIG), "w") as f:
        json.dump(
            {
                "first_layer": adapted.first,
                "rank": adapted.rank,
                "alpha": adapted.alpha,
                "base_fingerprint": model_lib.lm_head_fingerprint(base),
            },
            f,
            indent=1,
        )


# --- data: the residual stream entering the adapted layers, and the teacher
# -------------------------


def say(message):
    """What the run is doing, on stderr, at once."""
    print(f"[joint] {message}", file=sys.stderr, flush=True)


@torch.inference_mode()
def joint_data(model, convs, first, top_k):
    """A data dict as dataset.load_data's (ids, loss, offsets, teacher_top1, top_ids, top_p), whose
    "hidden" holds the residual stream entering layer `first` rather than the final hidden state.
    A line every tenth of the conversations says how far it is."""
    caught = {}
    hook = model.layers[first - 1].register_forward_hook(lambda m, a, out: caught.update(x=out))
    cols = {"ids": [], "loss": [], "hidden": [], "top_ids": [], "top_p": []}
    t0 = time.time()
    try:
        for i, (ids, loss) in enumerate(convs):
            if i and i % max(1, len(convs) // 10) == 0:
                say(f"the teacher's pass: {i}/{len(convs)} conversations, {time.time() - t0:.0f} s")
            logits, _ = model(
                torch.tensor([ids], device=model.device),
                torch.arange(len(ids), device=model.device),
            )
            top = logits[0].float().softmax(-1).topk(top_k, dim=-1)  # (T, k)
            top_p = top.values.clone()
            top_p[-1] = 0  # the last position's next token is not in the data
            cols["ids"].append(torch.tensor(ids))
            cols["loss"].append(torch.tensor(loss, dtype=torch.bool))
            cols["hidden"].append(caught["x"][0].half().cpu())  # (T, D)
            cols["top_ids"].append(top.indices.cpu())
            cols["top_p"].append(top_p.half().cpu())
    finally:
        hook.remove()
    data = {k: torch.cat(v) for k, v in cols.items()}
    data["offsets"] = torch.tensor([0] + [len(ids) for ids, _ in convs]).cumsum(0)
    data["teacher_top1"] = torch.where(data["top_p"][:, 0] > 0, data["top_ids"][:, 0], -1)
    return data


# --- the loss
# ----------------------------------------------------------------------------------------


def joint_loss(adapted, heads, batch, lm_rows, heads_weight, decay, dtype):
    """(total, distillation, heads) of a collated batch whose "hidden" is the adapted layers'
    input."""
    h = adapted(batch["hidden"].float())  # (B, T, D)
    seen = batch["top_p"][..., 0] > 0  # (B, T) a teacher was recorded
    distill = kernels.fused_batch_loss(
        "teacher", h[seen], lm_rows, None, batch["top_ids"][seen], batch["top_p"][seen], None, dtype
    )
    z, j, top_ids, top_p, target, _ = losses.head_states(heads, {**batch, "hidden": h})
    per_head = [
        kernels.fused_batch_loss(
            "teacher",
            z[j == d],
            heads.lm_head.weight,
            None,
            top_ids[j == d],
            top_p[j == d],
            None,
            dtype,
        )
        for d in range(heads.cfg.num_heads)
    ]
    heads_loss = sum(decay**d * loss for d, loss in enumerate(per_head))
    return distill + heads_weight * heads_loss, distill, heads_loss


@torch.no_grad()
def final_hidden(adapted, data, convs):
    """The data of `convs` alone, "hidden" now the adapted model's final hidden state."""
    off, parts, cols = (
        data["offsets"],
        [],
        {k: [] for k in ("ids", "loss", "top_ids", "top_p", "teacher_top1")},
    )
    for i in convs:
        a, e = int(off[i]), int(off[i + 1])
        parts.append(adapted(data["hidden"][a:e].float()[None])[0].half())
        for k in cols:
            cols[k].append(data[k][a:e])
    sub = {k: torch.cat(v) for k, v in cols.items()}
    sub["hidden"] = torch.cat(parts)
    sub["offsets"] = torch.tensor([0] + [int(off[i + 1] - off[i]) for i in convs]).cumsum(0)
    return sub


@torch.no_grad()
def quality(base, sub):
    """How close the adapted model stays to the original on `sub`'s positions: greedy top-1
    agreement over the whole vocabulary, and KL(original || adapted) over the teacher's top-k with
    the rest lumped together (a lower bound of the full KL)."""
    seen = sub["top_p"][:, 0] > 0
    h, top_ids, p = (
        sub["hidden"][seen].float(),
        sub["top_ids"][seen].long(),
        sub["top_p"][seen].float(),
    )
    agree, kl = 0, 0.0
    for a in range(0, len(h), 1024):
        logq = (h[a : a + 1024] @ base.lm_head.weight.float().T).log_softmax(-1)  # (R, V)
        agree += int((logq.argmax(-1) == top_ids[a : a + 1024, 0]).sum())
        pk, qk = p[a : a + 1024], logq.gather(1, top_ids[a : a + 1024]).exp()
        rest_p, rest_q = (1 - pk.sum(-1)).clamp(min=1e-9), (1 - qk.sum(-1)).clamp(min=1e-9)
        kl += float(
            (pk * (pk.clamp(min=1e-9) / qk.clamp(min=1e-9)).log()).sum()
            + (rest_p * (rest_p / rest_q).log()).sum()
        )
    return {
        "greedy_agreement": agree / max(len(h), 1),
        "kl_topk": kl / max(len(h), 1),
        "positions": len(h),
    }


# --- training
# ----------------------------------------------------------------------------------------


def evaluate(adapted, heads, base, data, held_out, to_kept, args):
    """Held-out chain tau and per-head top-1 of the heads on the adapted model, and its quality."""
    sub = final_hidden(adapted.eval(), data, held_out)
    report = evaluate_heads(
        heads.eval(), sub, list(range(len(held_out))), to_kept, args, base.device
    )
    adapted.train(), heads.train()
    return {**report, **quality(base, sub)}


def report_line(step, r):
    return (
        f"[joint step {step}] chain tau {r['chain_tau']:.3f}, top1 "
        + " ".join(f"{a:.3f}" for a in r["top1"])
        + f" | greedy agreement {r['greedy_agreement']:.4f}, KL {r['kl_topk']:.4f}"
    )


def run(args):
    """Joint training as the flags say; writes --out (heads, delta, eval.json) and returns the
    report."""
    device = torch.device(cli.pick_device(args.device))
    if device.type == "cpu":
        cli.use_threads(args.threads)
    say(f"loading the model ({args.model}) on {device}")
    base, _ = checkpoint.load(args.model, device, torch.float32)
    if args.layers >= base.cfg.n_layers:
        raise cli.UsageError(
            f"--layers {args.layers}: the model has {cli.plural(base.cfg.n_layers, 'layer')}; "
            f"adapt at most {base.cfg.n_layers - 1}"
        )
    vocab = base.cfg.vocab_size
    if args.teacher_k > vocab:  # as train.py checks it
        raise cli.UsageError(
            f"--teacher-k {args.teacher_k}: the model's vocabulary has {vocab} tokens; use at "
            f"most {vocab}"
        )
    heads = checkpoint.load_heads(init_folder(args.init), base)
    kernels.use(heads, kernels.Kernels())  # the readable path: these weights will change
    if heads.kept_ids is None:
        raise cli.UsageError(
            f"--init {args.init}: heads over the whole vocabulary; give heads trained with "
            "--kept-tokens"
        )
    convs = dataset.read_conversations(args.data)
    # train.py's split: --init's heads never saw held_out
    held_out, train_convs = split(len(convs), args.seed)
    held_out, train_convs = held_out[: args.eval_conversations], train_convs[: args.conversations]
    first = base.cfg.n_layers - args.layers
    writer = prepare.data_model(base, args.dtype)
    # the model by its weights, not by how --model was typed (dataset.weights_digest)
    key = {
        "weights": dataset.weights_digest(base),
        "lm_head": model_lib.lm_head_fingerprint(base),
        "data": dataset.file_digest(args.data),
        "convs": train_convs + held_out,
        "first": first,
        "teacher_k": args.teacher_k,
        "dtype": str(writer.dtype),
    }
    cached = os.path.join(
        cli.cache_root(),
        "joint",
        hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16] + ".safetensors",
    )
    t0 = time.time()
    if os.path.exists(cached):  # the same model, data, split and layer: computed by an earlier run
        data = load_file(cached)
    else:
        say(
            f"the teacher's pass over {cli.plural(len(train_convs + held_out), 'conversation')}: "
            f"the stream into layer {first} and the model's top-{args.teacher_k}, computed once"
        )
        data = joint_data(writer, [convs[i] for i in train_convs + held_out], first, args.teacher_k)
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        save_file(data, cached + ".tmp")
        os.replace(cached + ".tmp", cached)
    print(
        f"[joint] {len(train_convs)} + {len(held_out)} conversations, "
        f"{cli.plural(len(data['ids']), 'token')}: "
        "the stream into "
        f"layer {first} and the teacher in {time.time() - t0:.0f} s (kept in {cached})",
        file=sys.stderr,
        flush=True,
    )
    del writer
    trained, held = (
        list(range(len(train_convs))),
        list(range(len(train_convs), len(train_convs) + len(held_out))),
    )
    to_kept = losses.to_kept_map(heads.kept_ids.cpu(), base.cfg.vocab_size)
    torch.manual_seed(args.seed)
    adapted = Adapted(base, args.layers, args.rank, args.alpha).to(device)
    heads.train().requires_grad_(True)
    for b in heads.buffers():
        b.requires_grad_(False)
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in adapted.parameters() if p.requires_grad], "lr": args.lr_lora},
            {"params": [p for p in heads.parameters() if p.requires_grad], "lr": args.lr_heads},
        ],
        weight_decay=0.0,
    )
    lm_rows = base.lm_head.weight.detach()[heads.kept_ids]  # (V', D)
    bf16 = kernels.pick_dtype(args.train_dtype, device.type, native=False) == torch.bfloat16
    identity = resume.run_identity(heads, data, args, 1, bf16, key["weights"])
    more = {"adapted": adapted}  # what state.pt keeps beside the heads
    base_lrs = [g["lr"] for g in opt.param_groups]  # before a checkpoint's scheduled ones
    start = 0  # the step the checkpoint holds
    progress = {"curve": []}
    if resume.resumable(args.out, args):
        start, progress = resume.load_checkpoint(args.out, heads, opt, identity, more)
        say(f"resumed from step {start} in {args.out}")
    elif args.resume:
        say(f"no checkpoint in {args.out}; starting from step 0")
    curve = progress["curve"]  # the held-out evaluations so far
    if not curve:
        before = evaluate(adapted, heads, base, data, held, to_kept, args)
        print(report_line(0, before), file=sys.stderr, flush=True)
        curve.append(curve_point(0, before))
    batches = [
        b
        for e in range(args.epochs)
        for b in make_batches(data["offsets"].diff(), trained, args.batch_tokens, args.seed, e)
    ]
    t0 = time.time()
    saved_step = start  # the last checkpoint's step, and when it was written
    saved_at = time.time()

    def save(step):
        """The checkpoint of `step`: state.pt (heads, LoRA, optimizer), the heads' files and the
        delta's; a full disk is one line."""
        nonlocal saved_step, saved_at
        try:
            resume.save_checkpoint(args.out, heads, opt, step, identity, progress, more)
            save_delta(adapted, args.out, base)
        except OSError as e:
            kept = resume.kept_line(args.out, saved_step)
            raise resume.saving_failed(args.out, step, e, kept) from None
        saved_step = step
        saved_at = time.time()

    with StopFlag() as stop:
        for step, convs_b in enumerate(batches, start=1):
            if step <= start:  # done before the checkpoint: the batches are fixed by seed, epoch
                continue
            batch = losses.collate(data, convs_b, to_kept, heads.cfg.num_heads, device)
            warm = min(1.0, step / 50) * 0.5 * (1 + math.cos(math.pi * step / len(batches)))
            for g, lr in zip(opt.param_groups, base_lrs):
                g["lr"] = lr * warm
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, distill, heads_loss = joint_loss(
                    adapted,
                    heads,
                    batch,
                    lm_rows,
                    args.heads_weight * min(1.0, step / args.ramp),
                    args.decay,
                    torch.bfloat16 if bf16 else torch.float32,
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
            opt.step()
            if step % 10 == 0 or step == start + 1:
                say(
                    f"step {step}/{len(batches)}: loss {loss.item():.3f} (distill "
                    f"{distill.item():.3f}, heads {heads_loss.item():.3f}), "
                    f"{time.time() - t0:.0f} s"
                )
            if step % args.eval_every == 0 and step < len(batches) and not stop.signum:
                r = evaluate(adapted, heads, base, data, held, to_kept, args)
                curve.append(curve_point(step, r))
                print(report_line(step, r), file=sys.stderr, flush=True)
            if stop.signum or step == len(batches) or time.time() - saved_at >= args.save_every:
                save(step)
            if stop.signum:
                say(
                    f"stopped by signal {stop.signum} at step {step}; checkpoint written to "
                    f"{args.out} (--resume continues)"
                )
                return 128 + stop.signum
    r = evaluate(adapted, heads, base, data, held, to_kept, args)
    curve.append(curve_point(len(batches), r))
    print(report_line(len(batches), r), file=sys.stderr, flush=True)
    r.update(
        curve=curve,
        seconds=round(time.time() - t0),
        tokens=int(data["loss"][: int(data["offsets"][len(trained)])].sum()),
        flags={k: v for k, v in vars(args).items()},
    )
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        json.dump(r, f, indent=1)
    say(f"heads and LoRA delta in {args.out}")
    return 0


def curve_point(step, r):
    """One point of eval.json's learning curve."""
    return dict(
        step=step, **{k: r[k] for k in ("chain_tau", "top1", "greedy_agreement", "kl_topk")}
    )


def build_parser():
    p = cli.Parser(
        description="Train draft heads together with the base model's last layers (Medusa-2, LoRA)."
    )
    dataset.conversation_flags(p, "the one --init was trained on", 300)
    p.add_argument(
        "--init",
        default="medusa",
        help="the trained heads to start from (stage 1 of LP-FT): a shipped kind or a heads folder",
    )
    p.add_argument(
        "--layers", type=int, default=2, help="adapt the base model's last this many decoder layers"
    )
    p.add_argument("--rank", type=int, default=16, help="LoRA rank r")
    p.add_argument(
        "--alpha", type=float, default=32.0, help="LoRA scale alpha (the delta is alpha / r * B A)"
    )
    p.add_argument(
        "--lr-lora", type=float, default=2e-4, help="peak learning rate of the LoRA weights"
    )
    p.add_argument("--lr-heads", type=float, default=3e-4, help="peak learning rate of the heads")
    p.add_argument(
        "--heads-weight",
        type=float,
        default=0.2,
        help="lambda_0: the heads' loss weight once ramped up",
    )
    p.add_argument(
        "--decay", type=float, default=0.8, help="lambda: head k's loss weighs lambda^(k-1)"
    )
    p.add_argument(
        "--ramp",
        type=int,
        default=100,
        help="steps over which lambda_0 rises from 0 (heads warm-up)",
    )
    p.add_argument("--epochs", type=int, default=1, help="passes over the conversations")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch")
    p.add_argument(
        "--teacher-k",
        type=int,
        default=16,
        help="the original model's top-k kept as the teacher, at most the vocabulary",
    )
    p.add_argument(
        "--eval-every", type=int, default=100, help="held-out evaluation every this many steps"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="the base model's dtype while it computes the data: auto | fp32 | bf16",
    )
    p.add_argument(
        "--train-dtype",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="matrix products in training",
    )
    p.add_argument(
        "--save-every",
        type=float,
        default=120,
        help="checkpoint every this many seconds (0 = after every step), and at the end",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run whose checkpoint (state.pt) is in --out, with the same flags",
    )
    dataset.run_flags(
        p,
        "train.py's split and the batch order",
        "the heads folder to write (heads, lora.safetensors, state.pt, eval.json): new or empty, "
        "or with --resume the run's own",
    )
    return p


def init_folder(name):
    """--init -> the heads folder to start from. Joint training needs trained heads: none (or auto
    with nothing shipped) is refused, and so is a folder without readable heads. Reads heads.json
    only."""
    folder = catalog.find_heads(name, "--init")
    if folder is None:
        raise cli.UsageError(
            f"--init {name}: joint training starts from trained heads; give a shipped kind (such "
            "as medusa) or a heads folder train.py wrote"
        )
    catalog.check_heads_in(folder, f"--init {name}")
    return folder


def check_args(args):
    cli.check_counts(
        args,
        "conversations",
        "eval_conversations",
        "layers",
        "rank",
        "ramp",
        "epochs",
        "eval_every",
        "teacher_k",
    )
    for flag in ("alpha", "lr_lora", "lr_heads", "heads_weight", "decay"):
        if not (math.isfinite(getattr(args, flag)) and getattr(args, flag) > 0):
            raise cli.UsageError(
                f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be a number > 0"
            )
    if args.batch_tokens < 16:
        raise cli.UsageError(f"--batch-tokens {args.batch_tokens}: must be at least 16")
    if not (math.isfinite(args.save_every) and args.save_every >= 0):
        raise cli.UsageError(f"--save-every {args.save_every}: must be a number of seconds >= 0")
    cli.check_seed(args.seed)
    init_folder(args.init)
    dataset.check_conversations_file(args.data)
    cli.writable_folder("--out", args.out)
    if resume.resumable(args.out, args):  # its flags are these (else refused now)
        return
    if os.path.isfile(os.path.join(args.out, resume.STATE)):
        raise cli.UsageError(
            f"--out {args.out}: holds a run's checkpoint ({resume.STATE}); --resume continues it, "
            "or give a new or empty folder"
        )
    cli.empty_folder("--out", args.out)


def main(args):
    made = cli.new_folders(args.out)  # check_args makes it, to find an unwritable one now
    try:
        check_args(args)
        return run(args)
    finally:
        cli.remove_empty(made)  # a run that stopped leaves no empty folder of its own


def cli_main(argv=None) -> int:
    return cli.run(main, build_parser(), argv, "[joint] interrupted by Ctrl-C")


if __name__ == "__main__":
    sys.exit(cli_main())
