"""Where a decode step's time goes, on this machine: the batch-1 step against its memory floor and
against its matrix products alone, then one speculative step of the shipped Hydra++ split into its
phases (draft, the base forward over the tree, verification, the heads' context on accept).

    python experiments/step_time.py [--prompts 8] [--max-new-tokens 64]

Prints a markdown table. Times are medians (the one-token step, the products) or means over every
step (the phases).
"""

import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specdec import tuning  # noqa: E402
from specdec.loading import checkpoint  # noqa: E402
from specdec.loading import catalog  # noqa: E402
from specdec import cli  # noqa: E402
from specdec import drafters as D  # noqa: E402
from specdec.engines import decode  # noqa: E402
from specdec.fast import kernels as K  # noqa: E402
import model as M  # noqa: E402
from specdec.fast import verifiers as V  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--prompts", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=64)
args = p.parse_args()

device = cli.pick_device("auto")
model, tok = checkpoint.load(checkpoint.DEFAULT, device, K.pick_dtype("auto", device))
floor = tuning.distance_to_floor(model, device)
print(tuning.machine_line(tuning.machine(device, model.dtype, **floor)) + "\n")

rows = [
    ("batch-1 decode step, 200 cached tokens", floor["batch_1_step_ms"])
]  # tuning.step_time, median of 20
if isinstance(model.lm_head, K.PackedLinear):  # the same step's matrix products alone, back to back
    products = [
        (a.self_attn.packed, a.self_attn.o_proj.packed, a.mlp.packed, a.mlp.down_proj.packed)
        for a in model.layers
    ]
    x, y = (
        torch.randn(1, 1, model.cfg.dim, dtype=model.dtype),
        torch.randn(1, 1, model.cfg.hidden_dim, dtype=model.dtype),
    )

    @torch.inference_mode()  # the prepacked path of kernels.linear
    def chain():
        for qkv, o, gate_up, down in products:
            for w, i in ((qkv, x), (o, x), (gate_up, x), (down, y)):
                K.linear(i, w)
        K.linear(x, model.lm_head.packed)

    chain()
    rows.append(
        (
            "its matrix products alone (the same prepacked weights)",
            statistics.median(tuning.timed(chain, device) for _ in range(60)) * 1e3,
        )
    )
rows.append(("memory floor (weights / measured bandwidth)", floor["bandwidth_floor_ms"]))

# one speculative step, phase by phase: wrap the drafter's methods, the forward and the verifier
heads, folder = catalog.load_heads("hydra++", model)
tree = catalog.load_tree("auto", heads, folder)
spent, calls = collections.defaultdict(float), collections.Counter()


def timed(f, label):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        out = f(*a, **kw)
        spent[label] += time.perf_counter() - t0
        calls[label] += 1
        return out

    return wrapper


forward = M.Transformer.forward
M.Transformer.forward = lambda self, tokens, *a, **kw: timed(
    forward,
    "prefill" if tokens.shape[1] > tree.num_nodes else f"forward, {tokens.shape[1]} token(s)",
)(self, tokens, *a, **kw)
V.greedy = timed(V.greedy, "verify (greedy)")
prompts = [
    checkpoint.encode(tok, json.loads(line)["prompt"])
    for line in open(os.path.join(os.path.dirname(__file__), "..", "eval", "prompts.jsonl"))
][: args.prompts]
for name, make in (("plain", lambda: None), ("hydra++", lambda: D.HeadsDrafter(heads, tree))):
    decode.generate(model, prompts[0], 8, make())  # warm-up
    spent.clear(), calls.clear()
    tokens = seconds = steps = 0
    for ids in prompts:
        d = make()
        if d is not None:
            d.draft, d.accept = (
                timed(d.draft, "draft (heads)"),
                timed(d.accept, "accept (heads' context)"),
            )
        r = decode.generate(model, ids, args.max_new_tokens, d)
        tokens, seconds, steps = tokens + len(r.tokens), seconds + r.seconds, steps + r.steps
    rows.append(
        (
            f"**{name}**: {tokens / seconds:.1f} tokens/s, tau {tokens / steps:.2f}, ms a step "
            "(prefill included)",
            seconds / steps * 1e3,
        )
    )
    rows += [
        (f"- {label}", spent[label] / calls[label] * 1e3) for label in spent if label != "prefill"
    ]
M.Transformer.forward = forward
print("| | ms |\n|---|---:|")
for label, ms in rows:
    print(f"| {label} | {ms:.2f} |")
