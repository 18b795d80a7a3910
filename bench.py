"""Honest measurement: every method side by side, on the same prompts, in the same run, on this
machine, and the few numbers that compare them. Read it last: it times the loop the other six
files build.

    Method(name, run)                     a way to decode: run(prompt ids, n, seed) -> a Result
    measure(methods, prompts, ...)        warm up, then interleaved repeats, synchronised, medians
    summary(idx, secs, outs, plain)       tokens/s, seconds, tau and speedup over some prompts
    accepted_by_depth(accepted, depth)    how deep in the tree the accepted drafts reach
    results(methods, prompts, secs, outs) every method's numbers: overall, by category, per prompt

What is timed is what runs: the heads (medusa, hydra, hydra++ and their variants) and plain
decoding go through generate.py's own generate(), the loop `python generate.py --prompt ...` runs;
bench.py hands it to the package's catalogue of methods (specdec/benching/methods.py), which
calls decode.reply with it. The other drafters (prompt lookup, a draft model, the model's first
layers, Jacobi, lookahead, PaSS, heads that learn online), the batches of --batch-size and the
steps CUDA graphs replay run the package's twin of that loop (specdec/engines/decode.py,
engine.py), tested token-identical to it. Beside ours, what a user would run otherwise, on the
same weights and prompts: transformers' generate() (hf; hf-compiled: its static cache and
torch.compile; pld: its prompt lookup; assisted: its draft model), llama.cpp (llama.cpp-f16,
-q8_0, -q4_1, where llama-cpp-python is installed) and vLLM (vllm, vllm-medusa, vllm-eagle3: its
engine, plain and with a draft, in processes of its own python, where one is found). A speedup
over our own plain decoding alone could hide a slow baseline; beside theirs it cannot.

    python bench.py                                   # every available method, eval/prompts.jsonl
    python bench.py --limit 3 --max-new-tokens 32 --repeats 1            # a quick look
    python bench.py --methods plain,hf,hydra++ --json bench.json --plots plots/
    python bench.py --batch-size 4 --methods plain,hydra++ --limit 8   # 4 prompts at a time too
    python bench.py --tune-tree --heads hydra++        # the tree for this machine, saved
    python bench.py --kernels                          # the fast kernels against the readable path

Below the lesson, the command line: its flags and checks, the tuning modes (--tune-tree,
--tune-layers, --tune-skip, --tune-parallel), --kernels, the batch table, the tables, --json and
--plots are specdec/commands/bench.py's. Every table is headed by the machine it was measured on
(hardware, the CPU path kernels.c runs, dtype, threads, prompts, repeats, the step's bandwidth
floor): a number without its machine means nothing.
Test: `python -m pytest -q tests/test_bench_cli.py`.
"""

import specdec.ctrl_c  # noqa: F401 (first: a Ctrl-C while torch imports is one line, exit 130)
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

import generate

# --- a method -------------------------------------------------------------------------------------
# Ours run the loop a user runs; theirs count the base model's forward passes with a hook
# (transformers' generate() does not report its steps) or one llama.cpp eval a token.


@dataclass
class Method:
    """One way to decode a prompt, and what its numbers are checked against."""

    name: str
    run: Callable  # (prompt ids, max new tokens, seed) -> decode.Result: tokens, steps, accepted
    greedy: bool  # its output must equal plain decoding's (an adapted model's: how far it moved)
    depth: int = 0  # the deepest node it drafts, for "accepted by depth" (0: it drafts nothing)
    # what learns as it decodes (online heads) starts every repeat from the same state
    reset: Callable | None = None


# --- measuring ------------------------------------------------------------------------------------
# A GPU runs asynchronously: a clock read before its queue empties times the launch, not the work.
# So the device is synchronised before the clock starts and before it stops. The first calls
# allocate, compile kernels and fill caches: one warm-up run per method, untimed. The machine's
# speed drifts (other jobs, the clock of a hot CPU), so no method runs all its prompts in one spell:
# each repeat runs every prompt, every method on it, in an order rotated prompt by prompt, and a
# slow spell hits all methods alike. The median of the repeats then drops the spells that remain.


LOG_EVERY = 30  # seconds between measure()'s progress lines where no bar is shown


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


class Interrupted(Exception):
    """Ctrl-C during measure(): .done lists the prompts every method has run at least once, with
    their seconds and outputs so far (as measure returns them, for those prompts only): a
    comparison holds only over the prompts that every method ran."""

    def __init__(self, done, seconds, outputs):
        super().__init__("interrupted by Ctrl-C")
        self.done = done
        self.seconds = seconds
        self.outputs = outputs


def measure(methods, prompts, max_new_tokens, repeats, seed, device):
    """{name: Method}, prompts [(id, category, ids)] -> the seconds of each (method, prompt) in
    each interleaved repeat, and each run's Result: ({name: [[seconds]]}, {name: [Result]}), a
    list entry per prompt. Prompt i samples from seed + i, for every method in every repeat.
    Ctrl-C raises Interrupted with what was measured so far."""
    from tqdm import tqdm

    names = list(methods)
    for name in names:  # warm-up: first calls allocate, compile kernels, fill caches
        methods[name].run(prompts[0][2], min(16, max_new_tokens), seed)
    seconds = {m: [[] for _ in prompts] for m in names}
    outputs = {m: [None] * len(prompts) for m in names}
    total = repeats * len(prompts) * len(names)
    bar = tqdm(total=total, desc="bench", unit="run", disable=None)
    said = time.perf_counter()  # a log (stderr not a terminal: no bar) gets a line every 30 s
    try:
        for rep in range(repeats):
            for m in methods.values():  # from the same state again: the warm-up taught it too
                if m.reset:
                    m.reset()
            for i, (_, _, ids) in enumerate(prompts):
                k = (i + rep) % len(names)
                for name in names[k:] + names[:k]:  # the order rotated per prompt
                    sync(device)
                    t0 = time.perf_counter()
                    out = methods[name].run(ids, max_new_tokens, seed + i)
                    sync(device)
                    seconds[name][i].append(time.perf_counter() - t0)
                    outputs[name][i] = out
                    bar.update()
                    if bar.disable and time.perf_counter() - said > LOG_EVERY:
                        said = time.perf_counter()
                        runs = sum(len(s) for m in names for s in seconds[m])
                        print(f"[bench] {runs} of {total} runs", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        specdec.ctrl_c.handled()  # bench goes on: it reports what was measured
        bar.close()
        done = [i for i in range(len(prompts)) if all(seconds[m][i] for m in names)]
        raise Interrupted(
            done,
            {m: [seconds[m][i] for i in done] for m in names},
            {m: [outputs[m][i] for i in done] for m in names},
        ) from None
    bar.close()
    return seconds, outputs


# --- what the numbers mean ------------------------------------------------------------------------
# tokens/s = the new tokens of all the prompts over their seconds (a sum over a sum: a long reply
# weighs as much as its time; a mean of per-prompt rates would let short replies decide).
# tau = new tokens / forward passes of the base model, the prefill included: plain decoding's is 1,
# and a method's tau over its speedup says what its drafting and its larger forwards cost.
# speedup = tokens/s over plain decoding's in this run, on these prompts: never over a number from
# another day or another machine. Each prompt's seconds are the median of its repeats; the spread
# is the tokens/s of the slowest and the fastest repeat: two methods whose spreads overlap are not
# told apart by this run.


def summary(idx, secs, outs, plain):
    """Metrics of one method over the prompts idx (secs[i]: prompt i's seconds in each repeat);
    plain = plain decoding's summary over idx."""
    tokens = sum(len(outs[i].tokens) for i in idx)
    steps = [outs[i].steps for i in idx]
    seconds = sum(statistics.median(secs[i]) for i in idx)
    repeats = min(len(secs[i]) for i in idx)  # Ctrl-C may have cut the last repeat short
    by_repeat = [tokens / max(sum(secs[i][r] for i in idx), 1e-9) for r in range(repeats)]
    row = {
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "spread": [min(by_repeat), max(by_repeat)],
        "new_tokens": tokens,
        "seconds": seconds,
        "tau": tokens / sum(steps),
    }
    row["speedup"] = row["tokens_per_s"] / plain["tokens_per_s"] if plain else 1.0
    return row


def accepted_by_depth(accepted, depth):
    """accepted: the drafts each speculative step kept -> for d = 1..depth, the fraction of steps
    whose kept path reached depth d. The d-th draft of a path is head d's guess (or the d-th of a
    chain), so the row shows where guessing stops paying: it falls with d, and tau - 1 is about its
    sum (the bonus token and a cut last step aside)."""
    steps = max(len(accepted), 1)
    return [sum(a >= d for a in accepted) / steps for d in range(1, depth + 1)]


def results(methods, prompts, secs, outs):
    """The JSON "methods" object: overall and per-category metrics of every method, whether a
    greedy method's replies are plain decoding's (the contract: token-identical), per prompt."""
    cats = list(dict.fromkeys(cat for _, cat, _ in prompts))
    every = range(len(prompts))
    by_cat = {c: [i for i, p in enumerate(prompts) if p[1] == c] for c in cats}
    plain = summary(every, secs["plain"], outs["plain"], None)
    plain_cat = {c: summary(idx, secs["plain"], outs["plain"], None) for c, idx in by_cat.items()}
    res = {}
    for name, m in methods.items():
        row = summary(every, secs[name], outs[name], plain)
        accepted = [a for out in outs[name] for a in out.accepted]
        row["accept_by_depth"] = accepted_by_depth(accepted, m.depth) if m.depth else None
        differ = [prompts[i][0] for i in every if outs[name][i].tokens != outs["plain"][i].tokens]
        row["identical"] = not differ if m.greedy else None
        row["differs_on"] = differ if m.greedy else None
        row["by_category"] = {
            c: {
                k: v
                for k, v in summary(idx, secs[name], outs[name], plain_cat[c]).items()
                if k in ("tokens_per_s", "speedup", "tau")
            }
            for c, idx in by_cat.items()
        }
        row["per_prompt"] = [
            {
                "id": prompts[i][0],
                "new_tokens": len(outs[name][i].tokens),
                "seconds": round(statistics.median(secs[name][i]), 4),
                "steps": outs[name][i].steps,
            }
            for i in every
        ]
        res[name] = row
    return res


# --- command line ---------------------------------------------------------------------------------
# `python bench.py --help` lists the flags. The package never imports an entry script, so this
# file passes itself in (its Method, measure() and results(), which main runs) and generate.py's
# generate() (the loop the heads and plain decoding run): a print in either shows in the run.


def cli_main(argv=None) -> int:
    """Bad input: one line on stderr naming it and the fix, exit code 2. Ctrl-C: the tables of what
    was measured so far, exit code 130; before any result, nothing to report."""
    from specdec.commands import bench as command

    return command.cli_main(argv, lesson=sys.modules[__name__], loop=generate.generate)


if __name__ == "__main__":
    specdec.ctrl_c.exit_now(cli_main())  # no Python shutdown, where a Ctrl-C would end it mute
