"""Would a tree chosen afresh every step beat the fixed tuned one? EAGLE-2's dynamic tree, for
draft heads: at each depth expand the `width` likeliest nodes so far (a node's score: the product of
the heads' probabilities along its path), then keep the `budget` likeliest of all nodes expanded
(a child is never likelier than its parent, so they form a tree). Against the shipped Hydra++ with
its fixed tree, greedy, on eval/prompts.jsonl, every variant on every prompt in turn.

    python experiments/dynamic_tree.py [--repeats 1] [--max-new-tokens 64] [--budgets 4,6,8]

Prints a markdown table. Not in generate.py: measured (results/dynamic-tree.md, --repeats 2), it
gains too little for what it adds.
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
import tree as T  # noqa: E402


class DynamicTree(D.HeadsDrafter):
    def __init__(self, heads, budget, width=4, topk=4):
        super().__init__(heads, T.build(T.chain(heads.cfg.num_heads)))
        self.budget, self.width, self.topk = budget, width, topk
        self.shapes, self.max_nodes = D.Shapes(heads.lm_head.weight.device), budget + 1
        self.name = f"heads: {heads.cfg.kind}, dynamic tree: {budget} nodes + root"

    def draft(self, rows, roots):  # each row's tree chosen for it alone
        return [row.grow(root) for row, root in zip(rows, roots)]

    def grow(self, root):
        frontier, expanded = [(0.0, (), [root])], []  # (log p of the path, path, tokens root..node)
        for d in range(1, self.heads.cfg.num_heads + 1):
            z = self.heads.head(d, self.h, torch.tensor([f[2] for f in frontier]))  # (P|1, D)
            # (P|1, k)
            top = torch.log_softmax(self.heads.project(z, d).float(), -1).topk(self.topk)
            ids = self.heads.full_ids(top.indices).expand(len(frontier), -1).tolist()
            logp = top.values.expand(len(frontier), -1).tolist()
            children = [
                (s + lp, path + (r,), toks + [t])
                for (s, path, toks), lps, ts in zip(frontier, logp, ids)
                for r, (lp, t) in enumerate(zip(lps, ts))
            ]
            children.sort(key=lambda c: -c[0])
            expanded += children
            frontier = children[: self.width]
        expanded.sort(key=lambda c: (-c[0], len(c[1])))
        nodes = {}
        for _, path, toks in expanded:
            if len(nodes) == self.budget:
                break
            if len(path) == 1 or path[:-1] in nodes:
                nodes[path] = (toks[-1], len(path))  # source: head depth
        return self.shapes.draft(root, nodes)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--budgets", default="4,6,8", help="dynamic trees of these many nodes (root not counted)"
    )
    args = p.parse_args()

    device = cli.pick_device("auto")
    model, tok = checkpoint.load(checkpoint.DEFAULT, device, kernels.pick_dtype("auto", device))
    heads, folder = catalog.load_heads("hydra++", model)
    tree = catalog.load_tree("auto", heads, folder)
    variants = {
        f"fixed tuned tree, {tree.num_nodes - 1} nodes": lambda: D.HeadsDrafter(heads, tree)
    }
    for budget in map(int, args.budgets.split(",")):
        variants[f"dynamic, {budget} nodes"] = lambda b=budget: DynamicTree(heads, b)
    rows = [
        json.loads(line)
        for line in open(os.path.join(os.path.dirname(__file__), "..", "eval", "prompts.jsonl"))
    ]
    prompts = [checkpoint.encode(tok, r["prompt"]) for r in rows]
    decode.generate(
        model, prompts[0], 8, D.HeadsDrafter(heads, tree), eos_ids=model.cfg.eos_ids
    )  # warm-up
    done = {name: [0, 0.0, 0] for name in variants}  # tokens, seconds, steps
    for _ in range(args.repeats):
        for ids in prompts:
            for name, make in variants.items():
                out = decode.generate(
                    model, ids, args.max_new_tokens, make(), eos_ids=model.cfg.eos_ids
                )
                done[name][0] += len(out.tokens)
                done[name][1] += out.seconds
                done[name][2] += out.steps
    print(
        f"_{model.dtype}, {torch.get_num_threads()} threads, {len(prompts)} prompts, "
        f"{args.max_new_tokens} new tokens, "
        f"{args.repeats} repeat(s)_\n\n| drafter | tokens/s | tau |\n|---|---:|---:|"
    )
    for name, (n, s, steps) in done.items():
        print(f"| {name} | {n / s:.1f} | {n / steps:.2f} |")


if __name__ == "__main__":
    main()
