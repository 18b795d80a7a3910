"""Online speculative decoding (Liu et al. 2023): heads that keep learning from
the replies they draft.

Every speculative step already computes what the heads' teacher loss (train.py) needs: the base
model's hidden state at every position it commits and its logits there, the distribution of the
next token. OnlineHeads, a drafter, drafts through the HeadsDrafter it wraps and records those
pairs on the accepted path; between replies, never inside a step, Learner.update takes a few
optimizer steps of train.py's teacher loss on a bounded buffer of recent replies and copies the
result into the heads that draft. The base model never changes, so greedy output stays
token-identical to plain greedy decoding (tests/test_online.py); only the drafts, and so tau, move.

    learner = Learner(heads, model, lr=1e-4, buffer=4, every=4, steps=1)
    drafter = OnlineHeads(drafters.HeadsDrafter(heads, tree), learner)
    for prompt in stream:
        decode.generate(model, prompt, n, drafter)
        learner.reply_done()                    # every `every` replies: an update
    checkpoint.save_heads(learner.master, folder)   # the adapted heads, loadable by --heads

Test: `python -m pytest -q tests/test_online.py`. Shapes: T positions of a reply's sequence (its
prompt, then the committed reply tokens), n committed a step, D hidden, V vocabulary, k the
teacher's top-k, K heads, B replies of a batch.
"""

import copy
import time
from collections import deque
from dataclasses import dataclass, field

import torch

import heads as heads_lib
from specdec import cli, drafters
from specdec.fast import kernels
from specdec.training import losses

TEACHER_K = 16  # the base model's top-k kept per position, as train.py's --teacher-k default
# generate.py --online's and bench.py's defaults: chosen on a single-domain stream
# (results/online-cpu.md)
DEFAULTS = {"lr": 1e-4, "buffer": 4, "every": 4, "steps": 1}


# --- what a reply teaches -------------------------------------------------------------------------
# A reply's sequence is its prompt (hidden states only: Hydra++'s prefix layer reads them) and then
# the tokens each step committed: the root and the accepted drafts, at consecutive positions. The
# base model's logits at a committed position are its distribution of the token after it: the
# teacher of the head that predicts that token (losses.head_states reads it the same way).


@dataclass
class Record:
    ids: list  # the sequence's token ids: the prompt's, then the committed reply tokens
    hidden: list  # the base model's hidden states over them, pieces (T_i, D)
    top_ids: list = field(default_factory=list)  # per committed token: (n, k) teacher ids
    top_p: list = field(default_factory=list)  # per committed token: (n, k) their probabilities
    prompt: int = 0  # positions [0, prompt) have no teacher (the prefill keeps no logits)

    def add(self, tokens, hidden, logits, k=TEACHER_K):
        """One step's committed tokens (n), their hidden states (1, n, D) and the base model's
        logits (n, V) there."""
        top = logits.float().softmax(-1).topk(min(k, logits.shape[-1]), dim=-1)  # (n, k) each
        self.ids += tokens
        self.hidden.append(hidden[0])
        self.top_ids.append(top.indices)
        self.top_p.append(top.values)

    def __len__(self):
        return len(self.ids)


def collate(records, to_kept, K, device):
    """The records as the batch losses.head_states reads (losses.collate's layout): right-padded
    (B, T) ids, (B, T, D) hidden, valid (B, T, K) where head j at t predicts a token whose teacher
    sits at t + j (a committed reply position), the teachers (B, T, k) in head-vocabulary ids; on
    `device`."""
    B, T = len(records), max(len(r) for r in records)
    D = records[0].hidden[0].shape[-1]
    k = records[0].top_ids[0].shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    hidden = torch.zeros(B, T, D)
    taught = torch.zeros(B, T, dtype=torch.bool)  # the position holds a teacher
    top_ids = torch.zeros(B, T, k, dtype=torch.long)
    top_p = torch.zeros(B, T, k)
    for b, r in enumerate(records):
        n = len(r)
        ids[b, :n] = torch.tensor(r.ids)
        hidden[b, :n] = torch.cat(r.hidden).float()
        taught[b, r.prompt : n] = True
        top_ids[b, r.prompt : n] = torch.cat(r.top_ids).cpu()
        top_p[b, r.prompt : n] = torch.cat(r.top_p).cpu()
    valid = torch.zeros(B, T, K, dtype=torch.bool)
    for j in range(1, K + 1):  # head j at t: teacher at t + j, tokens t+1..t+j in the sequence
        valid[:, : max(T - 1 - j, 0), j - 1] = taught[:, j : T - 1]
    batch = dict(
        ids=ids,
        hidden=hidden,
        valid=valid,
        top_ids=to_kept[top_ids],
        top_p=top_p,
        targets=to_kept[ids],
    )
    return {name: x.to(device) for name, x in batch.items()}


# --- the learner ----------------------------------------------------------------------------------
# Training runs on an fp32 copy of the heads (the master, readable layers: AdamW's small steps
# would vanish in bf16 weights, and the fast kernels are for inference); after an update its
# weights are copied into the heads that draft, in their dtype, and kernels.use packs them again.


class Learner:
    """Recent replies (the last `buffer`) and an optimizer on the heads' trainable weights: every
    `every` replies, `steps` AdamW steps at learning rate `lr` of the teacher loss on the buffer."""

    def __init__(self, heads, model, lr: float, buffer: int, every: int, steps: int):
        if not lr > 0 or buffer < 1 or every < 1 or steps < 1:
            raise ValueError(
                f"need lr > 0, buffer, every, steps >= 1: {lr}, {buffer}, {every}, {steps}"
            )
        self.heads = heads
        self.master = heads_lib.build(heads.cfg, model, heads.kept_ids).float().train()
        self.master.load_state_dict(heads.state_dict())
        if getattr(self.master, "prefix", None) is not None:
            # Hydra++'s prefix layer stays as loaded: training it costs a third of an update's
            # time for little of its gain in tau (results/online-cpu.md)
            self.master.prefix.requires_grad_(False)
        trainable = [p for p in self.master.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
        self.forward = losses.TrainForward(self.master)
        self.to_kept = losses.to_kept_map(heads.kept_ids, heads.cfg.vocab_size).cpu()
        self.device = model.device
        self.lr = lr
        self.every = every
        self.steps = steps
        self.buffer = deque(maxlen=buffer)
        self.name = f"AdamW at {lr:g} on the last {buffer} replies, {steps} step(s) every {every}"
        self.replies = 0
        self.updates = 0
        self.seconds = 0.0  # spent in updates
        self.losses = []  # the buffer's loss before each update

    def new_record(self, prompt, hidden):
        """A new reply after `prompt` (ids) whose hidden states are (1, T, D): its Record, in the
        buffer from now on (rows of a batch fill theirs side by side)."""
        r = Record(list(prompt), [hidden[0]], prompt=len(prompt))
        self.buffer.append(r)
        return r

    def reply_done(self):
        """Call between replies: every `every`-th one runs update(). Returns its loss or None."""
        self.replies += 1
        return self.update() if self.replies % self.every == 0 else None

    def update(self):
        """`steps` optimizer steps on the buffer, then the drafting heads get the new weights.
        Returns the loss of the first step (None: nothing recorded yet)."""
        records = [r for r in self.buffer if len(r) > r.prompt + 1]
        if not records:
            return None
        t0 = time.perf_counter()
        batch = collate(records, self.to_kept, self.heads.cfg.num_heads, self.device)
        seen = []
        with torch.inference_mode(False), torch.enable_grad():
            for _ in range(self.steps):
                seen.append(losses.train_step(self.forward, self.opt, batch, self.lr, "teacher"))
        self.sync()
        self.updates += 1
        self.seconds += time.perf_counter() - t0
        self.losses.append(seen[0])
        return seen[0]

    @torch.no_grad()
    def sync(self):
        """The master's weights into the drafting heads (their dtype), packed again for the fast
        kernels."""
        master = dict(self.master.named_parameters())
        for name, p in self.heads.named_parameters():
            p.copy_(master[name])
        kernels.use(self.heads)


# --- the drafter ---------------------------------------------------------------------------------


class OnlineHeads:
    """A HeadsDrafter (or a drafter holding heads, as heads+lookup's) that records, for the learner,
    what every step committed; it drafts as the drafter it wraps."""

    def __init__(self, inner, learner: Learner):
        self.inner = inner
        self.learner = learner
        self.name = inner.name + ", learning online"
        self.legend = inner.legend
        self.max_nodes = inner.max_nodes
        self.max_depth = inner.max_depth

    def row(self, generator=None):  # a row of a batch: its own inner state and record, one learner
        other = copy.copy(self)
        other.inner = self.inner.row(generator)
        return other

    def start(self, prompt, hidden, max_len, cached=0):
        self.inner.start(prompt, hidden, max_len, cached)
        # a conversation's later turn (cached > 0): the record holds what is forwarded now; the
        # turns before it taught the learner already
        self.record = self.learner.new_record(prompt[cached:], hidden)

    def draft(self, rows, roots):
        return self.inner.draft([row.inner for row in rows], roots)

    def accept(self, accepted):
        self.inner.accept(accepted)
        self.record.add(accepted.ids, accepted.hidden, accepted.logits[accepted.nodes])


def learn(drafter, model, settings):
    """--online: the drafter, wrapped to record what every step commits, and its heads' learner
    (settings: online.Learner's lr, buffer, every and steps; None without --online: the drafter
    as it is, and no learner)."""
    if settings is None:
        return drafter, None
    inner = drafter.heads if isinstance(drafter, drafters.HeadsPlusLookup) else drafter
    if not isinstance(inner, drafters.HeadsDrafter):
        raise cli.UsageError(
            f"--online: no heads are shipped for {model.cfg.name}; train them with train.py and "
            "pass --heads FOLDER"
        )
    learner = Learner(inner.heads, model, **settings)
    return OnlineHeads(drafter, learner), learner
