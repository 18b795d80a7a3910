"""This machine: what a step costs here, and the settings that pay here. bench.py's modes call it.

    machine(device, dtype), distance_to_floor(model, device), timed(fn, device)   measuring
    kernel_table(model, device)            --kernels: each fast kernel against its readable twin
    sparse(acc, budget), expected_tau(acc, paths)          trees grown to measured acceptance
    tune_tree(args, model, prompts, device)                --tune-tree: the heads' tree
    tune_layers(args, model, prompts, device, eos)         --tune-layers: layers:N's N and gamma
    tune_skip(args, model, prompts, device, eos)           --tune-skip: the layers skip leaves out
    tune_parallel(args, model, prompts, eos, machine)      --tune-parallel: Jacobi's, lookahead's,
                                                           PaSS's

A parallel drafter's settings trade acceptance against the nodes each step computes: Jacobi's m
guesses, lookahead's window of W x (N-1) trajectories and its G n-grams of N-1 tokens, PaSS's tree
of G + K - 1 guesses and the K [LA] tokens after each of its nodes all ride in every forward. On a
CPU each node costs a share of the step; on a GPU a node costs little until the step fills the
device. So the best setting belongs to the machine, as the best tree does (bench.py --tune-tree),
and is measured on it:

    expected tokens/s of a setting = new tokens / the sum of the step times of its forwards
    new tokens and forwards: greedy decoding of the prompts with that setting (decode.generate),
        recording each forward's node count; the prefill counts as a one-node step, for every
        setting and for plain decoding alike
    step time of n nodes: one forward of n tokens after a cached prefix, timed here (median)

The search: from generate.py's defaults (catalog.DRAFT_DEFAULTS), coordinate ascent on a grid: move
one
setting one grid step up or down, to the neighbour with the highest expected tokens/s, while that
beats where it stands. The choice is saved as parallel-DEVICE-DTYPE.json in --heads-dir (next to
the heads and layers-DEVICE-DTYPE.json), which generate.py --draft jacobi | lookahead | pass and
bench.py's methods of those names read for this model (catalog.tuned_parallel). PaSS is tuned when
--heads-dir holds [LA] tokens (pass/, pass_tokens.py's), its K up to as many as were trained.

    tuned_drafter(kind, folder, model)                    bench.py's jacobi, lookahead and pass
                                                          methods
    Counted(drafter)                                      a drafter that records its drafts' sizes

Test: `python -m pytest -q tests/test_bench_cli.py -k parallel`.
"""

import dataclasses
import heapq
import itertools
import copy
import json
import math
import os
import statistics
import sys
import time

import torch

from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import cli
from specdec import drafters
from specdec.engines import decode
from specdec.engines import engine
import heads as heads_lib
from specdec.fast import kernels as kernels_lib
import model as model_lib
import tree as tree_lib

# --- the machine ----------------------------------------------------------------------------------
# Printed next to every table and saved in the JSON: numbers mean nothing without it.


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def hardware(device):
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            name = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        name = "unknown CPU"
    return f"{name} ({os.cpu_count()} cores)"


def machine(device, dtype, **extra):
    """What a number was measured on; on a CPU the device names the kernels.c path it runs
    (cpu-avx512-bf16, cpu-avx512f, cpu-avx2, cpu-neon; cpu-generic where none does), as tuned
    files do."""
    return {
        "hardware": hardware(device),
        "device": catalog.cpu_path(device) if torch.device(device).type == "cpu" else str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        **extra,
    }


def decoding_machine(args, model, device, prompts, **extra):
    """machine() for a tuner that decodes the prompts: `extra`, then what it decoded (prompts, new
    tokens a reply, repeats) and how far the device is from its floor."""
    return machine(
        device,
        model.dtype,
        **extra,
        prompts=len(prompts),
        max_new_tokens=args.max_new_tokens,
        repeats=args.tune_repeats,
        **distance_to_floor(model, device),
    )


def memory_bandwidth(device, mbytes=512):
    """GB/s reading a buffer much larger than any cache (the median of 7 sums, after one to touch
    every page): what a decode step, which reads every weight once, can at most stream."""
    x = torch.rand(mbytes * 2**20 // 4, device=device)
    x.sum()
    return x.numel() * 4 / statistics.median(timed(lambda: x.sum(), device) for _ in range(7)) / 1e9


@torch.inference_mode()
def step_time(model, device, tokens=1, prefix=200, repeats=20):
    """Median seconds of one forward of `tokens` new tokens (causal) after a cached prefix."""
    cache = model.new_cache(prefix + tokens)
    model(
        torch.zeros(1, prefix, dtype=torch.long, device=device),
        torch.arange(prefix, device=device),
        None,
        cache,
    )
    cache.keep(range(prefix))
    ids, pos = (
        torch.zeros(1, tokens, dtype=torch.long, device=device),
        torch.arange(prefix, prefix + tokens, device=device),
    )
    return statistics.median(
        timed(lambda: model(ids, pos, None, cache), device) for _ in range(repeats)
    )


def distance_to_floor(model, device):
    """How far the batch-1 decode step is from its memory-bandwidth floor: every weight is read
    once a step (the embedding table only a row of, unless the LM head shares it), a quantized
    model's matrices at their quantized size."""
    per_weight = {"fp16": 2, "int8": 1, "int4": 0.5}.get(kernels_lib.in_use(model).quant)
    weights = sum(
        p.numel() * (per_weight if per_weight and p.dim() == 2 else p.element_size())
        for p in model.parameters()
    )
    if not model.cfg.tie_embeddings:
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    bandwidth, step = memory_bandwidth(device), step_time(model, device)
    floor = weights / (bandwidth * 1e9)
    return {
        "batch_1_step_ms": round(step * 1e3, 1),
        "weights_read_MB": round(weights / 1e6),
        "memory_GB_per_s": round(bandwidth, 1),
        "bandwidth_floor_ms": round(floor * 1e3, 1),
        "step_over_floor": f"{step / floor:.1f}x",
    }


def machine_line(m):
    return "_" + ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in m.items()) + "_"


def write_json(path, data):
    """`data` as JSON in `path`, indented: the tuned files and the --json reports are read by people
    too."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def plotting(quiet=False):
    """matplotlib.pyplot with a file-only backend, or None where it is missing (requirements.txt
    lists it; an environment made by hand may lack it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        if not quiet:
            print(
                "[plots] skipped: matplotlib is not installed (pip install matplotlib)",
                file=sys.stderr,
            )
        return None


# --- sparse trees --------------------------------------------------------------------------------
# Medusa's greedy search. acc[k][r] = P(rank r of head k+1 holds the base model's token), measured
# on calibration data (train.py writes it to eval.json). Assuming heads err independently, a node
# is accepted with the product of acc along its path, and the expected tokens per step is
# 1 (the base model's bonus token) + the sum of those products over all nodes. Growing the tree one
# node
# at a time, always taking the likeliest node that can hang on it, maximises that sum for every
# budget when each acc[k] falls with the rank (then a child or a later sibling is never likelier).


def _check_acc(acc) -> None:
    if not (
        isinstance(acc, (list, tuple))
        and acc
        and all(isinstance(a, (list, tuple)) and a for a in acc)
        and all(isinstance(x, (int, float)) and 0 <= x <= 1 for a in acc for x in a)
    ):
        raise ValueError(
            f"acc must be a non-empty list (one per head) of non-empty lists of "
            f"probabilities in [0, 1], got {acc!r}"
        )


def path_prob(acc, path) -> float:
    """Acceptance probability of a node under independence: the product of acc along its path."""
    return math.prod(acc[d][r] for d, r in enumerate(path))


def expected_tau(acc, paths) -> float:
    """Estimated tokens per step of a tree: 1 (the bonus token) + the sum of its nodes'
    path_prob."""
    _check_acc(acc)
    return 1.0 + sum(path_prob(acc, p) for p in tree_lib.build(paths).paths)


def sparse(acc, budget: int) -> list:
    """The greedy tree of `budget` non-root nodes. Candidates are the first child (rank 0, one depth
    further, up to len(acc) heads) and the next sibling (next rank, up to len(acc[d])) of every
    node taken so far, starting from the root's first child (0,). Ties go to the smaller path."""
    _check_acc(acc)
    room = sum(itertools.accumulate((len(a) for a in acc), lambda x, y: x * y))
    if not isinstance(budget, int) or not 0 <= budget <= min(room, tree_lib.MAX_NODES - 1):
        raise ValueError(
            f"budget must be an int in [0, {min(room, tree_lib.MAX_NODES - 1)}] for these "
            f"{cli.plural(len(acc), 'head')} "
            f"and {[len(a) for a in acc]} ranks, got {budget!r}"
        )
    taken, frontier = [], [(-acc[0][0], (0,))]  # a heap of (-path_prob, path)
    while len(taken) < budget:
        p = heapq.heappop(frontier)[1]
        taken.append(p)
        d, r = len(p) - 1, p[-1]  # the node's head (0-based) and rank
        sibling = [p[:-1] + (r + 1,)] if r + 1 < len(acc[d]) else []
        child = [p + (0,)] if d + 1 < len(acc) else []
        for q in sibling + child:
            heapq.heappush(frontier, (-path_prob(acc, q), q))
    return tree_lib.build(taken).paths


# --- tree tuning ----------------------------------------------------------------------------------
# Expected tokens/s of a tree = expected tau / (verify step + draft), both measured here.


def prefilled(model, prefix, room, layers=None):
    """A cache that holds `prefix` (token ids) forwarded through `layers` (None: all), with room
    for `room` more tokens: what a step after a realistic context is timed on."""
    dev = model.device
    cache = model.new_cache(len(prefix) + room, num_layers=None if layers is None else len(layers))
    positions = torch.arange(len(prefix), device=dev)
    model(torch.tensor([prefix], device=dev), positions, None, cache, last_only=True, layers=layers)
    cache.keep(range(len(prefix)))
    return cache


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


@torch.inference_mode()
def kernel_table(model, device):
    """--kernels: each fast twin of kernels.py at this model's shapes, the readable path against the
    kernels chosen for this device and dtype (ms, median of 50 calls); then one whole step of each.
    results/kernels-cpu.md holds this table."""
    c, fast, readable = model.cfg, kernels_lib.in_use(model), kernels_lib.Kernels()
    fast_attend = model.layers[0].self_attn.attend  # the attention the chosen kernels run
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=model.dtype)
    ms = lambda fn: statistics.median(timed(fn, device) for _ in range(50)) * 1e3
    rows = []
    for what, B, T, S in (
        ("attention, 1 query (decode)", 1, 1, 201),
        ("attention, 16 queries (tree)", 1, 16, 216),
        ("attention, batch 64 x 1 query, key mask", 64, 1, 201),
        ("attention, 200 queries (prefill)", 1, 200, 200),
    ):
        q, k, v = (
            rand(B, c.n_heads, T, c.head_dim),
            rand(B, c.n_kv_heads, S, c.head_dim),
            rand(B, c.n_kv_heads, S, c.head_dim),
        )
        mask = (
            None
            if B == T == 1
            else torch.ones(B, 1, T, S, dtype=torch.bool, device=device).tril(S - T)
        )
        rows.append(
            (
                what,
                ms(lambda: model_lib.attend(q, k, v, mask)),
                ms(lambda: fast_attend(q, k, v, mask)),
            )
        )
    # one row through every layer's down projection in turn, as a decode step reads them: from
    # memory, not from a cache that one weight timed alone would sit in
    w, n = model.layers[0].mlp.down_proj.weight, len(model.layers)
    weights = f"the {n} layers' weights" if n > 1 else "the layer's weights"
    gate_up = [
        (torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]), layer.mlp)
        for layer in model.layers
    ]
    # a step's rows, a tree's, a large tree's: the fused gate and up products
    for rows_ in (1, 5, 16, 64):
        x = rand(rows_, c.dim)
        rows.append(
            (
                f"linear {c.dim} -> {2 * c.hidden_dim} (gate and up), "
                f"{cli.plural(rows_, 'row')}, {weights} in turn",
                ms(lambda: [torch.nn.functional.linear(x, weight) for weight, _ in gate_up]),
                ms(
                    lambda: [
                        kernels_lib.linear(x, mlp.packed)
                        if hasattr(mlp, "packed")
                        else torch.nn.functional.linear(x, weight)
                        for weight, mlp in gate_up
                    ]
                ),
            )
        )
    for what, layers in (
        (
            f"linear {w.shape[1]} -> {w.shape[0]}, 1 row, {weights} in turn",
            [layer.mlp.down_proj for layer in model.layers],
        ),
        (f"LM head {c.dim} -> {c.vocab_size}, 1 row", [model.lm_head]),
    ):
        x = rand(1, layers[0].in_features)
        pairs = [
            (m.weight, getattr(m, "packed", None)) for m in layers
        ]  # packed: kernels.PackedLinear's copy
        rows.append(
            (
                what,
                ms(lambda: [torch.nn.functional.linear(x, weight) for weight, _ in pairs]),
                ms(
                    lambda: [
                        torch.nn.functional.linear(x, weight)
                        if packed is None
                        else kernels_lib.linear(x, packed)
                        for weight, packed in pairs
                    ]
                ),
            )
        )
    steps = {}
    for name, kernels in (
        ("readable", readable),
        ("fast", fast),
        ("no glue", dataclasses.replace(fast, glue=False)),
        ("no C", dataclasses.replace(fast, native=False)),
    ):
        kernels_lib.use(model, kernels)
        steps[name] = step_time(model, device) * 1e3, step_time(model, device, tokens=16) * 1e3
    kernels_lib.use(model, fast)
    rows.append(
        ("whole decode step, batch 1, 200 cached tokens", steps["readable"][0], steps["fast"][0])
    )
    rows.append(
        (
            "whole step of 16 tokens (a tree's size), 200 cached",
            steps["readable"][1],
            steps["fast"][1],
        )
    )
    if fast.glue:  # the glue twins alone: the fast path without them (left) against with them
        rows.append(
            (
                "whole decode step, fast path without Kernels.glue (left), with it",
                steps["no glue"][0],
                steps["fast"][0],
            )
        )
    # kernels.c alone: oneDNN's products and PyTorch's layers (left) against kernels.c's
    if fast.native:
        rows.append(
            (
                "whole decode step, fast path without kernels.c (left), with it",
                steps["no C"][0],
                steps["fast"][0],
            )
        )
        rows.append(
            (
                "whole step of 16 tokens, without kernels.c (left), with it",
                steps["no C"][1],
                steps["fast"][1],
            )
        )
    kernels = (
        f"{fast.attention}, packed linears: {fast.packed}, glue: {fast.glue}, kernels.c: "
        f"{fast.native}"
    )
    print(
        machine_line(
            machine(device, model.dtype, kernels=kernels, **distance_to_floor(model, device))
        )
    )
    print("\n| op | readable path ms | fast path ms | speedup |\n|---|---:|---:|---:|")
    for what, a, b in rows:
        print(f"| {what} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
    return 0


# Tree sizes expected within 1% of the fastest count as a tie, and the smallest of them is kept: the
# held-out calibration overrates deep, low-ranked nodes on new prompts more than shallow ones, and
# a node costs a little beyond the step timed here (the heads' accept, the tree's bookkeeping).
# The measurements behind it: results/README.md, "The tree tuner's tie rule".
TREE_TIE = 0.01


def smallest_within(rows, tie, key="tokens_per_s"):
    """The first row (the smallest tree) whose expected tokens/s (`key`) is within `tie` of the
    best."""
    top = max(r[key] for r in rows)
    return next(r for r in rows if r[key] >= (1 - tie) * top)


def save_tree(paths, file, expected_speedup):
    """The chosen tree as tree.save writes it (one path a line; tree.load reads it and ignores the
    rest), and "expected_speedup": its expected tokens/s over plain decoding's on this device and
    dtype, a number rounded to 3 decimals; below 1 plain decoding is expected to be faster, which a
    loader can say. Files tuned before it was recorded lack it."""
    rows = ",\n  ".join(json.dumps(list(p)) for p in tree_lib.build(paths).paths)
    with open(file, "w") as f:
        f.write(
            '{"paths": [\n  '
            + rows
            + '\n],\n "expected_speedup": '
            + json.dumps(round(expected_speedup, 3))
            + "}\n"
        )


PROGRESS_EVERY = 10  # seconds between the tuners' progress lines


@torch.inference_mode()
def time_trees(trees, repeats, device, rows):
    """Time each tree's step and draft (its "step" and "draft" functions; no draft: the root
    alone), interleaved so that a burst of machine noise hits every size alike; the medians in ms
    and the expected tokens/s of `rows` rows drafting it, into each tree's dict. A line on stderr
    every 10 seconds says how far it is (a terminal or not: a log shows it too)."""
    for t in trees:
        t["step_s"], t["draft_s"] = [], []
    said = time.perf_counter()
    for r in range(repeats):
        if time.perf_counter() - said > PROGRESS_EVERY:
            said = time.perf_counter()
            print(
                f"[tune] timing {cli.plural(len(trees), 'tree')} at {cli.plural(rows, 'row')}: "
                f"repeat {r + 1} of {repeats}",
                file=sys.stderr,
                flush=True,
            )
        for t in trees:
            t["step_s"].append(timed(t["step"], device))
            t["draft_s"].append(timed(t["draft"], device) if t["draft"] else 0.0)
    for t in trees:
        t["step_ms"] = statistics.median(t["step_s"]) * 1e3
        t["draft_ms"] = statistics.median(t["draft_s"]) * 1e3
        t["tokens_per_s"] = rows * t["expected_tau"] / max(t["step_ms"] + t["draft_ms"], 1e-9) * 1e3


def tune_tree(args, model, prompts, device, eos=()):
    folder = (
        catalog.heads_folder(args.heads_dir, args.heads)
        if args.heads in heads_lib.KINDS
        else args.heads
    )
    if folder is None:
        raise cli.UsageError(
            f"--heads {args.heads}: no {args.heads} heads in --heads-dir {args.heads_dir}; give a "
            "heads folder"
        )
    heads, _ = catalog.load_heads(folder, model)
    try:
        with open(os.path.join(folder, "eval.json")) as f:
            acc = json.load(f)["rank_acceptance"][: heads.cfg.num_heads]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise cli.UsageError(
            f'{folder}/eval.json with "rank_acceptance" is needed (train.py writes it): {e}'
        )
    # a realistic cached prefix: eval prompts, encoded one after another
    prefix = [t for _, _, ids in prompts for t in ids][: args.prefix_len]
    n_max = args.max_budget + 1
    cache, head_cache = model.new_cache(len(prefix) + n_max), heads.new_cache(len(prefix) + n_max)
    positions = torch.arange(len(prefix), device=device)
    logits, hidden = model(
        torch.tensor([prefix], device=device), positions, None, cache, last_only=True
    )
    cache.keep(range(len(prefix)))
    h = heads.context(hidden, positions, head_cache)[:, -1]  # (1, D)
    roots = logits[0, -1:].argmax(-1)  # (1,) the root: the next token
    rows = []
    for budget in range(0, args.max_budget + 1):  # budget 0 = plain decoding, for reference
        paths = sparse(acc, budget)
        t = tree_lib.build(paths)
        plan = drafters.draft_plan(t.to(device))
        fill = drafters.fill_trees
        draft = lambda t=t, plan=plan: fill(heads, h, roots, plan, t.num_nodes)[0]  # (N,)
        tokens = draft() if budget else roots  # (N,)
        mask, pos = (t.mask.to(device) if budget else None), cache.length + t.depth.to(device)
        step = lambda tokens=tokens, pos=pos, mask=mask: model(tokens[None], pos, mask, cache)
        step(), step(), draft()  # warm-up
        rows.append(
            {
                "budget": budget,
                "depth": t.max_depth,
                "expected_tau": expected_tau(acc, paths),
                "paths": paths,
                "step": step,
                "draft": draft if budget else None,
            }
        )
    time_trees(rows, args.tune_repeats, device, rows=1)
    best = smallest_within(rows[1:], TREE_TIE)
    mach = machine(
        device,
        model.dtype,
        heads=folder,
        prefix_tokens=len(prefix),
        repeats=args.tune_repeats,
        **distance_to_floor(model, device),
    )
    print(
        machine_line(mach)
        + "\n\n| budget | depth | expected tau | step ms | draft ms | expected tokens/s "
        "|\n|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        mark = " **<- chosen**" if r is best else " (plain)" if r["budget"] == 0 else ""
        print(
            f"| {r['budget']} | {r['depth']} | {r['expected_tau']:.2f} | {r['step_ms']:.1f} | "
            f"{r['draft_ms']:.1f} | {r['tokens_per_s']:.1f}{mark} |"
        )
    saved = catalog.tuned_tree_file(
        folder, device, model.dtype, quant=kernels_lib.in_use(model).quant
    )
    speedup = best["tokens_per_s"] / rows[0]["tokens_per_s"]
    save_tree(best["paths"], saved, speedup)
    print(
        f"\nchosen: {cli.plural(best['budget'], 'node')} + root, expected tau "
        f"{best['expected_tau']:.2f}, expected {speedup:.2f}x plain decoding; saved {saved}"
    )
    if speedup < 1:  # saved all the same (--tree auto finds it), but these heads do not pay here
        cli.notice(
            f"plain decoding is faster for these heads here (the best tree is expected at "
            f"{speedup:.2f}x); use --heads none"
        )
    quant = kernels_lib.in_use(model).quant
    budgets = tune_budgets(args, model, heads, h, roots, prefix, acc, rows[: best["budget"] + 1])
    if budgets:
        pool = tree_lib.build(best["paths"])
        shared = tune_shared(args, model, heads, pool, prompts, prefix, eos)
        file = catalog.tuned_tree_file(folder, device, model.dtype, "budget", quant)
        save_budgets(budgets, file, {"pool": best["paths"], "by_batch": shared})
    if args.json:
        keys = ("budget", "depth", "expected_tau", "step_ms", "draft_ms", "tokens_per_s")
        write_json(
            args.json,
            {
                "machine": mach,
                "trees": [{k: r[k] for k in keys} for r in rows],
                "chosen": best["budget"],
                "expected_speedup": speedup,
                "by_batch": budgets,
                "shared": shared if budgets else None,
            },
        )
    if args.plots and (plt := plotting()) is not None:
        os.makedirs(args.plots, exist_ok=True)
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        nodes = [r["budget"] + 1 for r in rows]
        a.plot(nodes, [r["expected_tau"] for r in rows], marker=".")
        b.plot(nodes, [r["tokens_per_s"] for r in rows], marker=".")
        b.axvline(best["budget"] + 1, color="gray", linestyle="--", label="chosen")
        a.set(xlabel="tree nodes (root included)", ylabel="expected tau")
        b.set(xlabel="tree nodes (root included)", ylabel="expected tokens/s")
        b.legend()
        fig.suptitle(
            f"{os.path.basename(os.path.normpath(folder))}: {mach['hardware']}, {mach['dtype']}",
            fontsize=9,
        )
        fig.tight_layout()
        path = os.path.join(args.plots, "tree.png")  # plots/ + tree.png: one slash
        fig.savefig(path, dpi=120)
        print(f"[plots] {path}", file=sys.stderr)


# --- the tree by batch size ----------------------------------------------------------------------
# A tree's nodes cost little while a step's tokens are few; B rows of N nodes are B*N tokens, and
# past a few the step is no longer free. So each batch size gets its own nested sub-tree of the
# tuned tree (sparse's first n nodes): the one expected to accept the most tokens a second over
# all B rows, B * expected tau / (step + draft), the root alone (plain decoding) included.


def batch_sizes(most):
    """2, 4, 8, ... up to `most`: the batch sizes whose tree is chosen (1's is the tuned tree)."""
    return [2**i for i in range(1, most.bit_length()) if 2**i <= most]


def tune_budgets(args, model, heads, h, roots, prefix, acc, batch1):
    """{B: {budget, paths, expected_tau, step_ms, tokens_per_s, expected_speedup}} for B = 1 (the
    rows measured alone, `batch1`: budgets 0..the tuned tree's) and each of batch_sizes(
    --max-batch), each B's step timed here over B rows that hold `prefix`. {} for --max-batch 1."""
    if args.max_batch < 2:
        return {}
    device = model.device
    chosen = {1: batch1}
    for B in batch_sizes(args.max_batch):
        cache = model.new_cache(len(prefix) + len(batch1), batch=B)
        positions = torch.arange(len(prefix), device=device)
        model(torch.tensor([prefix] * B, device=device), positions, None, cache, last_only=True)
        cache.keep(*[range(len(prefix))] * B)
        hB, rootsB = h.expand(B, -1), roots.expand(B)  # (B, D), (B,): every row alike
        sizes = []
        for r in batch1:
            t = tree_lib.build(r["paths"]).to(device)
            plan = drafters.draft_plan(t)
            fill = drafters.fill_trees
            draft = lambda t=t, plan=plan: fill(heads, hB, rootsB, plan, t.num_nodes)  # (B, N)
            tokens = draft() if r["budget"] else rootsB[:, None]  # (B, N)
            mask = t.mask.expand(B, -1, -1) if r["budget"] else None  # (B, N, N)
            pos = cache.length + t.depth.expand(B, -1)  # (B, N)
            step = lambda tokens=tokens, pos=pos, mask=mask: model(tokens, pos, mask, cache)
            step(), step()  # warm-up
            tree_of = {k: r[k] for k in ("budget", "paths", "expected_tau")}
            sizes.append(tree_of | {"step": step, "draft": draft if r["budget"] else None})
        time_trees(sizes, args.tune_repeats, device, rows=B)
        chosen[B] = sizes
    keys = ("budget", "paths", "expected_tau", "step_ms", "draft_ms", "tokens_per_s")
    table = {}
    print("\n| batch | nodes + root | expected tau | step ms | expected tokens/s | over plain |")
    print("|---:|---:|---:|---:|---:|---:|")
    for B, sizes in chosen.items():
        best = smallest_within(sizes, TREE_TIE)
        gain = best["tokens_per_s"] / sizes[0]["tokens_per_s"]
        table[B] = {k: best[k] for k in keys} | {"expected_speedup": gain}
        print(
            f"| {B} | {best['budget']} | {best['expected_tau']:.2f} | {best['step_ms']:.1f} | "
            f"{best['tokens_per_s']:.1f} | {gain:.2f}x |"
        )
    return table


def save_budgets(table, file, shared=None):
    """The trees by batch size, and the budgets shared by a batch, as catalog.batch_trees and
    catalog.shared_budgets read them for --batch-size."""
    data = {"by_batch": {str(B): row for B, row in table.items()}}
    if shared:
        data["shared"] = shared | {"by_batch": {str(B): r for B, r in shared["by_batch"].items()}}
    write_json(file, data)
    print(f"trees by batch size saved: {file}")


# --- one budget shared by the batch --------------------------------------------------------------
# drafters.HeadsShared gives a step of B rows E nodes past the roots, to the surest nodes of every
# row's tree. For each B the E expected to accept the most tokens a second: (B + accepted(E)) /
# (forward(B rows, B + E tokens) + draft + the rest of a step), the draft (the heads over every
# row, the prefix layer's catch-up included) only where E > 0, the rest (verifying, keeping) as a
# plain step's. accepted(E) is counted, not modelled: the heads draft the
# whole tree for every row of a greedy batch (every node verified), and for each step the E surest
# nodes of B rows are taken as HeadsShared takes them; a row accepts its verified path as far as
# the nodes taken reach down it (greedy verification accepts the same path of any sub-tree).


def shared_log(model, heads, pool, prompts, eos, rows=16, new=96):
    """[(log-confidence of every node (N,), the nodes accepted)] per row and step, in step order,
    of `rows` prompts (spread over the list: its categories) decoded greedily side by side, each
    row drafting the whole of `pool`."""
    log = []

    class Logged(drafters.HeadsShared):
        def draft(self, rows, roots):
            out = super().draft(rows, roots)
            for row, c in zip(rows, self.confidence.tolist()):
                row.confidence = c
            return out

        def accept(self, accepted):
            log.append((self.confidence, accepted.nodes))
            super().accept(accepted)

    d = Logged(heads, pool, {1: rows * pool.num_nodes})
    ids = [p for _, _, p in prompts][:: max(1, len(prompts) // rows)][:rows]
    engine.generate_batch(model, ids, [new] * len(ids), d, eos_ids=eos)
    return log


def accepted_shared(log, B, E, n):
    """Mean tokens accepted a step of B rows (consecutive rows of the log) sharing E of the first n
    nodes of each row's tree."""
    total, steps = 0, 0
    for g in range(0, len(log) - B + 1, B):
        group = log[g : g + B]
        nodes = [
            (c, r, i) for r, (conf, _) in enumerate(group) for i, c in enumerate(conf[:n]) if i
        ]
        taken = {(r, i) for _, r, i in sorted(nodes, key=lambda x: -x[0])[:E]}
        for r, (_, path) in enumerate(group):
            total += next((k for k, i in enumerate(path[1:]) if (r, i) not in taken), len(path) - 1)
        steps += 1
    return total / max(steps, 1)


def tune_shared(args, model, heads, pool, prompts, prefix, eos):
    """{B: {extra, depth, expected_accepted, step_ms, draft_ms, rest_ms, tokens_per_s, measured,
    expected_speedup}} for B = 1 and batch_sizes(--max-batch): the nodes past the roots a step of B
    rows shares, down to 0 (plain decoding), and the depth of `pool` they are drawn from (fewer
    heads run). The model below ranks every budget; the few it ranks best and plain decoding are
    then decoded for real (decode_budgets), and the fastest is chosen: its gain over plain decoding
    there is the expected speedup."""
    device = model.device
    log = shared_log(model, heads, pool, prompts, eos)
    N = pool.num_nodes
    upto = [int((pool.depth <= d).sum()) for d in range(pool.max_depth + 1)]
    table = {}
    print(
        "\n| batch | nodes past the roots | depth | expected accepted | step ms | draft ms | "
        "rest of a step ms | expected over plain | decoded over plain |"
        "\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for B in [1] + batch_sizes(args.max_batch):
        cache = model.new_cache(len(prefix) + N, batch=B)
        positions = torch.arange(len(prefix), device=device)
        _, hidden = model(
            torch.tensor([prefix] * B, device=device), positions, None, cache, last_only=True
        )
        cache.keep(*[range(len(prefix))] * B)
        last = (hidden[:1, -1:], positions[-1:])  # a kept token for every row to catch up on
        steps, drafts = {}, {}
        for depth in range(1, pool.max_depth + 1):
            d = drafters.HeadsShared(heads, pool, {1: B * N}, {1: depth})
            rows = [d.row() for _ in range(B)]
            for r, h in zip(rows, hidden):
                r.start(prefix, h[None], len(prefix) + N + 1)

            def draft(rows=rows, d=d):
                for r in rows:
                    r.cache.length = len(prefix) - 1
                    r.pending = [last]
                d.draft(rows, [prefix[-1]] * B)

            draft()
            drafts[depth] = draft
        sizes = []
        for E in range(0, min(B * (N - 1), 3 * B) + 1, max(1, B // 4)):
            if E not in steps:  # one forward of B rows sharing E nodes, spread over the rows
                n = [1 + E // B + (b < E % B) for b in range(B)]
                T = max(n)
                tokens = torch.tensor([prefix[-1]] * B, device=device)[:, None].repeat(1, T)
                mask = pool.mask[:T, :T].to(device).expand(B, -1, -1) if T > 1 else None
                pos = cache.length + pool.depth[:T].to(device).expand(B, -1)
                sized = n if min(n) < T else None
                steps[E] = lambda tokens=tokens, pos=pos, mask=mask, s=sized: model(
                    tokens, pos, mask, cache, sizes=s
                )
                for _ in range(2):  # warm
                    steps[E]()
            for depth in range(1, pool.max_depth + 1) if E else [0]:
                if E > B * (upto[depth] - 1):
                    continue
                tau = B + (accepted_shared(log, B, E, upto[depth]) if E else 0)
                drafting = drafts[depth] if E else None
                sizes.append(
                    {
                        "extra": E,
                        "depth": depth,
                        "expected_tau": tau,
                        "step": steps[E],
                        "draft": drafting,
                    }
                )
        # what a step costs past its forward whatever it drafts (verifying each row, keeping its
        # entries): a plain step of the B rows, its forward taken off. Every step pays it, so
        # fewer steps save it too.
        plain = drafters.Plain(device)
        greedy = decode.choose_verifier("greedy", 0.0, 1.0, None)
        plain_rows = [decode.Row(plain, greedy, prefix[-1]) for _ in range(B)]
        lengths = list(cache.lengths)

        def plain_step():
            decode.step(model, cache, plain, plain_rows)
            cache.lengths = list(lengths)

        plain_step()
        rest = {"expected_tau": B, "step": plain_step, "draft": None}
        time_trees(sizes + [rest], args.tune_repeats, device, rows=1)
        rest_ms = max(0.0, rest["step_ms"] - sizes[0]["step_ms"])
        for r in sizes:  # tokens_per_s: all B rows' tokens a second
            r["rest_ms"] = rest_ms
            ms = max(r["step_ms"] + r["draft_ms"] + rest_ms, 1e-9)
            r["tokens_per_s"] = r["expected_tau"] / ms * 1e3
        # the model's few best, and plain decoding, decoded for real: the one that is fastest
        ranked = sorted(sizes[1:], key=lambda r: -r["tokens_per_s"])[: args.shared_candidates]
        decoded = decode_budgets(model, heads, pool, [sizes[0]] + ranked, prompts, B, eos, args)
        best = smallest_within(sorted(decoded, key=lambda r: r["extra"]), TREE_TIE, "measured")
        if not beats_plain(best, sizes[0]):
            best = sizes[0]
        gain = best["measured"] / sizes[0]["measured"]
        keys = ("extra", "depth", "step_ms", "draft_ms", "rest_ms", "tokens_per_s", "measured")
        table[B] = {k: best[k] for k in keys}
        table[B] |= {"expected_accepted": best["expected_tau"] - B, "expected_speedup": gain}
        print(
            f"| {B} | {best['extra']} | {best['depth']} | {best['expected_tau'] - B:.2f} | "
            f"{best['step_ms']:.1f} | {best['draft_ms']:.1f} | {rest_ms:.1f} | "
            f"{best['tokens_per_s'] / sizes[0]['tokens_per_s']:.2f}x | {gain:.2f}x |"
        )
    return table


# A batch's short decode is noisy (one budget measured 1.07x plain there decoded at 0.94x in
# bench.py), so a budget is kept only where the model and the decode both put it ahead of plain
# decoding, the decode by SHARED_MARGIN at least; else the batch decodes plain, never slower.
SHARED_MARGIN = 0.03


def beats_plain(r, plain):
    """Whether budget row `r` is ahead of `plain` (the budget-0 row) in the model and the decode."""
    return r is plain or (
        r["tokens_per_s"] > plain["tokens_per_s"]
        and r["measured"] >= (1 + SHARED_MARGIN) * plain["measured"]
    )


def decode_budgets(model, heads, pool, budgets, prompts, B, eos, args):
    """Each budget's tokens/s decoding max(B, 8) prompts (spread over the list: its categories), B
    side by side, 48 new tokens each, after a run that warms it up, the budgets interleaved
    --tune-repeats // 2 times (the median), into "measured"."""
    ids = [p for _, _, p in prompts][:: max(1, len(prompts) // max(B, 8))][: max(B, 8)]

    def run(d):
        return engine.generate_batch(model, ids, [48] * len(ids), d, eos_ids=eos, batch_size=B)

    for r in budgets:
        r["runs"] = []
        r["drafter"] = drafters.HeadsShared(heads, pool, {1: r["extra"]}, {1: r["depth"] or 1})
        run(r["drafter"])  # its sub-trees built, its pages laid out
    for _ in range(max(1, args.tune_repeats // 2)):
        for r in budgets:
            sync(model.device)
            started = time.perf_counter()
            out = run(r["drafter"])
            sync(model.device)
            seconds = time.perf_counter() - started
            r["runs"].append(sum(len(o.tokens) for o in out) / seconds)
    for r in budgets:
        r["measured"] = statistics.median(r.pop("runs"))
        del r["drafter"]
    return budgets


# --- layers tuning --------------------------------------------------------------------------------
# Self-speculative drafting with the first N layers: expected tokens/s of (N, gamma) = expected tau
# /
# (gamma one-token forwards of N layers + one (gamma+1)-token forward of the model). A chain of
# gamma
# drafts accepts min(a, gamma) where a chain of max_gamma accepts a (greedy), so one decoding run
# per
# N with the longest chain gives the expected tau of every shorter one: 1 + P(a >= 1) + ... + P(a >=
# gamma).


@torch.inference_mode()
def tune_layers(args, model, prompts, device, eos):
    if args.max_gamma < 1:
        raise cli.UsageError(f"--max-gamma {args.max_gamma}: must be at least 1")
    L, G = model.cfg.n_layers, args.max_gamma
    candidates = sorted({max(1, min(L - 1, round(L * k / 8))) for k in range(1, 8)})
    prefix = [t for _, _, ids in prompts for t in ids][: args.prefix_len]
    P = len(prefix)
    cache = prefilled(model, prefix, G + 1)
    chain = torch.full((1, G + 1), prefix[-1], device=device)  # (1, G+1) any tokens do
    at_end = torch.tensor([P], device=device)  # (1,) the position after the prefix
    verify = {
        g: lambda g=g: model(chain[:, : g + 1], P + torch.arange(g + 1, device=device), None, cache)
        for g in range(1, G + 1)
    }
    rows = []
    for n in candidates:
        drafter = drafters.ModelDrafter(model, G, 0.0, 1.0, None, range(n), f"layers:{n}")
        accepted = [
            a
            for _, _, ids in prompts
            for a in decode.generate(model, ids, args.max_new_tokens, drafter, eos_ids=eos).accepted
        ]
        dcache = prefilled(model, prefix, 1, range(n))
        rows.append(
            {
                "layers": n,
                "reach": decode.acceptance_by_depth(accepted, G),
                "draft_s": [],
                "draft": lambda n=n, dcache=dcache: model(
                    chain[:, :1], at_end, None, dcache, layers=range(n)
                ),
            }
        )
    verify_s = {g: [] for g in verify}
    plain = lambda: model(chain[:, :1], at_end, None, cache)
    plain_s = []
    for fn in [plain, *verify.values(), *(r["draft"] for r in rows)]:
        fn()  # warm-up
    # interleaved: a burst of machine noise hits every size alike
    for _ in range(args.tune_repeats):
        plain_s.append(timed(plain, device))
        for g, fn in verify.items():
            verify_s[g].append(timed(fn, device))
        for r in rows:
            r["draft_s"].append(timed(r["draft"], device))
    plain_ms = statistics.median(plain_s) * 1e3
    verify_ms = {g: statistics.median(v) * 1e3 for g, v in verify_s.items()}
    table = []
    for r in rows:
        draft_ms = statistics.median(r["draft_s"]) * 1e3
        for g in verify:
            tau = 1 + sum(r["reach"][:g])
            table.append(
                {
                    "layers": r["layers"],
                    "gamma": g,
                    "expected_tau": tau,
                    "draft_ms": draft_ms,
                    "verify_ms": verify_ms[g],
                    "tokens_per_s": tau / (g * draft_ms + verify_ms[g]) * 1e3,
                }
            )
    best = max(table, key=lambda t: t["tokens_per_s"])
    mach = decoding_machine(args, model, device, prompts, prefix_tokens=P)
    print(
        machine_line(mach)
        + f"\n\nplain decoding: {plain_ms:.1f} ms a token, {1e3 / plain_ms:.1f} tokens/s"
        "\n\n| layers | best gamma | expected tau | draft ms | verify ms | expected tokens/s "
        "|\n|---:|---:|---:|---:|---:|---:|"
    )
    for n in candidates:
        t = max((t for t in table if t["layers"] == n), key=lambda t: t["tokens_per_s"])
        mark = " **<- chosen**" if t is best else ""
        print(
            f"| {n} | {t['gamma']} | {t['expected_tau']:.2f} | {t['draft_ms']:.1f} | "
            f"{t['verify_ms']:.1f} | {t['tokens_per_s']:.1f}{mark} |"
        )
    speedup = best["tokens_per_s"] * plain_ms / 1e3
    out = catalog.tuned_tree_file(args.heads_dir, device, model.dtype, "layers")
    write_json(
        out,
        {
            "model": model.cfg.name,
            "layers": best["layers"],
            "gamma": best["gamma"],
            "machine": mach,
            "expected_speedup": speedup,
        },
    )
    print(
        f"\nchosen: layers:{best['layers']} --gamma {best['gamma']}, expected tau "
        f"{best['expected_tau']:.2f}, "
        f"{speedup:.2f}x plain "
        f"decoding{'' if speedup > 1 else ' (no setting beats plain decoding on this machine)'}; "
        f"saved {out}"
    )
    if args.json:
        write_json(
            args.json,
            {
                "machine": mach,
                "plain_ms": plain_ms,
                "rows": table,
                "chosen": {k: best[k] for k in ("layers", "gamma")},
            },
        )


# --- skip tuning ----------------------------------------------------------------------------------
# Self-speculative drafting with a searched set of layers skipped (Zhang et al. 2023, Draft &
# Verify). Greedy drafting makes acceptance cheap to measure. A chain's draft at depth d follows
# drafts that, where they were accepted, are the base model's own tokens, so whether the draft of
# reply token j is accepted depends only on whether the draft model's argmax after the base's
# reply up to j is token j. One teacher-forced forward of the kept layers over the base model's
# greedy replies gives that match at every position; walking the steps over the matches (a step at
# j accepts the run of matches from j, up to gamma, and the base adds one token) gives the tau of
# every gamma, without decoding once per set. Expected tokens/s of (set, gamma) = tau / (gamma
# one-token forwards of the kept layers + one (gamma+1)-token forward of the model), both timed
# here; a forward of k layers costs the same whichever k, so it is timed once per count.
#
# The search is greedy removal: skip the layer whose loss costs least (the best expected tokens/s
# with it skipped), then, the set kept, the next, and so on; the paper's Bayesian optimisation
# searches the same objective. Round 1 tries every layer; later rounds only the SKIP_WIDTH best of
# the round before (a layer that hurt alone rarely hurts less later), which makes the search
# about L + SKIP_WIDTH x rounds forwards instead of L^2 / 2. It stops when SKIP_PATIENCE more
# layers skipped in a row found nothing faster. results/skip-layers.md compares it with random sets.

SKIP_WIDTH = 8
SKIP_PATIENCE = 3


def accepted_per_step(matches, gamma):
    """The drafts each step of greedy chain drafting accepts over one reply: matches[j] says
    whether the draft of reply token j+1 (after the base's reply up to it) is that token. The
    prefill made token 0; the steps emit the len(matches) tokens after it, a+1 each."""
    accepted, i = [], 0
    while i < len(matches):
        a = 0
        while a < gamma and i + a < len(matches) and matches[i + a]:
            a += 1
        accepted.append(a)
        i += a + 1  # the accepted drafts and the base model's own token
    return accepted


@torch.inference_mode()
def draft_matches(model, replies, kept, chunk=64):
    """For each (prompt, reply) in `replies`: whether the model run on the `kept` layers guesses
    each reply token after the first from the true text before it (teacher forcing), as a list of
    bools. The text is fed in chunks of `chunk` tokens through a cache of the kept layers."""
    dev = model.device
    out = []
    for prompt, reply in replies:
        seq = prompt + reply
        cache = model.new_cache(len(seq), num_layers=len(kept))
        guesses = []
        for a in range(0, len(seq) - 1, chunk):
            ids = torch.tensor([seq[a : min(a + chunk, len(seq) - 1)]], device=dev)  # (1, T)
            at = torch.arange(a, a + ids.shape[1], device=dev)
            _, hidden = model(ids, at, None, cache, last_only=True, layers=kept)  # (1, T, D)
            cache.keep(range(ids.shape[1]))
            wanted = hidden[0, max(0, len(prompt) - a) :]  # the positions before reply tokens 1..
            if len(wanted):
                guesses += model.lm_head(wanted).argmax(-1).tolist()
        out.append([g == t for g, t in zip(guesses, reply[1:])])
    return out


@torch.inference_mode()
def skip_step_ms(model, prefix, G, repeats):
    """Median ms of the steps skip drafting takes, after a cached `prefix` (token ids): ("verify",
    g) one forward of the model over g drafts and the root (g = 0: a plain step), ("draft", k) one
    token through k layers (the first k: any k layers cost alike)."""
    dev = model.device
    P = len(prefix)
    cache = prefilled(model, prefix, G + 1)
    chain = torch.full((1, G + 1), prefix[-1], device=dev)  # (1, G+1) any tokens do
    at = P + torch.arange(G + 1, device=dev)  # (G+1,) the positions after the prefix
    timers = {
        ("verify", g): lambda g=g: model(chain[:, : g + 1], at[: g + 1], None, cache)
        for g in range(0, G + 1)
    }
    for k in range(1, model.cfg.n_layers):
        dcache = prefilled(model, prefix, 1, range(k))
        timers["draft", k] = lambda k=k, dcache=dcache: model(
            chain[:, :1], at[:1], None, dcache, layers=range(k)
        )
    samples = {key: [] for key in timers}
    for fn in timers.values():
        fn()  # warm-up
    for _ in range(repeats):  # interleaved: a burst of machine noise hits every size alike
        for key, fn in timers.items():
            samples[key].append(timed(fn, dev))
    return {key: statistics.median(v) * 1e3 for key, v in samples.items()}


def skip_row(model, replies, skipped, ms, G):
    """The skip set's teacher-forced acceptance over `replies` and its expected tokens/s at the
    best gamma up to G, from the step times `ms` (skip_step_ms)."""
    kept = [i for i in range(model.cfg.n_layers) if i not in skipped]
    matches = draft_matches(model, replies, kept)
    best = None
    for g in range(1, G + 1):
        steps = sum(len(accepted_per_step(m, g)) for m in matches)
        tau = sum(map(len, matches)) / max(steps, 1)
        speed = tau / (g * ms["draft", len(kept)] + ms["verify", g]) * 1e3
        if best is None or speed > best["tokens_per_s"]:
            best = {"gamma": g, "tau": tau, "tokens_per_s": speed}
    steps = [a for m in matches for a in accepted_per_step(m, G)]
    return {
        "skip": skipped,
        "kept": len(kept),
        "match": sum(map(sum, matches)) / max(sum(map(len, matches)), 1),
        "reach": decode.acceptance_by_depth(steps, G),  # P(a step accepts >= d), chains of G
        **best,
    }


def greedy_removal(
    n_layers, score, width=SKIP_WIDTH, patience=SKIP_PATIENCE, report=None, rounds=None
):
    """The search: from no layer skipped, skip one more layer a round, the one whose set scores
    best, trying every layer in round 1 and the `width` best of the round before after that; stop
    after `patience` rounds without a better set, after `rounds` rounds, or when one layer is
    left. score(set) takes a sorted tuple; report(set) is told each round's choice. Returns the set
    of every round and the best set."""
    skipped = best = ()  # the set so far; the best set met
    ranking = list(range(n_layers))  # the layers to try next, likeliest first
    path = []  # the set after each round
    since_best = 0  # rounds since the best set
    while len(skipped) < min(n_layers - 1, rounds or n_layers) and since_best < patience:
        tried = ranking if not skipped else ranking[:width]
        tried = sorted(tried, key=lambda i: -score(tuple(sorted(skipped + (i,)))))
        skipped = tuple(sorted(skipped + (tried[0],)))
        ranking = tried[1:] + [i for i in ranking if i not in tried]
        path.append(skipped)
        if report:
            report(skipped)
        since_best = 0 if not best or score(skipped) > score(best) else since_best + 1
        best = skipped if since_best == 0 else best
    return path, best


@torch.inference_mode()
def tune_skip(args, model, prompts, device, eos):
    if args.max_gamma < 1:
        raise cli.UsageError(f"--max-gamma {args.max_gamma}: must be at least 1")
    L, G = model.cfg.n_layers, args.max_gamma
    if L < 2:
        raise cli.UsageError(f"--tune-skip: the model has {L} layer; skipping needs at least 2")
    replies = [
        (ids, decode.generate(model, ids, args.max_new_tokens, None, eos_ids=eos).tokens)
        for _, _, ids in prompts
    ]
    prefix = [t for _, _, ids in prompts for t in ids][: args.prefix_len]
    ms = skip_step_ms(model, prefix, G, args.tune_repeats)
    plain_ms = ms["verify", 0]  # verifying no draft: a plain step
    rows = {}

    def score(skipped):  # expected tokens/s of the set at its best gamma, memoised
        if skipped not in rows:
            rows[skipped] = skip_row(model, replies, skipped, ms, G)
        return rows[skipped]["tokens_per_s"]

    def report(skipped):
        r = rows[skipped]
        print(
            f"[tune] skip {catalog.skip_spec(skipped)}: {cli.plural(r['kept'], 'layer')}, match "
            f"{r['match']:.2f}, tau {r['tau']:.2f} at gamma {r['gamma']}, expected "
            f"{r['tokens_per_s']:.1f} tokens/s",
            file=sys.stderr,
            flush=True,
        )

    path, best = greedy_removal(L, score, report=report)
    first_n = {s: tuple(range(L - len(s), L)) for s in path}  # equal draft cost: as many layers run
    for s in first_n.values():
        score(s)
    mach = decoding_machine(
        args, model, device, prompts, path=catalog.cpu_path(device), prefix_tokens=len(prefix)
    )
    print(
        machine_line(mach)
        + f"\n\nplain decoding: {plain_ms:.1f} ms a token, {1e3 / plain_ms:.1f} tokens/s; "
        f"{cli.plural(len(rows), 'set')} measured"
        "\n\n| layers run | skipped (searched) | match | tau | gamma | expected tokens/s | "
        "first-N match | first-N tau | first-N tokens/s |"
        "\n|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for s in path:
        r, f = rows[s], rows[first_n[s]]
        mark = " **<- chosen**" if s == best else ""
        print(
            f"| {r['kept']} | {catalog.skip_spec(s)} | {r['match']:.2f} | {r['tau']:.2f} | "
            f"{r['gamma']} | {r['tokens_per_s']:.1f}{mark} | {f['match']:.2f} | {f['tau']:.2f} | "
            f"{f['tokens_per_s']:.1f} |"
        )
    chosen = rows[best]
    speedup = chosen["tokens_per_s"] * plain_ms / 1e3
    out = catalog.tuned_tree_file(args.heads_dir, device, model.dtype, "skip")
    write_json(
        out,
        {
            "model": model.cfg.name,
            "path": catalog.cpu_path(device),
            "skip": list(best),
            "gamma": chosen["gamma"],
            "expected_tau": chosen["tau"],
            "expected_speedup": speedup,
            "machine": mach,
        },
    )
    print(
        f"\nchosen: skip:{catalog.skip_spec(best)} --gamma {chosen['gamma']} ({chosen['kept']} of "
        f"{L} layers draft), expected tau {chosen['tau']:.2f}, {speedup:.2f}x plain decoding"
        f"{'' if speedup > 1 else ' (no set beats plain decoding on this machine)'}; saved {out}"
    )
    if args.json:
        write_json(
            args.json,
            {
                "machine": mach,
                "plain_ms": plain_ms,
                "draft_ms": {k: ms["draft", k] for k in range(1, L)},
                "verify_ms": {g: ms["verify", g] for g in range(1, G + 1)},
                "path": [list(s) for s in path],
                "rows": [r | {"skip": list(r["skip"])} for r in rows.values()],
                "chosen": {"skip": list(best), "gamma": chosen["gamma"]},
            },
        )


# --- Jacobi's, lookahead's and PaSS's settings ----------------------------------------------------

# the values each setting may take; a GPU's best window may be past these: widen them there
GRIDS = {
    "jacobi": {"gamma": (1, 2, 3, 4, 6, 8, 12, 16)},
    "lookahead": {
        "window": (1, 2, 3, 4, 6, 8, 12, 16),
        "ngram": (2, 3, 4, 5, 6),
        "guesses": (1, 2, 3, 4, 6, 8, 12, 16),
    },
    "pass": {"gamma": tuple(range(1, 17)), "guesses": (1, 2, 3, 4, 6, 8)},
}  # gamma: up to the [LA] tokens trained


class Counted:
    """`drafter`, recording the number of nodes (the forward's size) of every draft it makes."""

    def __init__(self, drafter):
        self.drafter, self.sizes = drafter, []
        self.name, self.legend, self.max_nodes, self.max_depth = (
            drafter.name,
            drafter.legend,
            drafter.max_nodes,
            drafter.max_depth,
        )

    def row(self, generator=None):  # another sequence's: its drafter's state, one record of sizes
        other = copy.copy(self)
        other.drafter = self.drafter.row(generator)
        return other

    def start(self, prompt, hidden, max_len, cached=0):
        self.drafter.start(prompt, hidden, max_len, cached)

    def draft(self, rows, roots):
        drafts = self.drafter.draft([row.drafter for row in rows], roots)
        self.sizes += [len(d.tokens) for d in drafts]
        return drafts

    def accept(self, accepted):
        self.drafter.accept(accepted)


def make(kind, setting, model, folder):
    """A drafter of `kind` (jacobi, lookahead, pass: the [LA] tokens in folder/pass) at `setting`,
    for greedy decoding."""
    return catalog.make_drafter(
        kind, os.path.join(folder, "pass"), setting, model, None, None, None, 0.0, 1.0, None
    )


def trained_tokens(folder, model) -> int:
    """How many [LA] tokens folder/pass holds for this model (0: none; pass is then not tuned)."""
    try:
        return len(checkpoint.load_tokens(os.path.join(folder, "pass"), model))
    except heads_lib.HeadsError:
        return 0


def tuned_drafter(kind, folder, model):
    """bench.py's jacobi, lookahead or pass method: at the setting --tune-parallel saved in `folder`
    for this model and machine, else at generate.py's defaults; and a note that says which."""
    tuned = catalog.tuned_parallel(folder, model, kind)
    d = make(kind, catalog.DRAFT_DEFAULTS[kind] | tuned, model, folder)
    return d, d.name + (
        " (tuned for this machine)" if tuned else " (untuned: run bench.py --tune-parallel)"
    )


def ascend(start: dict, grid: dict, score) -> dict:
    """Coordinate ascent: from `start`, step to the neighbour (one setting one grid value up or
    down) with the highest score while it beats the current setting; score(setting) is memoised."""
    here = dict(start)
    while True:
        near = [
            here | {k: values[j]}
            for k, values in grid.items()
            for j in (values.index(here[k]) - 1, values.index(here[k]) + 1)
            if 0 <= j < len(values)
        ]
        best = max(near, key=score)
        if score(best) <= score(here):
            return here
        here = best


def label(setting: dict) -> str:
    return " ".join(f"{k} {v}" for k, v in setting.items())


@torch.inference_mode()
def tune_parallel(args, model, prompts, eos, machine):
    """Search each kind's setting on this machine, print the table, save the choice; `machine` is
    machine()'s description of it (hardware, dtype, threads, step over the bandwidth
    floor)."""
    dev = model.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    prefix = [t for _, _, ids in prompts for t in ids][: args.prefix_len]
    cache = prefilled(model, prefix, tree_lib.MAX_NODES)
    times = {}

    def step_ms(n):
        """Median ms of one forward of n nodes (causal among them) after the cached prefix."""
        if n not in times:
            ids = torch.full((1, n), prefix[-1], device=dev)  # (1, n)
            at = len(prefix) + torch.arange(n, device=dev)  # (n,)
            # (n, n)
            mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril() if n > 1 else None
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
            d = Counted(make(kind, setting, model, args.heads_dir))
            tokens = steps = 0
            for _, _, ids in prompts:
                r = decode.generate(model, ids, args.max_new_tokens, d, eos_ids=eos)
                tokens, steps = tokens + len(r.tokens), steps + r.steps
            ms = (steps - len(d.sizes)) * step_ms(1) + sum(step_ms(n) for n in d.sizes)
            rows[key] = {
                "kind": kind,
                **setting,
                "tau": tokens / steps,
                "mean_nodes": (steps - len(d.sizes) + sum(d.sizes)) / steps,
                "step_ms": ms / steps,
                "tokens_per_s": tokens / ms * 1e3,
            }
            print(
                f"[tune] {kind} {label(setting)}: tau {rows[key]['tau']:.2f}, "
                f"{rows[key]['mean_nodes']:.1f} nodes a step, "
                f"expected {rows[key]['tokens_per_s']:.1f} tokens/s",
                file=sys.stderr,
                flush=True,
            )
        return rows[key]["tokens_per_s"]

    grids, starts, trained = (
        dict(GRIDS),
        dict(catalog.DRAFT_DEFAULTS),
        trained_tokens(args.heads_dir, model),
    )
    if trained:  # K up to the [LA] tokens trained
        grids["pass"] = GRIDS["pass"] | {"gamma": GRIDS["pass"]["gamma"][:trained]}
        starts["pass"] = starts["pass"] | {"gamma": min(starts["pass"]["gamma"], trained)}
    else:  # no [LA] tokens for this model in --heads-dir: nothing to tune
        del grids["pass"]
    chosen = {
        kind: ascend(starts[kind], grid, lambda s, kind=kind: score(kind, s))
        for kind, grid in grids.items()
    }
    plain = 1e3 / step_ms(1)
    mach = machine | {
        "prefix_tokens": len(prefix),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.tune_repeats,
    }
    print(
        machine_line(mach)
        + f"\n\nplain decoding: {step_ms(1):.1f} ms a step, {plain:.1f} tokens/s\n\n"
        "| method | setting | tau | nodes a step | step ms | expected tokens/s | over plain "
        "|\n|---|---|---:|---:|---:|---:|---:|"
    )
    for (kind, name), r in rows.items():
        mark = " **<- chosen**" if name == label(chosen[kind]) else ""
        print(
            f"| {kind} | {name} | {r['tau']:.2f} | {r['mean_nodes']:.1f} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s'] / plain:.2f}x{mark} |"
        )
    out = catalog.tuned_tree_file(args.heads_dir, dev, model.dtype, "parallel")
    expected = {kind: rows[kind, label(s)]["tokens_per_s"] / plain for kind, s in chosen.items()}
    write_json(
        out,
        {"model": model.cfg.name, **chosen, "expected_speedup": expected, "machine": mach},
    )
    print(
        "\nchosen: "
        + "; ".join(
            f"{kind} {label(s)} ({expected[kind]:.2f}x plain decoding)"
            for kind, s in chosen.items()
        )
        + f"; saved {out}"
    )
    if args.json:
        write_json(
            args.json,
            {
                "machine": mach,
                "plain_tokens_per_s": plain,
                "rows": list(rows.values()),
                "chosen": chosen,
            },
        )
