"""Jacobi's and lookahead's settings for this machine: `python bench.py --tune-parallel`.

A parallel drafter's settings trade acceptance against the nodes each step computes: Jacobi's m
guesses, lookahead's window of W x (N-1) trajectories and its G n-grams of N-1 tokens all ride in
every forward. On a CPU each node costs a share of the step; on a GPU a node costs little until the
step fills the device. So the best setting belongs to the machine, as the best tree does
(bench.py --tune-tree), and is measured on it:

    expected tokens/s of a setting = new tokens / the sum of the step times of its forwards
    new tokens and forwards: greedy decoding of the prompts with that setting (generate.generate),
        recording each forward's node count; the prefill counts as a one-node step, for every
        setting and for plain decoding alike
    step time of n nodes: one forward of n tokens after a cached prefix, timed here (median)

The search: from generate.py's defaults (cli.DRAFT_DEFAULTS), coordinate ascent on a grid: move one
setting one grid step up or down, to the neighbour with the highest expected tokens/s, while that
beats where it stands. The choice is saved as parallel-DEVICE-DTYPE.json in --heads-dir (next to the
heads and layers.json), which generate.py --draft jacobi | lookahead and bench.py's jacobi and
lookahead methods read for this model (cli.tuned_parallel).

    tune_parallel(args, model, prompts, eos, machine)     the search, its table, the saved choice
    tuned_drafter(kind, folder, model)                    bench.py's jacobi and lookahead methods
    Counted(drafter)                                      a drafter that records its drafts' sizes

Test: `python -m pytest -q tests/test_bench_cli.py -k parallel`.
"""
import json
import statistics
import sys
import time

import torch

import cli
import generate
import tree as tree_lib

# the values each setting may take; a GPU's best window may be past these: widen them there
GRIDS = {"jacobi": {"gamma": (1, 2, 3, 4, 6, 8, 12, 16)},
         "lookahead": {"window": (1, 2, 3, 4, 6, 8, 12, 16), "ngram": (2, 3, 4, 5, 6), "guesses": (1, 2, 3, 4, 6, 8, 12, 16)}}


class Counted:
    """`drafter`, recording the number of nodes (the forward's size) of every draft it makes."""

    def __init__(self, drafter):
        self.drafter, self.sizes = drafter, []
        self.name, self.legend, self.max_nodes, self.max_depth = drafter.name, drafter.legend, drafter.max_nodes, drafter.max_depth

    def start(self, prompt, hidden, max_len):
        self.drafter.start(prompt, hidden, max_len)

    def draft(self, root):
        d = self.drafter.draft(root)
        self.sizes.append(len(d.tokens))
        return d

    def accept(self, tokens, hidden, positions, logits):
        self.drafter.accept(tokens, hidden, positions, logits)


def make(kind, setting, model):
    """A drafter of `kind` (jacobi, lookahead) at `setting`, for greedy decoding."""
    return cli.make_drafter(kind, None, setting, model, None, None, None, 0.0, 1.0, None)


def tuned_drafter(kind, folder, model):
    """bench.py's jacobi or lookahead method: at the setting --tune-parallel saved in `folder` for
    this model and machine, else at generate.py's defaults; and a note that says which."""
    tuned = cli.tuned_parallel(folder, model, kind)
    d = make(kind, cli.DRAFT_DEFAULTS[kind] | tuned, model)
    return d, d.name + (" (tuned for this machine)" if tuned else " (untuned: run bench.py --tune-parallel)")


def ascend(start: dict, grid: dict, score) -> dict:
    """Coordinate ascent: from `start`, step to the neighbour (one setting one grid value up or
    down) with the highest score while it beats the current setting; score(setting) is memoised."""
    here = dict(start)
    while True:
        near = [here | {k: values[j]} for k, values in grid.items()
                for j in (values.index(here[k]) - 1, values.index(here[k]) + 1) if 0 <= j < len(values)]
        best = max(near, key=score)
        if score(best) <= score(here):
            return here
        here = best


def label(setting: dict) -> str:
    return " ".join(f"{k} {v}" for k, v in setting.items())


@torch.inference_mode()
def tune_parallel(args, model, prompts, eos, machine):
    """Search each kind's setting on this machine, print the table, save the choice; `machine` is
    bench.machine()'s description of it (hardware, dtype, threads, step over the bandwidth floor)."""
    dev = model.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    prefix = [t for _, _, ids in prompts for t in ids][:args.prefix_len]
    cache = model.new_cache(len(prefix) + tree_lib.MAX_NODES)
    model(torch.tensor([prefix], device=dev), torch.arange(len(prefix), device=dev), None, cache, last_only=True)
    cache.keep(range(len(prefix)))
    times = {}

    def step_ms(n):  # median ms of one forward of n nodes (causal among them) after the cached prefix
        if n not in times:
            ids = torch.full((1, n), prefix[-1], device=dev)                                       # (1, n)
            at = len(prefix) + torch.arange(n, device=dev)                                         # (n,)
            mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril() if n > 1 else None        # (n, n)
            samples = []
            for _ in range(args.tune_repeats + 1):  # the first is a warm-up
                sync()
                t0 = time.perf_counter()
                model(ids, at, mask, cache)
                sync()
                samples.append(time.perf_counter() - t0)
            times[n] = statistics.median(samples[1:]) * 1e3
        return times[n]

    rows = {}

    def score(kind, setting):  # expected tokens/s of decoding the prompts with `setting`
        key = (kind, label(setting))
        if key not in rows:
            d = Counted(make(kind, setting, model))
            tokens = steps = 0
            for _, _, ids in prompts:
                r = generate.generate(model, ids, args.max_new_tokens, d, eos_ids=eos)
                tokens, steps = tokens + len(r.tokens), steps + r.steps
            ms = (steps - len(d.sizes)) * step_ms(1) + sum(step_ms(n) for n in d.sizes)
            rows[key] = {"kind": kind, **setting, "tau": tokens / steps, "mean_nodes": (steps - len(d.sizes) + sum(d.sizes)) / steps,
                         "step_ms": ms / steps, "tokens_per_s": tokens / ms * 1e3}
            print(f"[tune] {kind} {label(setting)}: tau {rows[key]['tau']:.2f}, {rows[key]['mean_nodes']:.1f} nodes a step, "
                  f"expected {rows[key]['tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True)
        return rows[key]["tokens_per_s"]

    chosen = {kind: ascend(cli.DRAFT_DEFAULTS[kind], grid, lambda s, kind=kind: score(kind, s)) for kind, grid in GRIDS.items()}
    plain = 1e3 / step_ms(1)
    mach = machine | {"prefix_tokens": len(prefix), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "repeats": args.tune_repeats}
    print(cli_line(mach) + f"\n\nplain decoding: {step_ms(1):.1f} ms a step, {plain:.1f} tokens/s\n\n"
          "| method | setting | tau | nodes a step | step ms | expected tokens/s | over plain |\n|---|---|---:|---:|---:|---:|---:|")
    for (kind, name), r in rows.items():
        mark = " **<- chosen**" if name == label(chosen[kind]) else ""
        print(f"| {kind} | {name} | {r['tau']:.2f} | {r['mean_nodes']:.1f} | {r['step_ms']:.1f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / plain:.2f}x{mark} |")
    out = cli.tuned_tree_file(args.heads_dir, dev, model.dtype, "parallel")
    expected = {kind: rows[kind, label(s)]["tokens_per_s"] / plain for kind, s in chosen.items()}
    with open(out, "w") as f:
        json.dump({"model": model.cfg.name, **chosen, "expected_speedup": expected, "machine": mach}, f, indent=1)
    print("\nchosen: " + "; ".join(f"{kind} {label(s)} ({expected[kind]:.2f}x plain decoding)" for kind, s in chosen.items())
          + f"; saved {out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": mach, "plain_tokens_per_s": plain, "rows": list(rows.values()), "chosen": chosen}, f, indent=1)


def cli_line(m):  # as bench.machine_line prints the machine
    return "_" + ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in m.items()) + "_"
