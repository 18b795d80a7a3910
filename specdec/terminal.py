"""What generate.py shows and writes: the text streamed as it is made (coloured by who proposed
each token with --show), the banner, a statistics line a reply, each reply's --out line, and the
chat terminal (--chat), which answers with decode.py's Conversation.

stdout gets the generated text alone, as it is produced; remarks and statistics go to stderr.
"""

import contextlib
import json
import os
import sys
import time

from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import cli
from specdec import ctrl_c
from specdec.engines import decode
from specdec.fast import compiled
from specdec.fast import graphs
from specdec.fast import kernels

# --- what is printed ------------------------------------------------------------------------------

# the base model's colour, then drafter.legend[1:]'s
COLOURS = ["\033[0m", "\033[32m", "\033[33m", "\033[36m", "\033[35m", "\033[34m", "\033[31m"]


def colour(source):
    return COLOURS[min(source, len(COLOURS) - 1)]


def banner_line(dec, draft, *, device, quantize, threads):
    """Which model runs where, in what numbers (on a CPU in bf16, kernels.c's path: the tuned
    files read are that path's), drafted by whom; threads: None off the CPU."""
    dtype = str(dec.model.dtype).removeprefix("torch.")
    weights = "" if quantize == "none" else f", {quantize} weights"
    on = f", {cli.plural(threads, 'thread')}" if threads else ""
    if device == "cpu" and kernels.native_library() is None:  # what runs instead, and why
        on += f"; kernels.c off: {kernels.native_reason()}"
    elif device == "cpu" and dtype == "bfloat16":
        dtype += f" (kernels.c: {kernels.native_path()})"
    name = dec.model.cfg.name
    heads = heads_source(draft.kind, draft.heads)
    return f"[{name} on {device}, {dtype}{weights}, {dec.drafter.name}{heads}{on}]"


def announce(dec, draft, *, device, quantize, threads, show):
    """The banner, and with --show on a terminal the legend of its colours, on stderr."""
    print(
        banner_line(dec, draft, device=device, quantize=quantize, threads=threads), file=sys.stderr
    )
    if show and dec.drafter.max_depth and sys.stderr.isatty():
        print(legend_line(dec.drafter), file=sys.stderr)


def heads_source(kind, name):
    """For the banner: the folder heads come from, where it is the user's (not the shipped), or
    where the shipped ones were retrained in place."""
    if kind == "eagle3":  # its layer: the shipped one (auto, eagle3), or the user's folder
        return "" if name in ("auto", "eagle3", "none") else f", layer from {name}"
    folder = catalog.find_heads(name) if kind in ("heads", "heads+lookup") else None
    if folder is None or catalog.shipped(folder) and not catalog.retrained(folder):
        return ""
    if catalog.shipped(folder):
        return f", retrained in {folder}, not the shipped heads"
    return f", heads from {folder}"


def legend_line(drafter):
    who = [f"{colour(s)}{name}{COLOURS[0]}" for s, name in enumerate(drafter.legend) if s]
    return f"[--show: plain = the base model's own token, {', '.join(who)} = proposed by it]"


class Printer:
    """Streams decoded text to stdout; holds back an incomplete UTF-8 character. show: colour
    codes."""

    def __init__(self, tokenizer, show):
        self.tok = tokenizer
        self.show = show
        self.ids = []
        self.printed = ""

    def __call__(self, new, sources):
        for t, s in zip(new, sources):
            self.ids.append(t)
            text = self.tok.decode(self.ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            piece = text[len(self.printed) :]
            self.printed = text
            if piece and self.show and s:
                sys.stdout.write(colour(s) + piece + COLOURS[0])
            elif piece:
                sys.stdout.write(piece)
        sys.stdout.flush()


def stats_line(r, max_depth, label="", more=()):
    """The statistics of a Result in one line: `label` before them, the clauses `more` after."""
    n = len(r.tokens)
    clauses = [
        cli.plural(n, "new token"),
        cli.plural(r.steps, "forward pass"),  # the prefill and each step: tau's denominator
        f"tau {n / max(r.steps, 1):.2f}",
        f"{n / max(r.seconds, 1e-9):.1f} tokens/s",
    ]
    if max_depth:
        rates = decode.acceptance_by_depth(r.accepted, max_depth)
        clauses.append("accepted by depth " + " ".join(f"{a:.2f}" for a in rates))
    return f"[{label}{', '.join(clauses + list(more))}]"


def online_line(learner, seconds):
    """What --online did: its updates, their time against the decoding's, the loss's course."""
    share = learner.seconds / max(seconds, 1e-9)
    line = f"[online: {cli.plural(learner.updates, 'update')} in {learner.seconds:.2f} s, "
    line += f"{share:.1%} of the decoding time"
    if learner.losses:
        line += f", loss {learner.losses[0]:.3f} -> {learner.losses[-1]:.3f}"
    return line + "]"


# why a forward ran outside the static step, in a user's words (GraphedForward.fallbacks' reasons)
OUTSIDE = {
    "last_only": ("prompt prefill", "prompt prefills"),
    "layers": ("draft by the model's own layers", "drafts by the model's own layers"),
    "extra": ("draft by learned [LA] tokens", "drafts by learned [LA] tokens"),
    "cache outside the buffers": (
        "forward on a cache of its own",
        "forwards on caches of their own",
    ),
}


def graphs_line(g):
    """What --cuda-graphs did (g: a graphs.GraphedForward), said for a user: the steps replayed
    from CUDA graphs (or run at static shapes where there are none), and the forwards that ran
    outside them, by what they were."""
    steps = cli.plural(g.replays, "step")
    shapes = cli.plural(len(g.shapes), "shape")
    if g.enabled:
        captured = sum(s.graph is not None for s in g.shapes.values())
        line = f"cuda graphs: {steps} replayed ({captured} of {shapes} captured)"
    else:
        line = f"static steps, cuda graphs off: {steps} ({shapes})"
    outside = []
    for why, n in g.fallbacks.most_common():
        one, many = OUTSIDE.get(why, (why, why))
        outside.append(f"{n} {one if n == 1 else many}")
    if outside:
        line += "; outside them: " + ", ".join(outside)
    return f"[{line}]"


class Replies:
    """What each finished reply leaves, streamed or batched alike: its text printed whole (with
    --batch-size), its statistics line, its --out line and --online's turn to learn; then the
    totals over all replies."""

    def __init__(self, ids, dec, *, whole, out):
        self.ids = ids  # the prompts' ids, in their order
        self.tokenizer = dec.tokenizer
        self.max_depth = dec.drafter.max_depth
        self.learner = dec.learner
        self.model = dec.model
        self.whole = whole  # print each reply whole as it ends, marked with its id
        self.out = out  # the open --out file, or None
        self.end = out.tell() if out else 0  # where its last whole row ends
        self.total = decode.Result()

    def done(self, i, r):
        """Prompt i's reply, r, is final."""
        ctrl_c.check()  # a Ctrl-C whose exception was lost: stop before writing more
        text = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
        if self.whole:
            print(f"[{self.ids[i]}] {text}")
        print(stats_line(r, self.max_depth), file=sys.stderr)
        self.total.tokens += r.tokens
        self.total.accepted += r.accepted
        self.total.steps += r.steps
        if self.out:
            record = {
                "id": self.ids[i],
                "text": text,
                "token_ids": r.tokens,
                "new_tokens": len(r.tokens),
                "steps": r.steps,
                "seconds": round(r.seconds, 4),
                "stopped": r.stopped,
            }
            self.write(json.dumps(record) + "\n", self.ids[i])
        if self.learner:  # between replies: the next ones draft with what this one taught
            self.learner.reply_done()

    def write(self, line, pid):
        """One --out line, whole, on disk before the next reply. A failure (a full disk) names the
        flag, the file and the reply, and cuts off what part of the line reached the file: it ends
        with the last whole row (resume_out reads it)."""
        try:
            self.out.write(line)
            self.out.flush()
            self.end += len(line.encode("utf-8"))
        except OSError as e:
            with contextlib.suppress(OSError):  # what is left in its buffer cannot be written
                self.out.close()
            with contextlib.suppress(OSError):
                os.truncate(self.out.name, self.end)
            raise cli.UsageError(
                f"--out {self.out.name}: writing the reply to prompt {cli.quoted(pid)} failed "
                f"({e.strerror or e}); the replies before it are in the file; free some space or "
                "give an --out in another folder"
            ) from None

    def report(self, seconds):
        """After `seconds` of decoding: the totals (of more than one prompt), what --online did,
        what --cuda-graphs replayed or --compile compiled."""
        self.total.seconds = seconds
        if len(self.ids) > 1:
            print(stats_line(self.total, self.max_depth, "all prompts: "), file=sys.stderr)
        if self.learner:
            print(online_line(self.learner, seconds), file=sys.stderr)
        if isinstance(self.model, graphs.GraphedForward):  # replayed, and what ran eagerly
            print(graphs_line(self.model), file=sys.stderr)
        if isinstance(self.model, compiled.CompiledModel):  # compiled, and what ran eagerly
            print(f"[{self.model.summary()}]", file=sys.stderr)


def resume_out(path, ids):
    """--resume: the ids of the prompts whose rows an interrupted run left whole in the --out file
    at `path` (ids: the --prompts' ids, in their order), to be left out of the rerun, which appends
    its rows: the file then holds a row for every prompt, as an uninterrupted run's. A last row cut
    short (a kill in mid-write) is cut off the file; a row that is not one of these prompts' is
    refused, naming its line. A file that does not exist yet: nothing done (a notice)."""
    if not os.path.exists(path):
        cli.notice(f"--resume: --out {path} does not exist yet; starting with the first prompt")
        return set()
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise cli.UsageError(f"--out {path}: cannot read it ({e.strerror})") from None
    known = set(ids)
    done = set()
    end = 0  # where the last whole row ends
    for n, line in enumerate(data.split(b"\n")[:-1], start=1):  # [-1]: after the last newline
        try:
            row = json.loads(line)
        except ValueError:  # bad JSON or bad UTF-8: not a row this project wrote
            row = None
        pid = row.get("id") if isinstance(row, dict) else None
        named = isinstance(pid, (str, int)) and not isinstance(pid, bool)
        if not named or pid not in known or pid in done:
            why = f"a second row of prompt {cli.quoted(pid)}" if pid in done else "no id of theirs"
            raise cli.UsageError(
                f"--out {path}, line {n}: not a row of these --prompts ({why}); give --resume "
                "the --out of the run that read them, or start afresh with --overwrite"
            )
        done.add(pid)
        end += len(line) + 1
    if end < len(data):  # the row being written when the run stopped
        os.truncate(path, end)
        cli.notice(f"--resume: --out {path} ended in a row cut short; it is cut off")
    return done


# --- --chat: a conversation at the terminal -------------------------------------------------------

CHAT_HELP = (
    "[type a message and press Enter; /reset starts a new conversation, /save FILE appends it to "
    'FILE as a {"messages": [...]} line (train.py reads those; its "cut" lists the replies cut '
    "short by --max-new-tokens or Ctrl-C), /load FILE goes on with the last "
    "conversation in FILE, /help shows this; a message that starts with / is typed //...; "
    "Ctrl-C stops a reply (the conversation stays), Ctrl-D ends]"
)


def read_message(interactive):
    """The next line typed, without its newline; None at the end (Ctrl-D, or stdin's end)."""
    try:
        return input("> " if interactive else "")
    except EOFError:
        return None


def last_conversation(path):
    """The messages of the last {"messages": [...]} line of a file (/save appends them), and the
    indices its "cut" gives of the replies cut short."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise cli.UsageError(f"/load {path}: cannot read it ({reason}); the chat goes on") from None
    if not lines:
        raise cli.UsageError(f"/load {path}: the file is empty; the chat goes on")
    try:
        record = json.loads(lines[-1])
    except (json.JSONDecodeError, RecursionError):
        record = None
    if not isinstance(record, dict) or "messages" not in record:
        raise cli.UsageError(
            f'/load {path}: its last line is not a {{"messages": [...]}} object; the chat goes on'
        )
    messages = cli.check_messages(record["messages"], f"/load {path}", ends_with_user=False)
    cut = record.get("cut", [])
    if not isinstance(cut, list) or not all(
        type(i) is int and 0 <= i < len(messages) and messages[i]["role"] == "assistant"
        for i in cut
    ):
        raise cli.UsageError(
            f'/load {path}: its "cut" is not a list of the indices of assistant messages; fix or '
            "drop it"
        )
    return messages, cut


class Chat:
    """generate.py --chat: the messages so far, laid out by the chat template every turn and
    answered by a Conversation, which forwards only what its cache does not hold yet. A mistake
    (an unknown command, a file that cannot be read, a message that cannot fit) is one line on
    stderr, and the conversation stays as it was."""

    def __init__(self, dec, *, system, max_new_tokens, show, stats):
        self.conversation = decode.Conversation(dec.model, dec.drafter)
        self.tokenizer = dec.tokenizer
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.system)
        self.want = max_new_tokens  # a reply's most, where the context has room
        self.decoding = dec.decoding | {"generator": dec.generator}  # Conversation.reply's
        self.show = show
        self.stats = stats
        self.learner = dec.learner  # --online: the heads learn between turns
        self.cut = []  # the replies cut short (the length limit, Ctrl-C): /save marks them
        self.seconds = 0.0  # spent answering (--online's share of it)

    def run(self, interactive):
        """Read, answer, repeat, until the end of the input."""
        if interactive:
            print(CHAT_HELP, file=sys.stderr)
        while True:
            try:
                line = read_message(interactive)
            except KeyboardInterrupt:  # at the prompt: a fresh one
                ctrl_c.handled()
                print(file=sys.stderr)
                continue
            if line is None:
                return
            try:
                if line.startswith("/") and not line.startswith("//"):
                    self.command(line)
                else:
                    self.say(line.removeprefix("/"))
            except cli.UsageError as e:
                print(cli.error_line(e), file=sys.stderr)

    def command(self, line):
        name, _, path = line.partition(" ")
        path = os.path.expanduser(path.strip())
        if name == "/help":
            print(CHAT_HELP, file=sys.stderr)
        elif name == "/reset":
            self.messages = list(self.system)  # the cache keeps what the next turn shares with it
            self.cut = []
            print("[a new conversation]", file=sys.stderr)
        elif name in ("/save", "/load") and not path:
            raise cli.UsageError(f"{name} needs a file name, as in {name} chat.jsonl")
        elif name == "/save":
            self.save(path)
        elif name == "/load":
            messages, cut = last_conversation(path)
            self.layout(messages)  # the template takes it (else: refused, the chat goes on)
            self.messages = messages
            self.cut = [messages[i] for i in cut]
            print(f"[{cli.plural(len(messages), 'message')} loaded from {path}]", file=sys.stderr)
            if messages[-1]["role"] == "user":  # a question waiting: answer it
                self.answer(messages)
        else:
            raise cli.UsageError(f"unknown command {name}; /help lists them")

    def save(self, path):
        """Append the conversation as a {"messages": [...]} line; the replies cut short are marked
        by their indices in its "cut" (train.py reads the messages: a cut reply is still the
        model's own text; /load keeps the marks)."""
        if len(self.messages) == len(self.system):
            raise cli.UsageError("/save: nothing to save yet; type a message first")
        record = {"messages": self.messages}
        cut = [i for i, m in enumerate(self.messages) if any(m is c for c in self.cut)]
        if cut:
            record["cut"] = cut
        try:
            with open(path, "a+b") as f:  # appended: nothing already there is lost
                if f.seek(0, os.SEEK_END) > 0:  # a last line without its newline stays whole
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        f.write(b"\n")
                f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        except OSError as e:
            raise cli.UsageError(
                f"/save {path}: cannot write it ({e.strerror}); give a file in a writable folder"
            ) from None
        marks = f'; "cut": {cut} marks the replies cut short' if cut else ""
        print(
            f"[{cli.plural(len(self.messages), 'message')} appended to {path}{marks}]",
            file=sys.stderr,
        )

    def layout(self, messages):
        """The conversation's ids, up to where the assistant's reply begins."""
        return checkpoint.encode(self.tokenizer, messages)

    def say(self, text):
        if not text.strip():
            raise cli.UsageError("the message is empty; type some text (/help lists the commands)")
        self.answer(self.messages + [{"role": "user", "content": cli.check_text(text, "message")}])

    def fit(self, messages):
        """(messages, their ids, the reply's most new tokens): while the reply would not fit the
        context, the oldest turn and its answer are dropped (said in one line); a last message that
        cannot fit alone is refused."""
        context = self.conversation.model.cfg.max_seq_len
        first = 1 if messages[0]["role"] == "system" else 0  # a system message always stays
        ids = self.layout(messages)
        dropped = 0
        while len(ids) + self.want > context and len(messages) > first + 1:
            turns = messages[first:]
            answered = next((i for i in range(1, len(turns)) if turns[i]["role"] == "user"), 1)
            messages = messages[:first] + turns[answered:]
            dropped += answered
            ids = self.layout(messages)
        room = context - len(ids)
        if room < 1:
            raise cli.UsageError(
                f"the message takes {len(ids)} tokens laid out, the model's context holds "
                f"{context}; shorten it"
            )
        if dropped:
            cli.notice(f"the context is full: dropping the oldest {cli.plural(dropped, 'message')}")
        if room < self.want:
            cli.notice(f"the context leaves room for {room} new tokens: the reply stops there")
        return messages, ids, min(self.want, room)

    def answer(self, messages):
        """Stream the reply to messages (the last one the user's); it joins the conversation.
        Returns its Result (None if Ctrl-C stopped it)."""
        messages, ids, limit = self.fit(messages)
        printer = Printer(self.tokenizer, self.show)
        t0 = time.perf_counter()
        first = []  # when the first token came: the time the user waits

        def on_tokens(new, sources):
            if not first:
                first.append(time.perf_counter())
            printer(new, sources)

        try:
            r = self.conversation.reply(ids, limit, on_tokens=on_tokens, **self.decoding)
        except KeyboardInterrupt:  # what was streamed stays, as the user saw it
            ctrl_c.handled()
            print()
            text = self.tokenizer.decode(printer.ids, skip_special_tokens=True)
            if text:
                self.messages = messages + [{"role": "assistant", "content": text}]
                self.cut.append(self.messages[-1])
            kept = (
                "; the reply so far stays in the conversation, /save marks it cut" if text else ""
            )
            print(f"[stopped{kept}]", file=sys.stderr)
            return None
        print()
        self.seconds += r.seconds
        text = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
        self.messages = messages + [{"role": "assistant", "content": text}]
        if r.stopped == "length":
            self.cut.append(self.messages[-1])
            if limit == self.want:
                why = f"--max-new-tokens {limit}"
            else:
                why = f"{cli.plural(limit, 'new token')}, all the context leaves"
            print(f"[cut at {why}; /save marks it cut]", file=sys.stderr)
        if self.learner:  # between turns: the next reply drafts with what this one taught
            self.learner.reply_done()
        if self.stats:
            forwarded = f"{self.conversation.forwarded} of {len(ids)} prompt tokens forwarded"
            waited = f"first token after {first[0] - t0:.2f} s"
            line = stats_line(r, self.conversation.drafter.max_depth, more=[forwarded, waited])
            print(line, file=sys.stderr)
        return r
