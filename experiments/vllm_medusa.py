"""Medusa heads served by vLLM itself: the shipped heads exported with python -m specdec.export, the
default model greedy on the evaluation prompts through vLLM's offline LLM, plain and with the heads
(speculative_config method medusa), at each dtype: how many replies are token-identical to plain,
vLLM's own acceptance counters, its tokens/s. Needs vLLM in its own virtual environment
(requirements-vllm.txt; README, "Serve with vLLM"). Writes a Markdown table.

    venv-vllm/bin/python experiments/vllm_medusa.py --out results/vllm-cpu.md

vLLM keeps an engine's state per process, so each engine runs in a process of its own: this script
with --one, which prints one JSON line (tests/test_vllm.py reads it too):

    venv-vllm/bin/python experiments/vllm_medusa.py --one --base FOLDER --heads FOLDER --dtype fp32
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from safetensors.torch import load_file  # noqa: E402

from specdec import export  # noqa: E402
from specdec.loading import catalog  # noqa: E402
from specdec.loading import checkpoint  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype -> vLLM's name
COUNTERS = {  # vLLM's metric -> our name
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
}


# --- one engine, in this process -----------------------------------------------------------------


def prompts(limit):
    with open(os.path.join(ROOT, "eval", "prompts.jsonl")) as f:
        return [json.loads(line)["prompt"] for line in f][:limit]


def serve(base, heads, dtype, limit, max_tokens, weights_track=True, num_speculative_tokens=3):
    """vLLM's offline LLM on `base` (heads None: plain; else Medusa heads from the folder `heads`),
    greedy on the first `limit` evaluation prompts as chats: {ids, tokens, seconds, counters}.
    weights_track False turns off the loader's check that every parameter was in the checkpoint."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for 8 short chats
    from vllm import LLM, SamplingParams

    speculative = None
    if heads is not None:
        speculative = {
            "method": "medusa",
            "model": heads,
            "num_speculative_tokens": num_speculative_tokens,
        }
    llm = LLM(
        base,
        dtype=DTYPES[dtype],
        max_model_len=1024,
        seed=0,
        enforce_eager=True,  # no torch.compile: minutes on a CPU, the same tokens
        disable_log_stats=False,  # the counters below
        speculative_config=speculative,
        model_loader_extra_config={} if weights_track else {"enable_weights_track": False},
    )
    chats = [[{"role": "user", "content": p}] for p in prompts(limit)]
    start = time.perf_counter()
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    seconds = time.perf_counter() - start
    ids = [list(out.outputs[0].token_ids) for out in outs]
    counters = {}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            counters[COUNTERS[metric.name]] = getattr(metric, "values", None) or metric.value
    return {"ids": ids, "tokens": sum(map(len, ids)), "seconds": seconds, "counters": counters}


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


def engine_env():
    """This process's environment with Intel OpenMP preloaded, as vLLM's CPU worker asks (its
    intel-openmp dependency installs libiomp5.so beside the environment's python): without it
    vLLM warns of "significant performance loss" for speculative decoding, and on 2 cores plain
    decoding and the heads both ran 7-20x slower (the first results/vllm-cpu.md, in git)."""
    env = dict(os.environ)
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if os.path.exists(iomp) and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(filter(None, [iomp, env.get("LD_PRELOAD")]))
    return env


def serve_apart(base, heads, dtype, limit, max_tokens, weights_track=True):
    """serve() in a new process of this script (--one): its JSON line."""
    argv = [sys.executable, os.path.abspath(__file__), "--one", "--base", base, "--dtype", dtype]
    argv += ["--limit", str(limit), "--max-new-tokens", str(max_tokens)]
    if heads is not None:
        argv += ["--heads", heads]
    if not weights_track:
        argv += ["--no-weights-track"]
    done = subprocess.run(argv, capture_output=True, text=True, env=engine_env())
    if done.returncode != 0:
        raise RuntimeError(f"vLLM failed (exit code {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    # one engine (--one)
    p.add_argument("--one", action="store_true", help="run one engine, print its JSON line")
    p.add_argument("--base", help="--one: the base model's folder")
    p.add_argument("--heads", help="--one: the exported heads' folder (none: plain decoding)")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="--one: the dtype")
    p.add_argument(
        "--no-weights-track",
        action="store_true",
        help="--one: vLLM's loader does not check that the checkpoint filled every parameter",
    )
    return p


def main(args):
    if args.one:
        run = serve(
            args.base,
            args.heads,
            args.dtype,
            args.limit,
            args.max_new_tokens,
            weights_track=not args.no_weights_track,
        )
        print(json.dumps(run))
        return
    import vllm

    work = args.work or tempfile.mkdtemp(prefix="vllm-medusa-")
    base, heads = export_default(work)
    kept = kept_form(heads, os.path.join(work, "medusa-kept"))
    runs = {"version": vllm.__version__, "dtypes": {}, "load": [os.getloadavg()[0]]}
    n = (args.limit, args.max_new_tokens)
    for dtype in args.dtypes.split(","):
        runs["dtypes"][dtype] = {
            "plain": serve_apart(base, None, dtype, *n),
            "medusa": serve_apart(base, heads, dtype, *n),
            "medusa, 8,192 tokens (token_map)": serve_apart(base, kept, dtype, *n, False),
        }
    runs["load"].append(os.getloadavg()[0])  # other work on the cores slows every row
    text = table(runs, args.limit, args.max_new_tokens)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":
    main(build_parser().parse_args())
