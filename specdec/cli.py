"""The convention every script follows: what a user typed, checked where it enters and reported
in one line. It imports nothing of the project but ctrl_c.py (which imports nothing), so every
file may use it.

The teaching files (tree, verify, decode, heads, drafters, model) raise plain errors
(ValueError and its subclasses) and never print. The scripts parse their flags with Parser,
check them with the functions here, and run through run(), which turns every mistake of the
user's into one line on stderr, "error: <what> ...; <fix>", and exit code 2 (no traceback),
Ctrl-C at any moment into one line and exit code 130 (ctrl_c.py), and a closed pipe into a quiet
exit.

    UsageError, Parser, run(main, parser, argv)      the convention
    notice(message)                                  a remark on stderr (stdout holds only results)
    plural(n, word)                                  "1 message", "2 messages"
    pick_device, DTYPES, check_seed                  the machine and randomness (kernels.pick_dtype
                                                     turns --dtype into one of DTYPES)
    check_quantize, check_exact                      --quantize and --exact on this device
    threads_flag, use_threads                        --threads: the cores other work leaves idle
    writable_file, new_file, writable_folder,        paths, checked before the work
        empty_folder
    check_text, check_counts, read_prompts           text, numbers and prompt files; quoted(id):
                                                     a prompt's id in a message
    check_messages                                   a {"messages": [...]} conversation
    cache_root()                                     the folder for what is made once per machine

Test: `python -m pytest -q tests/test_cli.py tests/test_reliability.py`.
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time

import torch

from specdec import ctrl_c

MAX_SEED = 2**32 - 1  # train.py combines it with the step into one 64-bit seed


# --- the convention ------------------------------------------------------------------------------
# Bad input raises UsageError with a message that names the input and the fix; run() prints it.


class UsageError(Exception):
    """Bad input from the command line or a file; the message names it and the fix."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, once: not where the help already says it, nor for a
    default of None or False (a flag that is off unless given)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "(default" in (action.help or ""):
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
    stderr, exit 2; a diverged training (FloatingPointError): one line, exit 1; Ctrl-C, at any
    moment (ctrl_c.py: one whose exception third-party code swallowed too): what is already on
    stdout stays, then `interrupted` (or interrupted(args), args None before they are parsed) on
    stderr, exit 130. No traceback for any of them."""
    args = None
    with ctrl_c.counted():
        try:
            args = parser.parse_args(argv)
            code = main(args) or 0
            if code == 0:
                ctrl_c.check()  # a press whose exception was lost: the work is not what was asked
            return code
        except BrokenPipeError:  # the reader went away (generate.py ... | head): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        except (UsageError, ValueError, OSError) as e:  # the project's own errors are ValueErrors
            if not ctrl_c.pressed:
                print(error_line(e), file=sys.stderr)
                return 2
            why = interrupted(args) if callable(interrupted) else interrupted
        except FloatingPointError as e:  # training diverged: not a mistake in the input
            print(error_line(e), file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            why = interrupted(args) if callable(interrupted) else interrupted
        sys.stdout.flush()
        print("\n" + why, file=sys.stderr)
        return ctrl_c.EXIT


def notice(message):
    """A one-line remark on stderr (never stdout, which holds only the generated text)."""
    print(f"notice: {message}", file=sys.stderr)


def plural(n, word):
    """The count and the word, plural unless the count is one: 1 message, 2 messages, 2 guesses."""
    return f"{n} {word}{('es' if word.endswith('s') else 's') * (n != 1)}"


# --- the machine and randomness ------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype


def pick_device(name):
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if not re.fullmatch(r"cuda(:[0-9]+)?", name):
        raise UsageError(f"--device {name}: unknown device; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise UsageError(
            f"--device {name}: CUDA is not available on this machine; use --device cpu"
        )
    if int(name.partition(":")[2] or 0) >= torch.cuda.device_count():
        raise UsageError(
            f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); "
            f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    return name


QUANTIZE = ("none", "fp16", "int8", "int4")  # --quantize: kernels.quantize's


def check_quantize(quantize, device):
    """--quantize fp16 runs a CPU kernel (fbgemm's): refused on another device."""
    if quantize == "fp16" and torch.device(device).type != "cpu":
        raise UsageError(
            f"--quantize fp16: a CPU kernel; on {device} use --dtype fp16 instead (or --device cpu)"
        )


def check_exact(exact, quantize, device):
    """--exact: exact.py's Triton kernels compute the model's own weights on a CUDA GPU. A CPU runs
    them only in Triton's interpreter, which is for the tests (minutes a token): refused, saying
    what keeps replies exact there."""
    if not exact:
        return
    if quantize != "none":
        raise UsageError(f"--exact computes bf16 weights, not --quantize {quantize}; drop one")
    if torch.device(device).type != "cuda":
        raise UsageError(
            f"--exact: exact.py's kernels run on a CUDA GPU, not on {device} (Triton's interpreter "
            "runs them on a CPU for the tests only, minutes a token); drop --exact: on a CPU, "
            "bf16 through kernels.c and fp32 keep speculative replies equal to plain decoding's"
        )


def busy_cores(seconds=0.1):
    """How many cores other work keeps busy now: the CPUs' non-idle time over `seconds`, from
    Linux's /proc/stat (elsewhere: 0)."""

    def times():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all, idle + iowait

    try:
        total0, idle0 = times()
        time.sleep(seconds)
        total1, idle1 = times()
    except (OSError, ValueError, IndexError):
        return 0
    cores = os.cpu_count() or 1
    return round(cores * (1 - (idle1 - idle0) / max(total1 - total0, 1)))


def use_threads(threads):
    """--threads: torch's CPU threads (and kernels.c's, which reads torch's count). 0 = the cores
    that other work leaves idle now, at least one: a thread that waits for a core another job
    holds stalls every step, so on a shared machine fewer threads are faster; more threads than
    the cores this process may use are refused. Returns the count."""
    if threads < 0:
        raise UsageError(f"--threads {threads}: must be 0 (the idle cores) or a number of threads")
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    if threads > cores:  # more threads than cores wait for each other every step
        raise UsageError(
            f"--threads {threads}: this process may use {cores} cores; give at most {cores}, or 0 "
            "for the idle ones"
        )
    if threads == 0:
        threads = max(1, cores - busy_cores())
    torch.set_num_threads(threads)
    return threads


def threads_flag(p):
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads, at most the cores this process may use (default: 0 = the cores other "
        "work leaves idle at the start)",
    )


def free_memory(device):
    """Bytes that can still be allocated on `device`: the GPU's free memory, or what Linux calls
    MemAvailable; None where it is not known."""
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024  # in kB
    except (OSError, KeyError, ValueError):
        return None


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
        raise UsageError(
            f"{flag} {path}: not a file in an existing folder; give a path such as {example}"
        )
    try:
        tempfile.TemporaryFile(dir=folder).close()
        if os.path.exists(path):
            open(path, "ab").close()  # append mode: the file is left as it is
    except OSError as e:
        raise UsageError(
            f"{flag} {path}: cannot write there ({e.strerror}); choose a writable folder"
        ) from None


def new_file(flag, path, example, prompts, overwrite, replaced):
    """An output file: writable (writable_file), not the --prompts file, and new unless
    --overwrite; `replaced` says what writing it would do to one that exists."""
    writable_file(flag, path, example)
    if prompts and os.path.isfile(path) and os.path.isfile(prompts):
        if os.path.samefile(path, prompts):
            raise UsageError(
                f"{flag} {path} is the --prompts file: writing it would overwrite the prompts; "
                f"give another {flag}"
            )
    if os.path.exists(path) and not overwrite:
        raise UsageError(
            f"{flag} {path}: the file exists, and {replaced}; give a new name, remove it, or add "
            "--overwrite"
        )


def writable_folder(flag, path):
    """Fail now, not after the work: `path` must be a folder that takes new files; it is created
    (with its parents) if it does not exist."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a file, not a folder; give a folder")
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise UsageError(
            f"{flag} {path}: cannot write there ({e.strerror}); choose a writable folder"
        ) from None


def os_error(e):
    """The OSError behind a failure (a full disk): `e` itself, or the one a library raised its own
    error from (torch's writer raises a RuntimeError over it); None if there is none."""
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__ or e.__context__
    return e


def new_folders(*paths):
    """The folders that creating `paths` (with their parents) would make: those not there now."""
    made = []
    for path in filter(None, paths):
        path = os.path.abspath(path)
        while not os.path.exists(path):
            made.append(path)
            path = os.path.dirname(path)
    return made


def remove_empty(folders):
    """Remove those of `folders` (made by this run) that are still empty, children first: a run
    that stops early (a model that fails to load, bad data) leaves no empty folder behind."""
    for folder in sorted(set(folders), key=len, reverse=True):
        try:
            os.rmdir(folder)  # refuses a folder that holds anything
        except OSError:
            pass


def empty_folder(flag, path):
    """writable_folder, with nothing in it yet: a run never writes over another's files."""
    writable_folder(flag, path)
    if os.listdir(path):
        raise UsageError(f"{flag} {path}: the folder is not empty; give a new or empty one")


def check_counts(args, *names):
    """Each of these whole-number flags, where given (not None), is at least 1."""
    for name in names:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(
                f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1"
            )


def check_text(text, what):
    """Text must be valid Unicode to be tokenized and printed. A lone surrogate is not: Python makes
    one of each command-line byte that is not UTF-8, and JSON of an unpaired escape like \\ud800."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(
            f"{what}: not valid Unicode text (a lone surrogate {text[e.start]!r} at character "
            f"{e.start}, "
            "from bytes that are not UTF-8 or an unpaired \\ud800-\\udfff escape); pass UTF-8 text"
        ) from None
    return text


ROLES = ("system", "user", "assistant")  # the speakers of a {"messages": [...]} conversation


def check_messages(messages, where, ends_with_user=True):
    """A conversation as chat templates take it: a list of {"role", "content"}, roles among ROLES,
    contents valid text; ending with the user's turn (the one to answer) unless told otherwise."""
    example = '{"messages": [{"role": "user", "content": "..."}, ...]}'
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: needs a non-empty list of messages, as in {example}")
    for i, m in enumerate(messages, start=1):
        if not (
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        ):
            raise UsageError(
                f'{where}: message {i} needs a "role" ({", ".join(ROLES)}) and a string '
                f'"content", as in {example}'
            )
        check_text(m["content"], f"{where}, message {i}")
    if ends_with_user and messages[-1]["role"] != "user":
        raise UsageError(f"{where}: the last message is the one answered: it must be the user's")
    if ends_with_user and not messages[-1]["content"].strip():
        raise UsageError(
            f"{where}: the last message, the one answered, is empty; give it some text"
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def json_kind(value):
    """What a JSON value is, in words: a list, an object, a number, a string, true, false, null."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    kinds = {list: "a list", dict: "an object", str: "a string"}
    return kinds.get(type(value), "a number")


def prompt_labels(obj, n, where):
    """A prompt line's "id" (a string or a whole number; the line number if absent) and "category"
    (a string; "all" if absent): both name the prompt in tables and output files."""
    pid, category = obj.get("id", n), obj.get("category", "all")
    if isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise UsageError(
            f'{where}: "id" is {json_kind(pid)}; give a string or a whole number, as in '
            '{"id": "q1", ...}'
        )
    if not isinstance(category, str):
        raise UsageError(
            f'{where}: "category" is {json_kind(category)}; give a string, as in '
            '{"category": "math", ...}'
        )
    if isinstance(pid, str):
        check_text(pid, f'{where}, "id"')
    return pid, check_text(category, f'{where}, "category"')


def quoted(pid):
    """A prompt's id as messages name it: a string in quotes ('long' would read as a word), a
    number (a line's) as it is."""
    return repr(pid) if isinstance(pid, str) else str(pid)


def read_prompts(path):
    """JSONL with a "prompt" field, or a "messages" list (a conversation whose last, user's, turn
    is answered), and optional "id", "category": [(id, prompt or messages, category)], errors name
    the line."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not part of line 1
            lines = f.read().splitlines()
    except OSError as e:
        raise UsageError(f"--prompts {path}: cannot read it ({e.strerror})")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"--prompts {path}: not valid UTF-8 text (bad byte at offset {e.start}); save it as "
            "UTF-8"
        )
    prompts = []
    seen = {}  # id -> the line that gave it: an --out row names its prompt by the id
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise UsageError(
                f'--prompts {path}, line {n}: not valid JSON; write one {{"prompt": "..."}} '
                "object per line"
            )
        if isinstance(obj, dict) and "messages" in obj and "prompt" not in obj:
            prompt = check_messages(obj["messages"], f"--prompts {path}, line {n}")
        elif not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise UsageError(
                f'--prompts {path}, line {n}: needs a string field "prompt", as in '
                f'{{"prompt": "..."}}, or a conversation {{"messages": [...]}}'
            )
        elif not obj["prompt"].strip():
            raise UsageError(
                f"--prompts {path}, line {n}: the prompt is empty; give it some text or drop the "
                "line"
            )
        else:
            prompt = check_text(obj["prompt"], f"--prompts {path}, line {n}")
        pid, category = prompt_labels(obj, n, f"--prompts {path}, line {n}")
        if pid in seen:
            same = (
                f"the id {quoted(pid)} is"
                if "id" in obj
                else f'has no "id" and its number, {n}, is'
            )
            raise UsageError(
                f"--prompts {path}, line {n}: {same} line {seen[pid]}'s id too; give each prompt "
                'an "id" of its own'
            )
        seen[pid] = n
        prompts.append((pid, prompt, category))
    if not prompts:
        raise UsageError(
            f'--prompts {path}: no prompts in the file; write one {{"prompt": "..."}} object per '
            "line"
        )
    return prompts


def cache_root():
    """The folder for what is made once per machine: the default model's conversion, kernels.c's
    build, training's caches (SPECDEC_CACHE moves it)."""
    return os.environ.get(
        "SPECDEC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    )
