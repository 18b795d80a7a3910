"""The acceptance rules' fast twins: each returns the same (nodes, bonus) as the readable rule of
the same name in verify.py, from the same draws of the generator, and is tested equal to it
(tests/test_verify.py). The decode engines run these (decode.choose_verifier).

    verify.py: readable                          here: fast twin
    greedy, typical: each candidate's accepted   every candidate's accepted length at once
        prefix in a Python loop, then max()          (cumprod), one argmax, one host transfer
    speculative: the walk reads q at each child  q at every child and the draws in one transfer;
        from the device, then zeroes the tokens      the residual built on the device from the
        it rejected in the residual                  tree's index tensors, without a transfer
    leviathan: a loop over the drafts            the drafts compared at once

Shapes: N tree nodes (root included), V vocab, L tree leaves, D max depth + 1, G drafts in a chain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import verify

if TYPE_CHECKING:
    from tree import Tree


def _accepted_prefixes(ok: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ok (N-1,) per drafted node -> per row of tree.retrieve (L, D): accepted length, last node."""
    ok = torch.cat([ok.new_ones(1), ok])  # (N,) the root always kept
    ok_rows = ok[rows.clamp(min=0)] & (rows >= 0)  # (L, D)
    length = ok_rows.long().cumprod(-1).sum(-1)  # (L,) >= 1: root is ok
    last = rows.gather(1, (length - 1)[:, None]).squeeze(1)  # (L,)
    return length, last


def greedy(logits: torch.Tensor, tokens: torch.Tensor, tree: Tree) -> tuple[torch.Tensor, int]:
    """The twin of verify.greedy, tested equal: the longest path first, then the lowest last node,
    as one argmax over an encoded key."""
    verify.check_shapes(logits, tokens, tree)
    n = tree.num_nodes
    best = logits.argmax(-1)  # (N,)
    ok = tokens[1:] == best[tree.parent[1:]]  # (N-1,)
    length, last = _accepted_prefixes(ok, tree.retrieve)  # (L,), (L,)
    leaf = (length * n - last).argmax()  # () longest first, then lowest end index
    accepted, bonus = torch.stack([length[leaf], best[last[leaf]]]).tolist()  # the one transfer
    return tree.retrieve[leaf, :accepted], bonus  # (accepted,) root..end


def typical(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tree: Tree,
    temperature: float,
    top_p: float,
    eps: float = 0.09,
    alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, int]:
    """The twin of verify.typical, tested equal: every candidate scored on the device. Its sums
    of log p are float32's, the readable rule's Python floats: two candidates whose sums differ by
    less than float32's rounding could be ordered differently (never seen in the tests)."""
    if verify.is_greedy(temperature):
        raise ValueError(
            f"typical acceptance needs temperature > 0, at least GREEDY_BELOW = "
            f"{verify.GREEDY_BELOW}, got {temperature}; use greedy below it"
        )
    verify.check_shapes(logits, tokens, tree)
    n, parent, rows = tree.num_nodes, tree.parent[1:], tree.retrieve  # N, (N-1,), (L, D)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, V)
    entropy = torch.special.entr(logp.exp()).sum(-1)  # (N,) -sum p log p
    threshold = (alpha * torch.exp(-entropy)).clamp(max=eps)  # (N,)
    token_logp = torch.zeros(n, device=tokens.device)  # (N,) log p at the parent
    token_logp[1:] = logp[parent, tokens[1:]]
    ok = token_logp[1:].exp() > threshold[parent]  # (N-1,)
    length, last = _accepted_prefixes(ok, rows)  # (L,), (L,)
    kept = torch.arange(rows.shape[1], device=rows.device) < length[:, None]  # (L, D)
    total = torch.where(kept, token_logp[rows.clamp(min=0)], 0.0).sum(-1)  # (L,)
    total = total.masked_fill(length < length.max(), -torch.inf)  # only the longest compete
    leaf = total.argmax()  # () the first of the likeliest
    bonus = verify.sample(verify.logits_to_probs(logits[last[leaf]], temperature, top_p), generator)
    accepted, bonus = torch.stack([length[leaf], bonus]).tolist()  # the one transfer
    return rows[leaf, :accepted], bonus  # (accepted,) root..end


def speculative(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tree: Tree,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, int]:
    """The twin of verify.speculative, tested equal: the same walk on numbers fetched in one
    transfer, token ids carried as floats in it (exact below 2**24)."""
    verify.check_shapes(logits, tokens, tree)
    probs = verify.logits_to_probs(logits, temperature, top_p)  # (N, V) one batched call
    n, parent = tree.num_nodes, tree.parent[1:]  # (N-1,)
    u = torch.rand(n - 1, device=probs.device, generator=generator)  # (N-1,) a draw for each child
    # the walk needs only q(child's token) at its parent, and the draws: one transfer
    walk = torch.stack([tokens[1:].float(), probs[parent, tokens[1:]], u])  # (3, N-1)
    token, q, u = walk.tolist() if n > 1 else ([], [], [])
    nodes, rejected = [0], []  # path; tokens zeroed at its end
    while True:
        accepted, mass = None, 1.0  # mass: what q' still holds
        for c in tree.children[nodes[-1]]:
            t = token[c - 1]
            held = 0.0 if t in rejected else q[c - 1]  # a duplicate sibling was zeroed
            if u[c - 1] * mass < held:  # u < q'(c) = held / mass
                accepted = c
                break
            rejected.append(t)
            mass -= held
        if accepted is None:
            break
        nodes.append(accepted)
        rejected = []
    end = nodes[-1]
    residual = without_tried(probs[end], tokens, tree, end, len(rejected))  # (V,) q' at the end
    bonus = int(verify.sample(residual / residual.sum(), generator))
    return path_to(tree, end, len(nodes)), bonus


def without_tried(
    q: torch.Tensor, tokens: torch.Tensor, tree: Tree, node: int, tried: int
) -> torch.Tensor:
    """q (V,) at `node` with the tokens of its first `tried` children (in rank order: the ones the
    walk rejected) zeroed: the residual the bonus is drawn from, unnormalised. On the device, with
    no transfer: the tree's index tensors say which children those are."""
    parent, rank = tree.parent[1:], tree.rank[1:]  # (N-1,) each
    siblings_before = ((parent[:, None] == parent) & (rank < rank[:, None])).sum(-1)  # (N-1,)
    drop = ((parent == node) & (siblings_before < tried)).float()  # (N-1,) 1: tried
    dropped = torch.zeros_like(q).scatter_reduce(0, tokens[1:], drop, "amax")  # (V,)
    return q * (1 - dropped)


def path_to(tree: Tree, node: int, length: int) -> torch.Tensor:
    """The node indices from the root down to `node` (at depth length - 1), from a leaf's row."""
    rows = tree.retrieve  # (L, D)
    return rows[(rows[:, length - 1] == node).int().argmax(), :length]


def leviathan(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, int]:
    """The twin of verify.leviathan, tested equal: every draft's test at once, one transfer."""
    G = len(tokens) - 1
    assert logits.dim() == 2 and logits.shape[0] == G + 1, (
        f"logits must be (G+1={G + 1}, V), not {tuple(logits.shape)}"
    )
    assert draft_probs.shape == (G, logits.shape[1]), (
        f"draft_probs must be (G={G}, V), not {tuple(draft_probs.shape)}"
    )
    q = verify.logits_to_probs(logits, temperature, top_p)  # (G+1, V)
    x = tokens[1:, None]  # (G, 1)
    qx, px = q[:-1].gather(1, x).squeeze(1), draft_probs.gather(1, x).squeeze(1)  # (G,), (G,)
    u = torch.rand(G, device=q.device, generator=generator)  # (G,) one draw a draft
    ok = u * px < qx  # (G,) u < q/p; px > 0, x was sampled from p
    n = int(ok.long().cumprod(0).sum())  # drafts accepted
    residual = q[G] if n == G else (q[n] - draft_probs[n]).clamp(min=0)  # (V,)
    if residual.sum() <= 0:  # q == p up to rounding: the rejection a rounding artefact, draw from q
        residual = q[n]
    bonus = verify.sample(residual / residual.sum(), generator)
    return torch.arange(n + 1, device=tokens.device), int(bonus)
