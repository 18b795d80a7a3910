"""What the heads' training objective reads, shared by train.py (offline), joint.py (Medusa-2) and
online.py (while serving): a batch of conversations collated for it, the heads run on it (which
positions, which targets), the batch's loss as one module (fused, or train.py's readable form), and
the optimizer step of train.py's loop for the online learner.

Tests: tests/test_train.py, tests/test_online.py. Shapes: B batch, T time, D hidden, K heads,
M predictions, V' the heads' vocabulary, k teacher top-k.
"""

import torch
import torch.nn as nn

from specdec.fast import kernels
from specdec.fast.kernels import bucket


# --- a batch, and the heads on it ----------------------------------------------------------------
# Head j (1-based) at position t predicts token t+1+j. Its target is either the base model's own
# distribution at position t+j (teacher loss, the default) or the data token itself (next-token
# loss, Medusa-1, head weights 0.8^j). Only assistant tokens are predicted: at inference the heads
# only ever draft the assistant's reply, so prompt tokens would teach them nothing they use. The
# losses themselves, in their readable form, are train.py's (teacher_loss, next_token_loss,
# batch_loss); kernels.fused_batch_loss is their fast twin.


def collate(data, convs, to_kept, K, device):
    """Right-padded (B, T) tensors for a list of conversation indices, plus per (b, t, j)
    targets."""
    off = data["offsets"]
    T = bucket(max(int(off[i + 1] - off[i]) for i in convs), 16)
    B, D, k = len(convs), data["hidden"].shape[1], data["top_ids"].shape[1]
    ids = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.bool)
    hidden = torch.zeros(B, T, D, dtype=torch.float16)
    top_ids = torch.zeros(B, T, k, dtype=torch.long)
    top_p = torch.zeros(B, T, k, dtype=torch.float16)
    for b, i in enumerate(convs):
        a, e = int(off[i]), int(off[i + 1])
        ids[b, : e - a], loss[b, : e - a], hidden[b, : e - a] = (
            data["ids"][a:e],
            data["loss"][a:e],
            data["hidden"][a:e],
        )
        top_ids[b, : e - a], top_p[b, : e - a] = data["top_ids"][a:e], data["top_p"][a:e]
    # valid[b, t, j-1]: head j at position t predicts token t+1+j, an assistant token
    valid = torch.zeros(B, T, K, dtype=torch.bool)
    for j in range(1, K + 1):
        n = max(T - 1 - j, 0)  # none when the batch is that short
        valid[:, :n, j - 1] = loss[:, 1 + j : 1 + j + n]
    # page-locked host memory: the copies overlap the GPU's work
    pinned = torch.device(device).type == "cuda"
    move = lambda x: x.pin_memory().to(device, non_blocking=True) if pinned else x.to(device)
    return dict(
        ids=move(ids),
        hidden=move(hidden),
        valid=move(valid),
        top_ids=move(to_kept[top_ids]),
        top_p=move(top_p),
        targets=move(to_kept[ids]),
    )


def head_states(heads, batch, noise=0.0, generator=None):
    """Run the heads on a batch: their states z (M, D) at the valid (b, t, j) (j = head - 1), the
    teacher's and the data's targets for them, and (b, t). The heads run only at positions where
    one of them predicts an assistant token (Hydra++'s prefix layer still reads every position).
    noise > 0 adds NEFTune-style noise drawn from `generator` (the caller seeds it per step)."""
    h = batch["hidden"].float()  # (B, T, D)
    B, T, D = h.shape
    if noise > 0:  # U(-1, 1) * alpha / sqrt(T * D)
        u = torch.rand(h.shape, generator=generator, device=h.device)  # (B, T, D)
        h = h + (u * 2 - 1) * noise / (T * D) ** 0.5
    positions = torch.arange(T, device=h.device).expand(B, T)
    valid = batch["valid"]  # (B, T, K)
    at = valid.any(-1).nonzero(as_tuple=True)  # the N positions used
    extra = bucket(len(at[0]), 64) - len(at[0])  # and the first again, to a
    padded = tuple(torch.cat([x, x[:1].expand(extra)]) for x in at)  # bucket of 64 rows (bucket())
    z = heads(heads.context(h, positions), batch["ids"], padded)  # (N + extra, K, D)
    n, j = valid[at].nonzero(as_tuple=True)  # (M,) each
    b, t = at[0][n], at[1][n]
    # head j+1 at t: the teacher's distribution sits at t+j+1, the data token at t+j+2
    return (
        z[n, j],
        j,
        batch["top_ids"][b, t + j + 1],
        batch["top_p"][b, t + j + 1],
        batch["targets"][b, t + j + 2],
        (b, t),
    )


def logits_of(heads, z, j):
    """The heads' logits (M, V') for states z (M, D) of heads j + 1 (each through its own LM head if
    it has one)."""
    if not heads.cfg.own_lm_head:
        return heads.project(z)
    logits = torch.empty(len(z), heads.lm_head.weight.shape[1], device=z.device)
    for d in range(heads.cfg.num_heads):
        logits[j == d] = heads.project(z[j == d], d + 1).float()
    return logits


class TrainForward(nn.Module):
    """A batch's loss as one module's forward. DistributedDataParallel averages the gradients only
    of what runs inside the forward of the module it wraps, and training uses more of the heads than
    their forward (context, i.e. Hydra++'s PrefixMLP, and the LM head, which may train).
    readable: None for kernels.fused_batch_loss (the LM head and the loss in blocks of rows), or
    the readable batch loss it is the twin of, train.py's batch_loss, passed in by train.py and
    called on the heads' logits (the same values and gradients: tests/test_kernels.py)."""

    def __init__(self, heads, readable=None):
        super().__init__()
        self.heads, self.readable = heads, readable

    def forward(self, batch, loss_kind, noise=0.0, generator=None, dtype=torch.float32):
        """dtype: the fused loss's products (the readable one's follow autocast)."""
        z, j, top_ids, top_p, target, _ = head_states(self.heads, batch, noise, generator)
        if self.readable is not None:
            logits = logits_of(self.heads, z, j)  # (M, V')
            # train.py counts heads from 1 (heads.py's head j), head_states from 0
            return self.readable(loss_kind, logits, j + 1, top_ids, top_p, target)
        return kernels.fused_batch_loss(
            loss_kind, z, self.heads.lm_head.weight, j, top_ids, top_p, target, dtype
        )


def to_kept_map(kept, vocab_size):
    """base token id -> the heads' id for it (its index in kept), -1 for a token not kept; kept
    None: all."""
    ids = kept if kept is not None else torch.arange(vocab_size)
    to_kept = torch.full((vocab_size,), -1, dtype=torch.long)
    to_kept[ids] = torch.arange(len(ids))
    return to_kept


# --- one optimizer step ------------------------------------------------------------------------


def train_step(forward, opt, batch, lr, loss_kind, noise=0.0, generator=None, bf16=False):
    """One optimizer step on one collated batch, as train.py's loop takes it (tests/test_train.py
    holds the two equal); returns the loss. For the learners that cannot import an entry script
    (online.py). forward is TrainForward(heads),
    possibly wrapped in DistributedDataParallel; bf16: its matrix products in bf16 (autocast), the
    loss in fp32. Raises FloatingPointError, with the weights untouched, if the loss or the gradient
    norm is not finite (under DDP the gradients, hence the norm, are averaged over ranks: a NaN on
    one rank stops them all at the same step)."""
    with torch.autocast(
        device_type=batch["hidden"].device.type, dtype=torch.bfloat16, enabled=bf16
    ):
        loss = forward(
            batch, loss_kind, noise, generator, torch.bfloat16 if bf16 else torch.float32
        )
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in opt.param_groups for p in group["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    if not (torch.isfinite(loss) and torch.isfinite(norm)):
        raise FloatingPointError(f"loss {loss.item()}, gradient norm {norm.item()}")
    opt.step()
    return loss.item()
