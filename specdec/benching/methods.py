"""bench.py's catalogue of methods: what each name decodes with, built once the model is loaded.

    METHODS                                  every name --methods takes
    build_methods(args, lesson, loop, ...)   {name: Entry}: the lesson's Method and what the command
                                             line knows of it, and a note for each one skipped
    ours(loop, model, drafter, ...)          one prompt through decode.reply: `loop` (generate.py's
                                             generate(), passed in by bench.py) for heads and plain
                                             decoding, the twin (decode.generate) for the rest
    ours_batched(...)                        a batch through engine.generate_batch
    theirs, TheirsCompiled, in_llama_cpp     transformers' generate() and llama.cpp, as a user
                                             runs them (vLLM's engines: in_vllm.py)

Every method of ours decodes through decode.reply(): the heads (medusa, hydra, hydra++, the joint
kinds, their sampling variants) and plain decoding through generate.py's own generate(), the loop
`python generate.py --prompt` runs (under CUDA graphs the twin's step, which the graphs replay);
lookup, hydra++-lookup, layers, skip, draft-model, jacobi, lookahead, pass, eagle3 (the EAGLE-3
layer in --heads-dir/eagle3 on its tree) and the online heads through decode.generate(). Theirs:
transformers' generate() (hf, hf-compiled: its static cache and
torch.compile, in --methods all on CUDA only, its compile timed apart; pld, assisted) or llama.cpp's
(llama.cpp-f16, -q8_0, -q4_1: GGUF files of the default model's weights, run where
llama-cpp-python is installed) or vLLM's (vllm, vllm-medusa, vllm-eagle3: the default model
exported, each engine in a process of vLLM's own python, where one is found: in_vllm.py); nothing
here is a decode loop. Drafting settings are generate.py's
defaults (DRAFT_DEFAULTS); 'layers' uses the N and gamma that --tune-layers saved in --heads-dir
for this model, device and dtype (layers-DEVICE-DTYPE.json), else for this model on a CPU (with a
notice off the CPU), else half the layers (reported as untuned); 'skip' the set --tune-skip saved
there for this model, device, CPU path and dtype (skip-DEVICE-DTYPE.json), else
catalog.default_skip (reported as untuned).

The package never imports an entry script: bench.py passes itself in (`lesson`: its Method) and
generate.py's generate() (`loop`). Test: `python -m pytest -q tests/test_bench_cli.py`.
"""

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

import heads as heads_lib
from specdec import cli
from specdec import drafters
from specdec import eagle3 as eagle3_lib
from specdec import tuning
from specdec.benching import in_vllm
from specdec.engines import decode
from specdec.engines import engine
from specdec.fast import graphs
from specdec.fast import kernels as kernels_lib
from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec.training import online
from specdec.tuning import sync

# on a quantized copy of the model (--quantize's)
QUANTIZED = tuple(f"{kind}-{q}" for q in cli.QUANTIZE[1:] for kind in ("plain", "hydra++"))
# llama.cpp on the default model's GGUF files
LLAMA_CPP = tuple(f"llama.cpp-{kind}" for kind in checkpoint.GGUF_KINDS)
VLLM = in_vllm.VLLM  # vLLM's engine on the default model: plain, and with a Medusa or EAGLE-3 draft
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
    "eagle3",
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
    *VLLM,
    *ONLINE,
)  # --methods all leaves out QUANTIZED and ONLINE: they run only when named


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


# --- methods --------------------------------------------------------------------------------------
# A method's run is run(ids, max_new, seed) -> decode.Result (its tokens, the base model's forward
# passes, the drafts accepted a step). Ours go through decode.reply(); transformers' count the base
# model's forward calls.


@dataclass
class Entry:
    """A method of the catalogue: the lesson's Method (bench.py's: name, run, greedy, depth, reset),
    and what the command line knows of it beside."""

    method: object
    # decodes a changed copy of the model: a joint kind's LoRA delta, or int8 or int4 weights
    adapted: bool = False
    # run_batch(list of ids, max_new, first seed, rows at once) -> (Results, the forward passes),
    # or None: it does not batch
    batch: Callable | None = None
    learns: object = None  # an Online method: its learner's updates are reported
    nodes_at: Callable | None = None  # rows at once -> the nodes a step drafts (or shares)
    max_nodes: int = 1  # the most nodes a row's draft holds in a batch (graph keys prepared to it)
    predicted: dict | None = None  # rows at once -> --tune-tree's expected speedup over plain
    close: Callable | None = None  # ends what it runs in beside bench (a vLLM engine's process)


def ours(loop, model, drafter, verify, temperature, eos):
    """One prompt through decode.reply: `loop` (generate.py's generate()) for heads on their tree
    and plain decoding, decode.generate for the other drafters (and for every one, loop None)."""

    def run(ids, max_new, seed):
        g = torch.Generator(device=model.device).manual_seed(seed)
        return decode.reply(
            loop,
            model,
            ids,
            max_new,
            drafter,
            verify=verify,
            temperature=temperature,
            generator=g,
            eos_ids=eos,
        )

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
    from the loaded heads at the first prompt; reset() starts again (bench.py's measure() calls it
    before every repeat). A reply's time includes the update that follows it."""

    def __init__(self, loop, model, heads, tree, eos):
        self.loop = loop
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
        self.decode = ours(self.loop, self.model, drafter, "greedy", 0.0, self.eos)

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
        return decode.Result(tokens=out[0, len(ids) :].tolist(), steps=counter.n)

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
        return decode.Result(tokens=new, steps=len(new))  # greedy, no drafts: a forward a token


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
                # one forward per token, the prefill's included
                return decode.Result(tokens=new, steps=len(new))
            llm.eval(new[-1:])

    return run


def vllm_python(args):
    """The python that runs vLLM's engines here (--vllm-python), or None: vLLM is not found, or
    the model is not the default one (the one served from its export)."""
    if args.model != checkpoint.DEFAULT:
        return None
    try:
        return in_vllm.find_python(args.vllm_python)
    except in_vllm.Unavailable:
        return None


def in_vllm_engine(args, name, python, model, dtype):
    """The engine `name` runs on (started now, in a process of its own; in_vllm.py) and a note
    saying what it serves: the default model exported for vLLM, and for vllm-medusa and
    vllm-eagle3 the draft of their flag (default: the shipped one exported), --vllm-speculative-
    tokens a step. A draft that cannot be had raises in_vllm.Unavailable."""
    draft = {}
    if name != "vllm":
        folder = in_vllm.draft_folder(name, getattr(args, name.replace("-", "_")))
        draft = {
            "draft": folder,
            "method": in_vllm.speculative_method(folder),
            "speculative_tokens": args.vllm_speculative_tokens,
        }
    threads = torch.get_num_threads()  # our methods' threads, as llama.cpp's
    engine = in_vllm.Engine(
        python,
        in_vllm.base_folder(),
        dtype=str(dtype).removeprefix("torch."),
        threads=threads,
        max_model_len=model.cfg.max_seq_len,
        max_num_seqs=max(args.batch_size),
        log=os.path.join(cli.cache_root(), "vllm", "logs", f"{name}.log"),
        **draft,
    )
    served = "plain"
    if draft:
        tokens = cli.plural(args.vllm_speculative_tokens, "token")
        served = f"{draft['method']} from {draft['draft']}, {tokens} a step (a chain)"
    note = (
        f"{name}: vLLM {engine.version} ({served}), {cli.plural(threads, 'thread')}, eager, "
        f"at most {max(args.batch_size)} at once; started in {engine.startup_seconds:.1f} s, "
        f"left out of tokens/s; its log: {engine.log}"
    )
    return engine, note


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


def eagle3_drafter(args, model, asked):
    """(the drafter of the EAGLE-3 layer in --heads-dir (its eagle3/ folder, or the folder itself)
    on its tree (catalog.load_tree's auto), its folder), or (None, None) where there is none for
    this model; one named in --methods must be there."""
    folder = catalog.heads_folder(args.heads_dir, eagle3_lib.KIND)
    try:
        if folder is None:
            raise heads_lib.HeadsError(f"no EAGLE-3 layer in --heads-dir {args.heads_dir}")
        module = eagle3_lib.load(folder, model)
    except heads_lib.HeadsError as e:
        if asked:  # --methods all skips it: heads folders from before EAGLE-3 have none
            raise cli.UsageError(
                f"--methods eagle3: {e}; train one with train.py --heads eagle3 --data FILE"
            ) from None
        return None, None
    tree = catalog.load_tree("auto", module, folder, args.quantize)
    return eagle3_lib.Eagle3Drafter(module, tree), folder


def build_methods(
    args, lesson, loop, model, tokenizer, eos, device, dtype, longest=None, graphed=None
):
    """{name: Entry} of the methods asked for, and a note for each one skipped. lesson: bench.py
    (its Method); loop: generate.py's generate(), which the heads and plain decoding run.
    longest: the longest prompt's tokens plus --max-new-tokens (hf-compiled's static cache; None:
    the model's context).
    graphed: a dict to fill with a graphs.GraphedForward per model our methods decode (one for
    all the methods on that model: one set of buffers and graphs), None: they decode eagerly."""

    def fast(m):  # the model the decode loop calls, replayed where graphed
        if graphed is None:
            return m
        if id(m) not in graphed:
            graphed[id(m)] = graphs.GraphedForward(m)
        return graphed[id(m)]

    # the loop a user runs where the model's own forward runs; the graphs replay the twin's step
    looped = loop if graphed is None else None

    def method(name, run, greedy, depth=0, learns=None, **known):
        """The lesson's Method, in an Entry with what the command line knows of it (known)."""
        reset = learns.reset if learns else None  # online heads start each repeat afresh
        return Entry(lesson.Method(name, run, greedy, depth, reset), learns=learns, **known)

    def greedy_alone(name, d):
        """A drafter `d` verified greedily on the base model, alone and in batches, as it is."""
        return method(
            name,
            ours(looped, fast(model), d, "greedy", 0.0, eos),
            greedy=True,
            depth=d.max_depth,
            batch=ours_batched(fast(model), d, "greedy", 0.0, eos),
            max_nodes=d.max_nodes,
        )

    # vLLM's python, looked for once (a subprocess where it is not this one)
    asks_vllm = args.methods == "all" or set(VLLM) & set(named_methods(args.methods))
    vllm_here = vllm_python(args) if asks_vllm else None
    # all: every method that can run here, but the quantized copies (run only when named)
    if args.methods == "all":
        wanted = [
            m
            for m in METHODS
            if m not in QUANTIZED + ONLINE + BATCH_ONLY
            and (m not in LLAMA_CPP or m in llama_cpp_available(args))
            and (m not in VLLM or vllm_here is not None)
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
    if args.methods == "all" and args.model == checkpoint.DEFAULT and vllm_here is None:
        notes.append(f"{', '.join(VLLM)}: not run (they need vLLM: README, 'Serve with vLLM')")
    look = catalog.DRAFT_DEFAULTS["lookup"]
    for name in wanted:
        if name == "plain":
            methods[name] = method(
                name,
                ours(looped, fast(model), None, "greedy", 0.0, eos),
                greedy=True,
                batch=ours_batched(fast(model), None, "greedy", 0.0, eos),
            )
        elif name in LLAMA_CPP:  # the same weights in llama.cpp: how many replies keep the model's
            llm, path = load_llama_cpp(name, device, model.cfg.max_seq_len)
            methods[name] = method(name, in_llama_cpp(llm, eos), greedy=True, adapted=True)
            notes.append(
                f"{name}: llama.cpp on {path}, {cli.plural(torch.get_num_threads(), 'thread')}"
            )
        elif name in VLLM:  # the same weights in vLLM's engine: its tokens/s, tau and replies
            try:
                engine, note = in_vllm_engine(args, name, vllm_here, model, dtype)
            except in_vllm.Unavailable as e:  # named: check_args refused it before the model
                notes.append(f"{name}: skipped ({e})")
                continue
            k = args.vllm_speculative_tokens if name != "vllm" else 0
            methods[name] = method(
                name,
                in_vllm.OneAtATime(engine, eos),
                greedy=True,
                depth=k,
                batch=in_vllm.batched(engine, eos),
                nodes_at=(lambda rows, k=k: f"{k} (chain)") if k else None,
                close=engine.close,
            )
            notes.append(note)
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
            methods[name] = method(
                name,
                ours(loop, q, d, "greedy", 0.0, eos),
                greedy=True,
                depth=d.max_depth if d else 0,
                adapted=True,
            )
        elif name == "lookup":
            d = drafters.Lookup(look["gamma"], look["ngram"], look["matches"], device)
            methods[name] = greedy_alone(name, d)
            notes.append(d.name)
        elif name == "eagle3":
            d, folder = eagle3_drafter(args, model, name in asked)
            if d is None:
                notes.append(
                    f"eagle3: skipped (no EAGLE-3 layer for this model in {args.heads_dir})"
                )
                continue
            methods[name] = greedy_alone(name, d)
            notes.append(
                f"eagle3: {folder}, {d.name.removeprefix('eagle3, ')}, depth {d.max_depth}"
            )
        elif name == "layers":
            n, gamma, how = layers_setting(args, model)
            d = drafters.ModelDrafter(model, gamma, 0.0, 1.0, None, range(n), f"layers:{n}")
            methods[name] = method(
                name, ours(looped, fast(model), d, "greedy", 0.0, eos), greedy=True, depth=gamma
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
            methods[name] = method(
                name, ours(looped, fast(model), d, "greedy", 0.0, eos), greedy=True, depth=d.gamma
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
            methods[name] = method(
                name, ours(looped, fast(model), d, "greedy", 0.0, eos), greedy=True, depth=gamma
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
            methods[name] = method(
                name,
                ours(looped, fast(model), d, "greedy", 0.0, eos),
                greedy=True,
                depth=d.max_depth,
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
            learns = Online(loop, model, heads, tree, eos)
            methods[name] = method(name, learns, greedy=True, depth=tree.max_depth, learns=learns)
            notes.append(f"{name}: {folder}, learning online ({learns.learner.name})")
        elif name == "hf-compiled":  # its own copy: hf's ForwardCounter hook would recompile
            run = TheirsCompiled(
                load_hf(args.model, device, dtype), eos, longest or model.cfg.max_seq_len
            )
            methods[name] = method(name, run, greedy=True)
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
            methods[name] = method(name, theirs(hf, counter, eos, **kw), greedy=True)
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
                by_batch = catalog.batch_drafter(
                    d, folder, base, args.quantize, catalog.UNTUNED_BUDGETS
                )
            elif variant == "uniform" and trees:
                by_batch = drafters.HeadsByBatch(heads, trees)
            # --tune-tree predicted a tuned budget's speed; the default rule's, nobody
            shared_only = type(by_batch) is drafters.HeadsShared and shared is not None
            verify = variant if variant in ("typical", "sample") else "greedy"
            temperature = args.temperature if verify != "greedy" else 0.0
            methods[name] = method(
                name,
                ours(looped, fast(base), d, verify, temperature, eos),
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
