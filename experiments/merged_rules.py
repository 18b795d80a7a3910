"""Which rules make heads + lookup pay? Tokens/s of drafters.HeadsPlusLookup under each combination
of its two newer rules, on eval/prompts.jsonl, greedy, every variant on every prompt in turn (so a
burst of machine noise hits all alike), against the better of hydra++ and lookup alone per category.

    python experiments/merged_rules.py [--repeats 1] [--max-new-tokens 64] [--json FILE] [--limit N]

shortest: lookup proposes matches of at least this many tokens; floor: the step keeps the heads'
tree size, at least `floor` heads nodes (None: both trees whole). Both variants keep the older rules
(lookup's chain adapts its length, and is verified alone while it copies). catalog.heads_and_lookup
is shortest 2, floor 4: with the shipped Hydra++'s 4-node tree the heads' tree stays whole, as with
floor None. Prints a markdown table: overall tokens/s, then per category the ratio to
max(hydra++, lookup) in that category (results/merged-rules.md: --repeats 3 --max-new-tokens 128).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specdec.loading import checkpoint  # noqa: E402
from specdec.fast import kernels  # noqa: E402
from specdec.loading import catalog  # noqa: E402
from specdec import cli  # noqa: E402
from specdec import drafters as D  # noqa: E402
from specdec.engines import decode  # noqa: E402

p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
p.add_argument("--repeats", type=int, default=1, help="every variant on every prompt this often")
p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens a reply")
p.add_argument("--json", help="also write the tokens and seconds to this file")
p.add_argument("--limit", type=int, default=0, help="the first N prompts only (0: all)")
args = p.parse_args()

device = cli.pick_device("auto")
model, tok = checkpoint.load(checkpoint.DEFAULT, device, kernels.pick_dtype("auto", device))
heads, folder = catalog.load_heads("hydra++", model)
tree = catalog.load_tree("auto", heads, folder)
dev, look = model.device, catalog.DRAFT_DEFAULTS["lookup"]
rows = [
    json.loads(line)
    for line in open(os.path.join(os.path.dirname(__file__), "..", "eval", "prompts.jsonl"))
]

H = lambda: D.HeadsDrafter(heads, tree)
L = lambda **kw: D.Lookup(look["gamma"], look["ngram"], look["matches"], dev, **kw)
variants = {"lookup": lambda: L(), "hydra++": H}
for shortest, floor in [(1, None), (2, None), (1, 3), (2, 3)]:
    variants[f"merged shortest {shortest}, floor {floor}"] = lambda s=shortest, f=floor: (
        D.HeadsPlusLookup(H(), L(adapt=True, shortest=s), dev, floor=f)
    )

prompts = [(r["category"], checkpoint.encode(tok, r["prompt"])) for r in rows[: args.limit or None]]
decode.generate(model, prompts[0][1], 8, H(), eos_ids=model.cfg.eos_ids)  # warm-up
done = {name: {} for name in variants}  # name -> category -> [tokens, seconds]
for _ in range(args.repeats):
    for cat, ids in prompts:
        for name, make in variants.items():
            out = decode.generate(
                model, ids, args.max_new_tokens, make(), eos_ids=model.cfg.eos_ids
            )
            c = done[name].setdefault(cat, [0, 0.0])
            c[0], c[1] = c[0] + len(out.tokens), c[1] + out.seconds

rate = lambda name, cat: done[name][cat][0] / done[name][cat][1]
cats = list(done["lookup"])
print(
    f"_{model.dtype}, {torch.get_num_threads()} threads, {len(prompts)} prompts, "
    f"{args.max_new_tokens} new tokens, "
    f"{args.repeats} repeat(s); per category: tokens/s over max(hydra++, lookup)_\n"
)
print("| variant | tokens/s | " + " | ".join(cats) + " |\n|---|---:|" + "---:|" * len(cats))
for name in variants:
    total = sum(v[0] for v in done[name].values()) / sum(v[1] for v in done[name].values())
    ratios = [rate(name, c) / max(rate("lookup", c), rate("hydra++", c)) for c in cats]
    print(f"| {name} | {total:.1f} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
if args.json:
    with open(args.json, "w") as f:
        json.dump(done, f, indent=1)
