"""
Benchmark: plain decoding, transformers' generate (greedy, its static cache compiled, prompt
lookup, assisted), draft heads (Medusa, Hydra, Hydra++) and the other drafters (prompt lookup, the
model's first layers, heads + lookup in one tree, a draft model), side by side on the same prompts,
in the same run, on this machine.

    python bench.py                                          # every available method,
                                                             eval/prompts.jsonl
    python bench.py --limit 3 --max-new-tokens 32 --repeats 1            # a quick look
    python bench.py --methods plain,hf,hydra++ --json bench.json --plots plots/
    python bench.py --batch-size 4 --methods plain,hydra++ --limit 8   # 4 prompts at a time too
    python bench.py --prompts mine.jsonl --methods hydra++,hydra++-online --repeats 1   # online.py
    python bench.py --draft-model some/small-llama ...       # adds draft-model and transformers'
                                                             assisted
    python bench.py --tune-tree --heads hydra++              # pick the tree for this machine ->
                                                             tree-DEVICE-DTYPE.json
    python bench.py --tune-layers --limit 8                  # pick N and gamma of 'layers' ->
                                                             layers-DEVICE-DTYPE.json
    python bench.py --tune-skip --limit 8 --max-new-tokens 64   # search the layers 'skip' leaves
                                                                out -> skip-DEVICE-DTYPE.json
    python bench.py --tune-parallel --limit 8 --max-new-tokens 64   # jacobi's m, lookahead's W, N,
                                                                    G, pass's K (tuning.py)
    python bench.py --kernels                                # the fast kernels against the readable
                                                             path, here

Every method decodes through decode.generate() (plain, the heads and their sampling variants,
lookup, hydra++-lookup, layers, draft-model), transformers' generate() (hf, hf-compiled: its
static cache and torch.compile, in --methods all on CUDA only, its compile timed apart; pld,
assisted) or
llama.cpp's (llama.cpp-f16, -q8_0, -q4_1: GGUF files of the default model's weights, run where
llama-cpp-python is installed); nothing here is a decode loop. Drafting settings are generate.py's
defaults (DRAFT_DEFAULTS); 'layers' uses the N and gamma that --tune-layers saved in --heads-dir
for this model, device and dtype (layers-DEVICE-DTYPE.json), else for this model on a CPU (with a
notice off the CPU), else half the layers (reported as untuned); 'skip' the set --tune-skip saved
there for this model, device, CPU path and dtype (skip-DEVICE-DTYPE.json), else
catalog.default_skip (reported as untuned).
Honest timing: one warm-up generation per method; the device is synchronised around every timed
region; repeats are interleaved (each repeat runs every prompt, and every method on it in an order
rotated per prompt) so machine noise hits all methods alike; the median over repeats per prompt.
tokens/s = sum of new tokens / sum of seconds; speedup = tokens/s over plain decoding's in this run;
tau = new tokens / forward passes of the base model (the prefill included, so plain tau = 1).

The command line (tests/test_bench_cli.py) follows cli.py's convention; --json and --plots are
checked before the run (an existing --json file is kept unless --overwrite); --kernels and the
--tune-* modes run one at a time, instead of the benchmark; Ctrl-C prints the tables of what was
measured so far, writes --json and --plots for the prompts every method finished (marked
partial) and exits 130.
--tune-tree and --tune-layers pick the heads' tree and the N and gamma of 'layers' for this
machine: expected tau (from held-out calibration, or measured acceptance) over the time of a
draft and a verify step measured here; the choice is saved next to the heads, named for the
device and dtype where it depends on them, and generate.py prefers it.
"""

import specdec.ctrl_c  # first: a Ctrl-C while torch imports is one line, exit 130
import contextlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import cli
from specdec import drafters
from specdec import terminal
from specdec.engines import decode
from specdec.engines import engine
from specdec.fast import graphs
import heads as heads_lib
from specdec.fast import kernels as kernels_lib
from specdec.training import online
from specdec import tuning
from specdec.tuning import (
    distance_to_floor,
    kernel_table,
    machine,
    machine_line,
    plotting,
    sync,
    tune_layers,
    tune_skip,
    tune_tree,
)
import verify as verify_lib

HERE = os.path.dirname(os.path.abspath(__file__))
# on a quantized copy of the model (--quantize's)
QUANTIZED = tuple(f"{kind}-{q}" for q in cli.QUANTIZE[1:] for kind in ("plain", "hydra++"))
# llama.cpp on the default model's GGUF files
LLAMA_CPP = tuple(f"llama.cpp-{kind}" for kind in checkpoint.GGUF_KINDS)
# heads that learn across the prompts in their order (online.py, generate.py --online's defaults)
ONLINE = tuple(f"{kind}-online" for kind in heads_lib.KINDS)
BATCH_ONLY = ("hydra++-uniform",)  # hydra++ but at batch sizes: every row the same tree
METHODS = (
    "plain",
    "hf",
    "hf-compiled",
    "pld",
    "assisted",
    "medusa",
    "hydra",
    "hydra++",
    "medusa-2",
    "hydra++-2",
    "hydra++-typical",
    "hydra++-sample",
    "lookup",
    "hydra++-lookup",
    "hydra++-uniform",
    "layers",
    "skip",
    "draft-model",
    "jacobi",
    "lookahead",
    "pass",
    *QUANTIZED,
    *LLAMA_CPP,
    *ONLINE,
)  # --methods all leaves out QUANTIZED and ONLINE: they run only when named


def build_parser():
    p = cli.Parser(
        description=__doc__.split("\n\n")[0].strip(),
    )
    # what to run
    p.add_argument(
        "--prompts",
        default=os.path.join(HERE, "eval", "prompts.jsonl"),
        help='JSONL with "prompt" (and "id", "category") per line',
    )
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0 = all)")
    p.add_argument(
        "--methods",
        default="all",
        help=f"comma list of {', '.join(METHODS)}; all = every available one (llama.cpp's"
        f" where llama-cpp-python is installed), but not {', '.join(QUANTIZED + ONLINE)}, which"
        " run when named (plain always runs: it is the baseline)",
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


# --- methods --------------------------------------------------------------------------------------
# A method is run(ids, max_new, seed) -> (new token ids, base forward passes or None, accepted per
# step or None). Ours wrap decode.generate(); transformers' count the base model's forward calls.


@dataclass
class Method:
    name: str
    run: Callable
    greedy: bool  # its output must equal plain decoding's (an adapted model's: how far it moved)
    depth: int = 0  # tree depth, for acceptance by depth (0: none)
    # decodes a changed copy of the model: a joint kind's LoRA delta, or int8 or int4 weights
    adapted: bool = False
    # run_batch(list of ids, max_new, first seed, rows at once) -> (Results, the forward passes),
    # or None: it does not batch
    batch: Callable | None = None
    learns: object = None  # an Online method: measure() resets it before every repeat
    nodes_at: Callable | None = None  # rows at once -> the nodes a step drafts (or shares)
    max_nodes: int = 1  # the most nodes a row's draft holds in a batch (graph keys prepared to it)
    predicted: dict | None = None  # rows at once -> --tune-tree's expected speedup over plain


def ours(model, drafter, verify, temperature, eos):
    def run(ids, max_new, seed):
        g = torch.Generator(device=model.device).manual_seed(seed)
        r = decode.generate(
            model,
            ids,
            max_new,
            drafter=drafter,
            verify=verify,
            temperature=temperature,
            generator=g,
            eos_ids=eos,
        )
        return r.tokens, r.steps, r.accepted

    return run


def ours_batched(model, drafter, verify, temperature, eos):
    """A batch of prompts through engine.generate_batch: row j samples from seed + j, as the
    one-at-a-time run samples prompt i from seed + i."""

    def run_batch(prompts, max_new, seed, size):
        forwards = []  # the base model's forward passes: one a step (the prefills too)
        hook = model.register_forward_hook(lambda *_: forwards.append(1))
        try:
            results = engine.generate_batch(
                model,
                prompts,
                [max_new] * len(prompts),
                drafter,
                verify,
                temperature,
                generators=[
                    torch.Generator(device=model.device).manual_seed(seed + j)
                    for j in range(len(prompts))
                ],
                eos_ids=eos,
                batch_size=size,
            )
        finally:
            hook.remove()
        return results, len(forwards)

    return run_batch


class Online:
    """Heads learning online across the prompts in their order (generate.py --online's defaults),
    from the loaded heads at the first prompt; reset() starts again. A reply's time includes the
    update that follows it."""

    def __init__(self, model, heads, tree, eos):
        self.model = model
        self.heads = heads
        self.tree = tree
        self.eos = eos
        self.initial = {k: v.clone() for k, v in heads.state_dict().items()}
        self.reset()

    def reset(self):
        self.heads.load_state_dict(self.initial)
        kernels_lib.use(self.heads)  # packed again from the initial weights
        self.learner = online.Learner(self.heads, self.model, **online.DEFAULTS)
        drafter = online.OnlineHeads(drafters.HeadsDrafter(self.heads, self.tree), self.learner)
        self.decode = ours(self.model, drafter, "greedy", 0.0, self.eos)

    def __call__(self, ids, max_new, seed):
        out = self.decode(ids, max_new, seed)
        self.learner.reply_done()
        return out


def load_hf(name, device, dtype):
    """transformers' own model (LlamaForCausalLM for Llama folders) on the same weights folder."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return (
        transformers.AutoModelForCausalLM.from_pretrained(checkpoint.resolve(name), dtype=dtype)
        .to(device)
        .eval()
    )


class ForwardCounter:
    """Counts a module's forward calls: transformers' generate() does not report its steps."""

    def __init__(self, module):
        self.n = 0
        module.register_forward_hook(self.hook)

    def hook(self, module, args, out):
        self.n += 1


def theirs(hf, counter, eos, **kw):
    def run(ids, max_new, seed):
        counter.n = 0
        x = torch.tensor([ids], device=hf.device)  # (1, T)
        out = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=sorted(eos),
            pad_token_id=min(eos),
            **kw,
        )  # (1, T + new)
        return out[0, len(ids) :].tolist(), counter.n, None

    return run


# transformers' own fast path (its docs: a static cache and torch.compile of the decode step;
# "reduce-overhead" replays CUDA graphs). tests/test_bench_cli.py swaps in a backend that compiles
# in seconds on a CPU.
HF_COMPILE = dict(fullgraph=True, mode="reduce-overhead")


class TheirsCompiled:
    """transformers' generate with its static KV cache (cache_implementation="static") and its own
    torch.compile of the decode step (a CompileConfig of HF_COMPILE; the prefill stays eager), as
    its documentation recommends for speed. One cache length for every prompt (max_cache_len: the
    longest prompt + its new tokens), so that it compiles once: in the first call, bench's
    warm-up, whose time (.warmup_seconds) is reported apart and left out of tokens/s. transformers
    compiles only on CUDA-like devices unless told to; on a CPU it is told (minutes to compile)."""

    def __init__(self, hf, eos, max_cache_len):
        from transformers import CompileConfig

        self.hf = hf
        self.eos = eos
        self.max_cache_len = max_cache_len
        self.config = CompileConfig(**HF_COMPILE)
        self.config._compile_all_devices = hf.device.type != "cuda"  # its switch for CPUs
        self.warmup_seconds = None

    def __call__(self, ids, max_new, seed):
        if len(ids) + max_new > self.max_cache_len:
            raise ValueError(
                f"hf-compiled: {len(ids)} + {max_new} tokens > its static cache of "
                f"{self.max_cache_len} (a longer cache would compile again)"
            )
        started = time.perf_counter()
        x = torch.tensor([ids], device=self.hf.device)  # (1, T)
        out = self.hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=sorted(self.eos),
            pad_token_id=min(self.eos),
            cache_implementation="static",
            max_cache_len=self.max_cache_len,
            compile_config=self.config,
        )  # (1, T + new)
        new = out[0, len(ids) :].tolist()
        if self.warmup_seconds is None:
            sync(self.hf.device)
            self.warmup_seconds = time.perf_counter() - started
        return new, len(new), None  # greedy, no drafts: one forward a new token


def llama_cpp_module():
    """llama-cpp-python's module, or None when it is not installed (it is optional)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def llama_cpp_available(args):
    """The llama.cpp methods that can run here: all of them for the default model (the one with GGUF
    files) where llama-cpp-python is installed, else none."""
    return LLAMA_CPP if args.model == checkpoint.DEFAULT and llama_cpp_module() is not None else ()


def load_llama_cpp(name, device, context):
    """(llama.cpp's Llama on the default model's GGUF file that `name` names, the file): torch's
    threads, the model's context, on the GPU too when the device is CUDA and llama.cpp was built for
    it."""
    path = checkpoint.default_gguf_as(name.removeprefix("llama.cpp-"))
    threads = torch.get_num_threads()
    return llama_cpp_module().Llama(
        model_path=path,
        n_ctx=context,
        n_threads=threads,
        n_threads_batch=threads,
        n_gpu_layers=-1 if torch.device(device).type == "cuda" else 0,
        verbose=False,
    ), path


def in_llama_cpp(llm, eos):
    """llama.cpp's greedy decoding of the same prompt ids (the chat template applied by
    checkpoint.encode, no BOS added): one llama_decode a token (Llama.eval) and the argmax of its
    logits, as llama.cpp's own greedy sampler takes it in C; not llama-cpp-python's generate(),
    whose sampler runs in Python every token (results/kernels-cpu.md timed both). Its cache is
    reset first: it would otherwise skip the prefill of a prompt it has seen, and ours pays it
    every run."""
    import numpy as np

    llama_cpp, vocab = llama_cpp_module(), llm.n_vocab()

    def run(ids, max_new, seed):
        llm.reset()
        llm.eval(ids)
        new = []
        while True:
            logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # the last token's
            new.append(int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab,)))))
            if new[-1] in eos or len(new) == max_new:
                return new, len(new), None  # one forward per token, the prefill's included
            llm.eval(new[-1:])

    return run


def layers_setting(args, model):
    """(N, gamma, how chosen) of the 'layers' method: what --tune-layers saved for this model,
    device and dtype; else what it saved on a CPU (the same dtype first), with a notice off the CPU;
    else half the layers."""
    on = lambda device, dtype: catalog.tuned_tree_file(args.heads_dir, device, dtype, "layers")
    # the CPU's files, the same dtype first
    cpu = [on("cpu", dtype) for dtype in (model.dtype, torch.bfloat16, torch.float32)]
    # each file once (on a CPU the first is cpu's too)
    for file in dict.fromkeys([on(model.device, model.dtype)] + cpu):
        try:
            with open(file) as f:
                tuned = json.load(f)
            if (
                tuned["model"] == model.cfg.name
                and 1 <= tuned["layers"] < model.cfg.n_layers
                and tuned["gamma"] >= 1
            ):
                if model.device.type != "cpu" and file in cpu:
                    cli.notice(
                        f"no 'layers' setting tuned for {model.device.type} in {args.heads_dir}: "
                        f"using {os.path.basename(file)}, "
                        "tuned on a CPU; bench.py --tune-layers picks one for this machine"
                    )
                return (
                    tuned["layers"],
                    tuned["gamma"],
                    f"tuned on {tuned['machine']['hardware']}, {tuned['machine']['dtype']}",
                )
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return (
        model.cfg.n_layers // 2,
        catalog.DRAFT_DEFAULTS["layers"]["gamma"],
        "untuned: run bench.py --tune-layers",
    )


def skip_drafter(args, model):
    """The 'skip' method's drafter: the set and gamma --tune-skip saved in --heads-dir for this
    model and machine, else catalog.default_skip at generate.py's gamma; and a note that says
    which."""
    L = model.cfg.n_layers
    skipped, gamma, tuned = catalog.skip_set(args.heads_dir, model)
    kept = [i for i in range(L) if i not in skipped]
    spec = catalog.skip_spec(skipped)
    d = drafters.ModelDrafter(model, gamma, 0.0, 1.0, None, kept, f"skip:{spec}")
    how = "tuned for this machine" if tuned else "untuned: run bench.py --tune-skip"
    return d, f"skip: layers {spec} of {L} skipped, {cli.plural(gamma, 'token')} a step ({how})"


def load_heads(args, name, folder, model, asked):
    """(heads in `folder`, the model they draft for), or (None, None) for shipped heads of another
    base model when --methods is all. Joint heads draft for a copy of the model with their LoRA
    delta merged in."""
    try:
        if checkpoint.has_delta(folder):
            model, _ = checkpoint.load(args.model, model.device, model.dtype)
            print(f"[bench] {name}: {checkpoint.merge_delta(model, folder)}", file=sys.stderr)
            if args.quantize != "none":
                kernels_lib.quantize(model, args.quantize)
        return checkpoint.load_heads(folder, model), model
    except heads_lib.HeadsError as e:
        if name in asked or args.heads_dir != catalog.SHIPPED:
            raise cli.UsageError(f"--heads-dir {args.heads_dir}: {e}") from None
        return None, None


def build_methods(args, model, tokenizer, eos, device, dtype, longest=None, graphed=None):
    """The methods asked for, and a note for each one skipped. longest: the longest prompt's
    tokens plus --max-new-tokens (hf-compiled's static cache; None: the model's context).
    graphed: a dict to fill with a graphs.GraphedForward per model our methods decode (one for
    all the methods on that model: one set of buffers and graphs), None: they decode eagerly."""

    def fast(m):  # the model the decode loop calls, replayed where graphed
        if graphed is None:
            return m
        if id(m) not in graphed:
            graphed[id(m)] = graphs.GraphedForward(m)
        return graphed[id(m)]

    # all: every method that can run here, but the quantized copies (run only when named)
    if args.methods == "all":
        wanted = [
            m
            for m in METHODS
            if m not in QUANTIZED + ONLINE + BATCH_ONLY
            and (m not in LLAMA_CPP or m in llama_cpp_available(args))
            and (m != "hf-compiled" or str(device).startswith("cuda"))
        ]
    else:
        wanted = named_methods(args.methods)
    # named: a missing one is an error, not a skip
    asked = set() if args.methods == "all" else set(wanted)
    wanted = ["plain"] + [m for m in wanted if m != "plain"]
    methods, notes, hf, loaded = {}, [], None, {}
    if args.methods == "all" and args.model == checkpoint.DEFAULT and llama_cpp_module() is None:
        notes.append(
            f"{', '.join(LLAMA_CPP)}: not run (they need llama-cpp-python: "
            "pip install llama-cpp-python)"
        )
    look = catalog.DRAFT_DEFAULTS["lookup"]
    for name in wanted:
        if name == "plain":
            methods[name] = Method(
                name,
                ours(fast(model), None, "greedy", 0.0, eos),
                greedy=True,
                batch=ours_batched(fast(model), None, "greedy", 0.0, eos),
            )
        elif name in LLAMA_CPP:  # the same weights in llama.cpp: how many replies keep the model's
            llm, path = load_llama_cpp(name, device, model.cfg.max_seq_len)
            methods[name] = Method(name, in_llama_cpp(llm, eos), greedy=True, adapted=True)
            notes.append(
                f"{name}: llama.cpp on {path}, {cli.plural(torch.get_num_threads(), 'thread')}"
            )
        elif (
            name in QUANTIZED
            # the same method on an fp16, int8 or int4 copy: how many replies keep the model's, and
            # tau
        ):
            kind, quant = name.rsplit("-", 1)
            cli.check_quantize(quant, device)
            if quant not in loaded:
                loaded[quant] = kernels_lib.quantize(
                    checkpoint.load(args.model, device, dtype)[0], quant
                )
            q = loaded[quant]
            folder = catalog.heads_folder(args.heads_dir, kind) if kind != "plain" else None
            if kind != "plain" and folder is None:
                raise cli.UsageError(
                    f"--methods {name}: no {kind} heads in --heads-dir {args.heads_dir}"
                )
            heads = checkpoint.load_heads(folder, q) if folder else None
            d = (
                drafters.HeadsDrafter(heads, catalog.load_tree("auto", heads, folder, quant))
                if heads
                else None
            )
            methods[name] = Method(
                name,
                ours(q, d, "greedy", 0.0, eos),
                greedy=True,
                depth=d.max_depth if d else 0,
                adapted=True,
            )
        elif name == "lookup":
            d = drafters.Lookup(look["gamma"], look["ngram"], look["matches"], device)
            methods[name] = Method(
                name,
                ours(fast(model), d, "greedy", 0.0, eos),
                greedy=True,
                depth=d.max_depth,
                batch=ours_batched(fast(model), d, "greedy", 0.0, eos),
                max_nodes=d.max_nodes,
            )
            notes.append(d.name)
        elif name == "layers":
            n, gamma, how = layers_setting(args, model)
            d = drafters.ModelDrafter(model, gamma, 0.0, 1.0, None, range(n), f"layers:{n}")
            methods[name] = Method(
                name, ours(fast(model), d, "greedy", 0.0, eos), greedy=True, depth=gamma
            )
            notes.append(
                f"layers: the first {n} of {cli.plural(model.cfg.n_layers, 'layer')} draft "
                f"{cli.plural(gamma, 'token')} ({how})"
            )
        elif name == "skip":
            if model.cfg.n_layers < 2:
                notes.append("skip: skipped (the model has one layer, none to skip)")
                continue
            try:
                d, note = skip_drafter(args, model)
            except cli.UsageError as e:  # a set tuned for another model or machine
                if name in asked:
                    raise
                notes.append(f"skip: skipped ({e})")
                continue
            methods[name] = Method(
                name, ours(fast(model), d, "greedy", 0.0, eos), greedy=True, depth=d.gamma
            )
            notes.append(note)
        elif name == "draft-model":
            if not args.draft_model:
                notes.append("draft-model: skipped (needs --draft-model)")
                continue
            gamma = catalog.DRAFT_DEFAULTS["model"]["gamma"]
            d = drafters.ModelDrafter(
                catalog.load_draft_model(args.draft_model, model, tokenizer, device, dtype),
                gamma,
                0.0,
                1.0,
                None,
            )
            methods[name] = Method(
                name, ours(fast(model), d, "greedy", 0.0, eos), greedy=True, depth=gamma
            )
            notes.append(f"draft-model: {args.draft_model}, {cli.plural(gamma, 'token')} a step")
        elif name in catalog.PARALLEL:
            # jacobi, lookahead, pass: as --tune-parallel chose for this machine
            if name == "pass" and not tuning.trained_tokens(args.heads_dir, model):
                if name in asked:
                    raise cli.UsageError(
                        "--methods pass: no [LA] tokens for this model in --heads-dir "
                        f"{args.heads_dir}/pass; "
                        "train them with python -m specdec.training.pass_tokens"
                    )
                notes.append(
                    f"pass: skipped (no [LA] tokens for this model in {args.heads_dir}/pass)"
                )
                continue
            d, note = tuning.tuned_drafter(name, args.heads_dir, model)
            methods[name] = Method(
                name, ours(fast(model), d, "greedy", 0.0, eos), greedy=True, depth=d.max_depth
            )
            notes.append(note)
        elif name in ONLINE:  # its own copy of the heads: the frozen method's must not move
            kind = name.removesuffix("-online")
            folder = catalog.heads_folder(args.heads_dir, kind)
            heads = load_heads(args, name, folder, model, asked)[0] if folder else None
            if heads is None:
                raise cli.UsageError(
                    f"--methods {name}: no {kind} heads in --heads-dir {args.heads_dir}"
                )
            tree = catalog.load_tree("auto", heads, folder, args.quantize)
            learns = Online(model, heads, tree, eos)
            methods[name] = Method(name, learns, greedy=True, depth=tree.max_depth, learns=learns)
            notes.append(f"{name}: {folder}, learning online ({learns.learner.name})")
        elif name == "hf-compiled":  # its own copy: hf's ForwardCounter hook would recompile
            run = TheirsCompiled(
                load_hf(args.model, device, dtype), eos, longest or model.cfg.max_seq_len
            )
            methods[name] = Method(name, run, greedy=True)
            notes.append(
                "hf-compiled: transformers' static cache "
                f"({cli.plural(run.max_cache_len, 'slot')}) and torch.compile "
                f"({', '.join(f'{k}={v}' for k, v in HF_COMPILE.items())}), "
                "compiled in the warm-up"
            )
        elif name in ("hf", "pld", "assisted"):
            if name == "assisted" and not args.draft_model:
                notes.append("assisted: skipped (needs --draft-model)")
                continue
            if hf is None:
                hf = load_hf(args.model, device, dtype)
                counter = ForwardCounter(hf)  # counts the base model only, never the draft model
            kw = {"pld": {"prompt_lookup_num_tokens": 10}, "hf": {}}.get(name)
            if name == "assisted":
                kw = {"assistant_model": load_hf(args.draft_model, device, dtype)}
            methods[name] = Method(name, theirs(hf, counter, eos, **kw), greedy=True)
        else:
            kind, _, variant = name.partition("-")  # "hydra++-typical" -> ("hydra++", "typical")
            if variant == "2":  # a joint kind: its own heads, on its adapted model
                kind, variant = name, ""
            folder = catalog.heads_folder(args.heads_dir, kind)
            if kind not in loaded:
                heads, base = (
                    load_heads(args, name, folder, model, asked) if folder else (None, None)
                )
                if heads is None:
                    if name in asked:
                        raise cli.UsageError(
                            f"--methods {name}: no {kind} heads in --heads-dir {args.heads_dir}; "
                            "give a heads "
                            "folder that train.py wrote (or a folder holding KIND/ or heads-KIND/ "
                            "folders)"
                        )
                    notes.append(
                        f"{name}: skipped (no {kind} heads for this model in {args.heads_dir})"
                    )
                    continue
                tree = catalog.load_tree("auto", heads, folder, args.quantize)
                trees = catalog.batch_trees(folder, base, tree, args.quantize)
                shared = catalog.shared_budgets(folder, base, args.quantize)
                loaded[kind] = heads, tree, trees, shared, base
            heads, tree, trees, shared, base = loaded[kind]
            d = drafters.HeadsDrafter(heads, tree)
            if variant == "lookup":  # heads and lookup in one tree, verified greedily
                d = catalog.heads_and_lookup(
                    d, look["gamma"], look["ngram"], look["matches"], device
                )
            # more rows at once: the budget the batch shares, as generate.py's (-uniform: every
            # row the tree --tune-tree chose for its batch size)
            by_batch = d
            if variant in ("", "lookup"):
                by_batch = catalog.batch_drafter(d, folder, base, args.quantize)
            elif variant == "uniform" and trees:
                by_batch = drafters.HeadsByBatch(heads, trees)
            shared_only = type(by_batch) is drafters.HeadsShared  # --tune-tree predicted it
            verify = variant if variant in ("typical", "sample") else "greedy"
            temperature = args.temperature if verify != "greedy" else 0.0
            methods[name] = Method(
                name,
                ours(fast(base), d, verify, temperature, eos),
                greedy=verify == "greedy",
                depth=d.max_depth,
                adapted=base is not model,
                batch=ours_batched(fast(base), by_batch, verify, temperature, eos),
                nodes_at=drafted_at(by_batch),
                max_nodes=by_batch.max_nodes,
                predicted=shared[3] if shared_only else None,
            )
            if not variant:
                notes.append(
                    f"{name}: {folder}, tree of {cli.plural(tree.num_nodes, 'node')}, "
                    f"depth {tree.max_depth}" + (f"; {by_batch.name}" if by_batch is not d else "")
                )
    return methods, notes


def drafted_at(d):
    """rows at once -> what `d` drafts a step at that many rows, for the batch table: its tree's
    nodes, or the nodes past the roots its rows share (with lookup's beside them)."""

    def at(rows):
        heads = d.heads if isinstance(d, drafters.HeadsPlusLookup) else d
        if isinstance(heads, drafters.HeadsShared):
            return f"{heads.budget(rows)[0]} shared" + (" + lookup" if heads is not d else "")
        if isinstance(d, drafters.HeadsByBatch):
            return d.tree_for(rows).max_nodes
        return d.max_nodes

    return at


# --- measuring ------------------------------------------------------------------------------------


class Interrupted(Exception):
    """Ctrl-C during measure(): .done lists the prompts every method has run at least once, with
    their median seconds and outputs so far (as measure returns them, for those prompts only)."""

    def __init__(self, done, seconds, outputs):
        super().__init__("interrupted by Ctrl-C")
        self.done, self.seconds, self.outputs = done, seconds, outputs


def measure(methods, prompts, args, device):
    """Median seconds per (method, prompt) over interleaved repeats, and each run's output.
    Ctrl-C raises Interrupted with what was measured so far."""
    from tqdm import tqdm

    names = list(methods)
    for name in names:  # warm-up: first calls allocate, compile kernels, fill caches
        methods[name].run(prompts[0][2], min(16, args.max_new_tokens), args.seed)
    learning = [m.learns for m in methods.values() if m.learns]
    seconds = {m: [[] for _ in prompts] for m in names}
    outputs = {m: [None] * len(prompts) for m in names}
    bar = tqdm(
        total=args.repeats * len(prompts) * len(names), desc="bench", unit="run", disable=None
    )
    try:
        for rep in range(args.repeats):
            for learns in learning:  # from the loaded heads again: the warm-up taught them too
                learns.reset()
            for i, (_, _, ids) in enumerate(prompts):
                k = (i + rep) % len(names)
                for name in names[k:] + names[:k]:
                    sync(device)
                    t0 = time.perf_counter()
                    out = methods[name].run(ids, args.max_new_tokens, args.seed + i)
                    sync(device)
                    seconds[name][i].append(time.perf_counter() - t0)
                    outputs[name][i] = out
                    bar.update()
    except KeyboardInterrupt:
        specdec.ctrl_c.handled()  # bench goes on: it reports what was measured
        bar.close()
        done = [i for i in range(len(prompts)) if all(seconds[m][i] for m in names)]
        raise Interrupted(
            done,
            {m: [statistics.median(seconds[m][i]) for i in done] for m in names},
            {m: [outputs[m][i] for i in done] for m in names},
        ) from None
    bar.close()
    return {m: [statistics.median(s) for s in seconds[m]] for m in names}, outputs


def measure_batched(methods, prompts, sizes, args, device):
    """Each method that batches decodes all the prompts at each batch size B: B rows at once, a row
    that ends taking the next prompt. Per method and B: total tokens/s (new tokens over the wall
    time, the median of the repeats), mean per-sequence tokens/s (a row's tokens over the time
    from its prefill until it ended), the time of a step (the wall time over the base
    model's forward passes) and the replies, to compare with the one-at-a-time ones. Returns them,
    and whether Ctrl-C stopped the measuring (then: the sizes measured before it)."""
    res = {}
    try:
        batch_rows(methods, prompts, sizes, args, device, res)
    except KeyboardInterrupt:
        specdec.ctrl_c.handled()  # bench goes on: it reports what was measured
        return res, True
    return res, False


def batch_rows(methods, prompts, sizes, args, device, res):
    """measure_batched's measuring, into res as each size is done: at each batch size the methods
    take turns, --repeats rounds (the median counts), so a slow spell of the machine hits them
    alike."""
    ids = [ids for _, _, ids in prompts]
    batching = {name: m for name, m in methods.items() if m.batch is not None}
    for m in batching.values():
        m.batch(ids[: sizes[0]], min(16, args.max_new_tokens), args.seed, sizes[0])  # warm
    for B in sizes:
        times = {name: [] for name in batching}  # seconds of each repeat
        outs = {}
        for _ in range(args.repeats):
            for name, m in batching.items():
                sync(device)
                t0 = time.perf_counter()
                outs[name] = m.batch(ids, args.max_new_tokens, args.seed, B)
                sync(device)
                times[name].append(time.perf_counter() - t0)
        for name, m in batching.items():
            (out, forwards), seconds = outs[name], statistics.median(times[name])
            res.setdefault(name, {})[B] = {
                "tokens_per_s": sum(len(r.tokens) for r in out) / max(seconds, 1e-9),
                "per_sequence_tokens_per_s": statistics.mean(
                    len(r.tokens) / max(r.seconds, 1e-9) for r in out
                ),
                "step_ms": 1000 * seconds / forwards,
                "tree_nodes": m.nodes_at(B) if m.nodes_at else None,
                "predicted": predicted_at(m.predicted, B),
                "replies": [r.tokens for r in out],
            }


def predicted_at(table, rows):
    """--tune-tree's expected speedup at `rows` rows (its entry for the most rows up to them)."""
    if not table:
        return None
    return table[max(B for B in table if B <= rows)]


def batched_table(res, batched, mach):
    """Beside each method's one-at-a-time row, its row at each batch size: what it drafts a step
    (tree nodes, or nodes past the roots shared by the batch), and its tokens/s over plain's at
    the same batch size, measured and as --tune-tree predicted it."""
    lines = [
        machine_line(mach),
        "",
        "| method | batch | tree nodes | total tokens/s | over plain | predicted | "
        "mean per-sequence tokens/s | step ms | same replies as batch 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    plain = batched.get("plain", {})
    for name, by_size in batched.items():
        r = res[name]
        alone = statistics.mean(p["new_tokens"] / max(p["seconds"], 1e-9) for p in r["per_prompt"])
        gain = f"{r['tokens_per_s'] / res['plain']['tokens_per_s']:.2f}x" if "plain" in res else "-"
        lines.append(
            f"| {name} | 1 | - | {r['tokens_per_s']:.1f} | {gain} | - | {alone:.1f} | - | - |"
        )
        for B, b in by_size.items():
            nodes = b.get("tree_nodes") or "-"
            over = f"{b['tokens_per_s'] / plain[B]['tokens_per_s']:.2f}x" if B in plain else "-"
            predicted = f"{b['predicted']:.2f}x" if b.get("predicted") else "-"
            lines.append(
                f"| {name} | {B} | {nodes} | {b['tokens_per_s']:.1f} | {over} | {predicted} | "
                f"{b['per_sequence_tokens_per_s']:.1f} | {b['step_ms']:.1f} | "
                f"{'yes' if b['same'] else 'NO'} |"
            )
    return "\n".join(lines)


def plot_title(mach, partial):
    """The machine, and a plot's mark when Ctrl-C cut the run short."""
    return f"{mach['hardware']}, {mach['dtype']}" + (
        "\npartial: stopped by Ctrl-C" if partial else ""
    )


def plot_batched(res, batched, mach, folder, partial=None):
    """Total tokens/s against the batch size, a line per method (batch.png)."""
    if (plt := plotting()) is None:
        return
    os.makedirs(folder, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_size in batched.items():
        sizes = [1, *by_size]
        tokens_per_s = [res[name]["tokens_per_s"]] + [b["tokens_per_s"] for b in by_size.values()]
        ax.plot(sizes, tokens_per_s, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows decoded at once)")
    ax.set_ylabel("total tokens/s")
    ax.set_title(plot_title(mach, partial), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "batch.png"), dpi=120)


def summary(idx, secs, outs, plain):
    """Metrics of one method over the prompts idx; plain = plain decoding's summary over idx."""
    tokens = sum(len(outs[i][0]) for i in idx)
    steps = [outs[i][1] for i in idx]
    row = {
        "tokens_per_s": tokens / max(sum(secs[i] for i in idx), 1e-9),
        "new_tokens": tokens,
        "seconds": sum(secs[i] for i in idx),
        "tau": tokens / sum(steps) if None not in steps else None,
    }
    row["speedup"] = row["tokens_per_s"] / plain["tokens_per_s"] if plain else 1.0
    return row


def results(methods, prompts, secs, outs):
    """The JSON "methods" object: overall and per-category metrics of every method."""
    cats = list(dict.fromkeys(cat for _, cat, _ in prompts))
    every = range(len(prompts))
    by_cat = {c: [i for i, p in enumerate(prompts) if p[1] == c] for c in cats}
    plain = summary(every, secs["plain"], outs["plain"], None)
    plain_cat = {c: summary(idx, secs["plain"], outs["plain"], None) for c, idx in by_cat.items()}
    res = {}
    for name, m in methods.items():
        row = summary(every, secs[name], outs[name], plain)
        accepted = [a for out in outs[name] if out[2] is not None for a in out[2]]
        row["accept_by_depth"] = decode.acceptance_by_depth(accepted, m.depth) if m.depth else None
        differ = [prompts[i][0] for i in every if outs[name][i][0] != outs["plain"][i][0]]
        row["identical"] = not differ if m.greedy else None
        row["differs_on"] = differ if m.greedy else None
        row["by_category"] = {
            c: {
                k: v
                for k, v in summary(idx, secs[name], outs[name], plain_cat[c]).items()
                if k in ("tokens_per_s", "speedup", "tau")
            }
            for c, idx in by_cat.items()
        }
        row["per_prompt"] = [
            {
                "id": prompts[i][0],
                "new_tokens": len(outs[name][i][0]),
                "seconds": round(secs[name][i], 4),
                "steps": outs[name][i][1],
            }
            for i in every
        ]
        res[name] = row
    return res


# --- reporting ------------------------------------------------------------------------------------


def online_cost(learner, seconds):
    """An online method's updates in its last repeat, and their time against the decoding's (its
    measured seconds hold both; with one repeat, exactly)."""
    return {
        "updates": learner.updates,
        "update_seconds": round(learner.seconds, 3),
        "of_decoding": round(learner.seconds / max(seconds - learner.seconds, 1e-9), 4),
        "loss": [round(x, 4) for x in learner.losses],
    }


def online_summary(cost):
    """online_cost's numbers in a line."""
    line = f"{cli.plural(cost['updates'], 'update')} in {cost['update_seconds']:.2f} s, "
    line += f"{cost['of_decoding']:.1%} of the decoding time"
    if cost["loss"]:
        line += f", loss {cost['loss'][0]:.3f} -> {cost['loss'][-1]:.3f}"
    return line


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


def tables(res, mach):
    lines = [
        machine_line(mach),
        "",
        "| method | tokens/s | speedup | tau | accepted by depth | identical to plain |",
        "|---|---:|---:|---:|---|:---:|",
    ]
    for name, r in res.items():
        acc = " ".join(f"{a:.2f}" for a in r["accept_by_depth"]) if r["accept_by_depth"] else "-"
        same = (
            "-"
            if r["identical"] is None
            else "yes"
            if r["identical"]
            else f"NO ({len(r['differs_on'])})"
        )
        lines.append(
            f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {fmt(r['tau'])} | {acc} "
            f"| {same} |"
        )
    names = list(res)
    cats = list(res["plain"]["by_category"])
    lines += [
        "",
        machine_line(mach),
        "",
        "Speedup over plain decoding by category:",
        "",
        "| category | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for c in cats:
        lines.append(
            f"| {c} | "
            + " | ".join(f"{res[n]['by_category'][c]['speedup']:.2f}x" for n in names)
            + " |"
        )
    return "\n".join(lines)


def plot_bench(res, mach, folder, partial=None):
    if (plt := plotting()) is None:
        return
    os.makedirs(folder, exist_ok=True)
    names = [n for n in res if n != "plain"]
    groups = list(res["plain"]["by_category"]) + ["all"]
    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 1.2), 4.5))
    width = 0.8 / max(len(names), 1)
    for j, n in enumerate(names):
        vals = [
            res[n]["by_category"][g]["speedup"] if g != "all" else res[n]["speedup"] for g in groups
        ]
        ax.bar(
            [i + j * width for i in range(len(groups))],
            vals,
            width,
            label=n,
            color=plt.cm.tab20(j % 20),
        )  # tab10 repeats past 10
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(
        [i + 0.4 - width / 2 for i in range(len(groups))], groups, rotation=30, ha="right"
    )
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(plot_title(mach, partial), fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "speedup.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for n, r in res.items():
        if r["accept_by_depth"]:
            ax.plot(
                range(1, len(r["accept_by_depth"]) + 1), r["accept_by_depth"], marker="o", label=n
            )
    ax.set_xticks(range(1, max([len(r["accept_by_depth"] or []) for r in res.values()] + [1]) + 1))
    ax.set_xlabel("depth (draft head)")
    ax.set_ylabel("fraction of steps accepting this deep")
    ax.set_ylim(0, 1)
    ax.set_title(plot_title(mach, partial), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "acceptance.png"), dpi=120)
    print(f"[plots] {folder}/speedup.png, {folder}/acceptance.png", file=sys.stderr)


# --- main -----------------------------------------------------------------------------------------


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


def named_methods(text):
    """--methods' names ([] for all); a name not in METHODS is refused."""
    if text == "all":
        return []
    names = [m.strip() for m in text.split(",") if m.strip()]
    if unknown := [m for m in names if m not in METHODS]:
        raise cli.UsageError(
            f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}"
        )
    return names


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
        )
        < 1
    ):
        raise cli.UsageError(
            "--max-new-tokens, --repeats, --max-budget, --max-batch, --tune-repeats, "
            "--prefix-len and --shared-candidates must be at least 1"
        )
    args.batch_size = batch_sizes(args.batch_size)
    named_methods(args.methods)
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
    if named and llama_cpp_module() is None:
        raise cli.UsageError(
            f"--methods {named[0]}: needs llama-cpp-python, which is not installed: pip install "
            "llama-cpp-python"
        )


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


def main(args):
    """Returns the exit code: 0, or 130 when Ctrl-C cut the measuring short (what was measured is
    printed)."""
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
    methods, notes = build_methods(args, model, tokenizer, eos, device, dtype, longest, graphed)
    for g in (graphed or {}).values():  # buffers for the longest reply, a tree and the most rows
        g.new_cache(longest + 256, batch=max(args.batch_size))  # now: never regrown mid-measure
        if max(args.batch_size) > 1:  # every key the batches step at, captured before timing
            nodes = max(m.max_nodes for m in methods.values() if m.batch is not None)
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
    total, interrupted = len(prompts), False
    try:
        secs, outs = measure(methods, prompts, args, device)
    except Interrupted as stop:
        if not stop.done:
            raise KeyboardInterrupt from None
        prompts, secs, outs, interrupted = (
            [prompts[i] for i in stop.done],
            stop.seconds,
            stop.outputs,
            True,
        )
    res = results(methods, prompts, secs, outs)
    mach = machine(
        device,
        dtype,
        quantize=args.quantize,
        prompts=len(prompts),
        mean_prompt_tokens=round(statistics.mean(len(p[2]) for p in prompts), 1),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        **distance_to_floor(model, device),
    )
    print(tables(res, mach))
    for name, r in res.items():
        if methods[name].adapted:
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
            print(
                f"[bench] {name}: output differs from plain decoding on "
                f"{', '.join(map(str, r['differs_on']))}{why}",
                file=sys.stderr,
            )
    for name, m in methods.items():
        if isinstance(m.run, TheirsCompiled):
            print(
                f"[bench] {name}: compiled and warmed up in {m.run.warmup_seconds:.1f} s, left "
                "out of tokens/s",
                file=sys.stderr,
            )
        if m.learns:
            res[name]["online"] = online_cost(m.learns.learner, res[name]["seconds"])
            print(f"[bench] {name}: {online_summary(res[name]['online'])}", file=sys.stderr)
    for g in (graphed or {}).values():  # what was replayed, and every forward that was not
        print(f"[bench] {g.model.cfg.name}: {terminal.graphs_line(g)}", file=sys.stderr)
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
        batched, stopped = measure_batched(methods, prompts, sizes, args, device)
        for name, by_size in batched.items():
            for b in by_size.values():
                b["same"] = b.pop("replies") == [out[0] for out in outs[name]]
        if batched:
            print("\n" + batched_table(res, batched, mach))
        if stopped:
            done = sum(len(by_size) for by_size in batched.values())
            pairs = len(sizes) * sum(m.batch is not None for m in methods.values())
            partial = (
                "interrupted by Ctrl-C while measuring --batch-size: the results cover every "
                f"prompt one at a time, and {done} of the {pairs} batched (method, size) pairs"
            )
            print(f"[bench] {partial}", file=sys.stderr)
    write_records(args, mach, res, batched, partial)
    return 130 if partial else 0


def write_records(args, mach, res, batched, partial):
    """--json and --plots, of what was measured; `partial`: what a Ctrl-C left out, in words (None
    for a whole run), in the JSON's "partial" and the plots' titles."""
    if args.json:
        record = {"machine": mach, "methods": res, "batched": batched, "partial": partial}
        write_json(args.json, record)
    if args.plots:
        try:
            plot_bench(res, mach, args.plots, partial)
            if batched:
                plot_batched(res, batched, mach, args.plots, partial)
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


def cli_main(argv=None) -> int:
    """Bad input: one line on stderr naming it and the fix, exit code 2. Ctrl-C: the tables of what
    was measured so far, exit code 130 (main returns it); before any result, nothing to report."""
    return cli.run(
        main,
        build_parser(),
        argv,
        "[bench] interrupted by Ctrl-C before any result: nothing to report",
    )


if __name__ == "__main__":
    sys.exit(cli_main())
