"""What the row-invariant kernels (exact.py) cost on a GPU: one base-model step (a forward over a
tree of N nodes for B rows, a cache of --context tokens each) of a model shaped like the default
(SmolLM2-135M: 30 layers, D 576, 9 heads over 3, Dh 64, V 49152, hidden 1536; random weights,
bf16), through the fast path (what kernels.use leaves on a GPU: cuBLAS, SDPA) and through
exact.use, for batch 1 and 8 and trees of 1, 16 and 64 nodes. A column says whether the tree's
root got the bits of a one-token step (plain decoding), on each path.

    python experiments/exact_cost.py --out results/exact-cost-h100-bf16.md   # a CUDA GPU
    python experiments/exact_cost.py --tiny   # a tiny model on the CPU under TRITON_INTERPRET=1

Times are medians over --repeats steps after 3 warm-up steps, the device synchronised around each.
--tiny checks that the script runs (the interpreter is thousands of times slower): no measurement.
"""

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specdec.fast import kernels  # noqa: E402
import model as model_lib  # noqa: E402
from specdec import rows

SMOLLM2 = dict(  # SmolLM2-135M's shapes (weights/ holds the real ones)
    vocab_size=49152,
    dim=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    head_dim=64,
    hidden_dim=1536,
    tie_embeddings=True,
    max_seq_len=8192,
)
TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64)


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # what is measured
    p.add_argument("--batches", default="1,8", help="batch sizes B, comma-separated")
    p.add_argument("--trees", default="1,16,64", help="tree sizes N (nodes), comma-separated")
    p.add_argument("--context", type=int, default=512, help="cached tokens in every row")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per cell (median)")
    # where
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random model on the CPU under TRITON_INTERPRET=1, batches 1 and 2, trees of "
        "1 and 4 nodes, 16 cached tokens, one step each: a check that the script runs",
    )
    p.add_argument("--out", default=None, help="write the markdown table there (else stdout)")
    return p


def random_tree_mask(N, device):
    """The (N, N) mask of a bushy tree (node i under node i // 2); None for one node."""
    if N == 1:
        return None
    mask = torch.eye(N, dtype=torch.bool)
    for i in range(1, N):
        mask[i] |= mask[i // 2]
    return mask.to(device)


def step(m, tokens, mask, cache, context):
    """One forward of the tree for every row at slots [context, context + N): (B, N, V) logits."""
    B, N = tokens.shape
    cache.lengths = [context] * B  # a forward never moves them: each step writes the same slots
    depth = mask.sum(-1) - 1 if mask is not None else torch.zeros(1, dtype=torch.long)
    positions = (context + depth).to(tokens.device)  # (N,)
    logits, _ = m(tokens, positions, mask, cache)
    return logits


def timed(f, device, repeats, warmup):
    for _ in range(warmup):
        f()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3  # ms


@torch.inference_mode()
def measure(m, exact, batches, trees, context, repeats, warmup):
    """Rows of the table: (B, N, fast ms, exact ms, fast root exact?, exact root exact?)."""
    device = m.device
    g = torch.Generator().manual_seed(0)
    rows = []
    for B in batches:
        cache = m.new_cache(context + max(trees), batch=B)
        cache.k.normal_()  # a random prefix in every row
        cache.v.normal_()
        for N in trees:
            tokens = torch.randint(0, m.cfg.vocab_size, (B, N), generator=g).to(device)
            mask = random_tree_mask(N, device)
            cells = [B, N]
            roots = []
            for use in (lambda: kernels.use(exact.use(m, False)), lambda: exact.use(m)):
                use()
                run = lambda: step(m, tokens, mask, cache, context)
                cells.append(timed(run, device, repeats, warmup))
                tree = step(m, tokens, mask, cache, context)[:, 0]  # (B, V) the roots
                alone = step(m, tokens[:, :1], None, cache, context)[:, 0]  # (B, V)
                roots.append(torch.equal(tree, alone))
            rows.append(cells + roots)
    return rows


def table(rows, what, device, dtype, context, exact):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    triton = exact.triton.__version__ if exact.triton is not None else "none"
    lines = [
        f"Step time of {what} (random weights), {dtype}, {context} cached "
        f"tokens a row, on {name or device.type} (torch {torch.__version__}, triton {triton}); "
        "`python experiments/exact_cost.py`. Root = 1-token step: whether the tree's root got the "
        "bits of a one-token forward (plain decoding).",
        "",
        "| batch | tree nodes | fast path ms | exact ms | exact / fast "
        "| root = 1-token step: fast | exact |",
        "|---:|---:|---:|---:|---:|:---:|:---:|",
    ]
    for B, N, fast, slow, fast_same, exact_same in rows:
        lines.append(
            f"| {B} | {N} | {fast:.2f} | {slow:.2f} | {slow / fast:.2f} "
            f"| {'yes' if fast_same else 'no'} | {'yes' if exact_same else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.tiny:  # before triton is imported: its kernels are decorated for the interpreter then
        os.environ["TRITON_INTERPRET"] = "1"
    from specdec.fast import exact

    if args.tiny:
        what, shape, device = "a tiny model", TINY, torch.device("cpu")
        batches, trees, context, repeats, warmup = [1, 2], [1, 4], 16, 1, 0
    else:
        if not torch.cuda.is_available():
            sys.exit("exact_cost.py: needs a CUDA GPU (or --tiny, on the CPU)")
        what, shape, device = "a SmolLM2-135M-shaped model", SMOLLM2, torch.device("cuda")
        batches = [int(b) for b in args.batches.split(",")]
        trees = [int(n) for n in args.trees.split(",")]
        context, repeats, warmup = args.context, args.repeats, 3
    exact.check(device)  # triton there, and a GPU or the interpreter
    torch.manual_seed(0)
    cfg = model_lib.Config(**shape, name="random")
    m = rows.Model(cfg).eval().requires_grad_(False).to(device, torch.bfloat16)
    measured = measure(m, exact, batches, trees, context, repeats, warmup)
    text = table(measured, what, device, "bf16", context, exact)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
