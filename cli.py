"""What a user typed, checked where it enters and reported in one line: shared by every script.

The teaching files (tree, verify, generate.generate, heads, drafters, model) raise plain errors
and never print. The scripts (generate.py, bench.py, train.py, joint.py, pass_tokens.py,
checkpoint.py, tree.py, export.py) parse their flags with Parser, check them with the functions here, and run through
run(), which turns every mistake of the user's into one line on stderr, "error: <what> ...;
<fix>", and exit code 2 (no traceback), Ctrl-C into exit code 130, and a closed pipe into a quiet
exit.

    UsageError, Parser, run(main, parser, argv)      the convention
    notice(message)                                  a remark on stderr (stdout holds only results)
    pick_device, pick_dtype, check_seed              the machine and randomness
    writable_file, writable_folder, check_text       paths and text, checked before the work
    read_prompts(path), encode(tokenizer, text)      prompt files; the one chat-template encoder
    eos_ids(model, tokenizer)                        the one set of tokens that end a reply
    generate_parser, Printer, stats_line             generate.py's flags and what it prints
    find_heads, load_heads, load_tree, parse_draft, draft_settings, make_drafter, pass_drafter
                                                     generate.py's --heads, --tree and --draft
    tuned_tree_file, tuned_parallel                  what bench.py tuned for this machine

Test: `python -m pytest -q tests/test_cli.py tests/test_reliability.py`.
"""
import argparse
import json
import math
import os
import re
import sys
import tempfile

import torch

import checkpoint
import drafters as drafters_lib
import heads as heads_lib
import tree as tree_lib
import verify as verify_lib

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = os.path.join(HERE, "weights", "smollm2-135m-instruct")  # heads trained by train.py
JOINT_KINDS = ("medusa-2", "hydra++-2")  # heads trained with the base model's last layers (joint.py)
MAX_SEED = 2 ** 32 - 1  # train.py combines it with the step into one 64-bit seed


# --- the convention ------------------------------------------------------------------------------
# Bad input raises UsageError with a message that names the input and the fix; run() prints it.

class UsageError(Exception):
    """Bad input from the command line or a file; the message names it and the fix."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, once: not where the help already says it, nor for a
    default of None or False (a flag that is off unless given)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, with defaults shown in --help and a mistake as one UsageError line."""

    def __init__(self, **kw):
        super().__init__(**{"formatter_class": HelpFormatter, **kw})

    def error(self, message):  # argparse would print usage + message and exit; we want one line
        raise UsageError(f"{message} (see --help)")


def error_line(e) -> str:
    return "error: " + " ".join(str(e).splitlines())


def run(main, parser, argv=None, interrupted="[interrupted by Ctrl-C]") -> int:
    """A script's exit code: main(args)'s return value (None = 0). Bad input or data: one line on
    stderr, exit 2; a diverged training (FloatingPointError): one line, exit 1; Ctrl-C: what is
    already on stdout stays, then `interrupted` on stderr, exit 130. No traceback for any of them."""
    try:
        return main(parser.parse_args(argv)) or 0
    except BrokenPipeError:  # the reader went away (generate.py ... | head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (UsageError, checkpoint.LoadError, heads_lib.HeadsError, ValueError, OSError) as e:
        print(error_line(e), file=sys.stderr)
        return 2
    except FloatingPointError as e:  # training diverged: not a mistake in the input
        print(error_line(e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\n" + interrupted, file=sys.stderr)
        return 130


def notice(message):
    """A one-line remark on stderr (never stdout, which holds only the generated text)."""
    print(f"notice: {message}", file=sys.stderr)


# --- the machine and randomness ------------------------------------------------------------------

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


QUANTIZE = ("none", "fp16", "int8", "int4")  # --quantize: kernels.quantize's


def check_quantize(quantize, device):
    """--quantize fp16 runs a CPU kernel (fbgemm's): refused on another device."""
    if quantize == "fp16" and torch.device(device).type != "cpu":
        raise UsageError(f"--quantize fp16: a CPU kernel; on {device} use --dtype fp16 instead (or --device cpu)")


def pick_dtype(name, device, quantize="none"):
    if name == "auto":  # bf16 where it is native (results/README.md), else fp32 on a CPU
        if torch.device(device).type == "cpu":  # fp16 weights: fp32 activations, no casts (results/kernels-cpu.md)
            native = torch.ops.mkldnn._is_mkldnn_bf16_supported() and quantize != "fp16"
            return torch.bfloat16 if native else torch.float32
        # a GPU before Ampere (compute capability < 8) emulates bf16 slowly; fp16 is native there
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if name not in DTYPES:
        raise UsageError(f"--dtype {name}: unknown dtype; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def check_seed(seed):
    if not 0 <= seed <= MAX_SEED:
        raise UsageError(f"--seed {seed}: out of range; use 0 to {MAX_SEED}")


# --- paths and text ------------------------------------------------------------------------------
# Checked before the work, not after it: a folder that cannot be written is found in a second.

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


def conversation_flags(p, data_help, eval_conversations):
    """--model, --data, --conversations, --eval-conversations of the scripts that train on the
    conversations train.py exported and on its split of them (joint.py, pass_tokens.py)."""
    p.add_argument("--model", default=checkpoint.DEFAULT, help=checkpoint.MODEL_HELP)
    p.add_argument("--data", default=os.path.join(HERE, "data", "smollm2-135m-instruct-conversations.safetensors"),
                   help=f"a conversations file written by train.py --export-conversations ({data_help})")
    p.add_argument("--conversations", type=int, default=2000, help="train on the first this many of train.py's training split")
    p.add_argument("--eval-conversations", type=int, default=eval_conversations, help="evaluate on the first this many of its held-out split")


def check_conversations_file(path, flag="--data"):
    import dataset  # it imports this module
    if not path.endswith(".safetensors"):
        raise UsageError(f"{flag} {path}: give a conversations file (.safetensors) written by train.py --export-conversations")
    dataset.conversation_tensors(path, flag)


def empty_folder(flag, path):
    """writable_folder, with nothing in it yet: a run never writes over another's files."""
    writable_folder(flag, path)
    if os.listdir(path):
        raise UsageError(f"{flag} {path}: the folder is not empty; give a new one")


def check_counts(args, *names):
    """Each of these whole-number flags is at least 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")


def check_text(text, what):
    """Text must be valid Unicode to be tokenized and printed. A lone surrogate is not: Python makes
    one of each command-line byte that is not UTF-8, and JSON of an unpaired escape like \\ud800."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{what}: not valid Unicode text (a lone surrogate {text[e.start]!r} at character {e.start}, "
                         "from bytes that are not UTF-8 or an unpaired \\ud800-\\udfff escape); pass UTF-8 text") from None
    return text


def read_prompts(path):
    """JSONL with a "prompt" field (and optional "id", "category"): [(id, prompt, category)],
    errors name the line."""
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
        prompts.append((obj.get("id", n), check_text(obj["prompt"], f"--prompts {path}, line {n}"), obj.get("category", "all")))
    if not prompts:
        raise UsageError(f"--prompts {path}: no prompts in the file; write one {{\"prompt\": \"...\"}} object per line")
    return prompts


def encode(tokenizer, text, system=None, raw=False):
    """The prompt's token ids: the user message in the model's chat template (with a system
    message if given), ending where the assistant's reply begins; raw, or no template: the text."""
    if not text.strip():
        raise UsageError("the prompt is empty; pass some text with --prompt")
    if raw or not tokenizer.chat_template:
        return tokenizer(text).input_ids
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def eos_ids(model, tokenizer) -> set:
    """Token ids that end a reply: the model config's and the tokenizer's."""
    return set(model.cfg.eos_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def acceptance_by_depth(accepted, max_depth):
    """Fraction of speculative steps whose accepted path reached depth d, for d = 1..max_depth."""
    steps = max(len(accepted), 1)
    return [sum(a >= d for a in accepted) / steps for d in range(1, max_depth + 1)]


# --- generate.py's printing -------------------------------------------------------------------------
# stdout gets the generated text alone, as it is produced; remarks and statistics go to stderr.

COLOURS = ["\033[0m", "\033[32m", "\033[33m", "\033[36m", "\033[35m", "\033[34m", "\033[31m"]  # base, then drafter.legend[1:]


def legend_line(drafter):
    return "[--show: plain = the base model's own token, " + ", ".join(
        f"{COLOURS[min(s, len(COLOURS) - 1)]}{who}{COLOURS[0]}" for s, who in enumerate(drafter.legend) if s) + " = proposed by it]"


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


def stats_line(r, max_depth):
    """generate.py's statistics of a Result."""
    n = len(r.tokens)
    line = f"[{n} new token{'s' * (n != 1)}, {r.steps} step{'s' * (r.steps != 1)}, tau {n / max(r.steps, 1):.2f}, {n / max(r.seconds, 1e-9):.1f} tokens/s"
    if max_depth:
        line += ", accepted by depth " + " ".join(f"{a:.2f}" for a in acceptance_by_depth(r.accepted, max_depth))
    return line + "]"


VERIFIERS = ("auto", "greedy", "typical", "sample")  # generate.py --verify
MAX_NEW_TOKENS = 256  # generate.py --max-new-tokens unless given


# --- generate.py's drafter: --draft, --heads, --tree ---------------------------------------------
# Everything that needs no model is checked before one loads: a typo costs a second, not a load.

# what --gamma, --ngram, --matches, --window and --guesses are for each drafter that takes them,
# when not given (jacobi, lookahead and pass: unless bench.py --tune-parallel chose for this machine)
DRAFT_DEFAULTS = {"lookup": {"gamma": 10, "ngram": 3, "matches": 1}, "layers": {"gamma": 4}, "model": {"gamma": 4},
                  "jacobi": {"gamma": 4}, "lookahead": {"window": 4, "ngram": 3, "guesses": 4}, "pass": {"gamma": 2, "guesses": 2}}
PARALLEL = ("jacobi", "lookahead", "pass")  # the model drafts for itself at nodes it computes but never verifies


def parse_draft(spec):
    """--draft -> (kind, arg): kind is heads, lookup, heads+lookup, layers, model, jacobi, lookahead or pass;
    arg is N for layers:N, the [LA] tokens' folder for pass[:FOLDER] (the shipped ones without)."""
    if spec == "pass" or spec.startswith("pass:"):
        folder = spec[5:] or os.path.join(SHIPPED, "pass")
        if not os.path.isfile(os.path.join(folder, checkpoint.TOKENS_CONFIG)):
            raise UsageError(f"--draft {spec}: no [LA] tokens in {folder}; train them with pass_tokens.py --out FOLDER, then --draft pass:FOLDER")
        return "pass", folder
    if m := re.fullmatch(r"layers:(-?[0-9]+)", spec):
        if int(m[1]) < 1:
            raise UsageError(f"--draft {spec}: N is how many of the model's first layers draft, at least 1; use layers:1 or more")
        return "layers", int(m[1])
    if spec in ("heads", "lookup", "heads+lookup", "model", *PARALLEL):
        return spec, None
    raise UsageError(f"--draft {spec}: unknown drafter; use heads, lookup, heads+lookup, layers:N (N a number), model, jacobi, lookahead or pass[:FOLDER]")


def check_sizes(kind, settings, where):
    """The drafter's settings (as given by `where`) fit one forward of at most MAX_NODES nodes."""
    if kind in ("lookup", "heads+lookup") and settings["gamma"] * settings["matches"] >= tree_lib.MAX_NODES:
        raise UsageError(f"{where}gamma {settings['gamma']} x {where}matches {settings['matches']}: the lookup tree would be "
                         f"over MAX_NODES={tree_lib.MAX_NODES}; use smaller values")
    if kind in ("layers", "model", "jacobi") and settings["gamma"] >= tree_lib.MAX_NODES:
        raise UsageError(f"{where}gamma {settings['gamma']}: the chain would be over MAX_NODES={tree_lib.MAX_NODES}; use a smaller {where}gamma")
    nodes = (settings["gamma"] + settings["guesses"]) * (settings["gamma"] + 1) if kind == "pass" else 0  # PaSS.max_nodes
    if nodes > tree_lib.MAX_NODES:
        raise UsageError(f"{where}gamma {settings['gamma']}, {where}guesses {settings['guesses']}: a step would compute "
                         f"{nodes} nodes, over MAX_NODES={tree_lib.MAX_NODES}; use smaller values")
    if kind == "lookahead":
        w, n, g = settings["window"], settings["ngram"], settings["guesses"]
        if n < 2:
            raise UsageError(f"{where}ngram {n}: lookahead's n-grams are a first token and at least one more; use {where}ngram 2 or more")
        if 1 + g * (n - 1) + (w - 1) + (n - 2) * w > tree_lib.MAX_NODES:  # drafters.Lookahead.max_nodes
            raise UsageError(f"{where}window {w}, {where}ngram {n}, {where}guesses {g}: a step would compute {(w - 1) + (n - 2) * w} "
                             f"window nodes and verify up to {g * (n - 1)}, over MAX_NODES={tree_lib.MAX_NODES}; use smaller values")


def draft_settings(args, kind):
    """--gamma, --ngram, --matches, --window, --guesses as given, the rest from DRAFT_DEFAULTS;
    checks that only the drafter's own flags are given and that its other flags fit it. Loads nothing."""
    takes = DRAFT_DEFAULTS.get("lookup" if kind == "heads+lookup" else kind, {})
    given = {k: getattr(args, k) for k in ("gamma", "ngram", "matches", "window", "guesses") if getattr(args, k) is not None}
    for k, v in given.items():
        if k not in takes:
            users = [{"lookup": "lookup, heads+lookup", "layers": "layers:N"}.get(d, d) for d, t in DRAFT_DEFAULTS.items() if k in t]
            users = ", ".join(users[:-1]) + " and " + users[-1] if len(users) > 1 else users[0]
            raise UsageError(f"--{k} does not apply to --draft {args.draft} (only to {users}); drop it")
        if v < 1:
            raise UsageError(f"--{k} {v}: must be at least 1")
    settings = takes | given
    check_sizes(kind, settings, "--")
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


def find_heads(name, flag="--heads"):
    """--heads -> the folder to load heads from, or None (plain decoding). A kind's name is the
    shipped heads of that kind; where none are shipped, a folder of that name (joint.py --out
    medusa-2, say) is the user's own. Loads nothing."""
    if name == "none":
        return None
    if name == "auto":
        folder = os.path.join(SHIPPED, "hydra++")
        return folder if os.path.isdir(folder) else None
    if name in heads_lib.KINDS + JOINT_KINDS:
        folder = os.path.join(SHIPPED, name)
        if os.path.isdir(folder):
            return folder
        if os.path.isdir(name):
            return name
        how = (f"joint.py --init {name.removesuffix('-2')} --out FOLDER" if name in JOINT_KINDS
               else f"train.py --heads {name} --out FOLDER")
        raise UsageError(f"{flag} {name}: no {name} heads are shipped in {SHIPPED}; train them with {how}, "
                         f"then pass {flag} FOLDER")
    if os.path.isdir(name):
        return name
    raise UsageError(f"{flag} {name}: not a heads folder nor one of none, auto, {', '.join(heads_lib.KINDS + JOINT_KINDS)}")


def heads_folder(heads_dir, kind):
    """The heads of `kind` for --heads-dir: the folder itself if it holds heads of that kind (what
    train.py or joint.py writes), else its KIND/ or heads-KIND/ (train.py's default name) sub-folder;
    or None. A joint kind (medusa-2) is heads of its frozen kind (medusa) with a LoRA delta."""
    frozen = kind.removesuffix("-2")
    for folder in (heads_dir, os.path.join(heads_dir, kind), os.path.join(heads_dir, "heads-" + kind)):
        try:
            with open(os.path.join(folder, checkpoint.HEADS_CONFIG)) as f:
                if json.load(f).get("kind") == frozen and checkpoint.has_delta(folder) == (kind != frozen):
                    return folder
        except (OSError, ValueError, AttributeError):
            continue
    return None


def load_heads(name, model):
    """--heads: none, auto, a shipped kind, or a folder. Returns (heads or None, their folder).
    Heads trained jointly with the base model (joint.py) bring a LoRA delta: it is merged into the
    model's weights here, so the model is changed from then on (a notice says how)."""
    folder = find_heads(name)
    if folder is None:
        return None, None
    try:
        heads = checkpoint.load_heads(folder, model)
        if checkpoint.has_delta(folder):
            notice(checkpoint.merge_delta(model, folder) + "; --heads none decodes with the original model")
        return heads, folder
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


def tuned_tree_file(folder, device, dtype, stem="tree", quant="none"):
    """Where bench.py --tune-tree saves the tree it chose for a device and dtype, e.g.
    tree-cpu-float32.json (tree-cpu-float32-fp16.json with --quantize fp16): the best tree depends
    on what a step of N tokens costs there (stem "parallel": where --tune-parallel saves jacobi's
    and lookahead's settings)."""
    name = f"{stem}-{torch.device(device).type}-{str(dtype).removeprefix('torch.')}" + ("" if quant == "none" else f"-{quant}")
    return os.path.join(folder, name + ".json")


def tuned_parallel(folder, model, kind):
    """The settings bench.py --tune-parallel saved in `folder` for `kind` (jacobi or lookahead) on
    this model, device and dtype, checked like the flags; {} if there are none."""
    file = tuned_tree_file(folder, model.device, model.dtype, "parallel")
    try:
        with open(file, encoding="utf-8") as f:
            saved = json.load(f)
        if saved.get("model") != model.cfg.name or kind not in saved:
            return {}
        settings = {k: saved[kind][k] for k in DRAFT_DEFAULTS[kind]}
    except OSError:
        return {}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise UsageError(f"{file}: not a settings file of bench.py --tune-parallel; run it again or delete the file") from None
    if not all(type(v) is int and v >= 1 for v in settings.values()):
        raise UsageError(f"{file}: {kind} settings {settings} are not all whole numbers >= 1; run bench.py --tune-parallel again")
    check_sizes(kind, settings, f"{file}: ")
    return settings


def load_tree(spec, heads, heads_folder, quant="none"):
    """--tree: a spec, or auto = the tree saved next to the heads (the one tuned for this device,
    dtype and the base model's --quantize if there is one, else for the device and dtype, else
    tree.json), else a chain as deep as the heads."""
    if heads is None:
        return None
    weight = next(heads.parameters())
    saved = None
    if heads_folder:
        tuned = tuned_tree_file(heads_folder, weight.device, weight.dtype, quant=quant)
        if not os.path.exists(tuned):
            tuned = tuned_tree_file(heads_folder, weight.device, weight.dtype)
        saved = tuned if os.path.exists(tuned) else os.path.join(heads_folder, "tree.json")
    if spec != "auto":
        paths = parse_tree(spec)
    elif saved and os.path.exists(saved):
        paths, spec = parse_tree(saved), saved
        if weight.device.type != "cpu" and saved != tuned:
            notice(f"no tree tuned for {weight.device.type} and {str(weight.dtype).removeprefix('torch.')} in {heads_folder}: "
                   f"using {os.path.basename(saved)}, tuned on a CPU; bench.py --tune-tree picks one for this machine")
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


def pass_drafter(folder, gamma, guesses, model):
    """--draft pass: the [LA] tokens in `folder`, trained for this model: `guesses` first tokens, a chain of gamma."""
    try:
        embeddings = checkpoint.load_tokens(folder, model)
    except heads_lib.HeadsError as e:
        raise UsageError(f"--draft pass: {e}") from None
    if gamma > len(embeddings):
        raise UsageError(f"--gamma {gamma}: {folder} holds {len(embeddings)} [LA] tokens, so pass drafts at most {len(embeddings)} a step; "
                         f"use --gamma {len(embeddings)} or fewer")
    return drafters_lib.PaSS(model, embeddings, gamma, guesses)


def make_drafter(kind, arg, settings, model, heads, tree, draft_model, temperature, top_p, generator):
    """The drafter that --draft names. Model drafters sample their drafts at `temperature` (0:
    greedy); the heads' drafter at --heads none (or no heads for this model) is plain decoding."""
    dev = model.device
    if kind == "heads":
        return drafters_lib.HeadsDrafter(heads, tree) if heads is not None else drafters_lib.Plain(dev)
    if kind == "lookup":
        return drafters_lib.Lookup(settings["gamma"], settings["ngram"], settings["matches"], dev)
    if kind == "heads+lookup":
        return drafters_lib.heads_and_lookup(drafters_lib.HeadsDrafter(heads, tree), settings["gamma"], settings["ngram"],
                                             settings["matches"], dev)
    if kind == "layers":
        return drafters_lib.ModelDrafter(model, settings["gamma"], temperature, top_p, generator, arg, f"layers:{arg}")
    if kind == "jacobi":
        return drafters_lib.Jacobi(settings["gamma"], dev)
    if kind == "lookahead":
        return drafters_lib.Lookahead(settings["window"], settings["ngram"], settings["guesses"], dev)
    if kind == "pass":
        return pass_drafter(arg, settings["gamma"], settings["guesses"], model)
    return drafters_lib.ModelDrafter(draft_model, settings["gamma"], temperature, top_p, generator)


def flags_without_effect(args, parser):
    """One remark for each flag set away from its default that the chosen mode ignores."""
    changed = lambda name: getattr(args, name) != parser.get_default(name)
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


def generate_parser(description):
    """generate.py's flags."""
    p = Parser(description=description)
    # what to say
    p.add_argument("--prompt", help="the user message (wrapped in the model's chat template)")
    p.add_argument("--prompts", help="JSONL file, one {\"prompt\": ..., \"id\": ...} per line, instead of --prompt")
    p.add_argument("--out", help="with --prompts: write one JSON object per prompt here")
    p.add_argument("--system", default=None, help="system message (default: the template's own)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    # the model and the drafter
    p.add_argument("--model", default=checkpoint.DEFAULT, help=checkpoint.MODEL_HELP)
    p.add_argument("--draft", default="heads", help="who proposes the tokens the model verifies: heads (the --heads below; none = plain decoding) | "
                   "lookup (prompt lookup: what followed the last n tokens earlier in the prompt or the reply) | heads+lookup (both, in one tree) | "
                   "layers:N (the model's own first N layers, self-speculative) | model (the --draft-model) | jacobi (the model's own outputs "
                   "of last step as guesses, Jacobi decoding) | lookahead (n-grams from a window of Jacobi iterations, lookahead decoding) | pass or "
                   "pass:FOLDER (learned [LA] tokens, PaSS: the shipped ones or pass_tokens.py's); jacobi, lookahead and pass take the settings "
                   "bench.py --tune-parallel saved for this machine where no flag sets them")
    p.add_argument("--heads", default="auto", help="with --draft heads or heads+lookup: none | medusa | hydra | hydra++ (shipped for the default model) | "
                   "a heads folder (train.py's or joint.py's --out; joint.py's medusa-2 and hydra++-2 heads adapt the model's last layers, "
                   "merged in at load); auto = hydra++ if shipped for this model, else none")
    p.add_argument("--tree", default="auto", help="with heads: chain:N | cartesian:4,3,2 | a tree JSON file {\"paths\": [[0], [0, 1], ...]}, at most as deep as there are heads; auto = the tree saved with the heads (tree-DEVICE-DTYPE.json that bench.py --tune-tree wrote for this device and dtype, else tree.json), else a chain as deep as the heads")
    p.add_argument("--draft-model", default=None, help="with --draft model: a Llama-family folder or hub id with the same tokenizer as --model")
    p.add_argument("--gamma", type=int, default=None, help="tokens drafted a step by lookup, layers:N, model, jacobi (its m guesses) and pass (its K [LA] tokens); unless given: " +
                   ", ".join(f"{k} {v['gamma']}" for k, v in DRAFT_DEFAULTS.items() if "gamma" in v))
    p.add_argument("--ngram", type=int, default=None, help="lookup: match the last n tokens, n from this down to 1; lookahead: the n-grams' length N, "
                   "first token included, = the window's levels + 1; unless given: " + ", ".join(f"{k} {v['ngram']}" for k, v in DRAFT_DEFAULTS.items() if "ngram" in v))
    p.add_argument("--matches", type=int, default=None, help=f"lookup: propose this many distinct continuations, a tree when > 1; unless given: {DRAFT_DEFAULTS['lookup']['matches']}")
    p.add_argument("--window", type=int, default=None, help=f"lookahead: W, the Jacobi trajectories computed a step; unless given: {DRAFT_DEFAULTS['lookahead']['window']}")
    p.add_argument("--guesses", type=int, default=None, help="lookahead: G, the most n-grams from its pool verified a step; pass: the first [LA] token's "
                   f"G likeliest tokens, verified side by side; unless given: lookahead {DRAFT_DEFAULTS['lookahead']['guesses']}, pass {DRAFT_DEFAULTS['pass']['guesses']}")
    # decoding
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"generate at most this many tokens; prompt + these must fit the model's context (default: {MAX_NEW_TOKENS}, "
                        "or what the context leaves after the prompt, with a notice)")
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
    p.add_argument("--quantize", default="none", choices=QUANTIZE, help="the base model's linear layers on fp16 weights multiplied in fp32 "
                   "(a CPU's fbgemm kernel, faster for one row), or on weight-only int8 (one scale per output channel) or int4 (a scale and a zero "
                   "per 32 inputs: fewer bytes to read a step); heads and KV cache as they are")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp16 on GPUs before Ampere; bf16 on CPUs with oneDNN bf16 kernels, AVX-512 and newer, "
                   "but fp32 under --quantize fp16; else fp32) | fp32 | bf16 | fp16")
    # output
    p.add_argument("--show", action="store_true", help="colour each token by who proposed it (draft head k, lookup, the draft model or layers, jacobi, lookahead, [LA] tokens, or the base model itself); only on a terminal")
    p.add_argument("--quiet", action="store_true", help="do not stream text (statistics only)")
    return p


def check_generate_args(args, parser):
    """generate.py's checks that need no model; remarks for flags without effect. Returns --draft's
    (kind, N) and its settings."""
    if args.prompt is None and args.prompts is None:
        raise UsageError("give a --prompt \"...\" or a --prompts FILE.jsonl")
    if args.prompt is not None and args.prompts is not None:
        raise UsageError("give either --prompt or --prompts, not both")
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("the prompt is empty; pass some text with --prompt")
    for flag in ("prompt", "system"):
        if getattr(args, flag) is not None:
            check_text(getattr(args, flag), f"--{flag}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
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
    check_seed(args.seed)
    if args.heads == "none" and args.tree != "auto":
        raise UsageError("--tree needs draft heads; drop --tree or pass --heads")
    kind, arg = parse_draft(args.draft)
    settings = draft_settings(args, kind)
    if args.out:
        writable_file("--out", args.out, "replies.jsonl")
        if args.prompts and os.path.isfile(args.out) and os.path.isfile(args.prompts) and os.path.samefile(args.out, args.prompts):
            raise UsageError(f"--out {args.out} is the --prompts file: the replies would overwrite the prompts; give another --out")
    pick_dtype(args.dtype, pick_device(args.device), args.quantize)
    if args.tree != "auto":
        parse_tree(args.tree)  # checked now, built once the heads are loaded
    find_heads(args.heads)
    for message in flags_without_effect(args, parser):
        notice(message)
    return kind, arg, settings


def generate_drafter(args, kind, arg, settings, model, tokenizer, generator):
    """generate.py's drafter, once the model is loaded: heads, their tree, a draft model, checked."""
    heads, heads_folder = load_heads(args.heads, model) if kind in ("heads", "heads+lookup") else (None, None)
    tree = load_tree(args.tree, heads, heads_folder, args.quantize)
    if kind == "heads+lookup" and heads is None:
        raise UsageError(f"--draft heads+lookup: no heads are shipped for {model.cfg.name}; train them with train.py and "
                         "pass --heads FOLDER, or use --draft lookup")
    if kind == "layers" and arg >= model.cfg.n_layers:
        raise UsageError(f"--draft {args.draft}: the model has {model.cfg.n_layers} layers, so N must be 1 to "
                         f"{model.cfg.n_layers - 1} (all of them would be the model itself)")
    draft_model = load_draft_model(args.draft_model, model, tokenizer, model.device, model.dtype) if kind == "model" else None
    if kind in PARALLEL:  # what bench.py --tune-parallel chose for this machine, under the flags given
        settings = settings | tuned_parallel(SHIPPED, model, kind) | {k: getattr(args, k) for k in settings if getattr(args, k) is not None}
        check_sizes(kind, settings, "--")
    sampled = args.temperature > 0 and args.verify in ("auto", "sample")  # drafts for Leviathan's rule, else greedy ones
    drafter = make_drafter(kind, arg, settings, model, heads, tree, draft_model,
                           args.temperature if sampled else 0.0, args.top_p, generator)
    if drafter.max_nodes > tree_lib.MAX_NODES:
        raise UsageError(f"--draft {args.draft}: trees of up to {drafter.max_nodes} nodes, over MAX_NODES={tree_lib.MAX_NODES}; "
                         "use a smaller --tree or --gamma")
    return drafter


def encode_prompts(prompts, tokenizer, args, context):
    """[(id, token ids, most new tokens)] of the prompts: --max-new-tokens where given (it must fit
    the model's context after the prompt), else MAX_NEW_TOKENS or what the context leaves."""
    if not args.raw and not tokenizer.chat_template:
        notice("the model's tokenizer has no chat template: the prompt is given as plain text (as with --raw)")
    encoded = []
    for pid, text, _ in prompts:
        ids = encode(tokenizer, text, args.system, args.raw)
        which = "the prompt" if args.prompts is None else f"prompt {pid}"
        room = context - len(ids)
        if room < 1:
            raise UsageError(f"{which} has {len(ids)} tokens, the model's context holds {context} (prompt and reply together); shorten it")
        if args.max_new_tokens is not None and args.max_new_tokens > room:
            raise UsageError(f"--max-new-tokens {args.max_new_tokens}: {which} ({len(ids)} tokens) leaves room for "
                             f"{room} in the model's context of {context}; ask for at most {room}")
        if args.max_new_tokens is None and MAX_NEW_TOKENS > room:
            notice(f"{which} ({len(ids)} tokens) leaves room for {room} new tokens in the model's context of {context}: "
                   f"generating at most {room}")
        encoded.append((pid, ids, args.max_new_tokens or min(MAX_NEW_TOKENS, room)))
    return encoded


def open_output(path):
    """--out, opened for writing (None: no file)."""
    try:
        return open(path, "w", encoding="utf-8") if path else None
    except OSError as e:
        raise UsageError(f"--out {path}: cannot write it ({e.strerror})") from None
