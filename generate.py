"""
Generate text with a Llama-family model, plainly or speculatively: draft heads, prompt lookup,
a draft model or the model's own first layers propose tokens, one forward verifies them.

    python generate.py --prompt "Write a haiku about the sea."            # shipped heads, greedy
    python generate.py --prompt "..." --heads none                        # plain decoding
    python generate.py --prompt "..." --heads medusa --tree chain:3 --show
    python generate.py --prompt "..." --temperature 0.7 --verify sample --seed 1
    python generate.py --prompt "Summarise: ..." --draft heads+lookup --show
    python generate.py --prompt "..." --draft layers:12 --gamma 3         # self-speculative
    python generate.py --model big/llama --draft model --draft-model small/llama
    python generate.py --prompts eval/prompts.jsonl --out replies.jsonl

One decode loop serves every method. Each step:
    the drafter fills a tree of candidate tokens after the last one     (HeadsDrafter, drafters.py)
    -> one forward of the base model over the whole tree, tree mask     (model.Transformer)
    -> verification picks the longest acceptable path + a bonus token   (verify.py)
    -> the accepted tokens are emitted and their KV entries kept        (KVCache.keep)
    -> the drafter learns what was accepted                             (drafter.accept)
Plain decoding is the same loop with a drafter that proposes nothing: the tree is only its root.

Contracts (tested in tests/test_generate.py, tests/test_drafters.py): greedy speculative output is
token-identical to plain greedy decoding in fp32, whatever the drafter (in bf16 a tree step and a
one-token step round differently, so near-ties can flip: README); speculative sampling samples from
the base model's own distribution. The command line (tests/test_cli.py, tests/test_reliability.py):
bad input ends with one line on stderr, "error: <what> ...; <fix>", exit code 2, no traceback;
Ctrl-C keeps the text so far and exits 130; the same --seed gives the same output. stdout holds
only the generated text: remarks ("notice: ...", e.g. a flag without effect in the chosen mode) go
to stderr, and colour codes (--show) only to a terminal.
Shapes: N tree nodes, D hidden, V vocabulary, P parent nodes at one depth.
"""
import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

import checkpoint
import drafters as drafters_lib
import heads as heads_lib
import tree as tree_lib
import verify as verify_lib

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = os.path.join(HERE, "weights", "smollm2-135m-instruct")  # heads trained by train.py


class UsageError(Exception):
    """Bad input from the command line or a file; the message names it and the fix."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage + message and exit; we want one line
        raise UsageError(f"{message} (see --help)")


# what --gamma, --ngram and --matches are for each drafter that takes them, when not given
DRAFT_DEFAULTS = {"lookup": {"gamma": 10, "ngram": 3, "matches": 1}, "layers": {"gamma": 4}, "model": {"gamma": 4}}


def build_parser():
    p = Parser(description=__doc__.split("\n\n")[0].strip(),
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # what to say
    p.add_argument("--prompt", help="the user message (wrapped in the model's chat template)")
    p.add_argument("--prompts", help="JSONL file, one {\"prompt\": ..., \"id\": ...} per line, instead of --prompt")
    p.add_argument("--out", help="with --prompts: write one JSON object per prompt here")
    p.add_argument("--system", default=None, help="system message (default: the template's own)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    # the model and the drafter
    p.add_argument("--model", default=checkpoint.DEFAULT, help="'default' (embedded SmolLM2-135M-Instruct), a local HF folder or a hub id")
    p.add_argument("--draft", default="heads", help="who proposes the tokens the model verifies: heads (the --heads below; none = plain decoding) | "
                   "lookup (prompt lookup: what followed the last n tokens earlier in the prompt or the reply) | heads+lookup (both, in one tree) | "
                   "layers:N (the model's own first N layers, self-speculative) | model (the --draft-model)")
    p.add_argument("--heads", default="auto", help="with --draft heads or heads+lookup: none | medusa | hydra | hydra++ (shipped for the default model) | a heads folder; auto = hydra++ if shipped for this model, else none")
    p.add_argument("--tree", default="auto", help="with heads: chain:N | cartesian:4,3,2 | a tree JSON file {\"paths\": [[0], [0, 1], ...]}, at most as deep as there are heads; auto = the tree saved with the heads (tree-DEVICE-DTYPE.json that bench.py --tune-tree wrote for this device and dtype, else tree.json), else a chain as deep as the heads")
    p.add_argument("--draft-model", default=None, help="with --draft model: a Llama-family folder or hub id with the same tokenizer as --model")
    p.add_argument("--gamma", type=int, default=None, help="tokens drafted a step by lookup, layers:N and model; unless given: " +
                   ", ".join(f"{k} {v['gamma']}" for k, v in DRAFT_DEFAULTS.items()))
    p.add_argument("--ngram", type=int, default=None, help=f"lookup: match the last n tokens, n from this down to 1; unless given: {DRAFT_DEFAULTS['lookup']['ngram']}")
    p.add_argument("--matches", type=int, default=None, help=f"lookup: propose this many distinct continuations, a tree when > 1; unless given: {DRAFT_DEFAULTS['lookup']['matches']}")
    # decoding
    p.add_argument("--max-new-tokens", type=int, default=256, help="generate at most this many tokens; prompt + these must fit the model's context")
    p.add_argument("--temperature", type=float, default=0.0,
                   help=f"0 = greedy, else sample at this temperature; below {verify_lib.GREEDY_BELOW} it is greedy too "
                        "(the probabilities are one-hot there, and overflow far below it)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--verify", default="auto", choices=VERIFIERS,
                   help="greedy (lossless at T=0) | typical (lossy) | sample (lossless speculative sampling: the tree rule, or Leviathan's "
                        "rule for the sampled drafts of layers:N and model); auto = greedy at T=0, else sample. "
                        "At --temperature 0, sample and typical reduce to greedy and give exactly its output")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling: same seed, same flags, same machine -> same output")
    # machine
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp16 on GPUs before Ampere; bf16 on CPUs with oneDNN bf16 kernels, AVX-512 and newer; else fp32) | fp32 | bf16 | fp16")
    # output
    p.add_argument("--show", action="store_true", help="colour each token by who proposed it (draft head k, lookup, the draft model or layers, or the base model itself); only on a terminal")
    p.add_argument("--quiet", action="store_true", help="do not stream text (statistics only)")
    return p


# --- drafting ------------------------------------------------------------------------------------
# Fill the tree with tokens: node (d, r) gets the r-th best token of head d. Hydra heads depend on
# the tokens above them, so the tree is filled depth by depth, one batched head call per depth.

@dataclass
class DepthPlan:                 # what drafting needs at one depth d, computed once per tree
    nodes: torch.Tensor          # (n,) node indices at depth d
    rank: torch.Tensor           # (n,) rank of each node's token in its head's top-k
    row: torch.Tensor            # (n,) which parent row each node hangs under
    paths: torch.Tensor          # (P, d) node indices root..parent for each distinct parent
    k: int                       # top-k needed at this depth


def draft_plan(tree):
    plan = []
    for d, nodes in enumerate(tree.by_depth, start=1):
        parents, row = torch.unique(tree.parent[nodes], return_inverse=True)
        paths = tree.mask[parents].nonzero()[:, 1].view(len(parents), d)  # ancestors, in depth order
        plan.append(DepthPlan(nodes, tree.rank[nodes], row, paths, int(tree.rank[nodes].max()) + 1))
    return plan


def draft(heads, h, root, plan, num_nodes):
    """h (1, D) draft state, root = the last emitted token -> tokens (N,) for every tree node."""
    tokens = torch.full((num_nodes,), root, dtype=torch.long, device=h.device)   # (N,)
    for d, step in enumerate(plan, start=1):
        z = heads.head(d, h, tokens[step.paths])                   # (P, D), or (1, D) for Medusa
        top = heads.project(z, d).topk(step.k, dim=-1).indices      # (P|1, k)
        top = heads.full_ids(top).expand(len(step.paths), -1)       # (P, k) base-vocabulary ids
        tokens[step.nodes] = top[step.row, step.rank]
    return tokens


class HeadsDrafter:
    """Heads as a drafter (the interface of drafters.py): one fixed tree, filled from the draft
    state h = heads.context over the base model's hidden states of the accepted tokens."""

    def __init__(self, heads, tree):
        assert tree.max_depth <= heads.cfg.num_heads, "tree deeper than the heads"
        dev = heads.lm_head.weight.device
        self.heads, self.tree, self.plan = heads, tree, draft_plan(tree)
        self.mask, self.depth = tree.mask.to(dev) if tree.num_nodes > 1 else None, tree.depth.to(dev)
        self.source = tree.depth.tolist()  # node i is head depth[i]'s guess; the root (0) the base model's
        self.name = f"heads: {heads.cfg.kind}, tree: {tree.num_nodes} nodes"
        self.legend = ["base model"] + [f"head {d}" for d in range(1, tree.max_depth + 1)]
        self.max_nodes, self.max_depth = tree.num_nodes, tree.max_depth

    def start(self, prompt, hidden, max_len):
        self.cache = self.heads.new_cache(max_len)  # Hydra++'s PrefixMLP keeps one, else None
        self.h = self.heads.context(hidden, torch.arange(len(prompt), device=hidden.device), self.cache)[:, -1]  # (1, D)

    def draft(self, root):
        tokens = draft(self.heads, self.h, root, self.plan, self.tree.num_nodes)       # (N,)
        return drafters_lib.Draft(tokens, self.tree, self.mask, self.depth, self.source)

    def accept(self, tokens, hidden, positions):
        self.h = self.heads.context(hidden, positions, self.cache)[:, -1]              # (1, D)


# --- the decode loop -----------------------------------------------------------------------------
# Prefill once, then draft, verify and keep, one base forward a step, until EOS or the length limit.

@dataclass
class Result:
    tokens: list = field(default_factory=list)    # generated ids (EOS included if reached)
    sources: list = field(default_factory=list)   # per token: who proposed it, an index into drafter.legend (0 = the base model)
    accepted: list = field(default_factory=list)  # per speculative step: drafted tokens accepted
    steps: int = 0                                 # base forward passes, the prefill included
    seconds: float = 0.0
    stopped: str = ""                              # "eos" | "length"


VERIFIERS = ("auto", "greedy", "typical", "sample")


def choose_verifier(verify, temperature, top_p, generator):
    """verifier(logits (N, V), draft) -> (accepted node indices, bonus token)."""
    if verify not in VERIFIERS:
        raise ValueError(f"verify={verify!r}: use one of {', '.join(VERIFIERS)}")
    if verify == "greedy" and temperature >= verify_lib.GREEDY_BELOW:
        raise ValueError(f"verify='greedy' keeps only the argmax, so it needs temperature 0, got {temperature}")
    if temperature < verify_lib.GREEDY_BELOW:  # what "greedy" (checked above) and auto at temperature 0 mean
        return lambda l, d: verify_lib.greedy(l, d.tokens, d.tree)
    if verify == "typical":
        return lambda l, d: verify_lib.typical(l, d.tokens, d.tree, temperature, top_p, generator=generator)

    def sample(l, d):  # sampled drafts come with their p: Leviathan's rule; picked ones: the tree rule
        if d.probs is not None:
            return verify_lib.leviathan(l, d.tokens, d.probs, temperature, top_p, generator)
        return verify_lib.speculative(l, d.tokens, d.tree, temperature, top_p, generator)
    return sample


@torch.inference_mode()
def generate(model, prompt, max_new_tokens, drafter=None, verify="auto", temperature=0.0,
             top_p=1.0, generator=None, eos_ids=(), on_tokens=None) -> Result:
    """Decode up to max_new_tokens after `prompt` (list of ids), verifying what `drafter`
    proposes (HeadsDrafter or one of drafters.py; None = plain decoding). on_tokens(new_ids,
    sources) is called as tokens are produced; a source indexes drafter.legend."""
    dev = model.device
    drafter = drafter if drafter is not None else drafters_lib.Plain(dev)
    if not prompt or len(prompt) + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"need a non-empty prompt and prompt + max_new_tokens <= the context of "
                         f"{model.cfg.max_seq_len}, got {len(prompt)} + {max_new_tokens}")
    verifier = choose_verifier(verify, temperature, top_p, generator)
    eos_ids = set(eos_ids)
    out = Result()
    t0 = time.perf_counter()

    def emit(new, sources):  # append, stop at EOS or the length limit; True when done
        new, sources = new[:max_new_tokens - len(out.tokens)], sources[:max_new_tokens - len(out.tokens)]
        for i, t in enumerate(new):
            if t in eos_ids:
                new, sources, out.stopped = new[:i + 1], sources[:i + 1], "eos"
                break
        out.tokens += new
        out.sources += sources
        if on_tokens:
            on_tokens(new, sources)
        if not out.stopped and len(out.tokens) >= max_new_tokens:
            out.stopped = "length"
        return bool(out.stopped)

    # prefill: the prompt in one forward; its last logits give the first token
    max_len = len(prompt) + max_new_tokens + drafter.max_nodes
    cache = model.new_cache(max_len)
    positions = torch.arange(len(prompt), device=dev)
    logits, hidden = model(torch.tensor([prompt], device=dev), positions, None, cache, last_only=True)
    cache.keep(range(len(prompt)))
    drafter.start(prompt, hidden, max_len)
    probs = verify_lib.logits_to_probs(logits[0, -1].float(), temperature, top_p)   # (V,)
    root = int(verify_lib.sample(probs, generator)) if temperature > 0 else int(probs.argmax())
    out.steps = 1
    done = emit([root], [0])

    while not done:
        d = drafter.draft(root)                                                     # tokens (N,), tree, ...
        positions = cache.length + d.depth                                          # (N,)
        logits, hidden = model(d.tokens[None], positions, d.mask, cache)            # (1, N, V), (1, N, D)
        nodes, bonus = verifier(logits[0].float(), d)
        cache.keep(nodes)  # slots [0, length): the prompt and every emitted token but the bonus
        out.steps += 1
        kept = d.tokens[nodes].tolist()                                             # the root, accepted drafts
        before = len(out.tokens)
        done = emit(kept[1:] + [bonus], [d.source[i] for i in nodes[1:].tolist()] + [0])
        out.accepted.append(min(len(nodes) - 1, len(out.tokens) - before))          # drafts emitted (EOS, length)
        if not done:
            drafter.accept(kept, hidden[:, nodes], positions[nodes])
        root = bonus
    out.seconds = time.perf_counter() - t0
    return out


def acceptance_by_depth(accepted, max_depth):
    """Fraction of speculative steps whose accepted path reached depth d, for d = 1..max_depth."""
    steps = max(len(accepted), 1)
    return [sum(a >= d for a in accepted) / steps for d in range(1, max_depth + 1)]


# --- setting up: device, dtype, heads, tree, drafter, prompts ------------------------------------
# Bad input is caught here, where it enters, and named with its fix. main() runs every check that
# needs no model before loading one: a typo costs a second, not a model load.

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device(name):
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if not re.fullmatch(r"cuda(:[0-9]+)?", name):
        raise UsageError(f"--device {name}: unknown device; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    if int(name.partition(":")[2] or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                         f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return name


def pick_dtype(name, device):
    if name == "auto":  # measured (README): bf16 is faster on CUDA and on a CPU with native bf16 (AVX512-BF16);
        # oneDNN also reports bf16 on AVX-512 CPUs without it (converted in its kernels), unmeasured here
        if device == "cpu":
            return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
        # a GPU before Ampere (compute capability < 8) emulates bf16 slowly; fp16 is native there
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if name not in DTYPES:
        raise UsageError(f"--dtype {name}: unknown dtype; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def find_heads(name):
    """--heads -> the folder to load heads from, or None (plain decoding). Loads nothing."""
    if name == "none":
        return None
    if name == "auto":
        folder = os.path.join(SHIPPED, "hydra++")
        return folder if os.path.isdir(folder) else None
    if name in heads_lib.KINDS:
        folder = os.path.join(SHIPPED, name)
        if not os.path.isdir(folder):
            raise UsageError(f"--heads {name}: no {name} heads are shipped in {folder}; train them with train.py --heads {name}")
        return folder
    if os.path.isdir(name):
        return name
    raise UsageError(f"--heads {name}: not a heads folder nor one of none, auto, {', '.join(heads_lib.KINDS)}")


def load_heads(name, model):
    """--heads: none, auto, a shipped kind, or a folder. Returns (heads or None, their folder)."""
    folder = find_heads(name)
    if folder is None:
        return None, None
    try:
        return checkpoint.load_heads(folder, model), folder
    except heads_lib.HeadsError as e:
        if name == "auto":
            return None, None  # shipped heads belong to the default model; another model runs plain
        raise UsageError(f"--heads {name}: {e}") from None


def parse_tree(spec):
    """--tree spec -> paths (tree.parse: data only, nothing in it is ever evaluated)."""
    try:
        return tree_lib.parse(spec)
    except (ValueError, OSError) as e:
        raise UsageError(f"--tree: {e}") from None


def tuned_tree_file(folder, device, dtype):
    """Where bench.py --tune-tree saves the tree it chose for a device and dtype, e.g.
    tree-cpu-float32.json: the best tree depends on what a step of N tokens costs there."""
    return os.path.join(folder, f"tree-{torch.device(device).type}-{str(dtype).removeprefix('torch.')}.json")


def load_tree(spec, heads, heads_folder):
    """--tree: a spec, or auto = the tree saved next to the heads (the one tuned for this device and
    dtype if there is one, else tree.json), else a chain as deep as the heads."""
    if heads is None:
        return None
    weight = next(heads.parameters())
    saved = None
    if heads_folder:
        tuned = tuned_tree_file(heads_folder, weight.device, weight.dtype)
        saved = tuned if os.path.exists(tuned) else os.path.join(heads_folder, "tree.json")
    if spec != "auto":
        paths = parse_tree(spec)
    elif saved and os.path.exists(saved):
        paths, spec = parse_tree(saved), saved
    else:
        paths = tree_lib.chain(heads.cfg.num_heads)
    t = tree_lib.build(paths)
    if t.max_depth > heads.cfg.num_heads:
        raise UsageError(f"--tree {spec}: depth {t.max_depth} needs {t.max_depth} heads, the heads have "
                         f"{heads.cfg.num_heads}; use a tree at most {heads.cfg.num_heads} deep")
    vocab = heads.cfg.kept_tokens or heads.cfg.vocab_size
    if t.num_nodes > 1 and int(t.rank.max()) >= vocab:
        raise UsageError(f"--tree {spec}: rank {int(t.rank.max())} asks a head for its top-{int(t.rank.max()) + 1} "
                         f"tokens, the heads predict {vocab}; use smaller ranks")
    return t


def writable_file(flag, path, example):
    """Fail now, not after the work: `path` must be a file (new or not) in an existing folder that
    takes new files. Tried, not read off permission bits (root ignores those). Writes nothing."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: not a file in an existing folder; give a path such as {example}")
    try:
        tempfile.TemporaryFile(dir=folder).close()
        if os.path.exists(path):
            open(path, "ab").close()  # append mode: the file is left as it is
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror}); choose a writable folder") from None


def writable_folder(flag, path):
    """Fail now, not after the work: `path` must be a folder that takes new files; it is created
    (with its parents) if it does not exist."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a file, not a folder; give a folder")
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror}); choose a writable folder") from None


def check_text(text, what):
    """Text must be valid Unicode to be tokenized and printed. A lone surrogate is not: Python makes
    one of each command-line byte that is not UTF-8, and JSON of an unpaired escape like \\ud800."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{what}: not valid Unicode text (a lone surrogate {text[e.start]!r} at character {e.start}, "
                         "from bytes that are not UTF-8 or an unpaired \\ud800-\\udfff escape); pass UTF-8 text") from None
    return text


def parse_draft(spec):
    """--draft -> (kind, N): kind is heads, lookup, heads+lookup, layers or model; N for layers:N."""
    if m := re.fullmatch(r"layers:(-?[0-9]+)", spec):
        if int(m[1]) < 1:
            raise UsageError(f"--draft {spec}: N is how many of the model's first layers draft, at least 1; use layers:1 or more")
        return "layers", int(m[1])
    if spec in ("heads", "lookup", "heads+lookup", "model"):
        return spec, None
    raise UsageError(f"--draft {spec}: unknown drafter; use heads, lookup, heads+lookup, layers:N (N a number) or model")


def draft_settings(args, kind):
    """--gamma, --ngram, --matches as given, the rest from DRAFT_DEFAULTS; checks that only the
    drafter's own flags are given and that its other flags fit it. Loads nothing."""
    takes = DRAFT_DEFAULTS.get("lookup" if kind == "heads+lookup" else kind, {})
    given = {k: getattr(args, k) for k in ("gamma", "ngram", "matches") if getattr(args, k) is not None}
    for k, v in given.items():
        if k not in takes:
            users = "lookup, heads+lookup, layers:N and model" if k == "gamma" else "lookup and heads+lookup"
            raise UsageError(f"--{k} does not apply to --draft {args.draft} (only to {users}); drop it")
        if v < 1:
            raise UsageError(f"--{k} {v}: must be at least 1")
    settings = takes | given
    if kind in ("lookup", "heads+lookup") and settings["gamma"] * settings["matches"] >= tree_lib.MAX_NODES:
        raise UsageError(f"--gamma {settings['gamma']} x --matches {settings['matches']}: the lookup tree would be over "
                         f"MAX_NODES={tree_lib.MAX_NODES}; use smaller values")
    if kind in ("layers", "model") and settings["gamma"] >= tree_lib.MAX_NODES:
        raise UsageError(f"--gamma {settings['gamma']}: the chain would be over MAX_NODES={tree_lib.MAX_NODES}; use a smaller --gamma")
    if kind not in ("heads", "heads+lookup") and args.tree != "auto":
        raise UsageError(f"--tree shapes the heads' tree, --draft {args.draft} has none; drop --tree or use --draft heads or heads+lookup")
    if kind not in ("heads", "heads+lookup") and args.heads != "auto":
        raise UsageError(f"--heads {args.heads}: --draft {args.draft} drafts without heads; drop --heads or use --draft heads or heads+lookup")
    if kind == "heads+lookup" and args.heads == "none":
        raise UsageError("--draft heads+lookup needs heads, not --heads none; name them or use --draft lookup")
    if kind == "model" and not args.draft_model:
        raise UsageError("--draft model needs --draft-model NAME: a Llama-family folder or hub id with the same tokenizer as --model")
    if kind != "model" and args.draft_model:
        raise UsageError(f"--draft-model is used by --draft model, not --draft {args.draft}; add --draft model or drop --draft-model")
    return settings


def load_draft_model(name, model, tokenizer, device, dtype):
    """--draft-model: a Llama-family model whose vocabulary is the base model's, token for token."""
    try:
        draft_model, draft_tokenizer = checkpoint.load(name, device, dtype)
    except checkpoint.LoadError as e:
        raise UsageError(f"--draft-model {name}: {e}") from None
    ours, theirs = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if ours != theirs or draft_model.cfg.vocab_size != model.cfg.vocab_size:
        differ = len(set(ours.items()) ^ set(theirs.items()))
        raise UsageError(f"--draft-model {name}: its vocabulary differs from the model's ({len(theirs)} against {len(ours)} "
                         f"tokens, {differ} entries differ; embeddings of {draft_model.cfg.vocab_size} against "
                         f"{model.cfg.vocab_size} rows); use a draft model with the same tokenizer")
    return draft_model


def build_drafter(kind, layers, settings, model, heads, tree, draft_model, temperature, top_p, generator):
    """The drafter that --draft names. Model drafters sample their drafts at `temperature` (0:
    greedy); the heads' drafter at --heads none (or no heads for this model) is plain decoding."""
    dev = model.device
    if kind == "heads":
        return HeadsDrafter(heads, tree) if heads is not None else drafters_lib.Plain(dev)
    if kind == "lookup":
        return drafters_lib.Lookup(settings["gamma"], settings["ngram"], settings["matches"], dev)
    if kind == "heads+lookup":
        return drafters_lib.heads_and_lookup(HeadsDrafter(heads, tree), settings["gamma"], settings["ngram"], settings["matches"], dev)
    if kind == "layers":
        return drafters_lib.ModelDrafter(model, settings["gamma"], temperature, top_p, generator, layers, f"layers:{layers}")
    return drafters_lib.ModelDrafter(draft_model, settings["gamma"], temperature, top_p, generator)


def read_prompts(path):
    """JSONL with a "prompt" field (and optional "id"): [(id, prompt)], errors name the line."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not part of line 1
            lines = f.read().splitlines()
    except OSError as e:
        raise UsageError(f"--prompts {path}: cannot read it ({e.strerror})")
    except UnicodeDecodeError as e:
        raise UsageError(f"--prompts {path}: not valid UTF-8 text (bad byte at offset {e.start}); save it as UTF-8")
    prompts = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise UsageError(f"--prompts {path}, line {n}: not valid JSON; write one {{\"prompt\": \"...\"}} object per line")
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise UsageError(f"--prompts {path}, line {n}: needs a string field \"prompt\", as in {{\"prompt\": \"...\"}}")
        if not obj["prompt"].strip():
            raise UsageError(f"--prompts {path}, line {n}: the prompt is empty; give it some text or drop the line")
        prompts.append((obj.get("id", n), check_text(obj["prompt"], f"--prompts {path}, line {n}")))
    if not prompts:
        raise UsageError(f"--prompts {path}: no prompts in the file; write one {{\"prompt\": \"...\"}} object per line")
    return prompts


def encode(tokenizer, text, system=None, raw=False):
    if not text.strip():
        raise UsageError("the prompt is empty; pass some text with --prompt")
    if raw or not tokenizer.chat_template:
        return tokenizer(text).input_ids
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


# --- printing ------------------------------------------------------------------------------------
# stdout gets the generated text alone, as it is produced; remarks and statistics go to stderr.

def notice(message):
    """A one-line remark on stderr (never stdout, which holds only the generated text)."""
    print(f"notice: {message}", file=sys.stderr)


def flags_without_effect(args):
    """One notice for each flag set away from its default that the chosen mode ignores."""
    changed = lambda name: getattr(args, name) != build_parser().get_default(name)
    ignored = []
    if args.temperature == 0:
        ignored += [f"--{n.replace('_', '-')} has no effect at --temperature 0 (greedy decoding)"
                    for n in ("top_p", "seed") if changed(n)]
        if args.verify in ("sample", "typical"):
            ignored.append(f"--verify {args.verify} at --temperature 0 is greedy verification (same output)")
    if args.heads == "none" and args.draft == "heads" and changed("verify"):
        ignored.append("--verify has no effect without a drafter (--heads none)")
    if args.raw and args.system is not None:
        ignored.append("--system has no effect with --raw (no chat template)")
    if args.show and args.quiet:
        ignored.append("--show has no effect with --quiet (no text is printed)")
    elif args.show and not sys.stdout.isatty():
        ignored.append("--show colours only a terminal; stdout is not one, so the text is written plain")
    return ignored


COLOURS = ["\033[0m", "\033[32m", "\033[33m", "\033[36m", "\033[35m", "\033[34m", "\033[31m"]  # base, then drafter.legend[1:]


class Printer:
    """Streams decoded text to stdout; holds back an incomplete UTF-8 character. show: colour codes."""

    def __init__(self, tokenizer, show):
        self.tok, self.show, self.ids, self.printed = tokenizer, show, [], ""

    def __call__(self, new, sources):
        for t, s in zip(new, sources):
            self.ids.append(t)
            text = self.tok.decode(self.ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            piece, self.printed = text[len(self.printed):], text
            if piece:
                sys.stdout.write(COLOURS[min(s, len(COLOURS) - 1)] + piece + COLOURS[0] if self.show and s else piece)
        sys.stdout.flush()


def stats_line(r: Result, max_depth):
    n = len(r.tokens)
    line = f"[{n} new tokens, {r.steps} steps, tau {n / max(r.steps, 1):.2f}, {n / max(r.seconds, 1e-9):.1f} tokens/s"
    if max_depth:
        line += ", accepted by depth " + " ".join(f"{a:.2f}" for a in acceptance_by_depth(r.accepted, max_depth))
    return line + "]"


def main(args):
    # checks that need no model
    if args.prompt is None and args.prompts is None:
        raise UsageError("give a --prompt \"...\" or a --prompts FILE.jsonl")
    if args.prompt is not None and args.prompts is not None:
        raise UsageError("give either --prompt or --prompts, not both")
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("the prompt is empty; pass some text with --prompt")
    for flag in ("prompt", "system"):
        if getattr(args, flag) is not None:
            check_text(getattr(args, flag), f"--{flag}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature {args.temperature}: must be a number >= 0 (0 = greedy)")
    if 0 < args.temperature < verify_lib.GREEDY_BELOW:
        notice(f"--temperature {args.temperature} is below {verify_lib.GREEDY_BELOW}: decoding greedily, as at 0")
        args.temperature = 0.0
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.verify == "greedy" and args.temperature > 0:
        raise UsageError("--verify greedy decodes at temperature 0; drop --temperature or use --verify sample")
    if not 0 <= args.seed < 2 ** 63:
        raise UsageError(f"--seed {args.seed}: must be in [0, 2**63)")
    if args.heads == "none" and args.tree != "auto":
        raise UsageError("--tree needs draft heads; drop --tree or pass --heads")
    kind, layers = parse_draft(args.draft)
    settings = draft_settings(args, kind)
    if args.out:
        writable_file("--out", args.out, "replies.jsonl")
        if args.prompts and os.path.isfile(args.out) and os.path.isfile(args.prompts) and os.path.samefile(args.out, args.prompts):
            raise UsageError(f"--out {args.out} is the --prompts file: the replies would overwrite the prompts; give another --out")
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    prompts = read_prompts(args.prompts) if args.prompts else [(0, args.prompt)]
    if args.tree != "auto":
        parse_tree(args.tree)  # checked now, built once the heads are loaded
    find_heads(args.heads)
    for message in flags_without_effect(args):
        notice(message)
    show = args.show and sys.stdout.isatty()  # colour codes only on a terminal, never into a file or a pipe

    # the model, then what depends on it
    torch.manual_seed(args.seed)
    model, tokenizer = checkpoint.load(args.model, device, dtype)
    heads, heads_folder = load_heads(args.heads, model) if kind in ("heads", "heads+lookup") else (None, None)
    tree = load_tree(args.tree, heads, heads_folder)
    if kind == "heads+lookup" and heads is None:
        raise UsageError(f"--draft heads+lookup: no heads are shipped for {model.cfg.name}; train them with train.py and "
                         "pass --heads FOLDER, or use --draft lookup")
    if kind == "layers" and layers >= model.cfg.n_layers:
        raise UsageError(f"--draft {args.draft}: the model has {model.cfg.n_layers} layers, so N must be 1 to "
                         f"{model.cfg.n_layers - 1} (all of them would be the model itself)")
    draft_model = load_draft_model(args.draft_model, model, tokenizer, device, dtype) if kind == "model" else None
    generator = torch.Generator(device=device).manual_seed(args.seed)
    sampled = args.temperature > 0 and args.verify in ("auto", "sample")  # drafts for Leviathan's rule, else greedy ones
    drafter = build_drafter(kind, layers, settings, model, heads, tree, draft_model,
                            args.temperature if sampled else 0.0, args.top_p, generator)
    if drafter.max_nodes > tree_lib.MAX_NODES:
        raise UsageError(f"--draft {args.draft}: trees of up to {drafter.max_nodes} nodes, over MAX_NODES={tree_lib.MAX_NODES}; "
                         "use a smaller --tree or --gamma")
    eos = set(model.cfg.eos_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    encoded = [(pid, encode(tokenizer, text, args.system, args.raw)) for pid, text in prompts]
    context = model.cfg.max_seq_len
    for pid, ids in encoded:
        which = "the prompt" if args.prompts is None else f"prompt {pid}"
        room = context - len(ids)
        if room < 1:
            raise UsageError(f"{which} has {len(ids)} tokens, the model's context holds {context} (prompt and reply together); shorten it")
        if args.max_new_tokens > room:
            raise UsageError(f"--max-new-tokens {args.max_new_tokens}: {which} ({len(ids)} tokens) leaves room for "
                             f"{room} in the model's context of {context}; ask for at most {room}")
    try:
        writer = open(args.out, "w", encoding="utf-8") if args.out else None
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot write it ({e.strerror})") from None
    print(f"[{model.cfg.name} on {device}, {str(dtype).removeprefix('torch.')}, {drafter.name}]", file=sys.stderr)
    if show and drafter.max_depth and sys.stderr.isatty():  # the legend is colours too
        print("[--show: plain = the base model's own token, " + ", ".join(
            f"{COLOURS[min(s, len(COLOURS) - 1)]}{who}{COLOURS[0]}" for s, who in enumerate(drafter.legend) if s) + " = proposed by it]", file=sys.stderr)
    total = Result()
    try:
        for pid, ids in encoded:
            printer = None if args.quiet else Printer(tokenizer, show)
            r = generate(model, ids, args.max_new_tokens, drafter, args.verify, args.temperature,
                         args.top_p, generator, eos, printer)
            if printer:
                print()
            print(stats_line(r, drafter.max_depth), file=sys.stderr)
            total.tokens += r.tokens
            total.accepted += r.accepted
            total.steps, total.seconds = total.steps + r.steps, total.seconds + r.seconds
            if writer:
                writer.write(json.dumps({"id": pid, "text": tokenizer.decode(r.tokens, skip_special_tokens=True),
                                         "token_ids": r.tokens, "new_tokens": len(r.tokens), "steps": r.steps,
                                         "seconds": round(r.seconds, 4)}) + "\n")
                writer.flush()
    finally:
        if writer:
            writer.close()
    if len(encoded) > 1:
        print("[all prompts: " + stats_line(total, drafter.max_depth)[1:], file=sys.stderr)


def cli(argv=None) -> int:
    """The command line. Bad input: one line on stderr naming it and the fix, exit code 2. Ctrl-C:
    the text so far is already on stdout; a notice, exit code 130. No traceback for either."""
    try:
        main(build_parser().parse_args(argv))
        return 0
    except BrokenPipeError:  # the reader went away (generate.py ... | head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (UsageError, checkpoint.LoadError, heads_lib.HeadsError, ValueError, OSError) as e:
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\n[interrupted by Ctrl-C; the text above is what was generated so far]", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show a character gets '?', not a crash
    sys.exit(cli())
