"""Many prompts at once: decode.py's prefill and step over the rows of one KV cache, a queue of
prompts taking the rows of those that end (continuous batching). Beside the lesson, never in it.

    results = engine.generate_batch(model, prompts, max_new_tokens, drafter, batch_size=8)

Up to batch_size prompts decode side by side, one cache row each (the cache keeps a length per
row); the others wait. Every step each row drafts its own tree (its own drafter.row()), one forward
scores all of them, each row verifies (and samples its drafts) on its own generator, so its draws
do not depend on its batch mates, and keeps its own path. A row that ends frees its cache row:
waiting prompts take free rows a few at a time (a prefill reads every weight once: grouped, it
reads them once for several), and once nothing waits ended rows leave the cache a quarter at a
time (each compaction copies it).

Contract (tests/test_batch.py): row i of a batch is generate(prompt i) alone, token for token
(greedy, fp32 and bf16 through kernels.c; sampled, with its own generator). Shapes: B rows, V
vocabulary, D hidden.
"""

import time
from dataclasses import dataclass

import torch

from specdec.engines import decode
from specdec import drafters as drafters_lib


@dataclass
class Waiting:
    """A prompt in the queue, or decoding: its place among the prompts and its reply so far."""

    index: int
    prompt: list
    limit: int  # its max_new_tokens
    generator: object
    out: decode.Result
    started: float = 0.0  # when its prefill began


def check_batch(model, prompts, max_new_tokens, generators):
    assert len(max_new_tokens) == len(generators) == len(prompts), "a limit, a generator a prompt"
    for prompt, n, generator in zip(prompts, max_new_tokens, generators):
        decode.check_prompt(model, prompt, n, generator)


@torch.inference_mode()
def generate_batch(
    model,
    prompts,
    max_new_tokens,
    drafter=None,
    verify="auto",
    temperature=0.0,
    top_p=1.0,
    generators=None,
    eos_ids=(),
    on_tokens=None,
    on_done=None,
    batch_size=None,
) -> list:
    """Decode the prompts (lists of ids), up to max_new_tokens[i] new tokens each: a decode.Result
    per prompt, in their order. generators[i]: prompt i's sampling generator (None: the default).
    on_tokens(i, new_ids, sources) is called as prompt i's tokens are produced, on_done(i, result)
    when its reply is whole. batch_size: rows decoding at once (None: every prompt)."""
    dev, B = model.device, len(prompts)
    drafter = drafter if drafter is not None else drafters_lib.Plain(dev)
    generators = generators if generators is not None else [None] * B
    check_batch(model, prompts, max_new_tokens, generators)
    eos_ids = set(eos_ids)
    queue = [
        Waiting(i, p, n, g, decode.Result())
        for i, (p, n, g) in enumerate(zip(prompts, max_new_tokens, generators))
    ][::-1]  # pop() takes the next in order
    results = [w.out for w in queue[::-1]]
    size = min(batch_size or B, B)
    max_len = max(len(p) + n for p, n in zip(prompts, max_new_tokens)) + drafter.max_nodes
    cache = model.new_cache(max_len, batch=size)
    rows = [None] * size  # the decode.Row in each cache row; None: free
    jobs = [None] * size  # the Waiting each row decodes

    def add(slot, new, sources):  # a row's new tokens, streamed; True when its reply is whole
        job = jobs[slot]
        before = len(job.out.tokens)
        done = job.out.add(new, sources, job.limit, eos_ids)
        if on_tokens:
            on_tokens(job.index, job.out.tokens[before:], job.out.sources[before:])
        return done

    def finish(slot):  # the row's Result is final: its cache row is free
        job = jobs[slot]
        job.out.seconds = time.perf_counter() - job.started
        rows[slot] = None  # a waiting prompt takes it; until then its entries (drafts kept past
        cache.lengths[slot] = 0  # its limit too) must not move where every row's forward writes
        if on_done:
            on_done(job.index, job.out)

    def refill(free):
        """The next waiting prompts take the free cache rows: prefilled in one forward into a cache
        of their own that then takes those rows (a new cache's first prompts go straight in)."""
        started = time.perf_counter()  # a prompt's time in the queue is not its own
        picked = [queue.pop() for _ in free]
        whole = len(free) == len(rows) and cache.length == 0
        into = cache if whole else model.new_cache(max(len(w.prompt) for w in picked), len(picked))
        reads = drafters_lib.features_of(drafter)  # the layers an EAGLE-3 drafter reads, or ()
        logits, hidden = decode.prefill(model, into, [w.prompt for w in picked], reads)  # (r, V)
        if into is not cache:
            cache.put(free, into)
        for j, (slot, job) in enumerate(zip(free, picked)):
            job.started = started
            own = drafter if size == 1 else drafter.row(job.generator)
            own.start(job.prompt, hidden[j], cache.max_len)
            verifier = decode.choose_verifier(verify, temperature, top_p, job.generator)
            root = decode.first_token(logits[j], temperature, top_p, job.generator)
            rows[slot], jobs[slot] = decode.Row(own, verifier, root), job
            job.out.steps = 1
            if add(slot, [root], [0]):
                finish(slot)

    while queue or any(rows):
        free = [s for s, row in enumerate(rows) if row is None]
        # refills are grouped: a few at a time, or the last ones
        if queue and len(free) >= min(len(queue), max(1, len(rows) // 8)):
            refill(free[: len(queue)])
            continue
        if not queue and len(free) >= max(1, len(rows) // 4):  # ended rows leave the cache
            alive = [s for s, row in enumerate(rows) if row is not None]
            cache.select_rows(alive)
            rows, jobs = [rows[s] for s in alive], [jobs[s] for s in alive]
        for slot, s in enumerate(decode.step(model, cache, drafter, rows)):
            if s is None:
                continue
            job = jobs[slot]
            job.out.steps += 1
            before = len(job.out.tokens)
            rows[slot].root = s.bonus
            done = add(slot, s.tokens, s.sources)
            # the drafts emitted: fewer than were accepted where EOS or the limit cut the step
            job.out.accepted.append(min(len(s.ids) - 1, len(job.out.tokens) - before))
            if done:
                finish(slot)
    return results
