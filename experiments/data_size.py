"""Held-out tau against the amount of training data: several heads folders, trained on different
amounts of the same self-distilled set, measured on the same conversations, ones none of them saw.

Each train.py run holds out its own 5% (the split depends on the number of conversations), so the
eval.json of runs on 4,992 and on 11,767 conversations describe different held-out sets. This script
takes the held-out 5% of the largest set (FEATURES, the split train.py makes for it) and keeps the
conversations after the first FIRST_FRESH (0-based index >= FIRST_FRESH): heads trained on the first
FIRST_FRESH never saw them, nor did the heads trained on the whole set (held out). Writes a Markdown
table and an SVG bar chart (ablations.py's).

    python experiments/data_size.py /work/data/smollm2/self_distill 11767 results/data-size \
        "medusa 141k=old/medusa" "medusa 892k=v3/medusa" "medusa
        5.02M=weights/smollm2-135m-instruct/medusa" ...
"""

import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ablations  # noqa: E402
from specdec.loading import checkpoint  # noqa: E402
from specdec.training import dataset  # noqa: E402
import heads as heads_lib  # noqa: E402
from specdec.training import losses  # noqa: E402
from specdec.training import batches  # noqa: E402
from specdec.training.evaluate import evaluate  # noqa: E402
from ablations import fail  # noqa: E402  one line on stderr, exit code 2


def measure(model, data, first_fresh, runs, seed=0):
    """(a line saying what was measured, {label: evaluate's report}) for (label, heads folder)
    pairs, all on the same held-out conversations."""
    held_out, _ = batches.split(len(data["offsets"]) - 1, seed)
    convs = sorted(c for c in held_out if c >= first_fresh)
    if not convs:
        fail(
            f"error: no held-out conversation comes after the first {first_fresh:,}; give a "
            "smaller FIRST_FRESH"
        )
    tokens = int(
        sum(data["loss"][data["offsets"][c] : data["offsets"][c + 1]].sum() for c in convs)
    )
    args = types.SimpleNamespace(batch_tokens=4096, seed=seed)
    what = (
        f"Measured on {len(convs)} held-out conversations ({tokens:,} assistant tokens) that come "
        "after "
        f"the first {first_fresh:,}, which no run below trained on."
    )
    reports = {}
    for label, folder in runs:
        heads = checkpoint.load_heads(folder, model).eval()
        to_kept = losses.to_kept_map(
            None if heads.kept_ids is None else heads.kept_ids.cpu(), model.cfg.vocab_size
        )
        with torch.inference_mode():
            reports[label] = evaluate(heads, data, convs, to_kept, args, torch.device("cpu"))
        print(label, f"chain tau {reports[label]['chain_tau']:.3f}", flush=True)
    return what, reports


def table(what, reports):
    lines = [what, "", "| run | held-out chain tau | held-out top-1 per head |", "|---|---:|---|"]
    for label, r in reports.items():
        lines.append(
            f"| {label} | {r['chain_tau']:.3f} | {' '.join(f'{a:.2f}' for a in r['top1'])} |"
        )
    return "\n".join(lines) + "\n"


# what a wrong folder raises
BAD_INPUT = (
    OSError,
    ValueError,
    heads_lib.HeadsError,
    checkpoint.LoadError,
)


def checked_runs(features, pairs):
    """The command line's LABEL=FOLDER pairs as (label, folder), each folder holding heads, and the
    FEATURES folder: checked before anything loads (one line, exit code 2)."""
    runs = [tuple(a.rsplit("=", 1)) for a in pairs]
    for _, folder in runs:
        if not os.path.isfile(os.path.join(folder, "heads.json")):
            fail(f"error: {folder} has no heads.json; give a folder that train.py wrote heads into")
    if not os.path.isdir(features):
        fail(
            f"error: {features} is not a folder; give the features folder train.py built (its "
            "--work/self_distill)"
        )
    return runs


def bad_input(e):
    fail(f"error: {e}; give the default model's features folder and heads trained for it")


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # the docstring says what it does and how to run it
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) < 5 or not sys.argv[2].isdigit() or any("=" not in a for a in sys.argv[4:]):
        fail(
            "usage: python experiments/data_size.py FEATURES FIRST_FRESH OUT_STEM LABEL=FOLDER "
            "[LABEL=FOLDER ...]"
        )
    runs = checked_runs(sys.argv[1], sys.argv[4:])
    try:
        data = dataset.load_data(sys.argv[1])
        model, _ = checkpoint.load(checkpoint.DEFAULT, torch.device("cpu"), torch.float32)
        what, reports = measure(model, data, int(sys.argv[2]), runs)
    except BAD_INPUT as e:
        bad_input(e)
    with open(sys.argv[3] + ".md", "w") as f:
        f.write(table(what, reports))
    with open(sys.argv[3] + ".svg", "w") as f:
        f.write(ablations.svg(reports))
