"""
Train draft heads (Medusa, Hydra, Hydra++) on a frozen base model: the data, the targets, the loss
and the loop.

    python train.py --heads hydra++                      # self-distilled data, teacher loss
    python train.py --heads medusa --loss next-token     # Medusa-1's loss on the data tokens
    python train.py --heads hydra --data chats.jsonl     # your ShareGPT-style conversations
    python train.py --heads hydra++ --resume             # continue after Ctrl-C, a crash or kill -9
    torchrun --nproc_per_node 4 train.py --heads hydra++ # one process per GPU (DDP)

The data: self-distillation. A draft is worth only what the base model accepts, and it accepts its
own next tokens, so the heads learn the base model's replies, not a human's: it writes user prompts
(Magpie-style, seeded with a task and a topic from data/magpie.json) and answers them greedily, as
it will decode. Or --data: a user's ShareGPT-style JSONL, whose teacher is still the base model.
For every token, one pass of the frozen base model records its final hidden state h_t and its
top-k next-token probabilities (the teacher). Heads read h_t as they will while drafting, so
training never runs the base model again (specdec/training/dataset.py builds and caches this;
prepare.py runs its stages).

The positions and the targets. Head j (j = 1..K, as in heads.py) at position t reads h_t and
guesses token t+1+j (the base model itself guesses t+1). It learns only where that token belongs to
an assistant reply: heads only ever draft replies, so prompt tokens would teach them nothing they
use. What it learns is the base model's own distribution for that token: its top-k at position t+j,
where the base model predicted it (teacher_loss below); --loss next-token: the data token itself,
as Medusa-1 (specdec/training/losses.py: collate marks the valid (b, t, j), head_states picks each
one's rows).

The heads' vocabulary. They predict over the --kept-tokens most frequent tokens of the assistant
replies and of the teacher's top-1s (batches.kept_vocabulary): a smaller softmax to train and to
draft from (the run prints the share of those tokens it covers). Teacher tokens outside it get
the id -1, which the losses below drop.

This file holds the loss and the loop, then the command line. Around the loop, in
specdec/training/: batches.py says which conversations each step reads, session.py keeps the
progress, the held-out evaluation (evaluate.py) and the checkpoints, heads included (resume.py:
every --save-every seconds, at Ctrl-C and at the end), distributed.py the processes of torchrun;
specdec/commands/train.py holds the flags and main, which train with this file's functions.

Test: `python -m pytest -q tests/test_train.py tests/test_train_cli.py`. Shapes: B batch, T time,
K heads, V' head vocabulary, M predictions (valid (b, t, j) triples), k teacher top-k.
"""

import specdec.ctrl_c  # noqa: F401 (first: a Ctrl-C while torch imports is one line, exit 130)
import math
import sys
from dataclasses import dataclass

import torch

# --- the loss -------------------------------------------------------------------------------------
# A batch makes M predictions, one per valid (b, t, j): the heads' logits (M, V') over their
# vocabulary (the most frequent tokens, --kept-tokens), and for each the teacher's top-k (M, k) at
# its target and the data token (M,), both as head-vocabulary ids (-1 where not kept).


def teacher_loss(logits, top_ids, top_p):
    """Cross-entropy against the teacher's top-k probabilities and its residual mass.
    logits (M, V') of the heads; top_ids (M, k) the teacher's top-k in head-vocabulary ids (-1 where
    the token is not kept); top_p (M, k) their probabilities. -> (M,)

    Only the top k of the teacher's probabilities are stored; the rest, r = 1 - sum(top_p), is
    spread over the other tokens in a way nobody recorded. So "any other token" is one more outcome:

        L = - sum_i p_i log q_i  -  r log(1 - sum_i q_i)          (i over the teacher's top-k)

    This is the exact cross-entropy once the other tokens are lumped together, and it is smallest
    where the head gives each top-k token the teacher's probability and mass r to the rest. It is
    preferred to renormalising p over the top-k (target p_i / sum(p)), which claims the teacher is
    sure the next token is among its k when it is not: where the teacher hesitates (large r) the
    head would be pushed hardest to crush every other token, learning overconfidence exactly where
    drafts are rarely accepted, and its probabilities would stop meaning "chance the base model says
    this" (which a confidence-based tree, or speculative sampling with the heads as the draft,
    needs). Top-k tokens outside the heads' vocabulary (-1) are dropped from both sums: a head
    cannot say them, so its best is then the teacher's distribution renormalised over the outcomes
    it can say. 1 - sum q is clamped at 1e-6 (fp32 cancellation); it only matters if r < 1e-6, i.e.
    r = 0 in fp16.
    """
    logq = logits.float().log_softmax(-1)  # (M, V')
    kept = top_ids >= 0  # (M, k)
    picked = logq.gather(1, top_ids.clamp(min=0)) * kept  # (M, k) log q_i, 0 if not kept
    p = top_p.float() * kept  # (M, k)
    rest_p = (1 - top_p.float().sum(-1)).clamp(min=0)  # (M,) teacher mass beyond its top-k
    rest_q = 1 - (picked.exp() * kept).sum(-1)  # (M,) head mass beyond them
    return -(p * picked).sum(-1) - rest_p * torch.log(rest_q.clamp(min=1e-6))


def next_token_loss(logits, target):
    """Cross-entropy against the data token (head-vocabulary id, -1 if not kept). -> (M,)"""
    logq = logits.float().log_softmax(-1)
    return -logq.gather(1, target.clamp(min=0)[:, None])[:, 0] * (target >= 0)


def batch_loss(kind, logits, j, top_ids, top_p, target):
    """The mean loss of a batch's M predictions, from the heads' logits (M, V'); j (M,) is the head
    that made each, 1..K. Teacher loss: every head alike; next-token loss: head j weighted 0.8^j
    (Medusa-1). A batch with no predictions gives 0."""
    M = max(len(logits), 1)
    if kind == "teacher":
        return teacher_loss(logits, top_ids, top_p).sum() / M
    return (next_token_loss(logits, target) * 0.8 ** j.float()).sum() / M


# Which one trains. `python train.py --loss-impl readable` trains with batch_loss above, and so with
# the teacher_loss you read (a print in it shows). The default, --loss-impl fused, is its fast twin
# kernels.fused_batch_loss: from the heads' states and the LM head's weight it forms the logits and
# the loss a block of rows at a time, so the (M, V') logits and their gradient never exist whole;
# same values and gradients (tests/test_kernels.py). The twin is the default because it is the only
# way to keep training within 1.2x of its time: steps that made the whole logits ran far slower,
# and in more memory (results/train-speed-zen5-bf16.md, "The readable loss or its twin").


# --- the loop -------------------------------------------------------------------------------------
# Each step: the batch of the step, the heads' loss on it, backward, clip, AdamW. Everything else
# (the batches' order, evaluation, checkpoints, Ctrl-C, other processes) sits in the objects the
# loop is handed, so that a resumed run, or one of many processes, runs this same loop.


@dataclass
class Recipe:
    loss: str  # "teacher" | "next-token"
    lr: float  # the peak learning rate
    noise: float  # NEFTune-style noise alpha on the hidden states (0 = off)
    bf16: bool  # the heads' matrix products in bf16; the loss, gradients and weights stay fp32


def learning_rate(step, total, peak):
    """The peak rate times two factors from step 0: a linear warm-up, (step + 1) / 50 until it
    reaches 1 at step 49, and a cosine from 1 at step 0 down to 0 at step `total`."""
    return peak * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / max(total, 1)))


def train(forward, opt, plan, recipe, step, session):
    """Train the heads from `step` (0, or a checkpoint's) to plan.total; returns the step reached.
    forward: the heads' batch loss as a module (losses.TrainForward: the heads run at every valid
    (b, t, j) and their guesses go through batch_loss or its twin; under torchrun wrapped so that
    backward averages the gradients over the processes). opt: AdamW over the heads' trainable
    weights. plan: each step's batch (batches.Plan). session: told after each step
    (session.Session: progress, evaluation, checkpoints; on Ctrl-C it saves and exits 130)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    dtype = torch.bfloat16 if recipe.bf16 else torch.float32
    while step < plan.total:
        # a few conversations, right-padded: ids (B, T), the base model's states h (B, T, D), its
        # top-k (B, T, k), and valid (B, T, K): head j at t predicts a token of a reply
        batch = plan.batch(step)
        device = batch["hidden"].device.type
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=recipe.bf16):
            loss = forward(batch, recipe.loss, recipe.noise, plan.noise(step), dtype)
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, plan.total, recipe.lr)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        # a loss or gradient that is not finite stops training before the weights change
        if not (torch.isfinite(loss) and torch.isfinite(norm)):
            raise FloatingPointError(
                f"step {step + 1}: loss {loss.item()}, gradient norm {norm.item()}"
            )
        opt.step()
        step += 1
        session.after_step(step, loss.item(), batch)
    return step


# --- command line ---------------------------------------------------------------------------------
# `python train.py --help` lists the flags. The flags' checks, the data stage, torchrun's processes,
# --resume and main are specdec/commands/train.py's; it trains with the functions passed in below,
# this file's own, looked up when the command runs: an edit above changes what `python train.py`
# does.


def cli_main(argv=None) -> int:
    """Bad input or data: one line on stderr, exit code 2. A NaN loss: one line, exit code 1.
    Ctrl-C: what is kept, exit code 130."""
    from specdec.commands import train as command

    lesson = command.Lesson(train=train, Recipe=Recipe, batch_loss=batch_loss)
    return command.cli_main(argv, lesson)


if __name__ == "__main__":
    sys.exit(cli_main())
