"""train.py --heads eagle3: an EAGLE-3 layer (specdec/eagle3.py) trained on a frozen base model
whose features are computed as it trains, batch by batch, from conversations (--data FILE: train.py
--export-conversations' .safetensors, or a ShareGPT-style file), by train.py's own loop.

    python train.py --heads eagle3 --data data/smollm2-135m-instruct-conversations.safetensors \
        --conversations 2000 --out eagle3-run

Each batch: the base model (a bf16 copy where that is fast, on kernels.c: prepare.data_model) runs
once over the batch's conversations, giving the fused inputs of the layers the drafter reads
(rows.Model's `features`) and its own next-token top-k (the teacher); nothing is cached on disk.
The layer then unrolls K = --num-heads steps over every position (Eagle3.unroll: EAGLE-3's
training-time test, step j reading its own output of step j-1): step j at t guesses token
t+2+j, exactly what a draft node at depth j+1 guesses, and learns where that token is an
assistant's. The loss is train.py's teacher loss against the base model's top-k at t+1+j over the
draft vocabulary (the rest of the mass one bucket; kernels.fused_batch_loss, or train.py's
batch_loss with --loss-impl readable), step j weighted 0.8^j as EAGLE-3's own training weighs it.

Around it everything is train.py's: the held-out split (batches.split), the batches (make_batches,
by length, fixed by seed and epoch), the loop (train.train: warm-up and cosine, clipping, a NaN
stops it), the session (progress, evaluation every --eval-every steps, checkpoints every
--save-every seconds, Ctrl-C / SIGTERM, --resume bit for bit) and eval.json. --conversations N
trains on the first N of the training split (0: all); --eval-conversations N evaluates on the first
N held out (0: all; every evaluation runs the base model over them again), as the heads' are
evaluated (per depth top-1 and top-5 against the base model's greedy token, each rank's acceptance,
and the chain tau, the drafter's inputs the data's tokens as the heads' are).

The draft vocabulary: the --kept-tokens most frequent assistant tokens of the data (the heads'
also count the teacher's top-1s, which are not known before this run's base passes; on greedy
self-distilled data they are the same tokens).

Test: `python -m pytest -q tests/test_eagle3.py`. Shapes: B batch, T time, D hidden, F fused
layers, K steps, k teacher top-k, M predictions, V' draft vocabulary.
"""

import os
import sys

import torch
import torch.nn as nn

from specdec import cli
from specdec import eagle3 as eagle3_lib
from specdec.fast import kernels
from specdec.fast.kernels import bucket
from specdec.training import dataset, prepare
from specdec.training.batches import kept_vocabulary, make_batches, split
from specdec.training.evaluate import report
from specdec.training.session import Session

STEP_WEIGHT = 0.8  # step j's loss weighs STEP_WEIGHT ** j (EAGLE-3's training code)


# --- the data: conversations, and the base model's features batch by batch -----------------------


def conversations_data(convs):
    """[(ids, loss mask)] -> the data dict the session and batches.py read (ids, loss, offsets),
    and teacher_top1 -1 everywhere (kept_vocabulary: assistant tokens alone)."""
    data = {
        "ids": torch.tensor([t for ids, _ in convs for t in ids], dtype=torch.long),
        "loss": torch.tensor([m for _, loss in convs for m in loss], dtype=torch.bool),
        "offsets": torch.tensor([0] + [len(ids) for ids, _ in convs]).cumsum(0),
    }
    data["teacher_top1"] = torch.full_like(data["ids"], -1)
    return data


@torch.no_grad()
def features(writer, data, convs, layers, to_kept, K, teacher_k, device):
    """A batch of conversations, right-padded to a multiple of 16 and run through the base model
    (`writer`) once: ids (B, T), "hidden" the fused inputs of `layers` (B, T, F*D), valid (B, T, K)
    (step j at t guesses an assistant token, t+2+j), and the teacher's top-k at each position
    (B, T, k): top_ids as draft-vocabulary ids (-1 where not kept), top_p."""
    off = data["offsets"]
    T = bucket(max(int(off[i + 1] - off[i]) for i in convs), 16)
    B = len(convs)
    ids = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.bool)
    for b, i in enumerate(convs):
        a, e = int(off[i]), int(off[i + 1])
        ids[b, : e - a], loss[b, : e - a] = data["ids"][a:e], data["loss"][a:e]
    ids, loss = ids.to(device), loss.to(device)
    cache = writer.new_cache(T, batch=B)  # (kernels.c's whole-forward path needs one)
    positions = torch.arange(T, device=device)
    _, hidden, fused = writer(ids, positions, None, cache, last_only=True, features=layers)
    top_ids = torch.empty(B * T, teacher_k, dtype=torch.long, device=device)
    top_p = torch.empty(B * T, teacher_k, device=device)
    flat = hidden.flatten(0, 1)  # (B*T, D)
    for a in range(0, B * T, 512):  # the LM head's (512, V) at a time
        top = writer.lm_head(flat[a : a + 512]).float().softmax(-1).topk(teacher_k, dim=-1)
        top_ids[a : a + 512], top_p[a : a + 512] = top.indices, top.values
    valid = torch.zeros(B, T, K, dtype=torch.bool, device=device)
    for j in range(K):  # step j at t guesses token t+2+j (collate's head j+1)
        n = max(T - 2 - j, 0)
        valid[:, :n, j] = loss[:, 2 + j : 2 + j + n]
    return dict(
        ids=ids,
        hidden=fused,  # (B, T, F*D): named as the heads' batches name what the drafter reads
        valid=valid,
        top_ids=to_kept.to(device)[top_ids].view(B, T, -1),
        top_p=top_p.view(B, T, -1),
    )


class Plan:
    """batches.Plan's twin for one process: the batches of the trained conversations (the first
    `conversations` of the split's, 0: all), epoch after epoch, each collated with the base
    model's features as it is asked for (`features` above). total: the number of steps."""

    def __init__(self, writer, data, to_kept, layers, args, device):
        self.writer, self.data, self.to_kept, self.layers = writer, data, to_kept, layers
        self.K, self.teacher_k, self.device = args.num_heads, args.teacher_k, torch.device(device)
        self.batch_tokens, self.seed, self.noisy = args.batch_tokens, args.seed, args.noise > 0
        held_out, trained = split(len(data["offsets"]) - 1, args.seed)
        self.held_out, self.trained = held_out, trained[: args.conversations or None]
        self.lengths = data["offsets"].diff()
        off, loss = data["offsets"], data["loss"]
        if not any(bool(loss[int(off[i]) + 2 : int(off[i + 1])].any()) for i in self.trained):
            raise ValueError(  # step 0 at t guesses t+2: an assistant token past the first two
                "nothing to learn from: no assistant token in the training conversations (or only "
                "in the 5% held out); give data that has assistant turns"
            )
        batches = make_batches(self.lengths, self.trained, self.batch_tokens, self.seed, 0)
        self.per_epoch = len(batches)
        self.total = self.per_epoch * args.epochs
        self.epoch, self.batches = None, None

    def collate(self, convs):
        return features(
            self.writer,
            self.data,
            convs,
            self.layers,
            self.to_kept,
            self.K,
            self.teacher_k,
            self.device,
        )

    def batch(self, step):
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self.epoch:
            self.batches = make_batches(
                self.lengths, self.trained, self.batch_tokens, self.seed, epoch
            )
            self.epoch = epoch
        return self.collate(self.batches[i])

    def noise(self, step):
        if not self.noisy:
            return None
        return torch.Generator(device=self.device).manual_seed(self.seed * 10**9 + step)


# --- the loss and the evaluation -----------------------------------------------------------------


def predictions(module, batch, noise=0.0, generator=None):
    """The unrolled steps on a batch: per step j, the states o (M_j, D) where it guesses an
    assistant token, and the teacher's top-k there (M_j, k) ids and p."""
    f = batch["hidden"].float()  # (B, T, F*D)
    if noise > 0:  # NEFTune-style, as losses.head_states: U(-1, 1) * alpha / sqrt(T * F*D)
        u = torch.rand(f.shape, generator=generator, device=f.device)
        f = f + (u * 2 - 1) * noise / (f.shape[1] * f.shape[2]) ** 0.5
    out = []
    for j, o in enumerate(module.unroll(f, batch["ids"], module.cfg.num_heads)):
        b, t = batch["valid"][..., j].nonzero(as_tuple=True)  # (M_j,) each
        out.append((o[b, t], batch["top_ids"][b, t + 1 + j], batch["top_p"][b, t + 1 + j]))
    return out


class TrainForward(nn.Module):
    """A batch's loss as one module's forward (losses.TrainForward's twin for the layer): step j's
    teacher loss, weighted STEP_WEIGHT ** j; readable: train.py's batch_loss on the logits, else
    its fused twin."""

    def __init__(self, module, readable=None):
        super().__init__()
        self.module, self.readable = module, readable

    def forward(self, batch, loss_kind, noise=0.0, generator=None, dtype=torch.float32):
        total = 0.0
        for j, (o, top_ids, top_p) in enumerate(predictions(self.module, batch, noise, generator)):
            z = self.module.norm(o)  # (M, D)
            if self.readable is not None:
                steps = torch.full((len(z),), j + 1, device=z.device)
                logits = self.module.lm_head(z)  # (M, V')
                loss = self.readable(loss_kind, logits, steps, top_ids, top_p, None)
            else:
                w = self.module.lm_head.weight  # (V', D)
                loss = kernels.fused_batch_loss(loss_kind, z, w, None, top_ids, top_p, None, dtype)
            total = total + STEP_WEIGHT**j * loss
        return total


@torch.no_grad()
def evaluate(module, plan, convs, bf16=False):
    """evaluate.evaluate's twin for the layer: per depth (step j + 1) its top-1 / top-5 against the
    base model's greedy token, the rank histogram, and the chain tau (1 + the leading steps whose
    top-1 is right, where every step guesses an assistant token)."""
    K, dev = module.cfg.num_heads, plan.device
    top1, top5, count = (torch.zeros(K, device=dev) for _ in range(3))
    ranks = torch.zeros(K, 10, device=dev)
    run_sum, run_n = torch.zeros((), device=dev), 0
    for convs_b in make_batches(plan.lengths, convs, plan.batch_tokens, plan.seed, 0):
        batch = plan.collate(convs_b)
        valid = batch["valid"]
        right = torch.zeros_like(valid)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
            guesses = predictions(module, batch)
        for j, (o, top_ids, _) in enumerate(guesses):
            logits = module.logits(o).float()  # (M, V')
            order = logits.topk(min(10, logits.shape[-1]), dim=-1).indices  # (M, 10)
            hit = order == top_ids[:, :1]  # (M, 10): the base model's own top-1
            count[j] += len(hit)
            top1[j] += hit[:, 0].sum()
            top5[j] += hit[:, :5].any(-1).sum()
            ranks[j, : hit.shape[1]] += hit.sum(0).float()
            right[..., j][valid[..., j]] = hit[:, 0]
        run = right[valid.all(-1)].long().cumprod(-1).sum(-1)  # (positions,)
        run_sum, run_n = run_sum + run.sum(), run_n + len(run)
    return report(top1, top5, ranks, count, run_sum, run_n)


class Eagle3Session(Session):
    """session.Session for the layer: its evaluation is evaluate() above, on the first
    --eval-conversations held out (0: all), their number in the report."""

    def evaluate(self):
        held = self.plan.held_out[: self.args.eval_conversations or None]
        report = evaluate(self.heads.eval(), self.plan, held, self.bf16)
        return report | {"conversations": len(held)}


# --- the run -------------------------------------------------------------------------------------


def say(message):
    print(f"[train] {message}", file=sys.stderr, flush=True)


def check_args(args):
    """The flags --heads eagle3 takes or refuses, before anything loads (one line, exit 2)."""
    if args.data == "self":
        raise cli.UsageError(
            "--heads eagle3 computes the base model's features as it trains, from conversations: "
            "give --data FILE (train.py --export-conversations' .safetensors, such as "
            "data/smollm2-135m-instruct-conversations.safetensors, or a ShareGPT-style JSONL)"
        )
    if args.loss != "teacher":
        raise cli.UsageError(
            f"--loss {args.loss}: an EAGLE-3 layer learns the base model's distribution; use "
            "--loss teacher"
        )
    if args.export_conversations:
        raise cli.UsageError(
            "--export-conversations writes the data set and stops, which --heads eagle3 has no "
            "stage for; drop one of them"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's (distributed.init_distributed)
        raise cli.UsageError(
            "--heads eagle3 trains in one process (the base model's features are computed batch "
            "by batch); run it without torchrun"
        )


def train(model, tokenizer, out, args, lesson):
    """The layer for the frozen `model` trained as `args` say on --data's conversations,
    checkpointed to `out`, by the lesson's loop (train.py's train, Recipe and batch_loss);
    returns it."""
    if args.data.endswith(".safetensors"):  # the tensors as they are: millions of tokens
        ids, loss, offsets = dataset.conversation_tensors(args.data)
        data = {"ids": ids.long(), "loss": loss.bool(), "offsets": torch.tensor(offsets)}
        data["teacher_top1"] = torch.full_like(data["ids"], -1)
    else:
        data = conversations_data(dataset.read_sharegpt(args.data, tokenizer, args.skip_bad))
    writer = prepare.data_model(model, args.dtype)  # the features' forward: bf16 where fast
    kept, to_kept, coverage = kept_vocabulary(data, model.cfg.vocab_size, args.kept_tokens)
    torch.manual_seed(args.seed)
    module = eagle3_lib.build(model, kept, depth=args.num_heads).train()
    layers = tuple(module.cfg.layers)
    bf16 = kernels.pick_dtype(args.train_dtype, model.device.type, native=False) == torch.bfloat16
    plan = Plan(writer, data, to_kept, layers, args, model.device)
    off = data["offsets"]
    answers = sum(int(data["loss"][int(off[i]) : int(off[i + 1])].sum()) for i in plan.trained)
    vocabulary = (
        f"{len(kept)} tokens ({coverage:.1%} of assistant tokens)" if kept is not None else "all"
    )
    say(
        f"eagle3: {cli.plural(len(plan.trained), 'conversation')} to train on "
        f"({cli.plural(answers, 'assistant token')}), {len(plan.held_out)} held out; the inputs "
        f"of layers {', '.join(map(str, layers))} fused; draft vocabulary {vocabulary}; "
        f"{cli.plural(plan.total, 'step')} of {args.num_heads} unrolled steps"
    )
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.0)
    weights = dataset.weights_digest(model)
    session = Eagle3Session(module, opt, data, plan, out, args, bf16, weights)
    readable = lesson.batch_loss if args.loss_impl == "readable" else None
    forward = TrainForward(module, readable)
    recipe = lesson.Recipe(loss="teacher", lr=args.lr, noise=args.noise, bf16=bf16)
    with session:
        try:
            lesson.train(forward, opt, plan, recipe, session.step, session)
        except FloatingPointError as e:
            raise FloatingPointError(f"{e}; training stopped, {session.kept()}") from None
    session.finish()
    return module
