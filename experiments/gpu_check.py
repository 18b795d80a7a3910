"""What graphs.py's replayed step buys on a GPU, and that it changes no token, in one run of about
8 minutes on an H100, on a fresh machine with no network (the repository's files only).

    python experiments/gpu_check.py --out results/gpu-check-h100.md
    python experiments/gpu_check.py --tiny --out /tmp/gpu-check.md     # a tiny model: seconds, CPU

The model has random weights of the default model's shape (SmolLM2-135M: 30 layers, D 576, 9
heads, 3 key/value heads, vocabulary 49152, MLP 1536), built here, the same weights in
model.Transformer and in transformers' LlamaForCausalLM. One markdown file (--out), headed by the
machine (GPU, torch, CUDA, transformers, dtype):
  1. the base forward's step time, B rows x N tree nodes after --context cached tokens, eager
     (model.Transformer) against replayed (graphs.GraphedForward: captured once, then replays),
     and the first call's capture time;
  2. fp32 greedy identity, replayed against eager: plain decoding, random Hydra++ heads on a tree,
     a batch of rows (decode.generate, engine.generate_batch);
  3. tokens/s in --dtype on --prompts random prompts: plain decoding eager and replayed, and
     transformers' generate eager (bench's hf) and compiled (bench's hf-compiled: its static cache
     and torch.compile), each method's warm-up (capture, compilation) timed apart.
On a CPU nothing is captured: the replayed rows are the static step run eagerly, and hf-compiled
compiles with dynamo's eager backend (inductor takes minutes there): a check that it runs, not a
measurement. Shapes: B rows, N tree nodes.
"""

import argparse
import copy
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import specdec.ctrl_c  # noqa: E402, F401 (first: a Ctrl-C while torch imports is one line)
import torch  # noqa: E402

from specdec import cli  # noqa: E402
from specdec.benching import methods as catalogue  # noqa: E402
from specdec.loading import checkpoint  # noqa: E402
from specdec import drafters  # noqa: E402
from specdec.engines import decode  # noqa: E402
from specdec.engines import engine  # noqa: E402
from specdec.fast import graphs  # noqa: E402
import heads as heads_lib  # noqa: E402
from specdec.fast import kernels  # noqa: E402
from specdec import rows
import tree as tree_lib  # noqa: E402

# the default model's config.json, as transformers writes it (its weights are not needed)
SMOLLM2_135M = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
TINY = SMOLLM2_135M | dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    # where and what
    p.add_argument("--out", default="results/gpu-check.md", help="the markdown file to write")
    p.add_argument("--tiny", action="store_true", help="a tiny model and short runs (CPU check)")
    p.add_argument("--device", default="auto", help="auto (CUDA where there is one), cpu, cuda")
    p.add_argument("--dtype", default="bf16", choices=DTYPES, help="the step times and tokens/s")
    # the step times
    p.add_argument("--rows", default="1,8", help="B: comma list of batch rows")
    p.add_argument("--nodes", default="1,4,16,64", help="N: comma list of tree nodes a step")
    p.add_argument("--context", type=int, default=256, help="cached tokens before each step")
    p.add_argument("--iters", type=int, default=30, help="timed steps per shape (the median)")
    # the generations
    p.add_argument("--prompts", type=int, default=4, help="random prompts of 16 to 64 tokens")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens/s runs: new tokens")
    p.add_argument("--identity-tokens", type=int, default=48, help="fp32 identity: new tokens")
    p.add_argument("--no-hf", action="store_true", help="leave out transformers' two rows")
    return p


# --- the model --------------------------------------------------------------------------------


def build_models(shape, device, dtype, with_hf):
    """(ours in dtype, ours in fp32, transformers' in dtype or None), one set of random weights;
    ours with the fast kernels for the device (kernels.use: on CUDA, attention that takes a mask
    on SDPA's memory-efficient kernel), as checkpoint.load returns a model."""
    import transformers

    transformers.logging.set_verbosity_error()
    hf_config = {k: v for k, v in shape.items() if k != "model_type"}
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config)).eval()
    ours = rows.Model(checkpoint.config_from_hf(shape, "random, SmolLM2-135M's shape"))
    ours.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()})
    ours = ours.eval().requires_grad_(False)
    fp32 = kernels.use(copy.deepcopy(ours).to(device))  # as checkpoint.load leaves a model
    hf = hf.to(device, dtype) if with_hf else None
    return kernels.use(ours.to(device, dtype)), fp32, hf


def machine_line(device, dtype, args):
    import transformers

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    cuda = torch.version.cuda or "none"
    return (
        f"{where}; torch {torch.__version__}, CUDA {cuda}, transformers "
        f"{transformers.__version__}; {str(dtype).removeprefix('torch.')}; "
        f"{'tiny model' if args.tiny else 'SmolLM2-135M shape, random weights'}"
    )


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- 1. step times ----------------------------------------------------------------------------


def median_ms(step, iters, device):
    """The median wall time of `step`, synchronised after each call as the loop's verify is."""
    for _ in range(3):
        step()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def step_row(model, B, N, context, iters):
    """One forward of B rows x N nodes after `context` cached tokens, eager and replayed: their
    median ms, the first replayed call's seconds (capture), their largest logit difference."""
    dev = model.device
    g = torch.Generator().manual_seed(1000 * B + N)
    tokens = torch.randint(0, model.cfg.vocab_size, (B, N), generator=g).to(dev)  # (B, N)
    positions = (context + torch.arange(N)).to(dev)  # (N,)
    chain = torch.ones(N, N, dtype=torch.bool).tril().expand(B, N, N)  # (B, N, N)
    mask = None if N == 1 else chain.to(dev)
    fast = graphs.GraphedForward(model)
    caches = [model.new_cache(context + N, batch=B), fast.new_cache(context + N, batch=B)]
    for cache in caches:
        cache.lengths = [context] * B  # nothing is kept: every call writes the same slots
    eager = lambda: model(tokens, positions, mask, caches[0])  # noqa: E731
    replayed = lambda: fast(tokens, positions, mask, caches[1])  # noqa: E731
    sync(dev)
    t0 = time.perf_counter()
    first = replayed()[0].clone()
    sync(dev)
    capture = time.perf_counter() - t0
    diff = (first.float() - eager()[0].float()).abs().max().item()
    row = (median_ms(eager, iters, dev), median_ms(replayed, iters, dev), capture, diff)
    assert not fast.fallbacks, fast.summary()
    return row  # the wrapper, its buffers and graphs go with it


# --- 2. fp32 greedy identity ------------------------------------------------------------------


def random_prompts(n, vocab, seed=0):
    r = random.Random(seed)
    return [[r.randrange(3, vocab) for _ in range(r.randint(16, 64))] for _ in range(n)]


def random_hydra(model):
    """Hydra++ heads with random weights (they draft junk, some of it accepted), on the model."""
    torch.manual_seed(0)
    heads = heads_lib.build(heads_lib.HeadsConfig(kind="hydra++", num_heads=3), model)
    with torch.no_grad():
        for p in heads.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.5 / p.shape[-1] ** 0.5)
    return heads.to(model.device).eval()


def identity_rows(model, prompts, n):
    """(what, prompts identical, of how many, the wrapper's summary) per decoding, fp32."""
    heads = random_hydra(model)
    tree = tree_lib.build(tree_lib.cartesian([3, 2, 2]))
    rows = []
    for what, drafter in [("plain", lambda: None), ("hydra++ heads", lambda: None)]:
        fast = graphs.GraphedForward(model)
        same = 0
        for p in prompts:
            drafts = [drafters.HeadsDrafter(heads, tree) if "heads" in what else None for _ in "ab"]
            eager = decode.generate(model, p, n, drafts[0])
            replayed = decode.generate(fast, p, n, drafts[1])
            same += replayed.tokens == eager.tokens
        rows.append((what, same, len(prompts), fast.summary()))
    fast = graphs.GraphedForward(model)
    eager = engine.generate_batch(
        model, prompts, [n] * len(prompts), batch_size=len(prompts) // 2 or 1
    )
    replayed = engine.generate_batch(
        fast, prompts, [n] * len(prompts), batch_size=len(prompts) // 2 or 1
    )
    same = sum(a.tokens == b.tokens for a, b in zip(eager, replayed))
    rows.append((f"batch of {len(prompts) // 2 or 1} rows", same, len(prompts), fast.summary()))
    return rows


# --- 3. tokens/s ------------------------------------------------------------------------------


def tokens_per_s(run, prompts, n, device):
    """(tokens/s over the prompts, the warm-up's seconds, the replies): a warm-up call first."""
    sync(device)
    t0 = time.perf_counter()
    run(prompts[0], n, 0)
    sync(device)
    warmup = time.perf_counter() - t0
    tokens, seconds, replies = 0, 0.0, []
    for p in prompts:
        sync(device)
        t0 = time.perf_counter()
        out = run(p, n, 0).tokens
        sync(device)
        seconds += time.perf_counter() - t0
        tokens += len(out)
        replies.append(out)
    return tokens / seconds, warmup, replies


def throughput_rows(model, hf, prompts, n, eos):
    dev = model.device
    fast = graphs.GraphedForward(model)
    methods = {
        "plain, eager": catalogue.ours(None, model, None, "greedy", 0.0, eos),
        "plain, replayed (graphs.py)": catalogue.ours(None, fast, None, "greedy", 0.0, eos),
    }
    if hf is not None:
        longest = max(map(len, prompts)) + n
        compiled = catalogue.TheirsCompiled(copy.deepcopy(hf), eos, longest)
        methods["hf (transformers, eager)"] = catalogue.theirs(
            hf, catalogue.ForwardCounter(hf), eos
        )
        methods["hf-compiled (static cache, torch.compile)"] = compiled
    rows, first = [], None
    for name, run in methods.items():
        try:
            speed, warmup, replies = tokens_per_s(run, prompts, n, dev)
        except Exception as e:  # a compiler this machine lacks: named in the table, not fatal
            rows.append((name, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"))
            continue
        first = first or replies
        same = sum(a == b for a, b in zip(replies, first))
        rows.append((name, f"{speed:.1f} | {warmup:.1f} | {same} of {len(prompts)}"))
    return rows, fast.summary()


# --- the report -------------------------------------------------------------------------------


def say(message):
    """What the check is doing, on stderr (stdout holds the report's lines)."""
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)


def write(path, lines):
    """The report so far: written after each section, so that a run cut short leaves its part."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(args):
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if args.tiny:  # seconds, on a CPU too
        args.context, args.iters, args.prompts = 32, 3, 2
        args.max_new_tokens, args.identity_tokens = 8, 8
        args.nodes = ",".join(n for n in args.nodes.split(",") if int(n) <= 16)
    if device.type != "cuda":  # dynamo's graph capture without inductor's minutes of compiling
        catalogue.HF_COMPILE = dict(fullgraph=True, backend="eager", mode=None)
    dtype = DTYPES[args.dtype]
    started = time.perf_counter()
    if device.type != "cuda" and not args.tiny:
        say(
            "no CUDA device: the full-size check runs on the CPU, several minutes without a "
            "line between sections (--tiny checks every section in seconds)"
        )
    size = "a tiny model" if args.tiny else "SmolLM2-135M's shape"
    say(f"building random models of {size} on {device} ({args.dtype}, and fp32)")
    ours, fp32, hf = build_models(
        TINY if args.tiny else SMOLLM2_135M, device, dtype, not args.no_hf
    )
    say(f"step times, eager and replayed: rows {args.rows} x nodes {args.nodes}")
    eos = {2}
    lines = ["# GPU check: graphs.py's replayed step", "", machine_line(device, dtype, args), ""]
    lines += [
        f"## Step time, {args.context} tokens cached (median of {args.iters})",
        "",
        "| B rows | N nodes | eager ms | replayed ms | speedup | capture s | max logit diff |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for B in map(int, args.rows.split(",")):
        for N in map(int, args.nodes.split(",")):
            eager, replayed, capture, diff = step_row(ours, B, N, args.context, args.iters)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the last shape's buffers and graph pool
            lines.append(
                f"| {B} | {N} | {eager:.2f} | {replayed:.2f} | {eager / replayed:.2f}x | "
                f"{capture:.2f} | {diff:.2g} |"
            )
            print(lines[-1], flush=True)
            write(args.out, lines)
    prompts = random_prompts(args.prompts, ours.cfg.vocab_size)
    say(f"fp32 greedy identity, replayed against eager, on {args.prompts} prompts")
    lines += [
        "",
        f"## fp32 greedy identity, replayed against eager ({args.identity_tokens} new tokens)",
        "",
        "| decoding | identical prompts | the replayed wrapper |",
        "|---|---:|---|",
    ]
    for what, same, total, summary in identity_rows(fp32, prompts, args.identity_tokens):
        lines.append(f"| {what} | {same} of {total} | {summary} |")
        print(lines[-1], flush=True)
    write(args.out, lines)
    del fp32
    say(f"tokens/s of plain decoding and transformers' generate, {args.max_new_tokens} new tokens")
    rows, summary = throughput_rows(ours, hf, prompts, args.max_new_tokens, eos)
    lines += [
        "",
        f"## Tokens/s, {args.prompts} prompts of 16-64 tokens, {args.max_new_tokens} new tokens"
        f" ({str(dtype).removeprefix('torch.')})",
        "",
        "| method | tokens/s | warm-up s (capture, compile) | replies equal to the first row's |",
        "|---|---:|---:|---:|",
    ]
    for name, cells in rows:
        lines.append(f"| {name} | {cells} |")
        print(lines[-1], flush=True)
    lines += ["", f"Replayed plain decoding: {summary}.", ""]
    if device.type != "cuda":
        lines.append("On a CPU: nothing captured; hf-compiled on dynamo's eager backend.")
    lines.append(f"Took {time.perf_counter() - started:.0f} s: `python {' '.join(sys.argv)}`.")
    write(args.out, lines)
    print(f"wrote {args.out}")


def interrupted(args):
    """The line after Ctrl-C: what --out holds (args: None before the flags are parsed)."""
    kept = f"; each section finished was written to {args.out}" if args else ""
    return f"[gpu-check] interrupted by Ctrl-C{kept}"


if __name__ == "__main__":
    specdec.ctrl_c.exit_now(cli.run(main, build_parser(), None, interrupted))
