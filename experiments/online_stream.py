"""Online speculative decoding on a stream of prompts from one domain the shipped heads were not
trained on (they saw self-distilled general chats): frozen heads against heads that learn across
the stream (bench.py's KIND-online methods, online.py), tau against the position in the stream.

The stream: prompts about Python's standard library, one per public function that has a docstring
in a fixed list of stdlib modules, asking for a short example of its use and quoting the first
paragraph of its docstring (text by CPython's authors, read from the running Python), spread
evenly over the functions found, in module order. Writes the prompts, then, from bench.py's --json
files, a Markdown report and a plot of tau in windows of prompts.

    python experiments/online_stream.py prompts stream.jsonl
    python bench.py --prompts stream.jsonl --limit 120 --max-new-tokens 64 --repeats 1 \\
        --methods hydra++,hydra++-online --json stream.json
    python bench.py --max-new-tokens 64 --repeats 1 --methods hydra++,hydra++-online \\
        --json eval.json
    python experiments/online_stream.py report stream.json eval.json results/online-cpu
"""

import importlib
import inspect
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specdec import tuning  # noqa: E402

MODULES = (
    "string textwrap re json os.path shutil itertools functools collections heapq bisect math "
    "statistics random datetime calendar fractions decimal pathlib glob fnmatch csv base64 "
    "hashlib zlib gzip copy operator difflib html urllib.parse uuid time struct array tempfile "
    "secrets ipaddress unicodedata keyword"
).split()
WINDOW = 20  # prompts a point of the plot


def documented_functions():
    """(module, name, the docstring's first paragraph on one line) of every public function."""
    found = []
    for module in MODULES:
        m = importlib.import_module(module)
        for name in sorted(n for n in dir(m) if not n.startswith("_")):
            f = getattr(m, name)
            doc = inspect.getdoc(f) if inspect.isfunction(f) or inspect.isbuiltin(f) else None
            first = (doc or "").strip().split("\n\n")[0].replace("\n", " ")
            if 20 <= len(first) <= 300:
                found.append((module, name, first))
    return found


def write_prompts(path, n=300):
    found = documented_functions()
    with open(path, "w") as f:
        for i in range(n):
            module, name, first = found[i * len(found) // n]
            prompt = (
                f"Show how to use the Python function {module}.{name} in a short example. Its "
                f"docstring says: {first}"
            )
            f.write(json.dumps({"id": f"{module}.{name}", "category": "stdlib", "prompt": prompt}))
            f.write("\n")


def tau(rows):
    return sum(r["new_tokens"] for r in rows) / sum(r["steps"] for r in rows)


def table(run, names):
    """One row per method: the run's tokens/s (an online method's updates included), tau over the
    whole stream and each half, acceptance by depth, identity with plain decoding."""
    lines = [
        "| method | tokens/s | tau | tau, 1st half | tau, 2nd half | accepted by depth | "
        "identical to plain |",
        "|---|---:|---:|---:|---:|---|:---:|",
    ]
    for name in names:
        r = run["methods"][name]
        rows = r["per_prompt"]
        half = len(rows) // 2
        depth = " ".join(f"{a:.2f}" for a in r["accept_by_depth"] or [])
        lines.append(
            f"| {name} | {r['tokens_per_s']:.1f} | {tau(rows):.3f} | {tau(rows[:half]):.3f} | "
            f"{tau(rows[half:]):.3f} | {depth} | {'yes' if r['identical'] else 'no'} |"
        )
    return lines


def report(stream_json, eval_json, out):
    stream = json.load(open(stream_json))
    evals = json.load(open(eval_json))
    names = [n for n in stream["methods"] if n != "plain"]
    frozen, learning = names[0], names[1]
    m = stream["machine"]
    lines = [
        "# Online speculative decoding on a single-domain stream",
        "",
        tuning.machine_line(m),
        "",
        f"## The stream ({len(stream['methods'][frozen]['per_prompt'])} prompts about Python's "
        f"standard library, {m.get('max_new_tokens')} new tokens each, in order)",
        "",
        *table(stream, ["plain", *names]),
    ]
    cost = stream["methods"][learning]["online"]
    s = stream["methods"]
    half = len(s[frozen]["per_prompt"]) // 2
    gain = tau(s[learning]["per_prompt"][half:]) / tau(s[frozen]["per_prompt"][half:])
    lines += [
        "",
        f"{learning}: {cost['updates']} updates, {cost['update_seconds']:.1f} s in all, "
        f"{cost['of_decoding']:.1%} of its decoding time; the buffer's loss before the first "
        f"update {cost['loss'][0]:.3f}, before the last {cost['loss'][-1]:.3f} (with a buffer "
        "no larger than the replies between updates, on replies not trained on yet). Over the "
        f"second half, tau x{gain:.3f} the frozen heads'; over the whole stream, tokens/s "
        f"x{s[learning]['tokens_per_s'] / s[frozen]['tokens_per_s']:.3f} (updates included).",
        "",
        f"## The 44 mixed evaluation prompts ({evals['machine'].get('max_new_tokens')} new tokens "
        "each, eval/prompts.jsonl, in order)",
        "",
        *table(evals, ["plain", *names]),
    ]
    cost = evals["methods"][learning]["online"]
    lines += ["", f"{learning}: {cost['updates']} updates, {cost['of_decoding']:.1%} of decoding."]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(stream, frozen, learning, out + ".png")


def plot(run, frozen, learning, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name in (frozen, learning):
        rows = run["methods"][name]["per_prompt"]
        starts = range(0, len(rows) - WINDOW + 1, WINDOW)
        xs = [s + WINDOW for s in starts]
        ax.plot(xs, [tau(rows[s : s + WINDOW]) for s in starts], marker="o", label=name)
    ax.set_xlabel(f"prompts into the stream (tau over the last {WINDOW})")
    ax.set_ylabel("tau")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # the docstring says what it does and how to run it
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) == 3 and sys.argv[1] == "prompts":
        write_prompts(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "report":
        report(*sys.argv[2:])
    else:
        sys.exit(__doc__)
