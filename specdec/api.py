"""The package's face: a model, its drafter and the decode loop from a script of your own.

    from specdec.api import load
    sd = load()                                  # the default model and its shipped hydra++ heads
    print(sd.generate("Give me three tips for staying focused while studying.").text)

    load(model, draft=, heads=, tree=, ...)      generate.py's flags as keywords -> a Decoder
    Decoder.generate(prompt, ...) -> Reply       a string (in the chat template) or a list of
                                                 {"role", "content"} messages
    Decoder.generate_batch(prompts, ...)         many side by side (engine.py): [Reply]
    Decoder.chat(system=...) -> Chat             Chat.send(message) -> Reply: the KV cache is
                                                 kept between turns (decode.Conversation)
    Reply                                        .text, .ids (no EOS), .stopped, .stats
    APIError                                     a bad argument (a ValueError), named with the fix

The keywords are generate.py's flags under the same names (--top-p is top_p), with the same
values and defaults (tests/test_api.py compares them), checked by the same functions (cli.py,
catalog.py) before a model loads where they can be; their message comes back as one APIError in
the keywords' words. Remarks (notices) go to stderr, as the scripts'. Flags that shape the
terminal or files (--show, --out, --chat's commands) and --online, --exact have no keyword here.
This file builds what generate.py's main builds; it never imports the scripts.

Test: `python -m pytest -q tests/test_api.py`.
"""

import contextlib
import os
import re
from dataclasses import dataclass

import torch

import specdec.lesson  # noqa: F401 (first of the project: a model.py of yours is named, not used)
from specdec import cli
from specdec import drafters as drafters_lib
from specdec import terminal
from specdec.engines import decode
from specdec.engines import engine
from specdec.fast import graphs
from specdec.fast import kernels
from specdec.loading import catalog
from specdec.loading import checkpoint
import verify as verify_lib

MAX_NEW_TOKENS = 256  # a reply's most unless given, or what the context leaves (generate.py's)
SIZES = ("gamma", "ngram", "matches", "window", "guesses")  # the drafters' size keywords


# --- bad arguments --------------------------------------------------------------------------------
# The checks are the command line's: they raise cli.UsageError with the flags' words, which
# `checked` turns into one APIError with the keywords' (`--top-p 2` -> `top_p=2`).


class APIError(ValueError):
    """A bad argument: the message names it and the fix."""


COMMAND = re.compile(r"((?:python -m |\b[\w./-]+\.py\b)[^,;()]*)")  # a command a message suggests
FLAG = re.compile(r"--([a-z][a-z0-9-]*)")


def in_keywords(message, values):
    """A check's message in the keywords' words: `--top-p 2` -> `top_p=2` (values: the keywords as
    given), `--heads` -> `heads`; a command it suggests (train.py --heads ...) stays as typed."""
    parts = COMMAND.split(message)
    for i in range(0, len(parts), 2):  # the even parts are prose, the odd ones commands
        for name, value in values.items():
            flag = re.escape(f"--{name.replace('_', '-')} {value}") + r"(?![\w+])"
            parts[i] = re.sub(flag, lambda m: f"{name}={value!r}", parts[i])
        parts[i] = FLAG.sub(lambda m: m[1].replace("-", "_"), parts[i])
    return "".join(parts)


@contextlib.contextmanager
def checked(values):
    """`with checked(values):` a UsageError or ValueError raised inside comes out as one APIError
    in the keywords' words (values: the keywords as given)."""
    try:
        yield
    except APIError:
        raise
    except (cli.UsageError, ValueError) as e:
        given = {k: v for k, v in values.items() if isinstance(v, (str, int, float))}
        raise APIError(in_keywords(str(e), given)) from None


def whole(name, value, least):
    """A whole-number keyword (a flag of type int) is an int, at least `least`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise APIError(f"{name}={value!r}: must be a whole number, at least {least}")


def number(name, value):
    """A number keyword (a flag of type float) is an int or a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(f"{name}={value!r}: must be a number")


def text(name, value, choices=None):
    """A keyword the command line takes as a word: a string (a path may be a Path), one of
    `choices` where the flag has them."""
    value = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(value, str):
        raise APIError(f"{name}={value!r}: must be a string")
    if choices and value not in choices:
        raise APIError(f"{name}={value!r}: use one of {', '.join(choices)}")
    return value


def check_decoding(temperature, top_p, verify, seed):
    """catalog.check_sampling, for keywords -> decode.generate's verify, temperature
    and top_p (a temperature below verify.GREEDY_BELOW is greedy, as at 0)."""
    number("temperature", temperature)
    number("top_p", top_p)
    text("verify", verify, verify_lib.VERIFIERS)
    whole("seed", seed, 0)
    with checked(dict(temperature=temperature, top_p=top_p, verify=verify, seed=seed)):
        catalog.check_sampling(temperature, top_p, verify, seed)
    greedy = verify_lib.is_greedy(temperature)
    if 0 < temperature and greedy:
        cli.notice(
            f"temperature={temperature!r} is below {verify_lib.GREEDY_BELOW}: decoding greedily, "
            "as at 0"
        )
    return dict(verify=verify, temperature=0.0 if greedy else float(temperature), top_p=top_p)


# --- what a reply is ------------------------------------------------------------------------------


@dataclass
class Reply:
    text: str  # the reply, decoded (special tokens left out)
    ids: list  # its token ids, without the EOS that ended it
    stopped: str  # "eos": the model ended it; "length": max_new_tokens (or the context) cut it
    stats: dict  # new_tokens (an EOS included), steps, tau, seconds, tokens_per_s,
    # accepted_by_depth; a chat's also prompt_tokens and forwarded (of them, not in the cache)

    def __str__(self):
        return self.text


def reply(result, tokenizer, max_depth, **more):
    """A decode.Result as a Reply; `more`: statistics to add. The numbers are generate.py's."""
    ids = result.tokens[:-1] if result.stopped == "eos" else result.tokens
    n = len(result.tokens)
    stats = {
        "new_tokens": n,
        "steps": result.steps,  # forwards of the base model, the prefill included
        "tau": n / max(result.steps, 1),  # new tokens a forward (plain decoding: 1)
        "seconds": result.seconds,
        "tokens_per_s": n / max(result.seconds, 1e-9),
        "accepted_by_depth": decode.acceptance_by_depth(result.accepted, max_depth),
    }
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return Reply(text, list(ids), result.stopped, stats | more)


def sampled_drafter(drafter, decoding, generator):
    """A model's own drafts (layers:N, skip, model: a ModelDrafter) are sampled at the temperature
    that Leviathan's rule verifies, from the reply's generator, as catalog.load_drafter builds
    them for generate.py; the other drafters propose alike at any temperature."""
    if not isinstance(drafter, drafters_lib.ModelDrafter):
        return drafter
    sampled = decoding["temperature"] > 0 and decoding["verify"] in ("auto", "sample")
    return drafters_lib.ModelDrafter(
        drafter.model,
        drafter.gamma,
        decoding["temperature"] if sampled else 0.0,
        decoding["top_p"],
        generator,
        drafter.layers,
        drafter.legend[1],  # its name
    )


# --- the model, its drafter, and what it is asked -------------------------------------------------


class Decoder:
    """A loaded model and drafter (load()'s): generate, generate_batch, chat. print() shows the
    banner generate.py prints."""

    def __init__(self, model, tokenizer, drafter, forward, draft, machine, batch_drafter=None):
        self.model = model  # model.Transformer (the drafters read it)
        self.tokenizer = tokenizer
        self.drafter = drafter  # drafters.py's, as --draft, --heads and --tree built it
        # generate_batch's: the budget the rows share (catalog.for_batches), as --batch-size's
        self.batch_drafter = batch_drafter or drafter
        self.forward = forward  # what the loop calls: the model, or its graphs.GraphedForward
        self.eos_ids = checkpoint.eos_ids(model, tokenizer)  # the tokens that end a reply
        self.draft = draft  # catalog.DraftFlags: what draft, heads and tree named
        self.machine = machine  # the banner's device, quantize and threads

    def __repr__(self):
        return terminal.banner_line(self, self.draft, **self.machine)

    def encode(self, prompt, system, max_new_tokens, which, cap=False):
        """(ids, most new tokens) of a prompt (a string or messages), checked as generate.py's
        encode_prompts does: max_new_tokens (None: MAX_NEW_TOKENS) must fit the model's context
        after the prompt. Where it does not, a number asked is refused; None, or a chat's (`cap`),
        is cut to what fits, with a notice."""
        if isinstance(prompt, list):
            prompt = cli.check_messages(prompt, which)
        elif isinstance(prompt, str):
            cli.check_text(prompt, which)
        else:
            raise APIError(
                f"{which}: a string or a list of {{'role': ..., 'content': ...}} messages, not "
                f"{type(prompt).__name__}"
            )
        if system is not None:
            cli.check_text(text("system", system), "system")
        if max_new_tokens is not None:
            whole("max_new_tokens", max_new_tokens, 1)
        ids = checkpoint.encode(self.tokenizer, prompt, system)
        context = self.model.cfg.max_seq_len
        room = context - len(ids)
        if room < 1:
            fix = "reset() the chat to start afresh" if cap else "shorten it"
            raise APIError(
                f"{which} has {len(ids)} tokens, the model's context holds {context} (prompt and "
                f"reply together); {fix}"
            )
        want = max_new_tokens or MAX_NEW_TOKENS
        if max_new_tokens is not None and max_new_tokens > room and not cap:
            raise APIError(
                f"max_new_tokens={max_new_tokens}: {which} ({len(ids)} tokens) leaves room for "
                f"{room} in the model's context of {context}; ask for at most {room}"
            )
        if want > room:
            cli.notice(
                f"{which} ({len(ids)} tokens) leaves room for {room} new tokens in the model's "
                f"context of {context}: generating at most {room}"
            )
        return ids, min(want, room)

    def generate(
        self,
        prompt,
        *,
        max_new_tokens=None,
        temperature=0.0,
        top_p=1.0,
        verify="auto",
        seed=0,
        system=None,
    ) -> Reply:
        """The reply to `prompt`: a string (the user's message, in the chat template) or a list
        of {"role", "content"} messages ending with the user's. Sampled from a generator seeded
        `seed`: the same seed, arguments and machine give the same reply."""
        with checked(locals()):
            decoding = check_decoding(temperature, top_p, verify, seed)
            ids, limit = self.encode(prompt, system, max_new_tokens, "prompt")
        generator = torch.Generator(device=self.model.device).manual_seed(seed)
        drafter = sampled_drafter(self.drafter, decoding, generator)
        r = decode.generate(
            self.forward, ids, limit, drafter, generator=generator, eos_ids=self.eos_ids, **decoding
        )
        return reply(r, self.tokenizer, self.drafter.max_depth)

    def generate_batch(
        self,
        prompts,
        *,
        batch_size=8,
        max_new_tokens=None,
        temperature=0.0,
        top_p=1.0,
        verify="auto",
        seed=0,
        system=None,
    ) -> list:
        """The replies to `prompts` (each as generate() takes it), in their order, batch_size of
        them decoding side by side (engine.py; generate.py --batch-size): reply i is the one
        generate() gives alone (greedy), sampled from its own generator, seeded seed + i."""
        with checked(locals()):
            if not isinstance(prompts, (list, tuple)) or not prompts:
                raise APIError("prompts: a non-empty list of prompts; for one, use generate()")
            whole("batch_size", batch_size, 1)
            decoding = check_decoding(temperature, top_p, verify, seed)
            encoded = [
                self.encode(p, system, max_new_tokens, f"prompts[{i}]")
                for i, p in enumerate(prompts)
            ]
        device = self.model.device
        generators = [
            torch.Generator(device=device).manual_seed(seed + i) for i in range(len(prompts))
        ]
        results = engine.generate_batch(
            self.forward,
            [ids for ids, _ in encoded],
            [limit for _, limit in encoded],
            sampled_drafter(self.batch_drafter, decoding, generators[0]),
            generators=generators,
            eos_ids=self.eos_ids,
            batch_size=batch_size,
            **decoding,
        )
        return [reply(r, self.tokenizer, self.drafter.max_depth) for r in results]

    def chat(
        self,
        system=None,
        *,
        max_new_tokens=None,
        temperature=0.0,
        top_p=1.0,
        verify="auto",
        seed=0,
    ):
        """A conversation (generate.py --chat): Chat.send(message) answers, keeping the KV cache;
        each reply at most max_new_tokens, or what the context leaves."""
        with checked(locals()):
            if not self.tokenizer.chat_template:
                raise APIError(
                    f"chat: {self.model.cfg.name} has no chat template to lay a conversation out; "
                    "use a chat model, or generate()"
                )
            if system is not None:
                cli.check_text(text("system", system), "system")
            if max_new_tokens is not None:
                whole("max_new_tokens", max_new_tokens, 1)
            decoding = check_decoding(temperature, top_p, verify, seed)
        return Chat(self, system, max_new_tokens, decoding, seed)


class Chat:
    """Messages answered by a decode.Conversation: every send() lays the whole conversation out
    with the chat template, and the cache keeps the longest prefix it shares with it, so a turn
    forwards only what is new (its Reply's stats: prompt_tokens, forwarded). A conversation that
    no longer fits the context is refused (reset() starts afresh), where generate.py --chat drops
    its oldest turns."""

    def __init__(self, dec, system, max_new_tokens, decoding, seed):
        self.dec = dec
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.system)  # the conversation so far
        self.max_new_tokens = max_new_tokens  # a reply's most, where the context has room
        self.generator = torch.Generator(device=dec.model.device).manual_seed(seed)
        self.decoding = decoding | {"generator": self.generator, "eos_ids": dec.eos_ids}
        # its own drafter state (row()), which follows the cache from turn to turn
        own = sampled_drafter(dec.drafter, decoding, self.generator).row(self.generator)
        self.conversation = decode.Conversation(dec.forward, own)

    def send(self, message) -> Reply:
        """The reply to the user's `message`; both join the conversation."""
        with checked({}):
            if not isinstance(message, str) or not message.strip():
                raise APIError(f"message={message!r}: needs some text")
            messages = self.messages + [{"role": "user", "content": message}]
            ids, limit = self.dec.encode(
                messages, None, self.max_new_tokens, "the conversation", cap=True
            )
        r = self.conversation.reply(ids, limit, **self.decoding)
        forwarded = self.conversation.forwarded  # of the prompt's ids, those the cache lacked
        out = reply(
            r,
            self.dec.tokenizer,
            self.dec.drafter.max_depth,
            prompt_tokens=len(ids),
            forwarded=forwarded,
        )
        self.messages = messages + [{"role": "assistant", "content": out.text}]
        return out

    def reset(self):
        """A new conversation (the system message stays); the cache keeps what it shares."""
        self.messages = list(self.system)


# --- load -----------------------------------------------------------------------------------------


def load(
    model=checkpoint.DEFAULT,
    *,
    draft="heads",
    heads="auto",
    tree="auto",
    draft_model=None,
    gamma=None,
    ngram=None,
    matches=None,
    window=None,
    guesses=None,
    device="auto",
    dtype="auto",
    quantize="none",
    threads=0,
    cuda_graphs="auto",
) -> Decoder:
    """The model `model` names (the default model, a Hugging Face folder or hub id) and the drafter
    `draft`, `heads` and `tree` name, as generate.py's flags of those names build them: the
    arguments are checked before the model loads, then the model, its drafter and the step."""
    with checked(locals()):
        model = text("model", model)
        heads = text("heads", heads)
        tree = text("tree", tree)
        draft = text("draft", draft)
        if draft_model is not None:
            draft_model = text("draft_model", draft_model)
        sizes = dict(zip(SIZES, (gamma, ngram, matches, window, guesses)))
        given = {name: value for name, value in sizes.items() if value is not None}
        for name, value in given.items():
            whole(name, value, 1)
        found = catalog.draft_flags(draft, given, heads, tree, draft_model)
        device = cli.pick_device(text("device", device))
        quantize = text("quantize", quantize, cli.QUANTIZE)
        dtype = kernels.pick_dtype(text("dtype", dtype), device, quantize)
        cli.check_quantize(quantize, device)
        text("cuda_graphs", cuda_graphs, ("auto", "on", "off"))
        if tree != "auto":
            catalog.parse_tree(tree)  # checked now, built once the heads are loaded
        catalog.find_heads(heads)
        whole("threads", threads, 0)
        threads = cli.use_threads(threads) if device == "cpu" else None
        net, tokenizer = catalog.load_model(model, device, dtype, quantize, False)
        generator = torch.Generator(device=device)  # a reply's own replaces it (sampled_drafter)
        greedy = dict(verify="auto", temperature=0.0, top_p=1.0)
        drafter = catalog.load_drafter(
            found, net, tokenizer, quantize=quantize, decoding=greedy, generator=generator
        )
    # the loop's forward; the drafters keep the readable model
    forward = graphs.GraphedForward(net) if catalog.cuda_graphs(cuda_graphs, device) else net
    machine = dict(device=device, quantize=quantize, threads=threads)
    batch_drafter = catalog.for_batches(drafter, found, net, quantize)
    return Decoder(net, tokenizer, drafter, forward, found, machine, batch_drafter)
