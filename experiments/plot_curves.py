"""Learning curves of the shipped heads: held-out chain tau against assistant tokens trained on,
read from the `curve` that train.py keeps in each eval.json. Writes a Markdown table and an SVG
plot (hand-written: the project does not depend on a plotting library).

    python experiments/plot_curves.py weights/smollm2-135m-instruct results/learning-curves
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
    lines = ["| heads | assistant tokens trained on | held-out chain tau | held-out top-1 per head |", "|---|---:|---:|---|"]
    for kind, curve in curves.items():
        for p in curve:
            lines.append(f"| {kind} | {p['tokens']:,} | {p['chain_tau']:.3f} | {' '.join(f'{a:.2f}' for a in p['top1'])} |")
    return "\n".join(lines) + "\n"


def svg(curves, w=640, h=400, pad=60):
    xs = [p["tokens"] for c in curves.values() for p in c]
    ys = [p["chain_tau"] for c in curves.values() for p in c]
    x1, y0, y1 = max(xs), 1.0, max(ys) * 1.05
    X = lambda x: pad + (w - 2 * pad) * x / x1
    Y = lambda y: h - pad - (h - 2 * pad) * (y - y0) / (y1 - y0)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
           f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">assistant tokens trained on (millions)</text>',
           f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" text-anchor="middle">held-out chain tau</text>']
    for i in range(5):
        x, y = x1 * i / 4, y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{X(x)}" y="{h - pad + 16}" text-anchor="middle">{x / 1e6:.2f}</text>')
        out.append(f'<text x="{pad - 6}" y="{Y(y) + 4}" text-anchor="end">{y:.2f}</text>')
    for n, (kind, curve) in enumerate(curves.items()):
        points = " ".join(f"{X(p['tokens']):.1f},{Y(p['chain_tau']):.1f}" for p in curve)
        out.append(f'<polyline points="{points}" fill="none" stroke="{COLOURS[kind]}" stroke-width="2"/>')
        out.append(f'<text x="{pad + 10}" y="{pad + 16 * n}" fill="{COLOURS[kind]}">{kind}</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python experiments/plot_curves.py HEADS_FOLDER OUT_STEM", file=sys.stderr)
        sys.exit(2)
    folder, stem = sys.argv[1], sys.argv[2]
    curves = read_curves(folder)
    if not curves:
        print(f"error: no eval.json with a learning curve under {folder}; train heads with train.py first", file=sys.stderr)
        sys.exit(2)
    with open(stem + ".md", "w") as f:
        f.write(table(curves))
    with open(stem + ".svg", "w") as f:
        f.write(svg(curves))
