"""Learning curves of the shipped heads: held-out chain tau against assistant tokens trained on,
read from the `curve` that train.py keeps in each eval.json. Writes a Markdown table and an SVG
plot (hand-written: the project does not depend on a plotting library).

    python experiments/plot_curves.py weights/smollm2-135m-instruct results/learning-curves

With --joint, joint.py's runs (each folder's eval.json curve) as a trade-off: held-out chain tau
gained since the run's start against the adapted model's greedy agreement with the original, one
line per run from its start to its end, the issue's 97% floor dashed:

    python experiments/plot_curves.py --joint results/beyond-frozen-heads LABEL=RUN_FOLDER ...
"""

import json
import os
import sys

COLOURS = {"medusa": "#1f77b4", "hydra": "#ff7f0e", "hydra++": "#2ca02c"}


def read_curves(folder):
    curves = {}
    for kind in COLOURS:
        path = os.path.join(folder, kind, "eval.json")
        if os.path.isfile(path):
            with open(path) as f:
                curves[kind] = json.load(f).get("curve", [])
    return {k: c for k, c in curves.items() if c}


def table(curves):
    lines = [
        "| heads | assistant tokens trained on | held-out chain tau | held-out top-1 per head |",
        "|---|---:|---:|---|",
    ]
    for kind, curve in curves.items():
        for p in curve:
            lines.append(
                f"| {kind} | {p['tokens']:,} | {p['chain_tau']:.3f} | "
                f"{' '.join(f'{a:.2f}' for a in p['top1'])} |"
            )
    return "\n".join(lines) + "\n"


def frame(w, h, pad, xlabel, ylabel):
    """An SVG's opening lines: white background, the two axes and their labels."""
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
        f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">{xlabel}</text>',
        f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" '
        f'text-anchor="middle">{ylabel}</text>',
    ]


def svg(curves, w=640, h=400, pad=60):
    xs = [p["tokens"] for c in curves.values() for p in c]
    ys = [p["chain_tau"] for c in curves.values() for p in c]
    x1, y0, y1 = max(xs), 1.0, max(ys) * 1.05
    X = lambda x: pad + (w - 2 * pad) * x / x1
    Y = lambda y: h - pad - (h - 2 * pad) * (y - y0) / (y1 - y0)
    out = frame(w, h, pad, "assistant tokens trained on (millions)", "held-out chain tau")
    for i in range(5):
        x, y = x1 * i / 4, y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{X(x)}" y="{h - pad + 16}" text-anchor="middle">{x / 1e6:.2f}</text>')
        out.append(f'<text x="{pad - 6}" y="{Y(y) + 4}" text-anchor="end">{y:.2f}</text>')
    for n, (kind, curve) in enumerate(curves.items()):
        points = " ".join(f"{X(p['tokens']):.1f},{Y(p['chain_tau']):.1f}" for p in curve)
        out.append(
            f'<polyline points="{points}" fill="none" stroke="{COLOURS[kind]}" stroke-width="2"/>'
        )
        out.append(f'<text x="{pad + 10}" y="{pad + 16 * n}" fill="{COLOURS[kind]}">{kind}</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def joint_svg(runs, w=640, h=400, pad=60):
    """runs: {label: joint.py's curve}; x greedy agreement, y chain tau minus the run's first."""
    pts = {
        k: [(p["greedy_agreement"], p["chain_tau"] - c[0]["chain_tau"]) for p in c]
        for k, c in runs.items()
    }
    xs, ys = (
        [x for c in pts.values() for x, _ in c] + [0.97],
        [y for c in pts.values() for _, y in c] + [0.0],
    )
    x0, x1, y0, y1 = min(xs) - 0.005, max(xs) + 0.002, min(ys) - 0.01, max(max(ys), 0.0) + 0.01
    X = lambda x: pad + (w - 2 * pad) * (x - x0) / (x1 - x0)
    Y = lambda y: h - pad - (h - 2 * pad) * (y - y0) / (y1 - y0)
    out = frame(
        w,
        h,
        pad,
        "greedy agreement with the original model (held out)",
        "held-out chain tau gained since the start",
    )
    out += [
        f'<line x1="{pad}" y1="{Y(0):.1f}" x2="{w - pad}" y2="{Y(0):.1f}" stroke="grey"/>',
        f'<line x1="{X(0.97):.1f}" y1="{pad}" x2="{X(0.97):.1f}" y2="{h - pad}" stroke="grey" '
        'stroke-dasharray="4 4"/>',
    ]
    for i in range(5):
        x, y = x0 + (x1 - x0) * i / 4, y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{X(x):.1f}" y="{h - pad + 16}" text-anchor="middle">{x:.3f}</text>')
        out.append(f'<text x="{pad - 6}" y="{Y(y) + 4:.1f}" text-anchor="end">{y:+.3f}</text>')
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    for n, (label, c) in enumerate(pts.items()):
        colour = colours[n % len(colours)]
        out.append(
            f'<polyline points="{" ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in c)}" fill="none" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        out.append(f'<circle cx="{X(c[-1][0]):.1f}" cy="{Y(c[-1][1]):.1f}" r="4" fill="{colour}"/>')
        out.append(
            f'<text x="{pad + 10}" y="{h - pad - 10 - 16 * (len(pts) - 1 - n)}" '
            f'fill="{colour}">{label}</text>'
        )
    return "\n".join(out + ["</svg>"]) + "\n"


def joint_main(stem, pairs):
    runs = {}
    for pair in pairs:
        label, _, folder = pair.partition("=")
        path = os.path.join(folder, "eval.json")
        if not (label and os.path.isfile(path)):
            print(
                f"error: {pair}: give LABEL=FOLDER, a folder that joint.py wrote (with eval.json)",
                file=sys.stderr,
            )
            sys.exit(2)
        with open(path) as f:
            runs[label] = json.load(f)["curve"]
    with open(stem + ".svg", "w") as f:
        f.write(joint_svg(runs))


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # the docstring says what it does and how to run it
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) > 3 and sys.argv[1] == "--joint":
        joint_main(sys.argv[2], sys.argv[3:])
        sys.exit(0)
    if len(sys.argv) != 3:
        print("usage: python experiments/plot_curves.py HEADS_FOLDER OUT_STEM", file=sys.stderr)
        sys.exit(2)
    folder, stem = sys.argv[1], sys.argv[2]
    curves = read_curves(folder)
    if not curves:
        print(
            f"error: no eval.json with a learning curve under {folder}; train heads with train.py "
            "first",
            file=sys.stderr,
        )
        sys.exit(2)
    with open(stem + ".md", "w") as f:
        f.write(table(curves))
    with open(stem + ".svg", "w") as f:
        f.write(svg(curves))
