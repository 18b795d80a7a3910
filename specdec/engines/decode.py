"""generate.py's ladder (prefill -> step -> generate) for many rows and every drafter: its twin,
tested equal to it. Read generate.py first. One prompt with heads or plain decoding runs
generate.py's own generate() (reply() below chooses); a batch, a chat and every drafter beyond
the heads (specdec/drafters.py) run this.

    prefill(model, cache, prompts)        one forward over the prompts: each one's last logits
    step(model, cache, drafter, rows)     one speculative step for every row of the cache:
        the drafter fills a tree of candidates after each row's last token    (specdec.drafters)
        -> one forward of the base model over every tree, tree masks    (specdec.rows)
        -> each row's verifier picks its longest acceptable path + a bonus     (verify.py)
        -> the accepted nodes' KV entries are kept, the rest is garbage        (RowsCache.keep)
        -> each row's drafter is told what was kept and what the model computed (drafter.accept)
    generate(model, prompt, max_new_tokens, drafter)   prefill, then step until EOS or the limit
    Conversation                          generate() with a KV cache that outlives the reply

What generate.py's one sequence does not need is here: rows of different lengths side by side
(a free row drafts a root nobody keeps), drafters that bring nodes computed but never verified
(Draft.candidates: lookahead, PaSS) or embeddings past the vocabulary (PaSS), statistics. Plain
decoding is the same loop with a drafter that proposes nothing. Many prompts at once is
engine.py, on the same prefill and step; the fast paths (specdec.fast) replace the forward.

Contracts (tests/test_generate.py, test_drafters.py, test_batch.py, test_chat.py): greedy
speculative output is token-identical to plain greedy decoding in fp32, whatever the drafter, and
in bf16 through kernels.c (elsewhere a tree step and a one-token step round differently); sampling
samples from the base model's own distribution; a chat's reply is the one-shot reply (greedy, fp32);
one row with heads takes generate.py's steps and, at a temperature, draws its tokens.
Shapes: B rows, N tree nodes, T prompt tokens, D hidden, V vocabulary.
"""

import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec import drafters as drafters_lib
from specdec.fast import verifiers as fast_verify
import verify as verify_lib

# --- what a reply is, and who verifies it -------------------------------------------------------


@dataclass
class Result:
    tokens: list = field(default_factory=list)  # generated ids (EOS included if reached)
    sources: list = field(default_factory=list)  # per token: who drafted it, a legend index
    accepted: list = field(default_factory=list)  # per speculative step: drafted tokens accepted
    steps: int = 0  # base forward passes, the prefill included
    seconds: float = 0.0
    stopped: str = ""  # "eos" | "length" | "stop" (on_tokens ended it)

    def add(self, new, sources, limit, eos_ids) -> bool:
        """Append what a step emitted, up to EOS (kept) or `limit` tokens in all; True when done."""
        new, sources = new[: limit - len(self.tokens)], sources[: limit - len(self.tokens)]
        for i, t in enumerate(new):
            if t in eos_ids:
                new, sources, self.stopped = new[: i + 1], sources[: i + 1], "eos"
                break
        self.tokens += new
        self.sources += sources
        if not self.stopped and len(self.tokens) >= limit:
            self.stopped = "length"
        return bool(self.stopped)


def acceptance_by_depth(accepted, max_depth):
    """Fraction of speculative steps whose accepted path reached depth d, for d = 1..max_depth."""
    steps = max(len(accepted), 1)
    return [sum(a >= d for a in accepted) / steps for d in range(1, max_depth + 1)]


def choose_verifier(verify, temperature, top_p, generator):
    """verifier(logits (n, V), tokens (n,), draft) -> (accepted nodes, bonus): its n candidates.
    The rules are verify.py's, run as their fast twins (specdec/fast/verifiers.py)."""
    if verify not in verify_lib.VERIFIERS:
        raise ValueError(f"verify={verify!r}: use one of {', '.join(verify_lib.VERIFIERS)}")
    if verify == "greedy" and not verify_lib.is_greedy(temperature):
        raise ValueError(
            f"verify='greedy' keeps only the argmax, so it needs temperature 0, got {temperature}"
        )
    if verify_lib.is_greedy(temperature):  # "greedy" (checked above), any verify at temperature 0
        return lambda l, t, d: fast_verify.greedy(l, t, d.tree)
    if verify == "typical":
        return lambda l, t, d: fast_verify.typical(
            l, t, d.tree, temperature, top_p, generator=generator
        )

    def sample(l, t, d):
        """Sampled drafts come with their p: Leviathan's rule; picked ones: the tree rule."""
        if d.probs is not None:
            return fast_verify.leviathan(l, t, d.probs, temperature, top_p, generator)
        return fast_verify.speculative(l, t, d.tree, temperature, top_p, generator)

    return sample


def first_token(logits, temperature, top_p, generator) -> int:
    """The reply's first token from the prompt's last logits (V,): no draft to verify yet."""
    probs = verify_lib.logits_to_probs(logits.float(), temperature, top_p)  # (V,)
    if verify_lib.is_greedy(temperature):
        return int(probs.argmax())
    return int(verify_lib.sample(probs, generator))


@dataclass
class Row:
    """One sequence while it decodes: who drafts and verifies it, and its last token."""

    drafter: object  # its own (drafter.row()), or the drafter itself for one sequence
    verifier: object  # choose_verifier's, on the row's own generator
    root: int  # the last emitted token, not yet in the cache


# --- prefill --------------------------------------------------------------------------------------


def prefill(model, cache, prompts, features=()):
    """Forward the prompts (lists of ids, one a cache row) past what the cache holds of them
    already (cache.length tokens: a conversation's earlier turns), right-padded into one forward
    (causal: no prompt sees the padding after it), and keep their entries. -> each prompt's last
    logits (B, V), and its hidden states over the part forwarded, [(1, T_b, D)]; with `features`
    (drafters.features_of's layers), those layers' inputs instead, [(1, T_b, F*D)]."""
    dev = model.device
    cached = cache.length  # a conversation's earlier turns
    lengths = [len(p) for p in prompts]
    L = max(lengths)
    padded = torch.tensor([p[cached:] + [0] * (L - len(p)) for p in prompts], device=dev)
    positions = torch.arange(cached, L, device=dev)
    if features:  # (B, T, D), (B, T, F*D)
        _, hidden, fused = model(padded, positions, None, cache, last_only=True, features=features)
    else:
        _, hidden = model(padded, positions, None, cache, last_only=True)
    last = torch.tensor(lengths, device=dev) - 1 - cached  # (B,) each prompt's last token
    logits = model.lm_head(hidden[torch.arange(len(prompts), device=dev), last])  # (B, V)
    cache.keep(*[range(n - cached) for n in lengths])  # row b: slots [0, len(prompt b))
    states = fused if features else hidden  # what the drafters' start() reads
    return logits, [states[b : b + 1, : n - cached] for b, n in enumerate(lengths)]


# --- one speculative step ------------------------------------------------------------------------


def pad_drafts(drafts):
    """The rows' drafts padded to the largest one's N nodes: tokens (B, N), mask (B, N, N) or None
    (every draft its root alone: causal), depth (B, N), and the embeddings (K, D) of ids past the
    vocabulary a draft brings (PaSS) or None. A padding node is token 0 at depth 0 that sees only
    itself: computed, never kept (the verifiers read a row's first d.candidates nodes alone)."""
    N = max(len(d.tokens) for d in drafts)
    tokens = torch.stack([F.pad(d.tokens, (0, N - len(d.tokens))) for d in drafts])  # (B, N)
    depth = torch.stack([F.pad(d.depth, (0, N - len(d.depth))) for d in drafts])  # (B, N)
    extra = next((d.extra for d in drafts if d.extra is not None), None)  # the rows' same (K, D)
    if N == 1:
        return tokens, None, depth, extra
    masks = []
    for d in drafts:
        mask = torch.eye(N, dtype=torch.bool, device=d.tokens.device)  # (N, N)
        if d.mask is not None:
            mask[: len(d.mask), : len(d.mask)] = d.mask
        masks.append(mask)
    return tokens, torch.stack(masks), depth, extra  # (B, N), (B, N, N), (B, N), (K, D)


def step(model, cache, drafter, rows):
    """One step of every row of the cache (rows[b]: a Row, or None for a free row, which drafts a
    root nobody keeps) -> per row the drafters.Accepted of its draft (None for a free row).
    `drafter`, the one every row's drafter was made from, drafts for all of them in one call."""
    live = [row for row in rows if row]
    drafted = iter(drafter.draft([row.drafter for row in live], [row.root for row in live]))
    if len(live) < len(rows):  # a free row's draft: token 0 alone, at depth 0
        zero = torch.zeros(1, dtype=torch.long, device=model.device)
        idle = drafters_lib.Draft(zero, None, None, zero, [0])
    drafts = [next(drafted) if row else idle for row in rows]
    tokens, mask, depth, extra = pad_drafts(drafts)  # (B, N), (B, N, N) | None, (B, N), (K, D)
    if len(rows) == 1:  # one row's length is a number
        positions = cache.length + depth  # (1, N)
    else:  # a batch's come from the host (on a GPU: one copy a step)
        positions = torch.tensor(cache.lengths, device=depth.device)[:, None] + depth  # (B, N)
    sizes = [len(d.tokens) for d in drafts]  # a row's tree smaller than the largest: its padding
    sizes = sizes if min(sizes) < tokens.shape[1] else None  # is left out where it can be
    features = drafters_lib.features_of(drafter)  # EAGLE-3's layers, or () for every other
    if features:  # (B, N, V), (B, N, D) and those layers' inputs (B, N, F*D)
        logits, hidden, fused = model(
            tokens, positions, mask, cache, extra=extra, sizes=sizes, features=features
        )
    else:  # (B, N, V), (B, N, D)
        logits, hidden = model(tokens, positions, mask, cache, extra=extra, sizes=sizes)
    steps = []
    for b, (row, d) in enumerate(zip(rows, drafts)):
        if row is None:
            steps.append(None)
            continue
        n = d.candidates  # the row's tree; nodes after it are computed only, or padding
        nodes, bonus = row.verifier(logits[b, :n].float(), d.tokens[:n], d)  # (n, V) -> (k,)
        ids, path = torch.stack([d.tokens[nodes], nodes]).tolist()  # the root, accepted drafts
        accepted = drafters_lib.Accepted(
            ids=ids,
            hidden=hidden[b : b + 1, nodes],  # (1, n, D)
            positions=positions[b, nodes],  # (n,)
            logits=logits[b, : len(d.tokens)],  # (N_b, V): the row's nodes, computed-only too
            nodes=path,
            bonus=bonus,
            sources=[d.source[i] for i in path[1:]] + [0],
            features=fused[b : b + 1, nodes] if features else None,  # (1, n, F*D)
        )
        steps.append(accepted)
    cache.keep(*[s.nodes if s else [] for s in steps])  # row b: its prompt, then what it kept
    for row, s in zip(rows, steps):
        if row:
            row.drafter.accept(s)
    return steps


# --- one sequence ---------------------------------------------------------------------------------


def check_prompt(model, prompt, max_new_tokens, generator):
    if not prompt or len(prompt) + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(
            f"need a non-empty prompt and prompt + max_new_tokens <= the context of "
            f"{model.cfg.max_seq_len}, got {len(prompt)} + {max_new_tokens}"
        )
    if generator is not None and generator.device.type != torch.device(model.device).type:
        raise ValueError(
            f"the generator is on {generator.device}, the model on {model.device}: sampling needs "
            f"a generator made on the model's device, torch.Generator(device={str(model.device)!r})"
        )


@torch.inference_mode()
def generate(
    model,
    prompt,
    max_new_tokens,
    drafter=None,
    verify="auto",
    temperature=0.0,
    top_p=1.0,
    generator=None,
    eos_ids=(),
    on_tokens=None,
    cache=None,
) -> Result:
    """Up to max_new_tokens after `prompt` (a list of ids), verifying what `drafter` proposes
    (drafters.py; None: plain decoding); on_tokens(new_ids, sources) is called as tokens come, and
    a true value back ends the reply there (stopped "stop": a stop string, a reader gone).
    cache: a one-row KVCache to go on from (Conversation), whose slots [0, cache.length) hold
    prompt[:cache.length], as the drafter's state does; None: a new one."""
    started = time.perf_counter()
    out = Result()
    drafter = drafter if drafter is not None else drafters_lib.Plain(model.device)
    check_prompt(model, prompt, max_new_tokens, generator)
    if cache is None:  # room for the reply, and a last step's tree past it
        cache = model.new_cache(len(prompt) + max_new_tokens + drafter.max_nodes)
    cached = cache.length
    # (1, V), [(1, T, D)]: the hidden states, or the layers' inputs a drafter reads (features_of)
    logits, hidden = prefill(model, cache, [prompt], drafters_lib.features_of(drafter))
    drafter.start(prompt, hidden[0], cache.max_len, cached)
    root = first_token(logits[0], temperature, top_p, generator)
    row = Row(drafter, choose_verifier(verify, temperature, top_p, generator), root)
    out.steps = 1  # the prefill
    done = out.add([root], [0], max_new_tokens, eos_ids)
    if on_tokens and on_tokens([root], [0]) and not done:
        done = True
        out.stopped = "stop"
    while not done:
        (s,) = step(model, cache, drafter, [row])
        before = len(out.tokens)
        done = out.add(s.tokens, s.sources, max_new_tokens, eos_ids)
        out.steps += 1
        # the drafts emitted: fewer than were accepted where EOS or the limit cut the step
        out.accepted.append(min(len(s.ids) - 1, len(out.tokens) - before))
        if on_tokens and on_tokens(out.tokens[before:], out.sources[before:]) and not done:
            done = True
            out.stopped = "stop"
        row.root = s.bonus
    out.seconds = time.perf_counter() - started
    return out


# --- one sequence, by the lesson ----------------------------------------------------------------


def by_the_lesson(drafter):
    """(heads, tree) where generate.py's own generate() decodes for `drafter` (heads on their
    tree, or plain decoding: heads None), else None: another drafter, which needs this twin."""
    if drafter is None or type(drafter) is drafters_lib.Plain:
        return None, None
    if type(drafter) is drafters_lib.HeadsDrafter:
        return drafter.heads, drafter.tree
    return None


def reply(lesson, model, prompt, max_new_tokens, drafter=None, on_tokens=None, **decoding):
    """One prompt's Result, decoded by `lesson` (generate.py's generate()) where it can
    (by_the_lesson; lesson None: never, as under CUDA graphs, whose replay is this twin's), else by
    this twin's generate(); decoding: their verify, temperature, top_p, generator and eos_ids. The
    statistics come from what each step emits: its accepted drafts sit at depths 1, 2, ... of the
    tree (drafted by head 1, 2, ...), then the bonus token."""
    drafted = by_the_lesson(drafter)
    if drafted is None or lesson is None:
        return generate(model, prompt, max_new_tokens, drafter, on_tokens=on_tokens, **decoding)
    started = time.perf_counter()
    check_prompt(model, prompt, max_new_tokens, decoding.get("generator"))
    out = Result()

    def emitted(ids):
        first = not out.tokens
        sources = [0] if first else list(range(1, len(ids))) + [0]
        if not first:
            out.accepted.append(len(ids) - 1)
        out.tokens += ids
        out.sources += sources
        if on_tokens:
            on_tokens(ids, sources)

    heads, tree = drafted
    _, out.steps = lesson(model, prompt, max_new_tokens, heads, tree, on_tokens=emitted, **decoding)
    out.stopped = "eos" if out.tokens[-1] in decoding.get("eos_ids", ()) else "length"
    out.seconds = time.perf_counter() - started
    return out


# --- a conversation that keeps its cache ---------------------------------------------------------
# Each turn the caller renders the whole conversation with the chat template; the cache keeps the
# longest common prefix of those ids with the ids it holds and only the rest is prefilled (a
# prefix cache, as serving engines keep). A template may render an earlier turn differently from
# how it was generated (a leading space, retokenized text): the cut is computed on ids, not assumed.


class Conversation:
    """A KV cache that outlives the reply, the ids it holds, and the drafter that follows it.

    Invariant: cache slots [0, len(self.ids)) hold the keys/values of self.ids, and the drafter's
    state covers at least those ids (step() calls its accept() every step, the last one included).
    After a reply, self.ids = the prompt and every token emitted but the last: the last was never
    forwarded (its logits were not needed), whether it ended at EOS or at the length limit; the
    next turn forwards it if the template renders it. A reply stopped by an exception (Ctrl-C)
    keeps the cut it started from: what it wrote since is not trusted."""

    def __init__(self, model, drafter=None):
        self.model = model
        self.drafter = drafter if drafter is not None else drafters_lib.Plain(model.device)
        # room for the whole context, and a last step's tree past it
        self.cache = model.new_cache(model.cfg.max_seq_len + self.drafter.max_nodes)
        self.ids = []
        self.forwarded = 0  # the positions the last reply's prefill forwarded (tests, statistics)

    def reply(self, prompt, max_new_tokens, **decoding) -> Result:
        """generate() after `prompt` (the whole conversation's ids, ending where the reply begins),
        forwarding only what the cache does not hold; decoding: generate()'s other arguments."""
        # the last prompt token is always forwarded: its logits give the reply's first token
        # (os.path.commonprefix compares any two lists item by item, ids included)
        cached = len(os.path.commonprefix([self.ids, prompt[:-1]]))
        self.ids = self.ids[:cached]
        self.cache.length = cached
        self.forwarded = len(prompt) - cached
        r = generate(self.model, prompt, max_new_tokens, self.drafter, cache=self.cache, **decoding)
        self.ids = prompt + r.tokens[:-1]
        return r
