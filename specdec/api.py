"""The package's face: a model, its drafter and the decode loop from a script of your own.

    from specdec.api import load
    sd = load()                                  # the default model and its shipped hydra++ heads
    print(sd.generate("Give me three tips for staying focused while studying.").text)

    load(model, draft=, heads=, tree=, ...)      generate.py's flags as keywords -> a Decoder
    Decoder.generate(prompt, ...) -> Reply       a string (in the chat template) or a list of
                                                 {"role", "content"} messages
    Decoder.stream(prompt, ...) -> Stream        the same reply, its text piece by piece as the
                                                 steps accept tokens; Stream.reply at the end
    Decoder.generate_batch(prompts, ...)         many side by side (engine.py): [Reply]
    Decoder.chat(system=...) -> Chat             Chat.send(message) -> Reply: the KV cache is
                                                 kept between turns (decode.Conversation)
    Reply                                        .text, .ids (no EOS), .stopped, .stats
    APIError                                     a bad argument (a ValueError), named with the fix

The keywords are generate.py's flags under the same names (--top-p is top_p), with the same
values and defaults (tests/test_api.py compares them), checked by the same functions (cli.py,
catalog.py) before a model loads where they can be; their message comes back as one APIError in
the keywords' words. Remarks (notices) go to stderr, as the scripts'. Flags that shape the
terminal or files (--show, --out, --chat's commands) and --online, --exact have no keyword here;
`stop` (strings that end a reply) and streaming are the API's own. This file builds what
generate.py's main builds; it never imports the scripts. help(load), help(Decoder.generate),
help(Reply): every argument's allowed values, every field.

Test: `python -m pytest -q tests/test_api.py`.
"""

import contextlib
import os
import queue
import re
import threading
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


def check_stop(stop):
    """stop: None, a string or a list of strings, none empty -> a tuple of them."""
    stops = [stop] if isinstance(stop, str) else stop
    if stop is None:
        return ()
    if not isinstance(stops, (list, tuple)) or not all(isinstance(t, str) and t for t in stops):
        raise APIError(f"stop={stop!r}: a string or a list of strings, none of them empty")
    return tuple(stops)


def check_prompt(prompt):
    """A prompt for generate() or stream() is one string or one conversation: a list of strings is
    several prompts, which generate_batch() takes."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise APIError(
            f"prompt: a list of {len(prompt)} strings; for several prompts use "
            "generate_batch([...]) (one conversation is a list of {'role': ..., 'content': ...} "
            "messages)"
        )


def check_prompts(prompts):
    """generate_batch's prompts: a list (or tuple) of prompts, at least one."""
    if isinstance(prompts, (str, dict)):
        raise APIError(
            f"prompts: one {type(prompts).__name__}; generate_batch takes a list of prompts "
            "(for one, use generate())"
        )
    if not isinstance(prompts, (list, tuple)):
        raise APIError(
            f"prompts: a {type(prompts).__name__}, not a list; give a list of prompts, such as "
            "list(...) of it"
        )
    if not prompts:
        raise APIError("prompts: an empty list; give at least one prompt")


# --- what a reply is ------------------------------------------------------------------------------


@dataclass
class Reply:
    """A reply and how it was made.

    text      the reply, decoded (special tokens left out); with `stop`, up to the stop string
    ids       its token ids, without the EOS that ended it (with `stop`: up to the token that
              completed the stop string)
    stopped   "eos": the model ended it; "length": max_new_tokens (or the context) cut it; "stop":
              one of the stop strings
    stats     new_tokens (the tokens decoded, an EOS included), steps (forwards of the base model,
              the prefill included), tau (new tokens a forward), seconds (this reply's own time,
              from its prefill to its last step; in a batch, beside the other rows), tokens_per_s
              (new_tokens / seconds), accepted_by_depth (the share of steps whose accepted drafts
              reached depth 1, 2, ...); a chat's also prompt_tokens and forwarded (of them, those
              its cache lacked)
    """

    text: str
    ids: list
    stopped: str
    stats: dict

    def __str__(self):
        return self.text


class TextSoFar:
    """A reply's text as its tokens come, cut before the first of the stop strings. What can be
    shown of it holds back an incomplete character and a tail that may begin a stop string."""

    def __init__(self, tokenizer, stop):
        self.tokenizer = tokenizer
        self.stop = stop  # the stop strings (a tuple, maybe empty)
        self.ids = []  # the tokens so far; with a stop string met, up to the one completing it
        self.text = ""  # their text, cut before a stop string
        self.stopped = False  # a stop string was met
        self.shown = 0  # characters of text given out by piece()

    def add(self, new):
        """Take the next tokens, one at a time; True once a stop string is met (the rest are
        left out)."""
        for t in new:
            if self.stopped:
                break
            self.ids.append(t)
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            met = [self.text.index(s) for s in self.stop if s in self.text]
            if met:
                self.text = self.text[: min(met)]
                self.stopped = True
        return self.stopped

    def piece(self, final=False):
        """The text not given out yet that can be: all of it once final (or stopped)."""
        end = len(self.text)
        if not (final or self.stopped):
            end = len(self.text.rstrip("\ufffd"))  # an incomplete UTF-8 character
            starts = [
                k for s in self.stop for k in range(1, len(s)) if self.text[:end].endswith(s[:k])
            ]
            end -= max(starts, default=0)  # may begin a stop string
        piece = self.text[self.shown : end]
        self.shown = max(self.shown, end)
        return piece


def reply(result, tokenizer, max_depth, text=None, **more):
    """A decode.Result as a Reply (text: its TextSoFar, where stop strings were looked for);
    `more`: statistics to add. The numbers are generate.py's."""
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
    if text is not None and text.stopped:
        return Reply(text.text, list(text.ids), "stop", stats | more)
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    return Reply(decoded, list(ids), result.stopped, stats | more)


class Stream:
    """Decoder.stream()'s reply as it is made: iterate over it for its text, piece by piece, each
    as soon as the step that accepted its tokens has ended (the pieces join into Reply.text);
    .reply is the Reply once the iteration has ended (None before). The decoding runs in a thread
    of its own, a piece ahead of the reader at most; leaving the loop early (break, Ctrl-C) ends
    it at its next step. A stream is read once."""

    def __init__(self, work):
        self.work = work  # work(show) -> Reply, calling show(piece) as the text grows
        self.reply = None
        self.read = False

    def __iter__(self):
        if self.read:
            raise APIError("this stream was read already; call stream() again for another reply")
        self.read = True
        pieces = queue.Queue(maxsize=1)
        left = threading.Event()  # the reader has left the loop
        failed = []
        done = object()

        def give(item):  # -> True once the reader has left
            while not left.is_set():
                try:
                    pieces.put(item, timeout=0.1)
                    return False
                except queue.Full:
                    continue
            return True

        def show(piece):
            return give(piece) if piece else left.is_set()

        def run():
            try:
                self.reply = self.work(show)
            except BaseException as e:  # the reader's to see
                failed.append(e)
            give(done)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        try:
            while (piece := pieces.get()) is not done:
                yield piece
        finally:
            left.set()
            worker.join()
        if failed:
            raise failed[0]


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
            if not prompt.strip():
                raise APIError(f"{which} is empty; give it some text")
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
        stop=None,
    ) -> Reply:
        """The reply to `prompt` (help(Reply): its fields). Sampled from a generator seeded `seed`:
        the same seed, arguments and machine give the same reply.

        prompt          a string (the user's message, laid out by the chat template) or a
                        conversation: a list of {"role": "system" | "user" | "assistant",
                        "content": str} ending with the user's; not empty (several prompts:
                        generate_batch)
        max_new_tokens  a whole number >= 1, at most what the context leaves after the prompt;
                        None: 256, or what the context leaves
        temperature     a number >= 0; 0 (or below 1e-4): greedy
        top_p           a number in (0, 1]: sample from the smallest set of tokens this likely
        verify          "auto" (greedy at temperature 0, else "sample"), "greedy" (temperature 0
                        only), "typical" (Medusa's typical acceptance: lossy, temperature > 0) or
                        "sample" (speculative sampling: lossless)
        seed            a whole number, 0 to 2**32 - 1
        system          None, or a system message (a string) put before the prompt
        stop            None, a string or a list of strings (none empty): the reply ends at the
                        first of them, which its text leaves out (Reply.stopped "stop")
        """
        with checked(locals()):
            job = self.prepare(
                prompt, max_new_tokens, temperature, top_p, verify, seed, system, stop
            )
        return self.decode_one(*job)

    def stream(
        self,
        prompt,
        *,
        max_new_tokens=None,
        temperature=0.0,
        top_p=1.0,
        verify="auto",
        seed=0,
        system=None,
        stop=None,
    ) -> Stream:
        """generate()'s reply, arguments and values as it takes them, as a Stream: iterate over it
        for the text piece by piece as the steps accept tokens (the first after the prompt's
        forward), then read its .reply. The pieces join into the text generate() gives.

            for piece in sd.stream("Tell me a story."):
                print(piece, end="", flush=True)
        """
        with checked(locals()):
            job = self.prepare(
                prompt, max_new_tokens, temperature, top_p, verify, seed, system, stop
            )
        return Stream(lambda show: self.decode_one(*job, show=show))

    def prepare(self, prompt, max_new_tokens, temperature, top_p, verify, seed, system, stop):
        """generate()'s and stream()'s arguments checked: (ids, most new tokens, decoding, seed,
        stop strings)."""
        check_prompt(prompt)
        decoding = check_decoding(temperature, top_p, verify, seed)
        stops = check_stop(stop)
        ids, limit = self.encode(prompt, system, max_new_tokens, "prompt")
        return ids, limit, decoding, seed, stops

    def decode_one(self, ids, limit, decoding, seed, stop, show=None):
        """One reply to the prompt `ids`, ending at a stop string where given; show(piece): each
        piece of its text as it comes, True back to end it (a reader gone)."""
        generator = torch.Generator(device=self.model.device).manual_seed(seed)
        drafter = sampled_drafter(self.drafter, decoding, generator)
        text = TextSoFar(self.tokenizer, stop) if stop or show else None

        def on_tokens(new, sources):
            met = text.add(new)
            left = show(text.piece()) if show else False
            return met or left

        r = decode.generate(
            self.forward,
            ids,
            limit,
            drafter,
            generator=generator,
            eos_ids=self.eos_ids,
            on_tokens=on_tokens if text else None,
            **decoding,
        )
        if show:
            show(text.piece(final=True))
        return reply(r, self.tokenizer, self.drafter.max_depth, text)

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
        stop=None,
    ) -> list:
        """The replies to `prompts`, in their order, batch_size of them decoding side by side
        (engine.py; generate.py --batch-size): reply i is the one generate() gives alone (greedy),
        sampled from its own generator, seeded seed + i. Each Reply's statistics are its own row's
        (its seconds: from its prefill to its last step).

        prompts     a list of prompts, each as generate() takes it (a string or a conversation),
                    at least one
        batch_size  a whole number >= 1: rows decoding at once (a row that ends takes the next)
        stop        as generate()'s; a row decodes on past its stop string to its EOS or its
                    limit, and its reply is cut there
        max_new_tokens, temperature, top_p, verify, seed, system   as generate() takes them, for
                    every prompt
        """
        with checked(locals()):
            check_prompts(prompts)
            whole("batch_size", batch_size, 1)
            decoding = check_decoding(temperature, top_p, verify, seed)
            stops = check_stop(stop)
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
        replies = []
        for r in results:
            text = TextSoFar(self.tokenizer, stops) if stops else None
            if text:
                text.add(r.tokens)
            replies.append(reply(r, self.tokenizer, self.drafter.max_depth, text))
        return replies

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
        each reply at most max_new_tokens, or what the context leaves.

        system          None, or a system message (a string) that opens the conversation
        max_new_tokens  a whole number >= 1, or None: 256 (each cut to what the context leaves)
        temperature, top_p, verify, seed   as generate() takes them
        """
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
    """The model `model` names and the drafter `draft`, `heads` and `tree` name, as generate.py's
    flags of those names build them: the arguments are checked before the model loads, then the
    model, its drafter and the step.

    model        "default" (SmolLM2-135M-Instruct, shipped), a Hugging Face folder or a hub id of
                 model_type llama, mistral, qwen2, qwen3, phi3, granite or gemma
    draft        who proposes the tokens: "heads", "lookup", "heads+lookup", "layers:N", "skip",
                 "skip:LAYERS" (e.g. "skip:2,5,9-12"), "model" (with draft_model), "jacobi",
                 "lookahead" or "pass"
    heads        with heads: "auto" (hydra++ where shipped for the model, else none), "none"
                 (plain decoding), "medusa", "hydra", "hydra++", or a heads folder
    tree         with heads: "auto" (the tree tuned beside the heads), "chain:N",
                 "cartesian:4,3,2", or a JSON file {"paths": [[0], [0, 1], ...]}
    draft_model  with draft="model": a model as `model` takes it, with the same tokenizer
    gamma, ngram, matches, window, guesses   the drafters' sizes, whole numbers >= 1 (None:
                 each drafter's own; generate.py --help says which takes which)
    device       "auto" (CUDA where there is one), "cpu", "cuda" or "cuda:N"
    dtype        "auto", "fp32", "bf16" or "fp16"
    quantize     "none", "fp16" (CPU only), "int8" or "int4": the base model's linear layers
    threads      0 (the cores other work leaves idle) or a number of CPU threads
    cuda_graphs  "auto" (on with CUDA), "on" or "off": the step replayed from CUDA graphs
    """
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
