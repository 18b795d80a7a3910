"""Which layers to skip, and does it pay: the measurements behind results/skip-layers.md.

bench.py --tune-skip stops its search where it stops finding faster sets. Here, on the same
calibration replies (eval/calibration.jsonl, the default model's greedy answers) and with the same
code (tuning.skip_step_ms, skip_row, greedy_removal), one part at a time (each under ten minutes on
a 2-core CPU), written to OUT.json:

    path      the greedy search carried on to half the layers skipped; beside each set, the first
              layers at equal cost (as many layers run) and the step times
    random    random sets of 1, 2 and 4 skipped layers (every one of the 30 sets of 1, 24 of the
              others: more than the search tried): does the greedy search find sets as good?
    decode    real decoding of the 44 eval prompts (eval/prompts.jsonl) at equal draft cost: the
              searched sets of 1 and 4 skipped layers against the first 29 and 26 layers, tau and
              acceptance per depth (chains of 4)

    python experiments/skip_layers.py path /tmp/skip/path.json
    python experiments/skip_layers.py random /tmp/skip/random.json
    python experiments/skip_layers.py decode /tmp/skip/decode.json /tmp/skip/path.json
"""

import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specdec.loading import catalog  # noqa: E402
from specdec.loading import checkpoint  # noqa: E402
from specdec import cli  # noqa: E402
from specdec import drafters  # noqa: E402
from specdec.engines import decode  # noqa: E402
from specdec.fast import kernels  # noqa: E402
from specdec import tuning  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
G = 8  # the longest chain tried
NEW = 64  # new tokens a reply


def load():
    torch.set_num_threads(2)
    dtype = kernels.pick_dtype("auto", "cpu")
    model, tokenizer = checkpoint.load(checkpoint.DEFAULT, "cpu", dtype)
    eos = checkpoint.eos_ids(model, tokenizer)
    return model, tokenizer, eos


def prompts(tokenizer, file):
    return [checkpoint.encode(tokenizer, text) for _, text, _ in cli.read_prompts(file)]


@torch.inference_mode()
def calibration(model, tokenizer, eos):
    ids = prompts(tokenizer, os.path.join(ROOT, "eval", "calibration.jsonl"))
    replies = [(p, decode.generate(model, p, NEW, None, eos_ids=eos).tokens) for p in ids]
    prefix = [t for p in ids for t in p][:200]
    return replies, tuning.skip_step_ms(model, prefix, G, 5)


def plain(row):
    return row | {"skip": list(row["skip"])}


@torch.inference_mode()
def main(part, out, *more):
    model, tokenizer, eos = load()
    L = model.cfg.n_layers
    result = {"dtype": str(model.dtype), "path": catalog.cpu_path("cpu")}
    if part in ("path", "random"):
        replies, ms = calibration(model, tokenizer, eos)
        rows = {}

        def score(skipped):
            if skipped not in rows:
                rows[skipped] = tuning.skip_row(model, replies, skipped, ms, G)
            return rows[skipped]["tokens_per_s"]

        result["draft_ms"] = {k: ms["draft", k] for k in range(1, L)}
        result["verify_ms"] = {g: ms["verify", g] for g in range(0, G + 1)}
    if part == "path":
        path, best = tuning.greedy_removal(
            L, score, patience=L, rounds=L // 2, report=lambda s: print(s, file=sys.stderr)
        )
        first = [tuple(range(L - len(s), L)) for s in path]
        result["searched"] = [plain(rows[s]) for s in path]
        result["first_n"] = [plain(tuning.skip_row(model, replies, f, ms, G)) for f in first]
        result["sets_measured"] = len(rows)
    if part == "random":
        pick = random.Random(0)
        result["random"] = {}
        for n, tries in ((1, L), (2, 24), (4, 24)):
            drawn = (tuple(sorted(pick.sample(range(L), n))) for _ in range(tries * 10))
            sets = list(dict.fromkeys(drawn))[:tries]  # distinct, in the order drawn
            scored = [plain(tuning.skip_row(model, replies, s, ms, G)) for s in sets]
            result["random"][n] = scored
            print(n, max(r["tau"] for r in scored), file=sys.stderr)
    if part == "decode":
        with open(more[0]) as f:
            searched = json.load(f)["searched"]
        ids = prompts(tokenizer, os.path.join(ROOT, "eval", "prompts.jsonl"))
        result["decode"] = []
        for n in (1, 4):
            skip = tuple(searched[n - 1]["skip"])
            for name, s in ((f"skip:{catalog.skip_spec(skip)}", skip), (f"layers:{L - n}", None)):
                kept = [i for i in range(L) if i not in s] if s else list(range(L - n))
                accepted, tokens, steps = [], 0, 0
                for p in ids:
                    d = drafters.ModelDrafter(model, 4, 0.0, 1.0, None, kept, name)
                    r = decode.generate(model, p, NEW, d, eos_ids=eos)
                    accepted += r.accepted
                    tokens += len(r.tokens)
                    steps += r.steps
                row = {
                    "draft": name,
                    "layers_run": len(kept),
                    "tau_steps": tokens / steps,  # the prefill counted, as bench.py's tau
                    "reach": decode.acceptance_by_depth(accepted, 4),
                }
                result["decode"].append(row)
                print(row, file=sys.stderr)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # the docstring says what it does and how to run it
        print(__doc__)
        sys.exit(0)
    needs = {"path": 3, "random": 3, "decode": 4}  # the part -> how many words the command has
    if len(sys.argv) < 2 or needs.get(sys.argv[1]) != len(sys.argv):
        sys.exit("usage: python experiments/skip_layers.py path|random|decode OUT.json [PATH.json]")
    main(*sys.argv[1:])
