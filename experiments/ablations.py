"""Recipe ablations: one row per training run, read from the eval.json and heads.json that train.py
writes into each run's --out folder. Writes a Markdown table and an SVG bar chart of held-out
chain tau (hand-written: the project does not depend on a plotting library).

    python experiments/ablations.py results/ablations "K=3 (baseline)=runs/base" "K=5=runs/k5" ...

Each argument is LABEL=FOLDER (the label may contain '=': the last one splits). Runs compared in one
table should share their data and held-out split, which train.py derives from the data set.
"""

import json
import os
import sys


def read_run(folder):
    with open(os.path.join(folder, "eval.json")) as f:
        report = json.load(f)
    with open(os.path.join(folder, "heads.json")) as f:
        config = json.load(f)
    curve = report.get("curve", [])
    return dict(
        chain_tau=report["chain_tau"],
        top1=report["top1"],
        kind=config["kind"],
        heads=config["num_heads"],
        layers=config["num_layers"],
        tokens=curve[-1]["tokens"] if curve else None,
    )


def table(runs):
    lines = [
        "| run | heads | K | MLP layers | assistant tokens trained on | held-out chain tau | "
        "held-out top-1 per head |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for label, r in runs.items():
        tokens = f"{r['tokens']:,}" if r["tokens"] else "-"
        lines.append(
            f"| {label} | {r['kind']} | {r['heads']} | {r['layers']} | {tokens} | "
            f"{r['chain_tau']:.3f} | "
            f"{' '.join(f'{a:.2f}' for a in r['top1'])} |"
        )
    return "\n".join(lines) + "\n"


def svg(runs, bar=28, w=640, pad=200):
    y1 = max(r["chain_tau"] for r in runs.values()) * 1.05
    h = 60 + bar * len(runs)
    X = lambda tau: pad + (w - pad - 40) * (tau - 1.0) / (y1 - 1.0)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{(w + pad) / 2}" y="{h - 10}" text-anchor="middle">held-out chain tau (bars '
        "start at 1.0)</text>",
    ]
    for n, (label, r) in enumerate(runs.items()):
        y = 20 + bar * n
        out.append(f'<text x="{pad - 8}" y="{y + bar / 2 + 4}" text-anchor="end">{label}</text>')
        out.append(
            f'<rect x="{pad}" y="{y + 3}" width="{X(r["chain_tau"]) - pad:.1f}" '
            f'height="{bar - 6}" fill="#2ca02c"/>'
        )
        out.append(
            f'<text x="{X(r["chain_tau"]) + 4:.1f}" '
            f'y="{y + bar / 2 + 4}">{r["chain_tau"]:.3f}</text>'
        )
    return "\n".join(out + ["</svg>"]) + "\n"


def fail(message):
    print(message, file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # the docstring says what it does and how to run it
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) < 3 or any("=" not in a for a in sys.argv[2:]):
        fail("usage: python experiments/ablations.py OUT_STEM LABEL=FOLDER [LABEL=FOLDER ...]")
    stem, runs = sys.argv[1], {}
    for arg in sys.argv[2:]:
        label, folder = arg.rsplit("=", 1)
        try:
            runs[label] = read_run(folder)
        except (OSError, ValueError, KeyError) as e:
            fail(
                f"error: {folder}: no readable eval.json and heads.json from train.py ({e}); "
                "train that run first"
            )
    with open(stem + ".md", "w") as f:
        f.write(table(runs))
    with open(stem + ".svg", "w") as f:
        f.write(svg(runs))
