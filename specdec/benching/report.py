"""What bench.py prints and draws of its results: the tables (the machine line above each), the
speedup and acceptance plots, and an online method's cost in words.

    tables(res, mach)              the markdown tables: every method, then speedup by category
    plot_bench(res, mach, folder)  speedup.png and acceptance.png (needs matplotlib)
    online_cost, online_summary    a method that learns as it decodes: its updates and their time

Test: `python -m pytest -q tests/test_bench_cli.py`.
"""

import os
import sys

from specdec import cli
from specdec.tuning import machine_line, plotting


def plot_title(mach, partial):
    """The machine, and a plot's mark when Ctrl-C cut the run short."""
    return f"{mach['hardware']}, {mach['dtype']}" + (
        "\npartial: stopped by Ctrl-C" if partial else ""
    )


def online_cost(learner, seconds):
    """An online method's updates in its last repeat, and their time against the decoding's (its
    measured seconds hold both; with one repeat, exactly)."""
    return {
        "updates": learner.updates,
        "update_seconds": round(learner.seconds, 3),
        "of_decoding": round(learner.seconds / max(seconds - learner.seconds, 1e-9), 4),
        "loss": [round(x, 4) for x in learner.losses],
    }


def online_summary(cost):
    """online_cost's numbers in a line."""
    line = f"{cli.plural(cost['updates'], 'update')} in {cost['update_seconds']:.2f} s, "
    line += f"{cost['of_decoding']:.1%} of the decoding time"
    if cost["loss"]:
        line += f", loss {cost['loss'][0]:.3f} -> {cost['loss'][-1]:.3f}"
    return line


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


def tables(res, mach):
    lines = [
        machine_line(mach),
        "",
        "| method | tokens/s | spread | speedup | tau | accepted by depth | identical to plain |",
        "|---|---:|---:|---:|---:|---|:---:|",
    ]
    for name, r in res.items():
        acc = " ".join(f"{a:.2f}" for a in r["accept_by_depth"]) if r["accept_by_depth"] else "-"
        same = (
            "-"
            if r["identical"] is None
            else "yes"
            if r["identical"]
            else f"NO ({len(r['differs_on'])})"
        )
        spread = "{:.1f}-{:.1f}".format(*r["spread"])  # the slowest and fastest repeat's
        lines.append(
            f"| {name} | {r['tokens_per_s']:.1f} | {spread} | {r['speedup']:.2f}x "
            f"| {fmt(r['tau'])} | {acc} | {same} |"
        )
    names = list(res)
    cats = list(res["plain"]["by_category"])
    lines += [
        "",
        machine_line(mach),
        "",
        "Speedup over plain decoding by category:",
        "",
        "| category | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for c in cats:
        lines.append(
            f"| {c} | "
            + " | ".join(f"{res[n]['by_category'][c]['speedup']:.2f}x" for n in names)
            + " |"
        )
    return "\n".join(lines)


def plot_bench(res, mach, folder, partial=None):
    if (plt := plotting()) is None:
        return
    os.makedirs(folder, exist_ok=True)
    names = [n for n in res if n != "plain"]
    groups = list(res["plain"]["by_category"]) + ["all"]
    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 1.2), 4.5))
    width = 0.8 / max(len(names), 1)
    for j, n in enumerate(names):
        vals = [
            res[n]["by_category"][g]["speedup"] if g != "all" else res[n]["speedup"] for g in groups
        ]
        ax.bar(
            [i + j * width for i in range(len(groups))],
            vals,
            width,
            label=n,
            color=plt.cm.tab20(j % 20),
        )  # tab10 repeats past 10
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(
        [i + 0.4 - width / 2 for i in range(len(groups))], groups, rotation=30, ha="right"
    )
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(plot_title(mach, partial), fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "speedup.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for n, r in res.items():
        if r["accept_by_depth"]:
            ax.plot(
                range(1, len(r["accept_by_depth"]) + 1), r["accept_by_depth"], marker="o", label=n
            )
    ax.set_xticks(range(1, max([len(r["accept_by_depth"] or []) for r in res.values()] + [1]) + 1))
    ax.set_xlabel("depth (draft head)")
    ax.set_ylabel("fraction of steps accepting this deep")
    ax.set_ylim(0, 1)
    ax.set_title(plot_title(mach, partial), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "acceptance.png"), dpi=120)
    written = [os.path.join(folder, name) for name in ("speedup.png", "acceptance.png")]
    print(f"[plots] {', '.join(written)}", file=sys.stderr)
