"""bench.py --batch-size: the methods that batch decode the prompts B at a time too (engine.py's
generate_batch, a row that ends taking the next prompt), and the table and plot of what that buys
beside the one-at-a-time row. The methods take turns at each size, --repeats rounds, the median
counting, as bench.py's measure() interleaves them one prompt at a time.

Test: `python -m pytest -q tests/test_bench_cli.py -k batch`.
"""

import os
import statistics
import time

import specdec.ctrl_c
from specdec.benching.report import plot_title
from specdec.tuning import machine_line, plotting, sync


def measure_batched(methods, prompts, sizes, args, device):
    """Each method that batches decodes all the prompts at each batch size B: B rows at once, a row
    that ends taking the next prompt. Per method and B: total tokens/s (new tokens over the wall
    time, the median of the repeats), mean per-sequence tokens/s (a row's tokens over the time
    from its prefill until it ended), the time of a step (the wall time over the base
    model's forward passes) and the replies, to compare with the one-at-a-time ones. Returns them,
    and whether Ctrl-C stopped the measuring (then: the sizes measured before it)."""
    res = {}
    try:
        batch_rows(methods, prompts, sizes, args, device, res)
    except KeyboardInterrupt:
        specdec.ctrl_c.handled()  # bench goes on: it reports what was measured
        return res, True
    return res, False


def batch_rows(methods, prompts, sizes, args, device, res):
    """measure_batched's measuring, into res as each size is done: at each batch size the methods
    take turns, --repeats rounds (the median counts), so a slow spell of the machine hits them
    alike."""
    ids = [ids for _, _, ids in prompts]
    batching = {name: m for name, m in methods.items() if m.batch is not None}
    for m in batching.values():
        m.batch(ids[: sizes[0]], min(16, args.max_new_tokens), args.seed, sizes[0])  # warm
    for B in sizes:
        times = {name: [] for name in batching}  # seconds of each repeat
        outs = {}
        for _ in range(args.repeats):
            for name, m in batching.items():
                sync(device)
                t0 = time.perf_counter()
                outs[name] = m.batch(ids, args.max_new_tokens, args.seed, B)
                sync(device)
                times[name].append(time.perf_counter() - t0)
        for name, m in batching.items():
            (out, forwards), seconds = outs[name], statistics.median(times[name])
            res.setdefault(name, {})[B] = {
                "tokens_per_s": sum(len(r.tokens) for r in out) / max(seconds, 1e-9),
                "per_sequence_tokens_per_s": statistics.mean(
                    len(r.tokens) / max(r.seconds, 1e-9) for r in out
                ),
                "step_ms": 1000 * seconds / forwards,
                "tree_nodes": m.nodes_at(B) if m.nodes_at else None,
                "predicted": predicted_at(m.predicted, B),
                "replies": [r.tokens for r in out],
            }


def predicted_at(table, rows):
    """--tune-tree's expected speedup at `rows` rows (its entry for the most rows up to them)."""
    if not table:
        return None
    return table[max(B for B in table if B <= rows)]


def batched_table(res, batched, mach):
    """Beside each method's one-at-a-time row, its row at each batch size: what it drafts a step
    (tree nodes, or nodes past the roots shared by the batch), and its tokens/s over plain's at
    the same batch size, measured and as --tune-tree predicted it."""
    lines = [
        machine_line(mach),
        "",
        "| method | batch | tree nodes | total tokens/s | over plain | predicted | "
        "mean per-sequence tokens/s | step ms | same replies as batch 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    plain = batched.get("plain", {})
    for name, by_size in batched.items():
        r = res[name]
        alone = statistics.mean(p["new_tokens"] / max(p["seconds"], 1e-9) for p in r["per_prompt"])
        gain = f"{r['tokens_per_s'] / res['plain']['tokens_per_s']:.2f}x" if "plain" in res else "-"
        lines.append(
            f"| {name} | 1 | - | {r['tokens_per_s']:.1f} | {gain} | - | {alone:.1f} | - | - |"
        )
        for B, b in by_size.items():
            nodes = b.get("tree_nodes") or "-"
            over = f"{b['tokens_per_s'] / plain[B]['tokens_per_s']:.2f}x" if B in plain else "-"
            predicted = f"{b['predicted']:.2f}x" if b.get("predicted") else "-"
            lines.append(
                f"| {name} | {B} | {nodes} | {b['tokens_per_s']:.1f} | {over} | {predicted} | "
                f"{b['per_sequence_tokens_per_s']:.1f} | {b['step_ms']:.1f} | "
                f"{'yes' if b['same'] else 'NO'} |"
            )
    return "\n".join(lines)


def plot_batched(res, batched, mach, folder, partial=None):
    """Total tokens/s against the batch size, a line per method (batch.png)."""
    if (plt := plotting()) is None:
        return
    os.makedirs(folder, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_size in batched.items():
        sizes = [1, *by_size]
        tokens_per_s = [res[name]["tokens_per_s"]] + [b["tokens_per_s"] for b in by_size.values()]
        ax.plot(sizes, tokens_per_s, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows decoded at once)")
    ax.set_ylabel("total tokens/s")
    ax.set_title(plot_title(mach, partial), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "batch.png"), dpi=120)
