"""Speculative decoding with draft heads, for one sequence, as a ladder: prefill -> step ->
generate. Read it after tree.py, verify.py, model.py and heads.py: this file puts them together.

    prefill(model, cache, prompt)       one forward over the prompt, its KV entries kept
    fill_tree(heads, h, root, tree)     the heads guess a token for every node, depth by depth
    step(model, cache, heads, ...)      draft a tree -> one forward over it -> verify -> keep
    generate(model, prompt, n, heads, tree)        prefill, then step until EOS or n tokens

Plain decoding is the same loop with a tree that is its root alone. The contract: greedy
speculative output is token-identical to plain greedy decoding; sampled output follows the base
model's own distribution (tests/test_generate.py).

Below the lesson, the command line (its flags, checks and modes):

    python generate.py --prompt "Write a haiku about the sea."            # shipped heads, greedy
    python generate.py --prompt "..." --heads none                        # plain decoding
    python generate.py --prompt "..." --temperature 0.7 --verify sample --seed 1
    python generate.py --prompt "Summarise: ..." --draft heads+lookup --show
    python generate.py --prompts eval/prompts.jsonl --batch-size 4 --out replies.jsonl
    python generate.py --chat                          # talk; the KV cache is kept between turns

What you read is what runs: one prompt, with heads or without, goes through generate() below.
A batch, a chat and the other drafters run the package's twin of this ladder
(specdec/engines/decode.py: many rows in one forward, drafters that bring computed-only nodes, a
cache kept between turns), tested token-identical to it.
Shapes: N tree nodes, T prompt tokens, D hidden, V vocabulary.
"""

import specdec.ctrl_c  # noqa: F401 (first: a Ctrl-C while torch imports is one line, exit 130)
import sys
from dataclasses import dataclass

import torch

import tree as tree_lib
import verify as verify_lib

# --- prefill --------------------------------------------------------------------------------------


def prefill(model, cache, prompt):
    """Forward the prompt (a list of ids) into an empty cache and keep every entry. -> the logits
    after its last token (V,) and its final hidden states (1, T, D)."""
    tokens = torch.tensor([prompt], device=model.device)  # (1, T)
    logits, hidden = model(tokens, torch.arange(len(prompt), device=model.device), None, cache)
    cache.keep(range(len(prompt)))
    return logits[0, -1], hidden  # (V,), (1, T, D)


# --- drafting with heads --------------------------------------------------------------------------
# Node (depth d, rank r) gets the r-th likeliest token of head d after its parent. A Hydra head
# reads the tokens on the path above the node, so the tree is filled depth by depth.


def fill_tree(heads, h, root, tree):
    """h (1, D) the heads' draft state, root the last emitted token -> tokens (N,) of the tree's
    nodes, node 0 the root. One call of head d drafts for every parent at depth d - 1."""
    tokens = torch.full((tree.num_nodes,), root, device=tree.parent.device)  # (N,)
    for d, nodes in enumerate(tree.by_depth, start=1):
        parents, under = tree.parent[nodes].unique(return_inverse=True)  # (P,), each node's parent
        P = len(parents)
        paths = tokens.expand(P, -1)[tree.mask[parents]].view(P, d)  # (P, d) root..each parent
        z = heads.head(d, h, paths)  # (P, D); Medusa's head reads h alone: (1, D)
        k = int(tree.rank[nodes].max()) + 1  # the deepest rank asked for under any parent
        top = heads.full_ids(heads.project(z, d).topk(k).indices)  # (P | 1, k) likeliest first
        tokens[nodes] = top.expand(P, -1)[under, tree.rank[nodes]]
    return tokens


# --- one speculative step -------------------------------------------------------------------------


@dataclass
class Sequence:
    """What a sequence carries from one step to the next."""

    root: int  # the last emitted token: not in the cache yet, the root of the next tree
    h: torch.Tensor | None = None  # (1, D) the heads' draft state after the accepted tokens
    head_cache: object = None  # Hydra++'s PrefixMLP cache (heads.new_cache), else None


def step(model, cache, heads, tree, verifier, seq):
    """One step: the heads draft the tree after seq.root, one forward of the base model checks
    every node, the verifier keeps the longest agreed path and adds the model's own next token.
    -> the tokens emitted (the accepted drafts, then that bonus token)."""
    tokens = fill_tree(heads, seq.h, seq.root, tree)  # (N,) the root alone without heads
    # node i sits at position length + depth[i] and sees its ancestors (the tree mask) and the cache
    positions = cache.length + tree.depth  # (N,)
    logits, hidden = model(tokens[None], positions, tree.mask, cache)  # (1, N, V), (1, N, D)
    # row i of the logits predicts the token after node i: the verifier checks children at parents
    nodes, bonus = verifier(logits[0].float(), tokens, tree)  # (n,) root..last accepted
    cache.keep(nodes.tolist())  # their KV entries follow the prefix; the rest is garbage
    if heads is not None:  # the next draft state, from the hidden states at the accepted nodes
        seq.h = heads.context(hidden[:, nodes], positions[nodes], seq.head_cache)[:, -1]  # (1, D)
    seq.root = bonus
    return tokens[nodes[1:]].tolist() + [bonus]


# --- generate -------------------------------------------------------------------------------------


def choose_verifier(temperature, top_p, generator, verify="auto"):
    """verify.py's rule for these settings, as verifier(logits, tokens, tree) -> (nodes, bonus)."""
    if verify not in verify_lib.VERIFIERS:
        raise ValueError(f"verify={verify!r}: use one of {', '.join(verify_lib.VERIFIERS)}")
    if verify_lib.is_greedy(temperature):  # at temperature 0 every rule is greedy's
        return verify_lib.greedy
    if verify == "greedy":
        raise ValueError(f"verify='greedy' needs temperature 0, got {temperature}")
    if verify == "typical":  # lossy: Medusa's typical acceptance
        return lambda l, t, tree: verify_lib.typical(
            l, t, tree, temperature, top_p, generator=generator
        )
    return lambda l, t, tree: verify_lib.speculative(l, t, tree, temperature, top_p, generator)


@torch.inference_mode()
def generate(
    model,
    prompt,
    max_new_tokens,
    heads=None,
    tree=None,
    temperature=0.0,
    top_p=1.0,
    generator=None,
    verify="auto",
    eos_ids=(),
    on_tokens=None,
):
    """Up to max_new_tokens ids after `prompt` (a list of ids), ending at the first of eos_ids
    (kept), drafted by `heads` on `tree` (tree.py's; None: a chain as deep as the heads; heads None:
    plain decoding). on_tokens(ids) is called with the ids each step emits, as they come. -> (the
    new ids, the base model's forward passes, the prefill included)."""
    if heads is None:
        tree = tree_lib.build([])  # the root alone
    elif tree is None:
        tree = tree_lib.build(tree_lib.chain(heads.cfg.num_heads))
    tree = tree.to(model.device)
    cache = model.new_cache(len(prompt) + max_new_tokens + tree.num_nodes)  # room for a last tree
    logits, hidden = prefill(model, cache, prompt)  # (V,), (1, T, D)
    probs = verify_lib.logits_to_probs(logits.float(), temperature, top_p)  # (V,)
    seq = Sequence(root=int(verify_lib.sample(probs, generator)))
    if heads is not None:
        seq.head_cache = heads.new_cache(cache.max_len)
        positions = torch.arange(len(prompt), device=model.device)  # (T,)
        seq.h = heads.context(hidden, positions, seq.head_cache)[:, -1]  # (1, D)
    verifier = choose_verifier(temperature, top_p, generator, verify)
    new, forwards, emitted = [], 1, [seq.root]  # the prefill emits the first token
    while True:
        emitted = emitted[: max_new_tokens - len(new)]  # the limit can cut a step short
        ends = [i + 1 for i, t in enumerate(emitted) if t in eos_ids]
        emitted = emitted[: ends[0]] if ends else emitted  # EOS is kept, what follows it is not
        new += emitted
        if on_tokens:
            on_tokens(emitted)
        if ends or len(new) == max_new_tokens:
            return new, forwards
        emitted = step(model, cache, heads, tree, verifier, seq)
        forwards += 1


# --- command line ---------------------------------------------------------------------------------
# `python generate.py --help` lists the flags. One prompt with heads or plain decoding runs
# generate() above, with the base model's fast forward (kernels.c) as `model`: a print in step()
# shows. The flags' checks and the modes (a file of prompts, a batch, a chat, the other drafters,
# online learning, quantisation, CUDA graphs) are specdec/commands/generate.py's.


def cli_main(argv=None) -> int:
    """Bad input: one line on stderr, exit code 2. Ctrl-C: the text so far stays, exit 130."""
    from specdec.commands import generate as command

    return command.cli_main(argv, lesson=generate)


if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show a character gets '?'
    specdec.ctrl_c.exit_now(cli_main())  # no Python shutdown, where a Ctrl-C would end it mute
