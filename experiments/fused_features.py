"""Does Hydra++ gain from EAGLE-3's fused features? EAGLE-3 feeds its drafter a low, a middle and a
high layer of the base model through one linear map; Hydra++'s prefix layer reads only the last
hidden state. Both arms start from the shipped Hydra++ heads and train the same steps at the same
rates on the conversations joint.py uses (the first 1,500 of train.py's training split; evaluated
on the first 200 of its held-out split, which the heads never saw), the base model frozen:

    control: the heads alone, on the last hidden state h
    fused:   the prefix layer reads h + W [rms(x_2); rms(x_15); rms(x_27)], x_l the input of layer
             l (EAGLE-3's choice for a 30-layer model), W (D, 3D) starting at zero, so step 0 is
             the shipped heads

Writes a Markdown table of held-out chain tau and per-head top-1 against steps. The features (the
last hidden state and the three layers' inputs, fp16, ~1.8 GB) are computed once into --cache.

    python experiments/fused_features.py results/fused.json [EPOCHS] [CACHE]
"""

import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from specdec.loading import checkpoint  # noqa: E402
from specdec.loading import catalog  # noqa: E402
from specdec import cli  # noqa: E402
from specdec.training import dataset  # noqa: E402
from specdec.fast import kernels  # noqa: E402
from specdec.training import losses  # noqa: E402
from specdec.training import batches, prepare  # noqa: E402
from specdec.training.evaluate import evaluate as evaluate_heads  # noqa: E402
from ablations import fail  # noqa: E402  one line on stderr, exit code 2

LAYERS = (2, 15, 27)  # their inputs = the outputs of layers l - 1
CONVS, HELD_OUT = 1500, 200
DATA = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "data",
    "smollm2-135m-instruct-conversations.safetensors",
)


@torch.inference_mode()
def features(base):
    """A data dict as losses.collate reads, whose "hidden" is [h, x_2, x_15, x_27] (N, 4D)."""
    convs = dataset.read_conversations(DATA)
    held, trained = batches.split(len(convs), 0)
    order = trained[:CONVS] + held[:HELD_OUT]
    writer = prepare.data_model(base, "auto")
    caught = {}
    hooks = [
        writer.layers[l - 1].register_forward_hook(
            lambda m, a, out, l=l: caught.__setitem__(l, out)
        )
        for l in LAYERS
    ]
    cols = {k: [] for k in ("ids", "loss", "hidden", "top_ids", "top_p")}
    for i in order:
        ids, loss = convs[i]
        logits, hidden = writer(torch.tensor([ids]), torch.arange(len(ids)))
        top = logits[0].float().softmax(-1).topk(16, dim=-1)  # (T, 16)
        top_p = top.values.clone()
        top_p[-1] = 0  # the last position's next token is not in the data
        cols["ids"].append(torch.tensor(ids))
        cols["loss"].append(torch.tensor(loss, dtype=torch.bool))
        # (T, 4D)
        cols["hidden"].append(torch.cat([hidden[0]] + [caught[l][0] for l in LAYERS], -1).half())
        cols["top_ids"].append(top.indices)
        cols["top_p"].append(top_p.half())
    for h in hooks:
        h.remove()
    data = {k: torch.cat(v) for k, v in cols.items()}
    data["offsets"] = torch.tensor([0] + [len(convs[i][0]) for i in order]).cumsum(0)
    data["teacher_top1"] = torch.where(data["top_p"][:, 0] > 0, data["top_ids"][:, 0], -1)
    return data


class Fused(nn.Module):
    """Hydra++ heads whose prefix layer reads h + W [rms(x_a); rms(x_b); rms(x_c)]; with fuse=False
    (the control) h alone. Each input's RMS is normalised: the residual stream's scale differs by
    layer."""

    def __init__(self, heads, dim, fuse):
        super().__init__()
        self.heads, self.dim, self.cfg, self.lm_head = heads, dim, heads.cfg, heads.lm_head
        self.fuse = nn.Linear(len(LAYERS) * dim, dim, bias=False) if fuse else None
        if fuse:
            nn.init.zeros_(self.fuse.weight)

    def context(self, x, positions, cache=None):
        h = x[..., : self.dim]  # (B, T, D)
        if self.fuse is not None:
            lower = [F.rms_norm(p, (self.dim,)) for p in x[..., self.dim :].split(self.dim, -1)]
            h = h + self.fuse(torch.cat(lower, -1))
        return self.heads.context(h, positions, cache)

    def forward(self, h, tokens, at=None):
        return self.heads(h, tokens, at)

    def project(self, z, d=None):
        return self.heads.project(z, d)


def run(arm, base, data, epochs, lr_heads=1e-4, lr_fuse=1e-3, eval_every=90):
    """train.py's teacher loss and joint.py's schedule (warm-up 50 steps, cosine) -> [(step,
    report)]."""
    heads = kernels.use(
        checkpoint.load_heads(catalog.find_heads("hydra++", "--init"), base), kernels.Kernels()
    )
    model = Fused(heads, base.cfg.dim, arm == "fused")
    to_kept = losses.to_kept_map(heads.kept_ids.cpu(), base.cfg.vocab_size)
    heads.train().requires_grad_(True)
    for b in heads.buffers():
        b.requires_grad_(False)
    groups = [{"params": [p for p in heads.parameters() if p.requires_grad], "lr": lr_heads}]
    groups += (
        [{"params": list(model.fuse.parameters()), "lr": lr_fuse}] if model.fuse is not None else []
    )
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    peak = [g["lr"] for g in opt.param_groups]
    trained, held = list(range(CONVS)), list(range(CONVS, CONVS + HELD_OUT))
    args = type("Args", (), {"batch_tokens": 4096, "seed": 0})
    evaluate = lambda: evaluate_heads(
        model.eval(), data, held, to_kept, args, base.device, bf16=True
    )
    curve = [(0, evaluate())]
    model.train()
    batches = [
        b
        for e in range(epochs)
        for b in batches.make_batches(data["offsets"].diff(), trained, 4096, 0, e)
    ]
    forward, t0 = losses.TrainForward(model, "fused"), time.time()
    for step, convs_b in enumerate(batches, start=1):
        batch = losses.collate(data, convs_b, to_kept, heads.cfg.num_heads, base.device)
        for g, lr in zip(opt.param_groups, peak):
            g["lr"] = lr * min(1.0, step / 50) * 0.5 * (1 + math.cos(math.pi * step / len(batches)))
        with torch.autocast(base.device.type, dtype=torch.bfloat16):
            loss = forward(batch, "teacher", dtype=torch.bfloat16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        if step % eval_every == 0 or step == len(batches):
            curve.append((step, evaluate()))
            model.train()
            print(
                f"[{arm}] step {step}/{len(batches)}: chain tau {curve[-1][1]['chain_tau']:.4f}, "
                f"{time.time() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    return curve


def main(out, epochs, cache):
    torch.manual_seed(0)
    base, _ = checkpoint.load(checkpoint.DEFAULT, torch.device("cpu"), torch.float32)
    if os.path.exists(cache):
        data = load_file(cache)
    else:
        data = features(base)
        save_file(data, cache + ".tmp")
        os.replace(cache + ".tmp", cache)
    curves = {arm: run(arm, base, data, epochs) for arm in ("control", "fused")}
    with open(out, "w") as f:
        json.dump(
            {arm: [(s, r["chain_tau"], r["top1"]) for s, r in c] for arm, c in curves.items()},
            f,
            indent=1,
        )
    print(
        "| step | control: chain tau | top-1 head 1 / 2 / 3 | fused: chain tau | top-1 head 1 / 2 "
        "/ 3 |"
    )
    print("|---:|---:|---|---:|---|")
    for (s, a), (_, b) in zip(curves["control"], curves["fused"]):
        top = lambda r: " / ".join(f"{x:.3f}" for x in r["top1"])
        print(f"| {s} | {a['chain_tau']:.3f} | {top(a)} | {b['chain_tau']:.3f} | {top(b)} |")


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # the docstring says what it does and how to run it
        print(__doc__)
        sys.exit(0)
    if not 2 <= len(sys.argv) <= 4:
        fail("usage: python experiments/fused_features.py OUT.json [EPOCHS] [CACHE]")
    main(
        sys.argv[1],
        int(sys.argv[2]) if len(sys.argv) > 2 else 3,
        sys.argv[3]
        if len(sys.argv) > 3
        else os.path.join(cli.cache_root(), "fused-features.safetensors"),
    )
