"""Which conversations train.py's loop reads at each step: the held-out split, batches of similar
length fixed by (seed, epoch), each process's share of them under torchrun, the heads' vocabulary,
and the seed of each step's noise. Everything here is fixed by the data and the seed, so that a
resumed run reads exactly the batches an uninterrupted one would.

    held_out, trained = split(n_conversations, seed)
    kept, to_kept, share = kept_vocabulary(data, vocab_size, n)
    plan = Plan(data, to_kept, K, device, batch_tokens, epochs, seed, noise, rank, world)
    batch = plan.batch(step)            # losses.collate's dict for this step and process
    generator = plan.noise(step)        # None without noise

Tests: tests/test_train.py. Shapes: B batch, T time, K heads.
"""

import torch

from specdec.training.losses import collate, to_kept_map


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


class Plan:
    """The batches of a run, step by step: epoch after epoch over the trained split, the process of
    rank r taking batches r, r + world, ... of each epoch (so that world processes together take
    what one process would, a step of each at a time). total is the number of steps."""

    def __init__(self, data, to_kept, K, device, batch_tokens, epochs, seed, noise, rank, world):
        n_conv = len(data["offsets"]) - 1
        self.data, self.to_kept, self.K, self.device = data, to_kept, K, device
        self.batch_tokens, self.seed, self.noisy = batch_tokens, seed, noise > 0
        self.rank, self.world = rank, world
        self.held_out, self.trained = split(n_conv, seed)
        self.lengths = data["offsets"].diff()
        in_train = torch.zeros(n_conv, dtype=torch.bool)
        in_train[self.trained] = True
        # within its conversation
        position = torch.arange(len(data["ids"])) - data["offsets"][:-1].repeat_interleave(
            self.lengths
        )
        # head 1 at t predicts t+2
        if not (data["loss"] & (position >= 2) & in_train.repeat_interleave(self.lengths)).any():
            raise ValueError(
                "nothing to learn from: no assistant token in the training data (no assistant "
                "turns, or only in the 5% held out); heads learn the assistant's replies, so give "
                "data that has them"
            )
        if epochs < 1:
            raise ValueError(f"--epochs {epochs} trains nothing; use 1 or more")
        n_batches = len(make_batches(self.lengths, self.trained, batch_tokens, seed, 0))
        self.per_epoch = n_batches // world  # steps per epoch
        if self.per_epoch == 0:
            raise ValueError(
                f"{n_batches} {'batch' if n_batches == 1 else 'batches'} of training data for "
                f"{world} ranks: add data or lower --batch-tokens"
            )
        self.total = self.per_epoch * epochs
        self.epoch, self.batches = None, None

    def batch(self, step):
        """This process's batch at `step`, collated (losses.collate) on the device."""
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self.epoch:
            self.batches = make_batches(
                self.lengths, self.trained, self.batch_tokens, self.seed, epoch
            )
            self.epoch = epoch
        convs = self.batches[i * self.world + self.rank]
        return collate(self.data, convs, self.to_kept, self.K, self.device)

    def noise(self, step):
        """The generator of this step's input noise, seeded by (seed, step, rank) so that a resumed
        run draws the same; None without noise."""
        if not self.noisy:
            return None
        seed = self.seed * 10**9 + step * self.world + self.rank
        return torch.Generator(device=self.device).manual_seed(seed)
