"""What the compiled step (specdec/fast/compiled.py) buys on a GPU, and that it keeps the tokens, in
one call of about 6 minutes (each part has its own timeout), on a machine with no network.

    python experiments/gpu_step.py                      # a GPU; logs under $OUT, else --out
    python experiments/gpu_step.py --tiny --out /tmp/gpu-step     # a tiny model on a CPU: a check

The model has random weights of the default model's shape (SmolLM2-135M: 30 layers, D 576, 9
heads, 3 key/value heads, vocabulary 49152, MLP 1536), the same in model.py's forward and in
transformers' LlamaForCausalLM, in --dtype (bf16); Hydra++ heads are random too, so their measured
tau says nothing: tokens/s is projected from the step time with --tau (results/ has the trained
heads' tau). The parts, each written to report.md as it ends (a part that fails or runs past
--part-timeout is named there and the next one runs):
  1. eager: generate.py's lesson over the readable model, plain and Hydra++ on a --tree of 64 nodes:
     ms a step (a generation's time over its forwards), kernels a step (torch.profiler: kernels on
     the GPU and the host's launch calls), the plain replies (the identity reference);
  2. compile: compiled.wrap and compiled.prepare, every graph's compile time apart;
  3. compiled: the same lesson over the compiled step: the same numbers, and how many replies are
     token-identical to eager plain greedy (in bf16 a near-tie may flip: exact.py's kernels are the
     project's answer to that, not this);
  4. hf: transformers' generate with its static cache and torch.compile (reduce-overhead), the
     same numbers, its compile apart.
On a CPU (--tiny) the compiles use --backend aot_eager unless told: inductor takes minutes there.
Not here: the batch (compiled.py serves one row; graphs.py's replays serve many) and Hydra++ with
prompt lookup (a drafter of specdec/drafters.py, not generate.py's heads).
Shapes: N tree nodes.
"""

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import generate  # noqa: E402
import heads as heads_lib  # noqa: E402
import tree as tree_lib  # noqa: E402
from specdec import rows  # noqa: E402
from specdec.fast import compiled  # noqa: E402
from specdec.loading import checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_check.py, beside this one
from gpu_check import DTYPES, SMOLLM2_135M, TINY  # noqa: E402 (the default model's shape, a tiny one)


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    # where and what
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or "results/gpu-step",
        help="the folder of report.md, results.json and log.txt ($OUT where set)",
    )
    p.add_argument("--tiny", action="store_true", help="a tiny model and short runs (CPU check)")
    p.add_argument("--device", default="auto", help="auto (CUDA where there is one), cpu, cuda")
    p.add_argument("--dtype", default="bf16", choices=DTYPES, help="the model's dtype")
    # the compile
    p.add_argument("--backend", default="auto", help="torch.compile's; auto: inductor on CUDA")
    p.add_argument("--mode", default="auto", help="torch.compile's; auto: reduce-overhead on CUDA")
    # the generations
    p.add_argument("--tree", default="cartesian:3,4,4", help="the heads' tree (tree.parse)")
    p.add_argument("--prompts", type=int, default=4, help="random prompts")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens a prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens a reply")
    p.add_argument(
        "--tau",
        type=float,
        default=2.96,
        help="Hydra++'s tokens a step, for the projection (results/bench-gpu-h200-bf16.md)",
    )
    p.add_argument("--part-timeout", type=int, default=240, help="seconds a part may take")
    p.add_argument("--budget", type=int, default=450, help="seconds all the parts may take")
    p.add_argument("--no-hf", action="store_true", help="leave transformers' part out")
    return p


# --- the models ---------------------------------------------------------------------------------


def build_models(shape, device, dtype, with_hf):
    """(ours, transformers' or None) with one set of random weights, in dtype on device."""
    import transformers

    transformers.logging.set_verbosity_error()
    hf_config = {k: v for k, v in shape.items() if k != "model_type"}
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config)).eval()
    ours = rows.Model(checkpoint.config_from_hf(shape, "random, SmolLM2-135M's shape"))
    ours.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()})
    ours = ours.eval().requires_grad_(False).to(device, dtype)
    if not with_hf:
        return ours, None
    hf.generation_config.eos_token_id = None  # random weights: every reply runs its full length
    return ours, hf.to(device, dtype)


def random_hydra(model, num_heads):
    """Hydra++ heads with random weights (they draft junk, some of it accepted), on the model."""
    torch.manual_seed(0)
    heads = heads_lib.build(heads_lib.HeadsConfig(kind="hydra++", num_heads=num_heads), model)
    with torch.no_grad():
        for p in heads.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.5 / p.shape[-1] ** 0.5)
    return heads.eval().requires_grad_(False)


def random_prompts(n, length, vocab, seed=0):
    r = random.Random(seed)
    return [[r.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- measuring ----------------------------------------------------------------------------------


class PartTimeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds):
    """PartTimeout raised in the main thread after `seconds` (when Python next runs)."""

    def fire(signum, frame):
        raise PartTimeout(f"past its {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def kernels_per_step(run, steps, device):
    """(GPU kernels, host launch calls) a step of run() (which takes `steps` steps), by
    torch.profiler; on a CPU (no kernels), the profiler's top-level operators and None."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            run()
            sync(device)
    except RuntimeError as e:  # a profiler this machine lacks: the step times still count
        print(f"profiler failed: {e}", file=sys.stderr)
        return float("nan"), None
    events = prof.events()
    if device.type != "cuda":
        top = sum(1 for e in events if e.cpu_parent is None)
        return top / steps, None
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel"))
    graphs = sum(1 for e in events if e.name == "cudaGraphLaunch")
    return kernels / steps, (launches + graphs) / steps


def measure(model, heads, tree, prompts, n, device):
    """The lesson's generate over each prompt: ms a step (all the replies' time over all their
    forwards, prefills included), tokens a step, kernels a step, the replies."""
    generate.generate(model, prompts[0], 8, heads, tree)  # warm-up
    seconds, forwards, tokens, replies = 0.0, 0, 0, []
    for p in prompts:
        sync(device)
        t0 = time.perf_counter()
        new, f = generate.generate(model, p, n, heads, tree)
        sync(device)
        seconds += time.perf_counter() - t0
        forwards += f
        tokens += len(new)
        replies.append(new)
    short = lambda: generate.generate(model, prompts[0], 16, heads, tree)  # noqa: E731
    steps = short()[1]
    kernels, launches = kernels_per_step(short, steps, device)
    return dict(
        ms_step=1000 * seconds / forwards,
        tau=tokens / forwards,
        tokens_s=tokens / seconds,
        kernels=kernels,
        launches=launches,
        replies=replies,
    )


def hf_runner(hf, max_cache_len, compile_kw):
    """transformers' generate, greedy, with its static cache and its compiled decode step."""
    from transformers import CompileConfig

    config = CompileConfig(**compile_kw)
    config._compile_all_devices = hf.device.type != "cuda"  # its switch for CPUs

    def run(ids, n):
        x = torch.tensor([ids], device=hf.device)  # (1, T)
        out = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="static",
            max_cache_len=max_cache_len,
            compile_config=config,
        )  # (1, T + n)
        return out[0, len(ids) :].tolist()

    return run


def measure_hf(run, prompts, n, device):
    sync(device)
    t0 = time.perf_counter()
    run(prompts[0], n)  # the compile
    sync(device)
    warmup = time.perf_counter() - t0
    seconds, tokens, replies = 0.0, 0, []
    for p in prompts:
        sync(device)
        t0 = time.perf_counter()
        replies.append(run(p, n))
        sync(device)
        seconds += time.perf_counter() - t0
        tokens += len(replies[-1])
    kernels, launches = kernels_per_step(lambda: run(prompts[0], 16), 16, device)
    return dict(
        compile_s=warmup,
        ms_step=1000 * seconds / tokens,
        tau=1.0,
        tokens_s=tokens / seconds,
        kernels=kernels,
        launches=launches,
        replies=replies,
    )


# --- the report ---------------------------------------------------------------------------------


class Report:
    """report.md (rewritten after each part), results.json and log.txt under one folder."""

    def __init__(self, folder, header):
        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self.lines = header
        self.results = {}
        self.log = open(os.path.join(folder, "log.txt"), "a")

    def say(self, line):
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def add(self, lines):
        self.lines += lines
        for line in lines:
            self.say(line)
        with open(os.path.join(self.folder, "report.md"), "w") as f:
            f.write("\n".join(self.lines) + "\n")
        with open(os.path.join(self.folder, "results.json"), "w") as f:
            json.dump(self.results, f, indent=1)


def row(name, r, tau, reference):
    """A table row: ms a step, kernels and launches a step, tokens/s measured and projected."""
    same = sum(a == b for a, b in zip(r["replies"], reference)) if reference else "-"
    launches = "-" if r["launches"] is None else f"{r['launches']:.0f}"
    return (
        f"| {name} | {r['ms_step']:.2f} | {r['kernels']:.0f} | {launches} | {r['tokens_s']:.1f} | "
        f"{tau:.2f} | {1000 * tau / r['ms_step']:.1f} | {same} of {len(r['replies'])} |"
    )


TABLE = [
    "| method | ms a step | kernels a step | launch calls a step | tokens/s measured | tau "
    "projected | tokens/s projected | replies = eager plain |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
]


def main(args):
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if args.tiny:
        args.prompts, args.prompt_tokens, args.max_new_tokens = 2, 12, 24
    backend = args.backend
    if backend == "auto":
        backend = "inductor" if device.type == "cuda" else "aot_eager"
    dtype = DTYPES[args.dtype]
    started = time.perf_counter()
    ours, hf = build_models(TINY if args.tiny else SMOLLM2_135M, device, dtype, not args.no_hf)
    import transformers

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report = Report(
        args.out,
        [
            "# GPU step: torch.compile over the static step (specdec/fast/compiled.py)",
            "",
            f"{where}; torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, "
            f"transformers {transformers.__version__}; {args.dtype}; "
            f"{'tiny model' if args.tiny else 'SmolLM2-135M shape, random weights'}; "
            f"{args.prompts} prompts of {args.prompt_tokens} tokens, {args.max_new_tokens} new; "
            f"compile: {backend}, mode {args.mode}",
            "",
        ],
    )
    tree = tree_lib.build(tree_lib.parse(args.tree))
    heads = random_hydra(ours, tree.max_depth)
    prompts = random_prompts(args.prompts, args.prompt_tokens, ours.cfg.vocab_size)
    n = args.max_new_tokens
    plain = tree_lib.build([])
    reference = None

    def part(name, fn):
        t0 = time.perf_counter()
        left = args.budget - (t0 - started)
        if left < 10:
            report.add(["", f"**{name} not run**: the --budget of {args.budget} s is spent"])
            return
        try:
            with deadline(min(args.part_timeout, left)):
                fn()
            report.say(f"[{name}: {time.perf_counter() - t0:.1f} s]")
        except Exception as e:  # named in the report; the next part runs
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            report.add(["", f"**{name} failed after {time.perf_counter() - t0:.0f} s**: {why}"])

    def eager():
        nonlocal reference
        p = measure(ours, None, plain, prompts, n, device)
        h = measure(ours, heads, tree, prompts, n, device)
        reference = p["replies"]
        report.results["eager"] = {"plain": p, "hydra++": h}
        report.add(["## Eager (the readable model)", "", *TABLE, row("plain", p, 1.0, reference)])
        report.add([row(f"hydra++, {tree.num_nodes} nodes", h, args.tau, reference), ""])

    wrapped = {}

    def compile_():
        model, cheads = compiled.wrap(ours, heads, mode=args.mode, backend=backend)
        t0 = time.perf_counter()
        max_len = args.prompt_tokens + n + tree.num_nodes
        compiled.prepare(model, None, max_len, args.prompt_tokens, plain)
        compiled.prepare(model, cheads, max_len, args.prompt_tokens, tree)
        seconds = time.perf_counter() - t0
        wrapped.update(model=model, heads=cheads)
        each = sorted(model.compiler.seconds.items(), key=lambda kv: -kv[1])
        report.results["compile"] = {str(k): s for k, s in each}
        report.add(
            [
                f"## Compile: {len(each)} graphs in {seconds:.1f} s ({compiled.cache_dir()})",
                "",
                "| graph | first call s |",
                "|---|---:|",
                *[f"| {' '.join(map(str, k))} | {s:.1f} |" for k, s in each],
                "",
            ]
        )

    def compiled_():
        model = wrapped["model"]
        p = measure(model, None, plain, prompts, n, device)
        h = measure(model, wrapped["heads"], tree, prompts, n, device)
        report.results["compiled"] = {"plain": p, "hydra++": h, "summary": model.summary()}
        report.add(["## Compiled", "", *TABLE, row("plain", p, 1.0, reference)])
        report.add([row(f"hydra++, {tree.num_nodes} nodes", h, args.tau, reference), ""])
        report.add([f"The compiled model: {model.summary()}.", ""])

    def hf_():
        kw = dict(fullgraph=True, backend=backend, mode=None)  # only inductor takes a mode
        if backend == "inductor":
            kw["mode"] = "reduce-overhead" if args.mode == "auto" else args.mode
        run = hf_runner(hf, args.prompt_tokens + n, kw)
        r = measure_hf(run, prompts, n, device)
        report.results["hf"] = r
        report.add(
            [
                f"## transformers: static cache + torch.compile (compile {r['compile_s']:.1f} s)",
                "",
                *TABLE,
                row("hf-compiled", r, 1.0, reference),
                "",
            ]
        )

    part("eager", eager)
    part("compile", compile_)
    if wrapped:
        part("compiled", compiled_)
    if hf is not None:
        part("hf", hf_)
    if device.type != "cuda":
        report.add(["On a CPU, 'kernels' are the profiler's top-level operators.", ""])
    report.add([f"Took {time.perf_counter() - started:.0f} s: `python {' '.join(sys.argv)}`."])
    print(f"wrote {os.path.join(args.out, 'report.md')}")


if __name__ == "__main__":
    main(build_parser().parse_args())
