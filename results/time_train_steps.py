"""Times N training steps of one checkout of this repository on the same real batches, to compare
two versions of train.py side by side (each in its own process, alternating):

    git worktree add /tmp/before <commit>
    python results/time_train_steps.py /tmp/before FEATURES_FOLDER 62
    python results/time_train_steps.py . FEATURES_FOLDER 62

Hydra++ with train.py's defaults (K = 3, 8,192 kept tokens, 4,096 padded tokens a batch, seed 0,
bf16 products where --train-dtype auto picks them), the first N batches of epoch 0 in order; the
first 2 steps warm up and are not counted. Prints assistant tokens/s of the steps alone (no data
loading, no evaluation), the last loss (the same in both if the math is) and the process's
anonymous memory at the end. Run it alone: it times the machine.
"""
import os
import sys
import time

import torch


def anonymous_gb():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous")) / 1e6


def main(repo, folder, n):
    sys.path.insert(0, os.path.abspath(repo))
    import dataset
    import heads as heads_lib
    import model as model_lib
    import train
    model, _ = model_lib.load(model_lib.DEFAULT, torch.device("cpu"), torch.float32)
    data = dataset.load_data(folder)
    kept, to_kept, _ = train.kept_vocabulary(data, model.cfg.vocab_size, 8192)
    torch.manual_seed(0)
    heads = heads_lib.build(heads_lib.HeadsConfig(kind="hydra++", num_heads=3), model, kept).train()
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    _, train_convs = train.split(len(data["offsets"]) - 1, 0)
    batches = train.make_batches(data["offsets"].diff(), train_convs, 4096, 0, 0)
    bf16 = train.pick_dtype("auto", "cpu") == torch.bfloat16
    forward = train.TrainForward(heads)
    seconds, tokens = 0.0, 0
    for i in range(n):
        batch = train.collate(data, batches[i], to_kept, 3, torch.device("cpu"))
        t0 = time.perf_counter()
        loss = train.train_step(forward, opt, batch, 1e-3, "teacher", bf16=bf16)
        if i >= 2:
            seconds += time.perf_counter() - t0
            tokens += int(batch["valid"][..., 0].sum())
    print(f"{repo}: steps 3-{n}: {tokens / seconds:.0f} assistant tokens/s ({seconds:.1f} s), last loss {loss:.4f}, "
          f"anonymous memory {anonymous_gb():.2f} GB")


if __name__ == "__main__":
    if len(sys.argv) != 4 or not sys.argv[3].isdigit() or int(sys.argv[3]) < 3:
        print("usage: python results/time_train_steps.py REPO FEATURES_FOLDER N (N >= 3 steps)", file=sys.stderr)
        sys.exit(2)
    for path, what in ((sys.argv[1], "a checkout of this repository"), (sys.argv[2], "the features folder train.py built (its --work/self_distill)")):
        if not os.path.isdir(path):
            print(f"error: {path} is not a folder; give {what}", file=sys.stderr)
            sys.exit(2)
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
