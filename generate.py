"""Generate text with a Llama-family model, plainly or speculatively: draft heads, prompt lookup,
a draft model, the model's own first layers, its own Jacobi iterations or learned [LA] tokens
propose tokens, one forward verifies them.

    python generate.py --prompt "Write a haiku about the sea."            # shipped heads, greedy
    python generate.py --prompt "..." --heads none                        # plain decoding
    python generate.py --prompt "..." --heads medusa --tree chain:3 --show
    python generate.py --prompt "..." --temperature 0.7 --verify sample --seed 1
    python generate.py --prompt "Summarise: ..." --draft heads+lookup --show
    python generate.py --prompt "..." --draft layers:12 --gamma 3         # self-speculative
    python generate.py --model big/llama --draft model --draft-model small/llama
    python generate.py --prompt "..." --draft lookahead --window 4 --ngram 3 --guesses 4 --show
    python generate.py --prompt "..." --draft pass --gamma 2              # PaSS's [LA] tokens
    python generate.py --prompts eval/prompts.jsonl --out replies.jsonl

One decode loop, generate(), serves every method. Each step:
    the drafter fills a tree of candidate tokens after the last one     (drafters.py)
    -> one forward of the base model over the whole tree, tree mask     (model.Transformer)
    -> verification picks the longest acceptable path + a bonus token   (verify.py)
    -> the accepted tokens are emitted and their KV entries kept        (KVCache.keep)
    -> the drafter learns what was accepted, and what the model said at every node (drafter.accept)
Plain decoding is the same loop with a drafter that proposes nothing: the tree is only its root.
A draft may carry nodes after its tree that are computed but never verified (lookahead's window,
drafters.Draft.candidates): the verifiers see only the tree, KVCache.keep only what they accept.

Contracts (tests/test_generate.py, tests/test_drafters.py): greedy speculative output is
token-identical to plain greedy decoding in fp32, whatever the drafter (in bf16 a tree step and a
one-token step round differently, so near-ties can flip); speculative sampling samples from the
base model's own distribution. The command line's checks live in cli.py (tests/test_cli.py).
Shapes: N tree nodes, D hidden, V vocabulary.
"""
import json
import sys
import time
from dataclasses import dataclass, field

import torch

import checkpoint
import cli
import drafters as drafters_lib
import kernels
import verify as verify_lib

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


def choose_verifier(verify, temperature, top_p, generator):
    """verifier(logits (n, V), tokens (n,), draft) -> (accepted node indices, bonus token), over the
    draft's n candidates."""
    if verify not in cli.VERIFIERS:
        raise ValueError(f"verify={verify!r}: use one of {', '.join(cli.VERIFIERS)}")
    if verify == "greedy" and temperature >= verify_lib.GREEDY_BELOW:
        raise ValueError(f"verify='greedy' keeps only the argmax, so it needs temperature 0, got {temperature}")
    if temperature < verify_lib.GREEDY_BELOW:  # what "greedy" (checked above) and auto at temperature 0 mean
        return lambda l, t, d: verify_lib.greedy(l, t, d.tree)
    if verify == "typical":
        return lambda l, t, d: verify_lib.typical(l, t, d.tree, temperature, top_p, generator=generator)

    def sample(l, t, d):  # sampled drafts come with their p: Leviathan's rule; picked ones: the tree rule
        if d.probs is not None:
            return verify_lib.leviathan(l, t, d.probs, temperature, top_p, generator)
        return verify_lib.speculative(l, t, d.tree, temperature, top_p, generator)
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
    if generator is not None and generator.device.type != torch.device(dev).type:
        raise ValueError(f"the generator is on {generator.device}, the model on {dev}: sampling needs a generator "
                         f"made on the model's device, torch.Generator(device={str(dev)!r})")
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
        n = d.candidates                                          # the tree; nodes after it are computed only
        nodes, bonus = verifier(logits[0, :n].float(), d.tokens[:n], d)             # (n, V), (n,)
        kept, path = torch.stack([d.tokens[nodes], nodes]).tolist()  # the root and accepted drafts, their nodes
        cache.keep(path)  # slots [0, length): the prompt and every emitted token but the bonus
        out.steps += 1
        before = len(out.tokens)
        done = emit(kept[1:] + [bonus], [d.source[i] for i in path[1:]] + [0])
        out.accepted.append(min(len(nodes) - 1, len(out.tokens) - before))          # drafts emitted (EOS, length)
        if not done:
            drafter.accept(kept, hidden[:, nodes], positions[nodes], logits[0])
        root = bonus
    out.seconds = time.perf_counter() - t0
    return out


# --- the command line ----------------------------------------------------------------------------
# cli.py defines the flags (generate_parser) and checks what was typed (everything that needs no
# model before one loads); main() runs it.

def build_parser():
    return cli.generate_parser(__doc__.split("\n\n")[0].strip())


def main(args):
    kind, arg, settings = cli.check_generate_args(args, build_parser())
    device = cli.pick_device(args.device)
    dtype = cli.pick_dtype(args.dtype, device, args.quantize)
    cli.check_quantize(args.quantize, device)
    prompts = cli.read_prompts(args.prompts) if args.prompts else [(0, args.prompt, "all")]
    show = args.show and sys.stdout.isatty()  # colour codes only on a terminal, never into a file or a pipe
    torch.manual_seed(args.seed)
    model, tokenizer = checkpoint.load(args.model, device, dtype)
    if args.quantize != "none":
        kernels.quantize(model, args.quantize)
    if args.quantize == "fp16" and not kernels.fp16_rows_alone():
        cli.notice("fbgemm's fp16 product on this CPU (no AVX-512) rounds a row differently with other rows "
                   "beside it: greedy speculative output may part from plain greedy output on fp16 weights; "
                   "--quantize none keeps them identical")
    generator = torch.Generator(device=device).manual_seed(args.seed)
    drafter = cli.generate_drafter(args, kind, arg, settings, model, tokenizer, generator)
    encoded = cli.encode_prompts(prompts, tokenizer, args, model.cfg.max_seq_len)
    eos = cli.eos_ids(model, tokenizer)
    writer = cli.open_output(args.out)
    weights = "" if args.quantize == "none" else f", {args.quantize} weights"
    print(f"[{model.cfg.name} on {device}, {str(dtype).removeprefix('torch.')}{weights}, {drafter.name}]", file=sys.stderr)
    if show and drafter.max_depth and sys.stderr.isatty():  # the legend is colours too
        print(cli.legend_line(drafter), file=sys.stderr)
    total = Result()
    try:
        for pid, ids, max_new_tokens in encoded:
            printer = None if args.quiet else cli.Printer(tokenizer, show)
            r = generate(model, ids, max_new_tokens, drafter, args.verify, args.temperature,
                         args.top_p, generator, eos, printer)
            if printer:
                print()
            print(cli.stats_line(r, drafter.max_depth), file=sys.stderr)
            total.tokens, total.accepted = total.tokens + r.tokens, total.accepted + r.accepted
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
        print("[all prompts: " + cli.stats_line(total, drafter.max_depth)[1:], file=sys.stderr)


def cli_main(argv=None) -> int:
    """Bad input: one line on stderr, exit code 2. Ctrl-C: the text so far stays on stdout, exit 130."""
    return cli.run(main, build_parser(), argv, "[interrupted by Ctrl-C; the text above is what was generated so far]")


if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show a character gets '?', not a crash
    sys.exit(cli_main())
