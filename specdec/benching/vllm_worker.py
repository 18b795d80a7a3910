"""One vLLM engine in this process, answering bench.py over a pipe: the worker that
specdec/benching/in_vllm.py starts with vLLM's own python (it needs vLLM, which requirements.txt
leaves out; README, "Serve with vLLM"). vLLM keeps an engine's state per process, so each engine
is a process of its own.

    python -m specdec.benching.vllm_worker --base FOLDER [--draft FOLDER --method medusa] ...

It starts the engine, then writes one JSON line on stdout: {"ready", "vllm", "seconds"} (the
start-up's seconds, timed apart). Then, for each JSON line on stdin,
{"id", "prompts": [[ids]], "max_new", "rows", "stop": [ids]}, it decodes the prompts greedily, at
most `rows` at a time (a row that ends takes the next prompt, as max_num_seqs = rows would), and
writes one line: {"id", "replies", "row_seconds", "steps", "seconds", "counters"}, or
{"id", "error"}. It ends at the end of its input (bench ended, or closed it).

Only the generation is timed: from the first request added to the last one finished, through
vLLM's engine loop (LLMEngine.add_request and step, what LLM.generate runs). vLLM's counters of
drafts and accepted tokens are read after the clock stops. Test: tests/test_vllm.py, in vLLM's
virtual environment.
"""

import argparse
import ctypes
import json
import os
import signal
import sys
import time

# vLLM's counter -> our name (each a total over the engine's life; a reply carries the change)
COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
}


# --- the engine -----------------------------------------------------------------------------------


def start(args):
    """vLLM's offline LLM on --base, a draft from --draft with --method, greedy, eager (no
    torch.compile: minutes on a CPU, the same tokens), no prefix cache (a prompt seen in an
    earlier repeat would skip its prefill, which ours pays every run)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for a few short replies
    from vllm import LLM

    speculative = None
    if args.draft:
        speculative = {
            "method": args.method,
            "model": args.draft,
            "num_speculative_tokens": args.speculative_tokens,
        }
    return LLM(
        args.base,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=0,
        enforce_eager=True,
        enable_prefix_caching=False,
        disable_log_stats=False,  # the counters below
        speculative_config=speculative,
        model_loader_extra_config={} if args.weights_track else {"enable_weights_track": False},
    )


def counters(llm):
    """vLLM's speculative-decoding counters now ({} where nothing is drafted)."""
    found = {}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            found[COUNTERS[metric.name]] = getattr(metric, "values", None) or metric.value
    return found


def change(after, before):
    """What the counters added between two readings."""
    delta = {}
    for name, value in after.items():
        old = before.get(name, [0] * len(value) if isinstance(value, list) else 0)
        delta[name] = (
            [a - b for a, b in zip(value, old)] if isinstance(value, list) else value - old
        )
    return delta


def generate(llm, tag, prompts, max_new, rows, stop):
    """The prompts (lists of ids) decoded greedily, at most `rows` at a time: (replies, each
    reply's seconds from the step that prefilled it until it ended, the engine's steps, the
    seconds of it all). tag: the request's id, which names its prompts in vLLM."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(
        temperature=0, max_tokens=max_new, stop_token_ids=stop, detokenize=False
    )
    replies, seconds = [None] * len(prompts), [0.0] * len(prompts)
    index, started = {}, {}  # our name of a prompt in vLLM -> its index, when it was added
    waiting = list(range(len(prompts)))
    steps = 0
    t0 = time.perf_counter()
    try:
        while waiting or index:
            while waiting and len(index) < rows:  # a row that ended takes the next prompt
                i = waiting.pop(0)
                name = f"{tag}-{i}"  # a finished output carries it back (vLLM's id adds to it)
                engine.add_request(name, TokensPrompt(prompt_token_ids=prompts[i]), params)
                index[name], started[name] = i, time.perf_counter()
            outs = engine.step()  # one forward of every row (a new row's prefill included)
            steps += 1
            for out in outs:
                if out.finished:
                    i = index.pop(out.request_id)
                    replies[i] = list(out.outputs[0].token_ids)
                    seconds[i] = time.perf_counter() - started.pop(out.request_id)
    finally:
        if index:  # a failed request leaves nothing behind for the next
            engine.abort_request(list(index))
    return replies, seconds, steps, time.perf_counter() - t0


# --- command line ---------------------------------------------------------------------------------


def build_parser():
    p = argparse.ArgumentParser(
        description="One vLLM engine answering bench.py over a pipe (JSON lines).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # the engine
    p.add_argument("--base", required=True, help="the base model's folder, as vLLM serves it")
    p.add_argument("--draft", default=None, help="a draft's folder (none: plain decoding)")
    p.add_argument("--method", default=None, help="vLLM's speculative method: medusa | eagle3")
    p.add_argument("--speculative-tokens", type=int, default=3, help="tokens drafted a step")
    p.add_argument("--dtype", default="float32", help="vLLM's dtype name")
    p.add_argument("--max-model-len", type=int, default=2048, help="the longest sequence")
    p.add_argument("--max-num-seqs", type=int, default=1, help="the most rows at once")
    p.add_argument(
        "--no-weights-track",
        dest="weights_track",
        action="store_false",
        help="vLLM's loader does not check that the checkpoint filled every parameter",
    )
    return p


def end_with_parent():
    """Linux: this process gets SIGTERM when bench's ends, however it ends (os._exit after a
    Ctrl-C included): no engine is left decoding on the cores the next run is timed on. Elsewhere
    the end of its input ends it, after the request it is decoding."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # bench ended before the line above
        sys.exit(0)


def main(args):
    end_with_parent()
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # the pipe to bench: ours alone
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what vLLM prints goes to the log
    t0 = time.perf_counter()
    llm = start(args)
    import vllm

    ready = {"ready": True, "vllm": vllm.__version__, "seconds": time.perf_counter() - t0}
    print(json.dumps(ready), file=protocol, flush=True)
    before = counters(llm) if args.draft else {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            replies, seconds, steps, total = generate(
                llm,
                request["id"],
                request["prompts"],
                request["max_new"],
                request["rows"],
                request["stop"],
            )
        except Exception as e:  # vLLM's refusal of a request: bench names it
            print(json.dumps({"id": request["id"], "error": repr(e)}), file=protocol, flush=True)
            continue
        after = counters(llm) if args.draft else {}  # read after the clock stopped
        reply = {
            "id": request["id"],
            "replies": replies,
            "row_seconds": seconds,
            "steps": steps,
            "seconds": total,
            "counters": change(after, before),
        }
        before = after
        print(json.dumps(reply), file=protocol, flush=True)


if __name__ == "__main__":
    main(build_parser().parse_args())
