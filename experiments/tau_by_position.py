"""Held-out chain tau by where in its answer a decoding step is: do the heads lose tau on the
evaluation prompts because those prompts differ from the self-distilled ones, or because bench.py
decodes only the first 64 tokens of each answer, where the heads may do worse than further on?

specdec/training/evaluate.py measures the chain tau over every position of every held-out answer
(the 5% split train.py holds out). Here the same measurement is repeated with the assistant mask
cut to a window of answer positions: a head counts at position t only if every token it and the
heads before it predict lies in the window, so each window's tau is that of decoding steps inside
it (the last K positions of a window, whose chain would reach past it, are left out).
Writes a Markdown table.

    python experiments/tau_by_position.py /work/data/smollm2/self_distill results/tau-by-position.md
    \
        medusa=weights/smollm2-135m-instruct/medusa hydra=... hydra++=...
"""

import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from specdec.loading import checkpoint  # noqa: E402
import data_size  # noqa: E402
from specdec.training import dataset  # noqa: E402
from specdec.fast import kernels  # noqa: E402
from specdec.training import losses  # noqa: E402
from specdec.training import batches  # noqa: E402
from specdec.training.evaluate import evaluate  # noqa: E402
import tree as tree_lib  # noqa: E402
from specdec import tuning  # noqa: E402
from ablations import fail  # noqa: E402  one line on stderr, exit code 2

WINDOWS = [(0, 16), (16, 64), (0, 64), (64, 1 << 30), (0, 1 << 30)]  # answer positions [a, b)


def answer_positions(loss):
    """(N,) bool, True on assistant tokens -> (N,) long: each token's position in its answer (its
    run of assistant tokens; a run never crosses conversations, which start with a system or user
    turn)."""
    idx = torch.arange(len(loss))
    starts = loss & ~torch.cat([torch.zeros(1, dtype=torch.bool), loss[:-1]])
    return idx - torch.cummax(torch.where(starts, idx, 0), 0).values


def measure(model, data, runs, seed=0, bf16=True):
    held_out, _ = batches.split(len(data["offsets"]) - 1, seed)
    loss = data["loss"]
    pos = answer_positions(loss)
    args = types.SimpleNamespace(batch_tokens=4096, seed=seed)
    rows = {}
    for label, folder in runs:
        heads = checkpoint.load_heads(folder, model).eval()
        # the readable path: fp32 prepacked weights refuse bf16 autocast
        kernels.use(heads, kernels.Kernels())
        saved = os.path.join(folder, "tree.json")
        shipped = (
            tree_lib.load(saved) if os.path.exists(saved) else tree_lib.chain(heads.cfg.num_heads)
        )
        to_kept = losses.to_kept_map(
            None if heads.kept_ids is None else heads.kept_ids.cpu(), model.cfg.vocab_size
        )
        for a, b in WINDOWS:
            window = dict(data, loss=loss & (pos >= a) & (pos < b))
            with torch.inference_mode():
                r = evaluate(heads, window, held_out, to_kept, args, torch.device("cpu"), bf16)
            r["trees"] = [
                tuning.expected_tau(r["rank_acceptance"], paths)
                for paths in (shipped, tuning.sparse(r["rank_acceptance"], 64))
            ]
            rows.setdefault(label, []).append(r)
            print(label, a, b, f"chain tau {r['chain_tau']:.3f}", flush=True)
    return len(held_out), rows


def table(n, rows):
    name = lambda a, b: f"{a}-{b - 1}" if b < 1 << 30 else f"{a}-"
    header = [
        "| heads | " + " | ".join(f"positions {name(a, b)}" for a, b in WINDOWS) + " |",
        "|---|" + "---:|" * len(WINDOWS),
    ]
    lines = [
        f"Held-out chain tau (train.py's evaluation, bf16 products) of the {n:,} conversations "
        "train.py held out, by the answer positions of the decoding step (top-1 per head in "
        "brackets).",
        "",
        *header,
    ]
    for label, rs in rows.items():
        cells = [f"{r['chain_tau']:.2f} ({' '.join(f'{x:.2f}' for x in r['top1'])})" for r in rs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Expected tau from each window's rank acceptance: the folder's tree.json (a chain without "
        "one) / a 64-node sparse tree.",
        "",
        *header,
    ]
    for label, rs in rows.items():
        lines.append(
            f"| {label} | "
            + " | ".join(f"{r['trees'][0]:.2f} / {r['trees'][1]:.2f}" for r in rs)
            + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # the docstring says what it does and how to run it
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) < 4 or any("=" not in a for a in sys.argv[3:]):
        fail(
            "usage: python experiments/tau_by_position.py FEATURES OUT.md LABEL=FOLDER "
            "[LABEL=FOLDER ...]"
        )
    runs = data_size.checked_runs(sys.argv[1], sys.argv[3:])
    try:
        data = dataset.load_data(sys.argv[1])
        model, _ = checkpoint.load(checkpoint.DEFAULT, torch.device("cpu"), torch.float32)
        n, rows = measure(model, data, runs)
    except data_size.BAD_INPUT as e:
        data_size.bad_input(e)
    with open(sys.argv[2], "w") as f:
        f.write(table(n, rows))
