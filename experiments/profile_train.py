"""Where a training step's time goes: times 20 steps of losses.train_step on real features (after 4
warm-up ones), then profiles one with FLOP counting, and prints the FLOPs, the share of time in
matrix products and their rate next to a large square product's on the same cores (the machine's
practical peak).

    python experiments/profile_train.py /work/data/smollm2/self_distill hydra++

Arguments: the features folder train.py built (its --work/self_distill) and the kind of heads.
The defaults of train.py otherwise (K = 3, 8,192 kept tokens, 4,096 padded tokens a batch, seed 0;
bf16 products where --train-dtype auto picks them, else fp32; the peak is measured in the same
dtype). Run it alone: it times the machine. To compare two versions of train.py, run each
checkout's own copy of this script, alternating: the same batches, the step alone (no data loading,
no evaluation).
"""

import os
import resource
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from specdec.loading import checkpoint  # noqa: E402
from specdec.training import dataset  # noqa: E402
import heads as heads_lib  # noqa: E402
from specdec.fast import kernels  # noqa: E402
from specdec.training import losses  # noqa: E402
from specdec.training.batches import kept_vocabulary, make_batches, split  # noqa: E402
from ablations import fail  # noqa: E402  one line on stderr, exit code 2

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")
STEPS, WARM_UP = 24, 4


def peak_rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KB


def square_peak(dtype, n=2048, repeats=5):
    """GFLOP/s of an (n, n) @ (n, n) product in `dtype`, median of repeats."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / sorted(times)[repeats // 2] / 1e9


def main(folder, kind):
    model, _ = checkpoint.load(checkpoint.DEFAULT, torch.device("cpu"), torch.float32)
    data = dataset.load_data(folder)
    kept, to_kept, _ = kept_vocabulary(data, model.cfg.vocab_size, 8192)
    torch.manual_seed(0)
    heads = heads_lib.build(heads_lib.HeadsConfig(kind=kind, num_heads=3), model, kept).train()
    opt = torch.optim.AdamW(
        [p for p in heads.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0
    )
    _, train_convs = split(len(data["offsets"]) - 1, 0)
    batches = make_batches(data["offsets"].diff(), train_convs, 4096, 0, 0)
    bf16 = kernels.pick_dtype("auto", "cpu", native=False) == torch.bfloat16
    forward = losses.TrainForward(heads)
    step = lambda batch: losses.train_step(forward, opt, batch, 1e-4, "teacher", bf16=bf16)
    timed_tokens, timed_seconds = 0, 0.0
    for i in range(STEPS):  # the first WARM_UP steps warm up the allocator and the kernels, untimed
        batch = losses.collate(data, batches[i], to_kept, 3, torch.device("cpu"))
        t0 = time.perf_counter()
        loss = step(batch)
        seconds = time.perf_counter() - t0
        tokens = int(batch["valid"][..., 0].sum())
        if i >= WARM_UP:
            timed_tokens, timed_seconds = timed_tokens + tokens, timed_seconds + seconds
        print(
            f"step {i}: {tuple(batch['ids'].shape)} padded, {tokens} assistant tokens, "
            f"{seconds:.2f} s: {tokens / seconds:.0f} tokens/s"
        )
    print(
        f"steps {WARM_UP}-{STEPS - 1}: {timed_tokens} assistant tokens in {timed_seconds:.1f} s: "
        f"{timed_tokens / timed_seconds:.0f} "
        f"tokens/s (the step alone: no data loading, no evaluation); last loss {loss:.4f}; peak "
        f"RSS {peak_rss_gb():.1f} GB"
    )
    batch = losses.collate(data, batches[STEPS], to_kept, 3, torch.device("cpu"))
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        step(batch)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / 1e6
    gflop = sum(e.flops for e in events if e.flops) / 1e9
    print(
        f"profiled step: {int(batch['valid'][..., 0].sum())} assistant tokens, "
        f"{int(batch['valid'].sum())} predictions, "
        f"{gflop:.0f} GFLOP; {total:.2f} s, of which matrix products {mm:.2f} s "
        f"({mm / total:.0%}) at {gflop / mm:.0f} GFLOP/s"
    )
    dtype = torch.bfloat16 if bf16 else torch.float32  # what the step's products run in
    print(
        f"a 2048 x 2048 {str(dtype).removeprefix('torch.')} product on these cores: "
        f"{square_peak(dtype):.0f} GFLOP/s"
    )
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # the docstring says what it does and how to run it
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) != 3 or sys.argv[2] not in ("medusa", "hydra", "hydra++"):
        fail("usage: python experiments/profile_train.py FEATURES_FOLDER medusa|hydra|hydra++")
    if not os.path.isdir(sys.argv[1]):
        fail(
            f"error: {sys.argv[1]} is not a folder; give the features folder train.py built (its "
            "--work/self_distill)"
        )
    main(sys.argv[1], sys.argv[2])
