"""Medusa heads served by vLLM itself: the shipped heads exported with python -m specdec.export, the
default model greedy on the evaluation prompts through vLLM's engine, plain and with the heads
(speculative_config method medusa), at each dtype: how many replies are token-identical to plain,
vLLM's own acceptance counters, its tokens/s. Needs vLLM in its own virtual environment
(requirements-vllm.txt; README, "Serve with vLLM"). Writes a Markdown table.

    venv-vllm/bin/python experiments/vllm_medusa.py --out results/vllm-cpu.md

vLLM keeps an engine's state per process, so each engine runs in a process of its own: bench.py's
(specdec/benching/in_vllm.py's serve_apart, vllm_worker.py), given every prompt at once as the
chat template's ids. tests/test_vllm.py runs serve_apart below.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from safetensors.torch import load_file  # noqa: E402

from specdec import cli  # noqa: E402
from specdec import export  # noqa: E402
from specdec.benching import in_vllm  # noqa: E402
from specdec.loading import catalog  # noqa: E402
from specdec.loading import checkpoint  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtypes -> vLLM's name


# --- one engine, in a process of its own ---------------------------------------------------------


def prompts(base, limit):
    """The first `limit` evaluation prompts as chats: their ids in the base model's template, and
    the token that ends a reply."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    with open(os.path.join(ROOT, "eval", "prompts.jsonl")) as f:
        texts = [json.loads(line)["prompt"] for line in f][:limit]
    return [checkpoint.encode(tokenizer, text) for text in texts], tokenizer.eos_token_id


def serve_apart(base, heads, dtype, limit, max_tokens, weights_track=True):
    """vLLM's engine on `base` (heads None: plain; else the draft in the folder `heads`: Medusa
    heads or an EAGLE-3 layer, as specdec.export wrote them), greedy on the first `limit`
    evaluation prompts, all at once, in a process of its own: {vllm, ids, tokens, seconds,
    counters}. weights_track False turns off the loader's check that
    every parameter was in the checkpoint."""
    ids, eos = prompts(base, limit)
    draft = {}
    if heads:  # its method (medusa, eagle3) from the folder's config.json
        draft = {
            "draft": heads,
            "method": in_vllm.speculative_method(heads),
            "speculative_tokens": 3,
        }
    return in_vllm.serve_apart(
        in_vllm.find_python("auto"),
        base,
        ids,
        max_tokens,
        [eos],
        dtype=DTYPES[dtype],
        threads=len(os.sched_getaffinity(0)),
        max_model_len=1024,
        log=os.path.join(cli.cache_root(), "vllm", "logs", "vllm_medusa.log"),
        weights_track=weights_track,
        **draft,
    )


# --- engines apart, compared ---------------------------------------------------------------------


def export_default(folder):
    """The shipped Medusa heads and the default model, written by specdec.export as vLLM reads them
    (fp32): (base folder, heads folder)."""
    base = os.path.join(folder, "base")
    heads = os.path.join(folder, "medusa")
    argv = ["--heads", "medusa", "--out", heads, "--base-out", base, "--dtype", "fp32"]
    if code := export.cli_main(argv):
        sys.exit(code)
    return base, heads


def export_eagle3(folder):
    """An EAGLE-3 layer for the default model exported as vLLM reads it (fp32): the shipped one
    where there is one, else a fresh layer (eagle3.build: the base's own next-token guess one
    layer on, the shipped heads' draft vocabulary), trained for nothing: a check of the format."""
    layer = os.path.join(folder, "eagle3-layer")
    if not os.path.isdir(os.path.join(catalog.SHIPPED, "eagle3")):
        import torch

        from specdec import eagle3

        base, _ = checkpoint.load(checkpoint.DEFAULT, "cpu", torch.float32)
        kept = load_file(os.path.join(catalog.find_heads("hydra++"), checkpoint.HEADS_WEIGHTS))
        checkpoint.save_heads(eagle3.build(base, kept["kept_ids"]), layer)
    out = os.path.join(folder, "eagle3")
    argv = ["--heads", layer if os.path.isdir(layer) else "eagle3", "--out", out, "--dtype", "fp32"]
    if code := export.cli_main(argv):
        sys.exit(code)
    return out


def kept_form(heads, out):
    """vLLM's reduced form of the exported shipped heads (folder `heads`, the full vocabulary) into
    `out`: the LM head's rows of the 8,192 tokens the shipped heads keep, their token_map and
    truncated_vocab_size (what specdec.export wrote before; vLLM 0.32 loads it only with its
    loader's weight check off, as its Medusa loader does not report token_map loaded)."""
    shipped = catalog.find_heads("medusa")
    kept = load_file(os.path.join(shipped, checkpoint.HEADS_WEIGHTS))["kept_ids"]  # (V',)
    tensors = load_file(os.path.join(heads, export.WEIGHTS))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][kept].contiguous()  # (V', D)
    tensors["token_map"] = kept
    with open(os.path.join(heads, export.CONFIG)) as f:
        config = json.load(f) | {"truncated_vocab_size": len(kept)}
    os.makedirs(out)
    checkpoint.save_tensors(tensors, os.path.join(out, export.WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out, export.CONFIG), "w") as f:
        json.dump(config, f, indent=1)
    return out


def table(runs, limit, max_tokens):
    load = " / ".join(f"{a:.1f}" for a in runs["load"])
    lines = [
        "# The shipped Medusa heads served by vLLM",
        "",
        "`venv-vllm/bin/python experiments/vllm_medusa.py --out results/vllm-cpu.md`",
        "",
        f"_vLLM {runs['version']}, {os.cpu_count()} CPU cores (1-minute load average before / "
        f"after: {load}), {limit} prompts of eval/prompts.jsonl as chats, greedy, {max_tokens} new "
        "tokens at most, all in one batch, enforce_eager, Intel OpenMP preloaded; the shipped "
        "Medusa heads exported in fp32, 3 speculative tokens (a chain); the token_map row is "
        "vLLM's reduced form, loaded with model_loader_extra_config enable_weights_track false. "
        "Accepted by position: vLLM's accepted tokens at each draft position over its drafts._",
        "",
        "| dtype | method | tokens/s | identical to plain | drafts | draft tokens | accepted "
        "| accepted by position | mean accepted length |",
        "|---|---|---:|:---:|---:|---:|---:|---|---:|",
    ]
    for dtype, named in runs["dtypes"].items():
        plain = named["plain"]
        for name, run in named.items():
            same = sum(a == b for a, b in zip(run["ids"], plain["ids"]))
            c = run["counters"]
            spec = "| - | - | - | - | - |"
            if c.get("drafts"):
                by_pos = " ".join(f"{n / c['drafts']:.2f}" for n in c["accepted_per_pos"])
                spec = (
                    f"| {c['drafts']} | {c['draft_tokens']} | {c['accepted']} | {by_pos} "
                    f"| {1 + c['accepted'] / c['drafts']:.2f} |"
                )
            speed = run["tokens"] / run["seconds"]
            lines.append(f"| {dtype} | {name} | {speed:.1f} | {same} of {len(plain['ids'])} {spec}")
    return "\n".join(lines) + "\n"


# --- command line --------------------------------------------------------------------------------


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", help="the Markdown table's file (the comparison)")
    p.add_argument(
        "--work",
        help="a new or empty folder for the exported heads and model (default: a temporary one)",
    )
    p.add_argument("--dtypes", default="fp32,bf16", help="the dtypes compared, comma-separated")
    p.add_argument("--limit", type=int, default=8, help="evaluation prompts decoded")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens a reply at most")
    return p


def main(args):
    work = args.work or tempfile.mkdtemp(prefix="vllm-medusa-")
    base, heads = export_default(work)
    kept = kept_form(heads, os.path.join(work, "medusa-kept"))
    runs = {"dtypes": {}, "load": [os.getloadavg()[0]]}
    n = (args.limit, args.max_new_tokens)
    for dtype in args.dtypes.split(","):
        runs["dtypes"][dtype] = {
            "plain": serve_apart(base, None, dtype, *n),
            "medusa": serve_apart(base, heads, dtype, *n),
            "medusa, 8,192 tokens (token_map)": serve_apart(base, kept, dtype, *n, False),
        }
    runs["load"].append(os.getloadavg()[0])  # other work on the cores slows every row
    runs["version"] = runs["dtypes"][dtype]["plain"]["vllm"]
    text = table(runs, args.limit, args.max_new_tokens)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":
    main(build_parser().parse_args())
