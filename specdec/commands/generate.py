"""generate.py's command line: its flags, the checks that need no model (before one loads: a typo
costs a second, not a load), the modes, and main(), which turns the flags into plain values once.

One prompt at a time with heads or plain decoding runs generate.py's own generate() (passed in as
`lesson`), the model's fast forward (kernels.c) as its model: what a reader reads is what runs.
The other drafters, --online, a batch and a chat run the package's twin of the loop
(specdec/engines/decode.py, engine.py): rows of a cache, drafters that bring computed-only nodes.

Test: `python -m pytest -q tests/test_cli.py`.
"""

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

import specdec.ctrl_c
import verify as verify_lib
from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import cli
from specdec import drafters
from specdec.engines import decode
from specdec.engines import engine
from specdec.fast import graphs
from specdec.fast import kernels
from specdec.training import online
from specdec import terminal

MAX_NEW_TOKENS = 256  # --max-new-tokens unless given
DESCRIPTION = (
    "Speculative decoding with draft heads: replies to a prompt, a file of prompts or a chat."
)


def defaults(key):
    """'lookup 3, lookahead 3': a drafter setting's defaults, for its flag's help."""
    return ", ".join(f"{k} {v[key]}" for k, v in catalog.DRAFT_DEFAULTS.items() if key in v)


def add_prompt_flags(p):
    """What to say, and where the replies go."""
    p.add_argument("--prompt", help="the user message (wrapped in the model's chat template)")
    p.add_argument(
        "--prompts",
        help='JSONL file, one {"prompt": ..., "id": ...} per line, instead of --prompt; a line '
        '{"messages": [{"role": ..., "content": ...}, ...]} is a conversation whose last '
        "message, the user's, is answered",
    )
    p.add_argument(
        "--out",
        help="with --prompts: one JSON line per reply, naming its prompt's id, written as it ends "
        "(with --batch-size, in the order they end); a new file, unless --overwrite",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out file (else refused: decoding would empty it)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="with --prompts and --out: continue an interrupted run: the prompts whose rows --out "
        "holds are left out, the others' rows appended (a last row cut short is cut off)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="talk: type a message, the reply streams; the KV cache is kept between turns, so each "
        "forwards only what is new (/help lists the commands, Ctrl-D ends)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="with --prompts: decode this many side by side, one forward for all, any --draft; "
        "each reply is printed whole as it ends, marked with its id, and sampled from its own "
        "generator, seeded --seed + its line's index. Heads share the budget of nodes that "
        "bench.py --tune-tree chose for this machine and the rows still decoding (--tree: that "
        "tree each)",
    )
    p.add_argument("--system", help="system message (default: the template's own)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")


def add_drafter_flags(p):
    """The model, and who drafts for it."""
    p.add_argument("--model", default=checkpoint.DEFAULT, help=checkpoint.MODEL_HELP)
    p.add_argument(
        "--draft",
        default="heads",
        help="who proposes the tokens the model verifies: heads (--heads; none = plain decoding) "
        "| lookup (prompt lookup: what followed the last n tokens earlier in prompt or reply) | "
        "heads+lookup (both, one tree) | layers:N (the model's first N layers) | skip[:LAYERS] "
        "(the model without LAYERS, numbered from 0, e.g. skip:2,5,9-12; plain skip: what "
        "bench.py --tune-skip saved for this machine) | model (--draft-model) | jacobi (Jacobi "
        "decoding: last step's own outputs as guesses) | lookahead (lookahead decoding: n-grams "
        "from a window of Jacobi iterations) | pass[:FOLDER] (PaSS's learned [LA] tokens, shipped "
        "or pass_tokens.py's) | eagle3 (EAGLE-3: one decoder layer over the model's fused "
        "layers; --heads auto for the shipped one, or a folder; on --tree). Self-speculative: "
        "layers, skip, jacobi, lookahead and pass; unless flags set them, jacobi, lookahead and "
        "pass take what bench.py --tune-parallel saved for this machine",
    )
    p.add_argument(
        "--heads",
        default="auto",
        help="with --draft heads or heads+lookup: none | medusa | hydra | hydra++ (shipped for "
        "the default model) | a heads folder (train.py's or joint.py's; joint.py's medusa-2 and "
        "hydra++-2 adapt the model's last layers, merged in at load); auto = hydra++ if shipped "
        "for this model, else none. With --draft eagle3: auto (the shipped layer) | none | a "
        "folder train.py --heads eagle3 wrote",
    )
    p.add_argument(
        "--tree",
        default="auto",
        help="with heads or eagle3: chain:N | cartesian:4,3,2 | a JSON file "
        '{"paths": [[0], [0, 1], ...]}, at most as deep as the heads; auto = the tree beside '
        "the heads (bench.py --tune-tree's tree-DEVICE-DTYPE.json for this device, CPU path and "
        "dtype, else tree.json), else a chain as deep as the heads",
    )
    p.add_argument(
        "--draft-model",
        help="with --draft model: a Llama-family folder or hub id sharing --model's tokenizer",
    )


# the drafters' size flags, each a whole number; unless given, the drafter's own (DRAFT_DEFAULTS)
SIZES = {
    "gamma": "tokens drafted a step by lookup, layers:N, skip, model, jacobi (its m guesses) and "
    "pass (its K [LA] tokens)",
    "ngram": "lookup: match the last n tokens, n from this down to 1; lookahead: the n-grams' "
    "length N, first token included, = the window's levels + 1",
    "matches": "lookup: propose this many distinct continuations, a tree when > 1",
    "window": "lookahead: W, the Jacobi trajectories computed a step",
    "guesses": "lookahead: G, the most n-grams from its pool verified a step; pass: the first "
    "[LA] token's G likeliest tokens, verified side by side",
}


def add_draft_size_flags(p):
    """How much the drafters propose a step; each drafter's defaults unless given."""
    for name, what in SIZES.items():
        p.add_argument(f"--{name}", type=int, help=f"{what}; unless given: {defaults(name)}")


def add_online_flags(p):
    """Online speculative decoding (online.py): the heads learn between replies."""
    p.add_argument(
        "--online",
        action="store_true",
        help="with heads: between replies, train them on the base model's distribution at every "
        "token committed so far, to draft the next replies better; the base model and its "
        "output are unchanged",
    )
    for name, kind, what in (
        ("lr", float, "AdamW's rate"),
        ("buffer", int, "train on the last this many replies"),
        ("every", int, "update the heads after every this many replies"),
        ("steps", int, "optimizer steps an update"),
    ):
        p.add_argument(
            f"--online-{name}", type=kind, default=online.DEFAULTS[name], help=f"--online: {what}"
        )
    p.add_argument(
        "--online-save",
        metavar="FOLDER",
        help="--online: write the adapted heads here at the end or at Ctrl-C (load them with "
        "--heads FOLDER); a new or empty folder, not in the shipped heads'",
    )


def add_decoding_flags(p):
    """How each token is chosen and verified."""
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help="generate at most this many tokens, within the model's context with the prompt "
        f"(default: {MAX_NEW_TOKENS}, or what the context leaves, with a notice)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help=f"0 = greedy, else sample at this temperature; below {verify_lib.GREEDY_BELOW} it is "
        "greedy too (the probabilities are one-hot there, and overflow far below)",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument(
        "--verify",
        default="auto",
        choices=verify_lib.VERIFIERS,
        help="greedy (lossless at T=0) | typical (lossy) | sample (lossless speculative sampling: "
        "the tree rule, or Leviathan's for layers:N's and model's sampled drafts); auto = greedy "
        "at T=0, else sample. At T=0 all three give greedy's exact output",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling's seed: the same seed, flags and machine give the same output, at the same "
        "--batch-size (a batch seeds each prompt's generator apart)",
    )


def add_machine_flags(p):
    """Where it runs, and in what numbers."""
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=("auto", "on", "off"),
        help="replay the base model's step from CUDA graphs (graphs.py; auto: on CUDA); forwards "
        "run eagerly instead are counted and named after the reply",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="the base model's step and the heads' drafting through torch.compile, one graph a "
        "tree size (specdec/fast/compiled.py; CUDA graphs on a GPU), its compiles cached in "
        "~/.cache/specdec/inductor; generate.py's loop runs over it as over any model",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="the base model on exact.py's kernels, each row computed alone: bf16 speculative "
        "replies equal plain decoding's on a GPU too (needs triton and CUDA)",
    )
    cli.threads_flag(p)
    p.add_argument(
        "--quantize",
        default="none",
        choices=cli.QUANTIZE,
        help="the base model's linear layers on fp16 weights multiplied in fp32 (CPU, fbgemm: "
        "faster for one row), weight-only int8 (a scale per output channel) or int4 (a scale and "
        "zero per 32 inputs: fewer bytes a step); heads and KV cache unchanged",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bf16 on CUDA, fp16 on GPUs before Ampere; on a CPU bf16 where kernels.c runs "
        "(AVX-512 with or without BF16, AVX2 or NEON) or oneDNN has bf16 kernels, else fp32; "
        "fp32 under --quantize fp16; the banner names it) | fp32 | bf16 | fp16",
    )


def add_output_flags(p):
    """What is printed."""
    p.add_argument(
        "--show",
        action="store_true",
        help="colour each token by who proposed it (a drafter, or the base model); only on a "
        "terminal",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="do not stream text (statistics only); with --chat: no statistics line",
    )


def build_parser():
    p = cli.Parser(description=DESCRIPTION)
    add_prompt_flags(p)  # what to say
    add_drafter_flags(p)  # the model and the drafter
    add_draft_size_flags(p)  # how much it drafts
    add_online_flags(p)  # online speculative decoding
    add_decoding_flags(p)  # decoding
    add_machine_flags(p)  # the machine
    add_output_flags(p)  # output
    return p


# the checks before a model loads


def flags_without_effect(args, parser):
    """One remark for each flag set away from its default that the chosen mode ignores."""

    def changed(name):
        return getattr(args, name) != parser.get_default(name)

    ignored = []
    if verify_lib.is_greedy(args.temperature):
        for name in ("top_p", "seed"):
            if changed(name):
                flag = "--" + name.replace("_", "-")
                ignored.append(f"{flag} has no effect at --temperature 0 (greedy decoding)")
        if args.verify in ("sample", "typical"):
            ignored.append(
                f"--verify {args.verify} at --temperature 0 is greedy verification (same output)"
            )
    if args.heads == "none" and args.draft == "heads" and changed("verify"):
        ignored.append("--verify has no effect without a drafter (--heads none)")
    if args.raw and args.system is not None:
        ignored.append("--system has no effect with --raw (no chat template)")
    if args.overwrite and not args.out:
        ignored.append("--overwrite has no effect without --out")
    if args.show and args.batch_size > 1:
        ignored.append("--show has no effect with --batch-size (replies are printed whole, plain)")
    elif args.show and args.quiet and not args.chat:
        ignored.append("--show has no effect with --quiet (no text is printed)")
    elif args.show and not sys.stdout.isatty():
        ignored.append(
            "--show colours only a terminal; stdout is not one, so the text is written plain"
        )
    return ignored


def check_prompt_flags(args):
    """Something to answer, in one way; text that can be encoded; a length that can be made."""
    if args.chat:
        check_chat_flags(args)
    elif args.prompt is None and args.prompts is None:
        raise cli.UsageError('give a --prompt "...", a --prompts FILE.jsonl, or --chat')
    if args.prompt is not None and args.prompts is not None:
        raise cli.UsageError("give either --prompt or --prompts, not both")
    if args.prompt is not None and not args.prompt.strip():
        raise cli.UsageError("the prompt is empty; pass some text with --prompt")
    for flag in ("prompt", "system"):
        if getattr(args, flag) is not None:
            cli.check_text(getattr(args, flag), f"--{flag}")
    cli.check_counts(args, "max_new_tokens", "batch_size")
    if args.resume and not (args.prompts and args.out):
        raise cli.UsageError(
            "--resume continues the --out file of a --prompts run; give both, or drop --resume"
        )
    if args.resume and args.overwrite:
        raise cli.UsageError(
            "--resume keeps the rows --out holds and --overwrite replaces them; give one of them"
        )


def check_chat_flags(args):
    """--chat reads its messages from the terminal and writes its replies there."""
    for flag in ("prompt", "prompts", "out"):
        if getattr(args, flag) is not None:
            raise cli.UsageError(
                "--chat reads the messages from the terminal (or stdin, a line each) and streams "
                f"the replies; drop --{flag}, or drop --chat"
            )
    if args.raw:
        raise cli.UsageError("--chat lays the conversation out with the chat template; drop --raw")
    if args.batch_size != 1:
        raise cli.UsageError("--chat answers one conversation; drop --batch-size")


def check_sampling_flags(args):
    """A temperature, a nucleus and a seed that sampling can use, and a rule that fits them."""
    catalog.check_sampling(args.temperature, args.top_p, args.verify, args.seed)
    if 0 < args.temperature and verify_lib.is_greedy(args.temperature):
        cli.notice(
            f"--temperature {args.temperature} is below {verify_lib.GREEDY_BELOW}: decoding "
            "greedily, as at 0"
        )


def check_online(args, kind):
    """--online needs heads to train; its numbers are positive; --online-save is a new or empty
    folder."""
    if not args.online:
        if args.online_save:
            raise cli.UsageError("--online-save writes the heads --online adapts; add --online")
        return
    if kind not in ("heads", "heads+lookup"):
        raise cli.UsageError(
            f"--online trains draft heads, and --draft {args.draft} drafts without them; use "
            "--draft heads or heads+lookup"
        )
    if args.heads == "none":
        raise cli.UsageError(
            "--online trains draft heads, and --heads none loads none; give --heads (hydra++, "
            "medusa, hydra or a heads folder)"
        )
    if not (math.isfinite(args.online_lr) and args.online_lr > 0):
        raise cli.UsageError(f"--online-lr {args.online_lr}: must be a number > 0, such as 1e-4")
    cli.check_counts(args, "online_buffer", "online_every", "online_steps")
    if args.quantize != "none":
        cli.notice(
            f"--online with --quantize {args.quantize}: the heads learn the {args.quantize} "
            "model's distribution, the one that verifies here"
        )
    if args.online_save:
        catalog.check_online_save(args.online_save)


def check_compile(args):
    """--compile wraps the readable model for one sequence: not with another way of running it."""
    if not args.compile:
        return
    others = {
        "--cuda-graphs on": args.cuda_graphs == "on",
        f"--quantize {args.quantize}": args.quantize != "none",
        "--exact": args.exact,
        "--online": args.online,
        f"--batch-size {args.batch_size}": args.batch_size > 1,
        "--chat": args.chat,
    }
    for flag, given in others.items():
        if given:
            raise cli.UsageError(
                f"--compile compiles the readable model's step for one prompt at a time; it does "
                f"not go with {flag}: drop one of them"
            )


def check_args(args, parser):
    """The checks that need no model, then a remark for each flag without effect. Returns the
    --draft to load."""
    check_prompt_flags(args)
    check_sampling_flags(args)
    given = {k: getattr(args, k) for k in SIZES if getattr(args, k) is not None}
    draft = catalog.draft_flags(args.draft, given, args.heads, args.tree, args.draft_model)
    if args.out:
        replaced = "decoding would empty it"
        kept = args.overwrite or args.resume  # --resume appends to it
        cli.new_file("--out", args.out, "replies.jsonl", args.prompts, kept, replaced)
    check_online(args, draft.kind)
    device = cli.pick_device(args.device)
    kernels.pick_dtype(args.dtype, device, args.quantize)
    cli.check_quantize(args.quantize, device)
    cli.check_exact(args.exact, args.quantize, device)
    check_compile(args)
    if args.tree != "auto":
        catalog.parse_tree(args.tree)  # checked now, built once the heads are loaded
    catalog.find_heads(args.heads)
    for message in flags_without_effect(args, parser):
        cli.notice(message)
    return draft


# the model and the prompts, from the checked flags (the drafter: catalog.load_drafter)


@dataclass
class Decoder:
    """What main builds for a mode to run."""

    model: torch.nn.Module
    tokenizer: object
    drafter: object  # drafters.py's, wrapped by online.OnlineHeads with --online
    learner: object  # --online's online.Learner, or None
    decoding: dict  # decode.generate's verify, temperature, top_p and eos_ids
    generator: torch.Generator  # seeded --seed (a batch seeds one for each prompt)


def load_model(name, *, device, dtype, quantize, chat, exact_kernels):
    """catalog.load_model's model and tokenizer, refused for --chat without a chat template."""
    model, tokenizer = catalog.load_model(name, device, dtype, quantize, exact_kernels)
    if chat and not tokenizer.chat_template:
        raise cli.UsageError(
            f"--chat: {name} has no chat template (tokenizer_config.json's chat_template) to lay "
            "a conversation out; use a chat model, or --prompt with --raw"
        )
    if quantize == "fp16" and not kernels.fp16_rows_alone():
        cli.notice(
            "fbgemm's fp16 product on this CPU (no AVX-512) rounds a row differently with other "
            "rows beside it: greedy speculative output may part from plain greedy output on fp16 "
            "weights; --quantize none keeps them identical"
        )
    return model, tokenizer


def read_prompts(args):
    """[(id, prompt, category)]: --prompts' lines, or --prompt alone; none with --chat. A
    conversation needs the chat template: refused with --raw before the model loads."""
    if args.chat:  # the messages come from the terminal
        return []
    prompts = cli.read_prompts(args.prompts) if args.prompts else [(0, args.prompt, "all")]
    talks = [pid for pid, prompt, _ in prompts if isinstance(prompt, list)]
    if args.raw and talks:
        raise cli.UsageError(
            f"--raw: --prompts {args.prompts} holds conversations (id {cli.quoted(talks[0])}: a "
            '{"messages": [...]} line), which only the chat template lays out; drop --raw'
        )
    return prompts


def batch_rows(batch_size, prompts):
    """--batch-size, at most the number of prompts (said in a notice)."""
    if batch_size <= max(len(prompts), 1):
        return batch_size
    cli.notice(
        f"--batch-size {batch_size}: there {'are' if len(prompts) > 1 else 'is'} only "
        f"{cli.plural(len(prompts), 'prompt')}; decoding {len(prompts)} at a time"
    )
    return len(prompts)


def encode_prompts(prompts, tokenizer, *, system, raw, max_new_tokens, context, one=True):
    """[(id, token ids, most new tokens)] of the prompts: `max_new_tokens` where given (it must fit
    the model's context after the prompt), else MAX_NEW_TOKENS or what the context leaves. `one`:
    the --prompt, not a --prompts file (for the messages)."""
    if not raw and not tokenizer.chat_template:
        cli.notice(
            "the model's tokenizer has no chat template: the prompt is given as plain text (as "
            "with --raw)"
        )
    encoded = []
    for pid, text, _ in prompts:
        ids = checkpoint.encode(tokenizer, text, system, raw)
        which = "the prompt" if one else f"prompt {cli.quoted(pid)}"
        room = context - len(ids)
        if room < 1:
            raise cli.UsageError(
                f"{which} has {len(ids)} tokens, the model's context holds {context} (prompt and "
                "reply together); shorten it"
            )
        if max_new_tokens is not None and max_new_tokens > room:
            raise cli.UsageError(
                f"--max-new-tokens {max_new_tokens}: {which} ({len(ids)} tokens) leaves room for "
                f"{room} in the model's context of {context}; ask for at most {room}"
            )
        if max_new_tokens is None and MAX_NEW_TOKENS > room:
            cli.notice(
                f"{which} ({len(ids)} tokens) leaves room for {room} new tokens in the model's "
                f"context of {context}: generating at most {room}"
            )
        encoded.append((pid, ids, max_new_tokens or min(MAX_NEW_TOKENS, room)))
    return encoded


def check_batch_memory(model, drafter, encoded, batch_size):
    """--batch-size rows of KV cache, each as long as the longest prompt and reply: refused before
    it is allocated where it would not fit in the memory free now (with room for the rest)."""
    free = cli.free_memory(model.device)
    if batch_size == 1 or free is None:
        return
    longest = max(len(ids) + n for _, ids, n in encoded) + drafter.max_nodes
    cfg = model.cfg
    slots = 2 * cfg.n_layers * cfg.n_kv_heads * longest * cfg.head_dim  # keys and values
    row = slots * torch.finfo(model.dtype).bits // 8  # one row's cache, in bytes
    if batch_size * row > free * 0.8:
        fits = max(1, int(free * 0.8 // row))
        raise cli.UsageError(
            f"--batch-size {batch_size}: the KV cache would take {batch_size * row / 2**30:.1f} GB "
            f"and {free / 2**30:.1f} GB are free; use --batch-size {fits} or fewer, or a smaller "
            "--max-new-tokens"
        )


def compiled_model(model, drafter):
    """--compile: compiled.wrap's model; the heads' drafter gets the compiled heads."""
    from specdec.fast import compiled

    heads = drafter.heads if type(drafter) is drafters.HeadsDrafter else None
    model, heads = compiled.wrap(model, heads)
    if heads is not None:
        drafter.heads = heads
    return model


@contextlib.contextmanager
def open_output(path, resume=False):
    """--out, opened for writing (None: no file), only once the model is loaded: a Ctrl-C before
    (even one whose exception a finalizer swallowed) leaves the old file whole. A run stopped
    before its first reply is written removes the file: an empty --out would refuse the rerun.
    resume: the rows are appended to those an interrupted run left."""
    specdec.ctrl_c.check()
    if not path:
        yield None
        return
    try:
        f = open(path, "a" if resume else "w", encoding="utf-8")
    except OSError as e:
        raise cli.UsageError(f"--out {path}: cannot write it ({e.strerror})") from None
    try:
        with f:
            yield f
    except BaseException:
        with contextlib.suppress(OSError):
            if os.path.getsize(path) == 0:
                os.remove(path)
        raise


# the modes: one prompt after another streamed, a batch, a chat


def one_by_one(dec, encoded, replies, *, stream, show, lesson):
    """Each prompt's reply streamed as it is made (without `stream`: only its statistics), one
    generator through every prompt; heads or plain decoding through generate.py's generate()
    (`lesson`), the other drafters through the twin. Returns the seconds it decoded."""
    t0 = time.perf_counter()
    for i, (_, ids, max_new_tokens) in enumerate(encoded):
        printer = terminal.Printer(dec.tokenizer, show) if stream else None
        r = decode.reply(
            lesson,
            dec.model,
            ids,
            max_new_tokens,
            dec.drafter,
            generator=dec.generator,
            on_tokens=printer,
            **dec.decoding,
        )
        if printer:
            print()
        replies.done(i, r)
    return decoding_seconds(dec, t0)


def batch(dec, encoded, replies, *, batch_size, seeds):
    """batch_size prompts side by side, each reply printed whole as it ends; prompt i samples from
    its own generator, seeded seeds[i]. Returns the seconds it decoded."""
    device = dec.model.device
    generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    t0 = time.perf_counter()
    engine.generate_batch(
        dec.model,
        [ids for _, ids, _ in encoded],
        [max_new_tokens for _, _, max_new_tokens in encoded],
        dec.drafter,
        generators=generators,
        on_done=replies.done,
        batch_size=batch_size,
        **dec.decoding,
    )
    return decoding_seconds(dec, t0)


def decoding_seconds(dec, t0):
    """The seconds since t0, without the updates --online made between replies."""
    return time.perf_counter() - t0 - (dec.learner.seconds if dec.learner else 0)


def chat(dec, *, system, max_new_tokens, show, stats):
    """--chat: a conversation at the terminal (or stdin, a line a message), until its end. Returns
    the seconds spent answering."""
    want = max_new_tokens or MAX_NEW_TOKENS  # a reply's most, where the context has room
    talk = terminal.Chat(dec, system=system, max_new_tokens=want, show=show, stats=stats)
    talk.run(interactive=sys.stdin.isatty())
    return talk.seconds


@contextlib.contextmanager
def online_saved(learner, folder, heads):
    """--online-save: the adapted heads are written at the end, or at Ctrl-C with what they
    learned so far (heads: the --heads they started from, whose trees go with them)."""
    try:
        yield
    except KeyboardInterrupt:
        if learner and folder:
            catalog.save_online(learner, folder, heads)
            updates = cli.plural(learner.updates, "update")
            print(
                f"[online: stopped by Ctrl-C; the heads after {updates} are in {folder}]",
                file=sys.stderr,
            )
        raise
    if learner and folder:
        catalog.save_online(learner, folder, heads)
        print(f"[online: the adapted heads are in {folder}]", file=sys.stderr)


def main(args, lesson):
    """llama2.c's run.c: the flags checked and turned into plain values, the model, drafter and
    learner built, then one mode run: one prompt after another streamed, a batch, or a chat."""
    draft = check_args(args, build_parser())
    device = cli.pick_device(args.device)
    dtype = kernels.pick_dtype(args.dtype, device, args.quantize)
    threads = cli.use_threads(args.threads) if device == "cpu" else None
    prompts = read_prompts(args)
    line = {pid: i for i, (pid, _, _) in enumerate(prompts)}  # a batch seeds prompt i --seed + i
    if args.resume:
        done = terminal.resume_out(args.out, [pid for pid, _, _ in prompts])
        prompts = [p for p in prompts if p[0] not in done]
        if not prompts:
            cli.notice(f"--resume: --out {args.out} holds a row for every prompt; nothing to do")
            return 0
    batch_size = batch_rows(args.batch_size, prompts)
    show = args.show and sys.stdout.isatty()  # colour codes only on a terminal, never a file
    temperature = 0.0 if verify_lib.is_greedy(args.temperature) else args.temperature
    torch.manual_seed(args.seed)

    model, tokenizer = load_model(
        args.model,
        device=device,
        dtype=dtype,
        quantize=args.quantize,
        chat=args.chat,
        exact_kernels=args.exact,
    )
    generator = torch.Generator(device=device).manual_seed(args.seed)
    eos = checkpoint.eos_ids(model, tokenizer)
    decoding = dict(verify=args.verify, temperature=temperature, top_p=args.top_p, eos_ids=eos)
    drafter = catalog.load_drafter(
        draft,
        model,
        tokenizer,
        quantize=args.quantize,
        decoding=decoding,
        generator=generator,
        batch_size=args.batch_size,
    )
    learning = {k: getattr(args, f"online_{k}") for k in online.DEFAULTS} if args.online else None
    drafter, learner = online.learn(drafter, model, learning)
    encoded = encode_prompts(
        prompts,
        tokenizer,
        system=args.system,
        raw=args.raw,
        max_new_tokens=args.max_new_tokens,
        context=model.cfg.max_seq_len,
        one=args.prompts is None,
    )
    check_batch_memory(model, drafter, encoded, batch_size)
    # the loop's forward; the drafters keep the readable model
    if args.compile:  # the compiled step as the model, the compiled heads as the heads
        model = compiled_model(model, drafter)
    elif catalog.cuda_graphs(args.cuda_graphs, device):
        model = graphs.GraphedForward(model)
        lesson = None  # the graphs replay the twin's step (decode.reply)
    dec = Decoder(model, tokenizer, drafter, learner, decoding, generator)
    terminal.announce(dec, draft, device=device, quantize=args.quantize, threads=threads, show=show)

    args.decoding = True  # from here on a Ctrl-C stops a reply whose text is on the screen
    with (
        open_output(args.out, args.resume) as out,
        online_saved(learner, args.online_save, args.heads),
    ):
        whole = batch_size > 1 and not args.quiet
        replies = terminal.Replies([pid for pid, _, _ in encoded], dec, whole=whole, out=out)
        if args.chat:
            seconds = chat(
                dec,
                system=args.system,
                max_new_tokens=args.max_new_tokens,
                show=show,
                stats=not args.quiet,
            )
        elif batch_size == 1:
            seconds = one_by_one(
                dec, encoded, replies, stream=not args.quiet, show=show, lesson=lesson
            )
        else:
            seeds = [args.seed + line[pid] for pid, _, _ in encoded]
            seconds = batch(dec, encoded, replies, batch_size=batch_size, seeds=seeds)
        replies.report(seconds)


def tidy_main(args, lesson):
    """main, leaving no empty --online-save folder behind a run that stops before saving."""
    made = cli.new_folders(args.online_save)
    try:
        return main(args, lesson)
    finally:
        cli.remove_empty(made)


def interrupted(args):
    """The line after Ctrl-C (args: None before the flags are parsed)."""
    started = getattr(args, "decoding", False)  # not while the model loads
    shown = started and (args.chat or not args.quiet)  # --quiet: no text was shown
    kept = "; the text above is what was generated so far" if shown else ""
    return f"[interrupted by Ctrl-C{kept}]"


def cli_main(argv, lesson) -> int:
    """generate.py's command line; lesson: its generate(). Bad input: one line on stderr, exit
    code 2. Ctrl-C: the text so far stays on stdout, exit 130."""
    return cli.run(lambda args: tidy_main(args, lesson), build_parser(), argv, interrupted)
