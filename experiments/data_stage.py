"""The data stage's decoding speed: train.py's self-distillation (dataset.decode, the one decode
loop with a queue and the teacher's top-k recorded) over the eval prompts three times, greedy, for
each dtype and batch size given.

    python experiments/data_stage.py [--dtypes fp32,bf16] [--batches 128] [--max-new-tokens 64]

Prints a markdown table: new tokens/s of each run, one run each, in the order given.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specdec.loading import checkpoint  # noqa: E402
from specdec.training import dataset  # noqa: E402
from specdec.fast import kernels  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--batches", default="128")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--top-k", type=int, default=16)
    args = p.parse_args()
    with open(os.path.join(HERE, "eval", "prompts.jsonl")) as f:
        texts = [json.loads(line)["prompt"] for line in f] * 3
    print("| dtype | batch | prompts | new tokens | seconds | new tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.dtypes.split(","):
        model, tok = checkpoint.load(
            checkpoint.DEFAULT, "cpu", kernels.pick_dtype(name, "cpu", native=False)
        )
        prompts = [checkpoint.encode(tok, t) for t in texts]
        for batch in map(int, args.batches.split(",")):
            start = time.perf_counter()
            out = dataset.decode(
                model, prompts, args.max_new_tokens, model.cfg.eos_ids, batch, top_k=args.top_k
            )
            seconds = time.perf_counter() - start
            new = sum(len(ids) for ids, _ in out)
            print(
                f"| {name} | {batch} | {len(prompts)} | {new:,} | {seconds:.1f} | "
                f"{new / seconds:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    with torch.inference_mode():
        main()
