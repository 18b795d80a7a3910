"""bench.py's command line: its flags, the checks that need no model (before one loads: a typo
costs a second, and an output folder that cannot be written is found before an hour of measuring,
not after), the modes, and main(), which turns the flags into plain values once.

What is measured and how is bench.py's lesson (passed in as `lesson`: its Method, measure() and
results()); the heads and plain decoding decode through generate.py's generate() (passed in as
`loop`), the loop `python generate.py --prompt` runs. The methods are specdec/benching/methods.py's
catalogue, the batch table specdec/benching/batches.py's, the tables and plots report.py's.

The command line (tests/test_bench_cli.py) follows cli.py's convention; --json and --plots are
checked before the run (an existing --json file is kept unless --overwrite); --kernels and the
--tune-* modes run one at a time, instead of the benchmark; Ctrl-C prints the tables of what was
measured so far, writes --json and --plots for the prompts every method finished (marked
partial) and exits 130.
--tune-tree and --tune-layers pick the heads' tree and the N and gamma of 'layers' for this
machine: expected tau (from held-out calibration, or measured acceptance) over the time of a
draft and a verify step measured here; the choice is saved next to the heads, named for the
device and dtype where it depends on them, and generate.py prefers it (specdec/tuning.py).
"""

import contextlib
import json
import math
import os
import statistics
import sys

import torch

import verify as verify_lib
from specdec import cli
from specdec import ctrl_c
from specdec import terminal
from specdec import tuning
from specdec.benching import batches
from specdec.benching import in_vllm
from specdec.benching import methods as catalogue
from specdec.benching import report
from specdec.benching.methods import LLAMA_CPP, METHODS, ONLINE, QUANTIZED, VLLM
from specdec.fast import kernels as kernels_lib
from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec.tuning import (
    distance_to_floor,
    kernel_table,
    machine,
    plotting,
    tune_layers,
    tune_skip,
    tune_tree,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DESCRIPTION = (
    "Benchmark: plain decoding, transformers' generate (greedy, its static cache compiled, prompt "
    "lookup, assisted), draft heads (Medusa, Hydra, Hydra++) and the other drafters (prompt "
    "lookup, the model's first layers, heads + lookup in one tree, a draft model), llama.cpp and "
    "vLLM (plain, Medusa, EAGLE-3), side by side on the same prompts, in the same run, on this "
    "machine."
)


def build_parser():
    p = cli.Parser(
        description=DESCRIPTION,
    )
    # what to run
    p.add_argument(
        "--prompts",
        default=os.path.join(ROOT, "eval", "prompts.jsonl"),
        help='JSONL with "prompt" (and "id", "category") per line',
    )
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0 = all)")
    p.add_argument(
        "--methods",
        default="all",
        help=f"comma list of {', '.join(METHODS)}; all = every available one (llama.cpp's"
        " where llama-cpp-python is installed, vLLM's where --vllm-python finds vLLM), but not"
        f" {', '.join(QUANTIZED + ONLINE)}, which run when named (plain always runs: it is the"
        " baseline)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument(
        "--batch-size",
        default="1",
        help="also decode the prompts this many at a time, or at each of a comma list of sizes "
        "(engine.generate_batch: a row that ends takes the next prompt) with the methods that "
        "batch (plain, the heads, lookup, hydra++-lookup; hydra++ shares the budget --tune-tree "
        "chose among the rows, hydra++-uniform gives every row the same tree): total and mean "
        "per-sequence tokens/s and the time of a step beside the one-at-a-time row",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs of every (prompt, method); the median counts",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="temperature of hydra++-typical and hydra++-sample (below "
        f"{verify_lib.GREEDY_BELOW}: greedy)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="sampling seed; prompt i uses seed + i in every repeat"
    )
    # the model and the heads
    p.add_argument("--model", default=checkpoint.DEFAULT, help=checkpoint.MODEL_HELP)
    p.add_argument(
        "--heads-dir",
        default=catalog.SHIPPED,
        help="where the heads methods find their heads: a heads folder as train.py "
        "writes it (its kind names the method), or a folder holding KIND/ or heads-KIND/ folders "
        "(medusa, hydra, hydra++)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="a small Llama-family model sharing the tokenizer: enables the 'draft-model' and "
        "'assisted' methods",
    )
    # vLLM (the vllm methods: the default model exported, each engine a process of vLLM's python)
    p.add_argument(
        "--vllm-python",
        default="auto",
        help="the python of vLLM's virtual environment (requirements-vllm.txt), which runs the "
        "vllm methods' engines; auto: this python if it imports vllm, else venv-vllm/bin/python "
        "in the repository",
    )
    p.add_argument(
        "--vllm-medusa",
        default="default",
        help="the draft vllm-medusa serves: a folder in vLLM's Medusa layout (python -m "
        "specdec.export); default: the shipped Medusa heads, exported once into the cache",
    )
    p.add_argument(
        "--vllm-eagle3",
        default="default",
        help="the draft vllm-eagle3 serves: an EAGLE-3 folder (config.json's architectures "
        "LlamaForCausalLMEagle3); default: python -m specdec.export --heads eagle3's, exported "
        "once into the cache",
    )
    p.add_argument(
        "--vllm-speculative-tokens",
        type=int,
        default=3,
        help="tokens vLLM drafts a step for vllm-medusa and vllm-eagle3 (a chain: no tree)",
    )
    # machine
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (generate.py --dtype's: fp32 under --quantize fp16) | fp32 | bf16 | fp16",
    )
    p.add_argument(
        "--quantize",
        default="none",
        choices=cli.QUANTIZE,
        help="every method's base model on fp16, int8 or int4 linear layers (generate.py "
        "--quantize)",
    )
    p.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=("auto", "on", "off"),
        help="our methods' base forward replayed from CUDA graphs (graphs.GraphedForward; auto: "
        "on where the device is CUDA); on a CPU, on runs its static step uncaptured",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="our methods' base model through exact.py's kernels, each row computed alone so that "
        "bf16 replies equal plain decoding's on a GPU (needs triton and CUDA)",
    )
    cli.threads_flag(p)
    # output
    p.add_argument(
        "--json",
        default=None,
        help="write the results to this JSON file (its folder is checked before the run)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --json file (else refused)",
    )
    p.add_argument(
        "--plots",
        default=None,
        help="write PNG plots to this folder, created if need be (needs matplotlib; checked "
        "before the run)",
    )
    # tree tuning
    p.add_argument(
        "--tune-tree",
        action="store_true",
        help="choose the tree size for this machine instead of benchmarking (see --heads)",
    )
    p.add_argument(
        "--heads",
        default="hydra++",
        help="with --tune-tree: medusa | hydra | hydra++ (in --heads-dir) or a heads folder with "
        "eval.json",
    )
    p.add_argument(
        "--max-budget",
        type=int,
        default=64,
        help="with --tune-tree: try trees of 1..N non-root nodes",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="with --tune-tree: also choose the tree for batches of 2, 4, ... up to this many rows "
        "(a sub-tree of the tuned one, down to plain decoding), which --batch-size then follows",
    )
    p.add_argument(
        "--shared-candidates",
        type=int,
        default=2,
        help="with --tune-tree: at each batch size, decode this many of the budgets the batch "
        "shares that the model ranks best, and plain decoding, for real, and keep the fastest",
    )
    p.add_argument(
        "--prefix-len",
        type=int,
        default=200,
        help="with --tune-tree: cached prefix length before the timed tree step",
    )
    p.add_argument(
        "--tune-repeats",
        type=int,
        default=7,
        help="with --tune-tree / --tune-layers: timed runs per size; the median counts",
    )
    # layers tuning
    p.add_argument(
        "--kernels",
        action="store_true",
        help="time each kernel choice of kernels.Kernels (readable path against fast path) at "
        "this model's shapes, and the batch-1 step against its bandwidth floor, instead of "
        "benchmarking",
    )
    p.add_argument(
        "--tune-layers",
        action="store_true",
        help="choose N and gamma of the 'layers' method for this machine instead of benchmarking "
        "(uses --limit, --max-new-tokens, --prefix-len)",
    )
    p.add_argument(
        "--max-gamma",
        type=int,
        default=8,
        help="with --tune-layers / --tune-skip: try chains of 1..this many drafts",
    )
    p.add_argument(
        "--tune-skip",
        action="store_true",
        help="search the layers the 'skip' method leaves out, and its gamma, for this machine "
        "instead of benchmarking (tuning.tune_skip; uses --limit, --max-new-tokens, --max-gamma, "
        "--prefix-len, --tune-repeats; saved in --heads-dir)",
    )
    p.add_argument(
        "--tune-parallel",
        action="store_true",
        help="choose jacobi's m, lookahead's W, N, G and pass's K for this machine instead of "
        "benchmarking (tuning.py; uses --limit, --max-new-tokens, --prefix-len, "
        "--tune-repeats; saved in --heads-dir)",
    )
    return p


def read_eval(path, limit):
    """[(id, category, text)] of the first `limit` prompts (0: all)."""
    rows = [(pid, cat, text) for pid, text, cat in cli.read_prompts(path)]
    return rows[:limit] if limit > 0 else rows


# Bad input is refused before the model loads where it can (a typo costs a second, and an output
# folder that cannot be written is found before an hour of measuring, not after).


def batch_sizes(text):
    """--batch-size: one size or a comma list of them, each at least 1."""
    try:
        sizes = sorted({int(part) for part in text.split(",")})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise cli.UsageError(
            f"--batch-size {text}: use a number of rows of at least 1, or a comma list of them "
            "(1,2,4,8,16)"
        )
    return sizes


# One mode a run: benchmarking (none of these flags), or one of them instead.
MODES = ("kernels", "tune_tree", "tune_layers", "tune_skip", "tune_parallel")
TUNERS = MODES[1:]
# The flags that only some modes read (None: benchmarking); elsewhere they get a notice.
READ_BY = {
    "methods": (None,),
    "repeats": (None,),
    "temperature": (None,),
    "seed": (None,),
    "draft_model": (None,),
    "batch_size": (None,),
    "cuda_graphs": (None,),
    "vllm_python": (None,),
    "vllm_medusa": (None,),
    "vllm_eagle3": (None,),
    "vllm_speculative_tokens": (None,),
    "prompts": (None, *TUNERS),
    "limit": (None, *TUNERS),
    "max_new_tokens": (None, "tune_layers", "tune_skip", "tune_parallel"),
    "heads": ("tune_tree",),
    "max_budget": ("tune_tree",),
    "max_batch": ("tune_tree",),
    "shared_candidates": ("tune_tree",),
    "prefix_len": TUNERS,
    "tune_repeats": TUNERS,
    "max_gamma": ("tune_layers", "tune_skip"),
    "json": (None, *TUNERS),
    "plots": (None, "tune_tree"),
}


def flag(name):
    return "--" + name.replace("_", "-")


def pick_mode(args):
    """The one mode flag given (None: benchmarking); two or more are refused."""
    given = [m for m in MODES if getattr(args, m)]
    if len(given) > 1:
        raise cli.UsageError(
            f"{', '.join(map(flag, given))}: one mode a run; give one of them (a run each)"
        )
    return given[0] if given else None


def no_effect(name, mode):
    """The notice for a flag that `mode` does not read."""
    if mode is not None:
        return f"{flag(name)} has no effect with {flag(mode)}"
    modes = [flag(m) for m in READ_BY[name]]
    either = modes[0] if len(modes) == 1 else f"{', '.join(modes[:-1])} or {modes[-1]}"
    return f"{flag(name)} has no effect without {either}"


def check_args(args):
    """Every check that needs no model; notices for flags without effect in the chosen mode."""
    mode = pick_mode(args)
    default = build_parser().get_default
    given = [name for name in READ_BY if getattr(args, name) != default(name)]
    if (
        min(
            args.max_new_tokens,
            args.repeats,
            args.max_budget,
            args.max_batch,
            args.tune_repeats,
            args.prefix_len,
            args.shared_candidates,
            args.vllm_speculative_tokens,
        )
        < 1
    ):
        raise cli.UsageError(
            "--max-new-tokens, --repeats, --max-budget, --max-batch, --tune-repeats, "
            "--prefix-len, --shared-candidates and --vllm-speculative-tokens must be at least 1"
        )
    args.batch_size = batch_sizes(args.batch_size)
    catalogue.named_methods(args.methods)
    if args.limit < 0:
        raise cli.UsageError(
            f"--limit {args.limit}: must be 0 (all prompts) or a number of prompts"
        )
    if args.threads < 0:
        raise cli.UsageError(
            f"--threads {args.threads}: must be 0 (the idle cores) or a number of threads"
        )
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise cli.UsageError(f"--temperature {args.temperature}: must be a number >= 0")
    cli.check_seed(args.seed)
    if not os.path.isdir(args.heads_dir):
        raise cli.UsageError(
            f"--heads-dir {args.heads_dir}: no such folder; give a heads folder that train.py wrote"
        )
    if args.json and mode in READ_BY["json"]:
        replaced = "the results would replace it"
        cli.new_file(
            "--json", args.json, "results/bench.json", args.prompts, args.overwrite, replaced
        )
    if args.plots and mode in READ_BY["plots"]:
        if plotting(quiet=True) is None:  # before the folder is made and the run is measured
            raise cli.UsageError(
                f"--plots {args.plots}: needs matplotlib, which is not installed; "
                "pip install matplotlib, or drop --plots"
            )
        cli.writable_folder("--plots", args.plots)
    if args.draft_model and wants_assisted(args) and mode is None:
        draft_folder(args.draft_model)
    for name in given:
        if mode not in READ_BY[name]:
            cli.notice(no_effect(name, mode))
    if args.overwrite and not (args.json and mode in READ_BY["json"]):
        cli.notice("--overwrite has no effect without --json")
    if args.draft_model and mode is None and not wants_assisted(args):
        cli.notice("--draft-model has no effect unless --methods includes assisted")
    if 0 < args.temperature < verify_lib.GREEDY_BELOW and mode is None:
        cli.notice(
            f"--temperature {args.temperature} is below {verify_lib.GREEDY_BELOW}: the sampling "
            "methods decode greedily"
        )
    if mode is None:
        check_llama_cpp(args)
        check_vllm(args, given)
    return mode


def check_llama_cpp(args):
    """The llama.cpp methods, named: they need llama-cpp-python and the default model (its GGUF
    files)."""
    named = [
        m
        for m in LLAMA_CPP
        if args.methods != "all" and m in {n.strip() for n in args.methods.split(",")}
    ]
    if named and args.model != checkpoint.DEFAULT:
        raise cli.UsageError(
            f"--methods {named[0]}: llama.cpp runs the default model's GGUF files only; drop "
            "--model or the llama.cpp methods"
        )
    if named and catalogue.llama_cpp_module() is None:
        raise cli.UsageError(
            f"--methods {named[0]}: needs llama-cpp-python, which is not installed: pip install "
            "llama-cpp-python"
        )


def check_vllm(args, given):
    """The vLLM methods, named: the default model (served from its export), a python that imports
    vLLM (args.vllm_python becomes it), and each draft's folder (args.vllm_medusa, args.vllm_eagle3
    become theirs: the shipped heads exported once where the flag says default). Refused before
    the model loads, one line each; their flags without them get a notice."""
    asked = set(catalogue.named_methods(args.methods))
    named = [m for m in VLLM if m in asked]
    if args.methods != "all" and not named:
        for name in given:
            if name.startswith("vllm_"):
                cli.notice(f"{flag(name)} has no effect unless --methods includes a vLLM method")
        return
    if named and args.model != checkpoint.DEFAULT:
        raise cli.UsageError(
            f"--methods {named[0]}: vLLM serves the default model's export here; drop --model or "
            "the vLLM methods"
        )
    for name in named:
        try:
            args.vllm_python = in_vllm.find_python(args.vllm_python)
            if name != "vllm":
                attr = name.replace("-", "_")
                setattr(args, attr, in_vllm.draft_folder(name, getattr(args, attr)))
        except in_vllm.Unavailable as e:
            raise cli.UsageError(f"--methods {name}: {e}") from None


def wants_assisted(args):
    return args.methods == "all" or {"assisted", "draft-model"} & {
        m.strip() for m in args.methods.split(",")
    }


def draft_folder(name):
    """--draft-model: the folder of a model of a SUPPORTED family (config.json read; nothing
    loaded)."""
    folder = checkpoint.resolve(name)
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        arch = config.get("model_type") if isinstance(config, dict) else None
    except (OSError, ValueError, RecursionError) as e:
        raise cli.UsageError(f"--draft-model {name}: no readable config.json ({e})") from None
    if arch not in checkpoint.SUPPORTED:
        raise cli.UsageError(
            f"--draft-model {name}: architecture '{arch}' is not supported (supported: "
            f"{', '.join(checkpoint.SUPPORTED)}); give a small model of the base model's family"
        )
    return folder


def check_draft_tokenizer(name, tokenizer):
    """Assisted generation compares token ids: the draft model must share the base model's
    tokenizer."""
    from transformers import AutoTokenizer

    try:
        draft = AutoTokenizer.from_pretrained(draft_folder(name))
    except (OSError, ValueError, TypeError) as e:
        raise cli.UsageError(f"--draft-model {name}: no tokenizer could be read ({e})") from None
    if draft.get_vocab() != tokenizer.get_vocab():
        raise cli.UsageError(
            f"--draft-model {name}: its tokenizer is not the base model's ({len(draft)} tokens "
            "against "
            f"{len(tokenizer)}, or other ids); give a draft model with the same tokenizer"
        )


def main(args, lesson, loop):
    """Returns the exit code: 0, or 130 when Ctrl-C cut the measuring short (what was measured is
    printed). lesson: bench.py (its Method, measure() and results()); loop: generate.py's
    generate()."""
    mode = check_args(args)
    device = cli.pick_device(args.device)
    if device == "cpu":
        cli.use_threads(args.threads)
    dtype = kernels_lib.pick_dtype(args.dtype, device, args.quantize)
    cli.check_quantize(args.quantize, device)
    cli.check_exact(args.exact, args.quantize, device)
    rows = read_eval(args.prompts, args.limit) if mode in READ_BY["prompts"] else []
    if mode is None and max(args.batch_size) > len(rows):
        cli.notice(
            f"--batch-size {max(args.batch_size)}: there are only "
            f"{cli.plural(len(rows), 'prompt')}; decoding at most {len(rows)} at a time"
        )
        args.batch_size = sorted({min(B, len(rows)) for B in args.batch_size})
    model, tokenizer = catalog.load_model(args.model, device, dtype, args.quantize, args.exact)
    eos = checkpoint.eos_ids(model, tokenizer)
    prompts = [(pid, cat, checkpoint.encode(tokenizer, text)) for pid, cat, text in rows]
    if args.kernels:
        return kernel_table(model, device)
    if args.tune_tree:
        return tune_tree(args, model, prompts, device, eos)
    if args.tune_layers:
        return tune_layers(args, model, prompts, device, eos)
    if args.tune_skip:
        return tune_skip(args, model, prompts, device, eos)
    if args.tune_parallel:
        return tuning.tune_parallel(
            args, model, prompts, eos, machine(device, dtype, **distance_to_floor(model, device))
        )
    if args.draft_model and wants_assisted(args):
        check_draft_tokenizer(args.draft_model, tokenizer)
    longest = max(len(ids) for _, _, ids in prompts) + args.max_new_tokens
    graphed = {} if catalog.cuda_graphs(args.cuda_graphs, device) else None
    entries, notes = catalogue.build_methods(
        args, lesson, loop, model, tokenizer, eos, device, dtype, longest, graphed
    )
    methods = {name: e.method for name, e in entries.items()}  # what the lesson measures
    for g in (graphed or {}).values():  # buffers for the longest reply, a tree and the most rows
        g.new_cache(longest + 256, batch=max(args.batch_size))  # now: never regrown mid-measure
        if max(args.batch_size) > 1:  # every key the batches step at, captured before timing
            nodes = max(e.max_nodes for e in entries.values() if e.batch is not None)
            g.prepare_batches(max(args.batch_size), nodes, longest + 256)
    for note in notes:
        print(f"[bench] {note}", file=sys.stderr)
    print(
        f"[bench] measuring {cli.plural(len(methods), 'method')} on "
        f"{cli.plural(len(prompts), 'prompt')}, {cli.plural(args.repeats, 'repeat')} "
        "(Ctrl-C prints what was measured so far)",
        file=sys.stderr,
        flush=True,
    )
    floor = distance_to_floor(model, device)  # probed before, so that no Ctrl-C falls after
    total, interrupted = len(prompts), False
    try:
        secs, outs = lesson.measure(
            methods, prompts, args.max_new_tokens, args.repeats, args.seed, device
        )
    except lesson.Interrupted as stop:
        if not stop.done:
            raise KeyboardInterrupt from None
        prompts, secs, outs, interrupted = (
            [prompts[i] for i in stop.done],
            stop.seconds,
            stop.outputs,
            True,
        )
    with ctrl_c.deferred() as late:  # a press from here on cuts no table: they are reported
        res, mach = report_measured(
            args,
            lesson,
            entries,
            graphed,
            prompts,
            secs,
            outs,
            device=device,
            dtype=dtype,
            floor=floor,
        )
    interrupted = interrupted or bool(late)
    partial = None  # what Ctrl-C left out, in words: --json and --plots say so
    if interrupted:
        partial = (
            f"interrupted by Ctrl-C: the results cover the {len(prompts)} of {total} prompts that "
            "every method ran, over the repeats done so far"
        )
        print(f"[bench] {partial}", file=sys.stderr)
    batched = {}
    sizes = [B for B in args.batch_size if B > 1]
    if sizes and not interrupted:
        batched, stopped = batches.measure_batched(entries, prompts, sizes, args, device)
        for name, by_size in batched.items():
            for b in by_size.values():
                b["same"] = b.pop("replies") == [out.tokens for out in outs[name]]
        if batched:
            print("\n" + batches.batched_table(res, batched, mach))
        if stopped:
            done = sum(len(by_size) for by_size in batched.values())
            pairs = len(sizes) * sum(e.batch is not None for e in entries.values())
            partial = (
                "interrupted by Ctrl-C while measuring --batch-size: the results cover every "
                f"prompt one at a time, and {done} of the {pairs} batched (method, size) pairs"
            )
            print(f"[bench] {partial}", file=sys.stderr)
    with ctrl_c.deferred() as late:  # the files are written whole
        write_records(args, mach, res, batched, partial)
    for e in entries.values():  # vLLM's engines end (else when bench does: their input closes)
        if e.close:
            e.close()
    return 130 if partial or late else 0


def report_measured(args, lesson, entries, graphed, prompts, secs, outs, *, device, dtype, floor):
    """The numbers of what was measured, and its machine: the tables printed, and what each
    method's numbers mean beside them. floor: distance_to_floor's, probed before measuring.
    -> (results, machine)"""
    methods = {name: e.method for name, e in entries.items()}
    res = lesson.results(methods, prompts, secs, outs)
    mach = machine(
        device,
        dtype,
        quantize=args.quantize,
        prompts=len(prompts),
        mean_prompt_tokens=round(statistics.mean(len(p[2]) for p in prompts), 1),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        **floor,
    )
    print(report.tables(res, mach))
    for name, r in res.items():
        if entries[name].adapted:
            print(
                f"[bench] {name} decodes a changed copy of the model (LoRA delta, int8, int4, "
                f"GGUF in llama.cpp): {len(prompts) - len(r['differs_on'] or [])} "
                f"of {len(prompts)} replies keep the original model's greedy reply",
                file=sys.stderr,
            )
        elif r["identical"] is False:
            why = (
                ""
                if dtype == torch.float32
                else (
                    " (in reduced precision an N-token forward rounds differently "
                    "from a 1-token one, so near-ties can flip; fp32 is exact)"
                )
            )
            if name in VLLM and dtype != torch.float32:
                why = " (vLLM's kernels round otherwise than ours in reduced precision: near-ties"
                why += " can flip; in fp32 its replies are ours, tests/test_vllm.py)"
            print(
                f"[bench] {name}: output differs from plain decoding on "
                f"{', '.join(map(str, r['differs_on']))}{why}",
                file=sys.stderr,
            )
    for name, e in entries.items():
        run = e.method.run
        if isinstance(run, catalogue.TheirsCompiled):
            print(
                f"[bench] {name}: compiled and warmed up in {run.warmup_seconds:.1f} s, left "
                "out of tokens/s",
                file=sys.stderr,
            )
        if isinstance(run, in_vllm.OneAtATime) and e.method.depth:
            drafts, accepted, length = in_vllm.counted(outs[name])
            print(
                f"[bench] {name}: vLLM counted {drafts} drafts of {e.method.depth} tokens and "
                f"{accepted} tokens accepted: its mean acceptance length 1 + accepted / drafts = "
                f"{length:.2f} (tau above: new tokens / (1 + drafts), the prefill a forward as "
                "for every method)",
                file=sys.stderr,
            )
        if e.learns:
            res[name]["online"] = report.online_cost(e.learns.learner, res[name]["seconds"])
            print(f"[bench] {name}: {report.online_summary(res[name]['online'])}", file=sys.stderr)
    for g in (graphed or {}).values():  # what was replayed, and every forward that was not
        print(f"[bench] {g.model.cfg.name}: {terminal.graphs_line(g)}", file=sys.stderr)
    return res, mach


def write_records(args, mach, res, batched, partial):
    """--json and --plots, of what was measured; `partial`: what a Ctrl-C left out, in words (None
    for a whole run), in the JSON's "partial" and the plots' titles."""
    if args.json:
        record = {"machine": mach, "methods": res, "batched": batched, "partial": partial}
        write_json(args.json, record)
    if args.plots:
        try:
            report.plot_bench(res, mach, args.plots, partial)
            if batched:
                batches.plot_batched(res, batched, mach, args.plots, partial)
        except OSError as e:
            raise cli.UsageError(
                f"--plots {args.plots}: cannot write the plots ({e.strerror or e}); free some "
                "space or give another folder"
            ) from None
    if partial and (args.json or args.plots):
        written = " and ".join(f for f in (args.json, args.plots) if f)
        print(f"[bench] {written}: of what was measured, marked partial", file=sys.stderr)


def write_json(path, record):
    """--json, whole or not at all (a temporary file renamed over it): a run stopped while writing
    leaves the old file; a failure (a full disk) names the flag and the file."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise cli.UsageError(
            f"--json {path}: cannot write it ({e.strerror or e}); the tables above hold the "
            "results; free some space or give a --json in another folder"
        ) from None


def cli_main(argv, lesson, loop) -> int:
    """bench.py's command line; lesson: bench.py, loop: generate.py's generate(). Bad input: one
    line on stderr naming it and the fix, exit code 2. Ctrl-C: the tables of what was measured so
    far, exit code 130 (main returns it); before any result, nothing to report."""
    return cli.run(
        lambda args: main(args, lesson, loop),
        build_parser(),
        argv,
        "[bench] interrupted by Ctrl-C before any result: nothing to report",
    )
