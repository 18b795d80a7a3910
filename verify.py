"""Verification: which drafted tokens the base model keeps, and the one token it adds.

One decoding step runs the base model over every tree node at once. Row i of its logits predicts
the token after node i, so a drafted node is checked against the logits at its parent. Every
verifier returns (nodes, bonus): the accepted node indices along one root-to-node path, starting
with the root 0, and the base model's own next token after the last of them. The step emits
tokens[nodes[1:]] followed by bonus (len(nodes) tokens) and keeps the KV entries of `nodes`.

    logits_to_probs(logits, temperature, top_p) -> probs      the one sampling primitive
    sample(probs, generator) -> token ids
    greedy(logits, tokens, tree)                               lossless at temperature 0
    typical(logits, tokens, tree, temperature, top_p, ...)     Medusa/Hydra's acceptance, lossy
    speculative(logits, tokens, tree, temperature, ...)        lossless sampling on a tree
    leviathan(logits, tokens, draft_probs, temperature, ...)   lossless, a chain of sampled drafts

Test: `python -m pytest -q tests/test_verify.py` (greedy against brute force, typical against its
formula node by node, both sampling rules against the exact two-token joint distribution).
Shapes: N tree nodes (root included), V vocab, G drafts in a chain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tree import Tree

# --- sampling -----------------------------------------------------------------------------------
# Plain decoding, drafting and verification all turn logits into probabilities here.


# Below this temperature sampling is greedy decoding. There softmax(logits / T) is already one-hot
# in float32 (a logit gap of 0.01 becomes 100 nats), and far below it logits / T overflows to inf.
GREEDY_BELOW = 1e-4
VERIFIERS = ("auto", "greedy", "typical", "sample")  # generate()'s verify: auto = greedy or sample


def is_greedy(temperature: float) -> bool:
    """Whether decoding at `temperature` is greedy: the one meaning of "greedy" in the project."""
    return temperature < GREEDY_BELOW


def logits_to_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Softmax over the last dim at `temperature`, restricted to the top-p nucleus; float32.
    temperature 0 (below GREEDY_BELOW) is greedy: a one-hot at the argmax. top-p keeps the smallest
    set of likeliest tokens whose mass reaches top_p (at least the top one), renormalised."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
    if is_greedy(temperature):
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()  # (..., V)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (..., V)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # (..., V)
        mass_above = sorted_probs.cumsum(-1) - sorted_probs  # (..., V) mass ranked above
        sorted_probs = sorted_probs.masked_fill(mass_above >= top_p, 0.0)  # (..., V) nucleus full
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)  # (..., V)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of probs: (V,) -> (), (B, V) -> (B,)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# --- choosing a path ----------------------------------------------------------------------------
# A candidate is one root-to-leaf row of tree.retrieve. A rule says which drafted nodes pass its
# test at their parent; each candidate keeps its prefix of passing nodes, and the rule picks one.


def check_shapes(logits: torch.Tensor, tokens: torch.Tensor, tree: Tree) -> None:
    """A tree rule's inputs: logits (N, V) and tokens (N,), on the tree's device."""
    n = tree.num_nodes
    assert logits.dim() == 2 and logits.shape[0] == n, (
        f"logits must be (N={n}, V), not {tuple(logits.shape)}"
    )
    assert tokens.shape == (n,), f"tokens must be (N={n},), got {tuple(tokens.shape)}"
    assert tree.parent.device == tokens.device, (
        f"tree on {tree.parent.device}, tokens on {tokens.device}: tree.to(device) once"
    )


def _accepted_prefixes(tree: Tree, passes: list[bool]) -> list[list[int]]:
    """Each candidate's nodes from the root down to the first that does not pass, in leaf order.
    The root is always kept: its token was emitted last step."""
    prefixes = []
    for row in tree.retrieve.tolist():  # node indices root..leaf, right-padded with -1
        prefix = [0]
        for node in row[1:]:
            if node < 0 or not passes[node]:
                break
            prefix.append(node)
        prefixes.append(prefix)
    return prefixes


# --- greedy -------------------------------------------------------------------------------------
# A node is accepted iff its token is the argmax at its parent and its parent is accepted. The
# output is token-identical to plain greedy decoding with the base model.


def greedy(logits: torch.Tensor, tokens: torch.Tensor, tree: Tree) -> tuple[torch.Tensor, int]:
    """Longest accepted path (ties: lowest last-node index); bonus = argmax after it.

    With distinct sibling tokens (top-k picks) this is a walk down from the root into the one child
    that agrees; siblings that repeat a token can both agree, so the rule asks for the longest."""
    check_shapes(logits, tokens, tree)
    best = logits.argmax(-1).tolist()  # the base model's token after each node
    token = tokens.tolist()
    parent = tree.parent.tolist()
    passes = [True] + [token[c] == best[parent[c]] for c in range(1, tree.num_nodes)]
    path = max(_accepted_prefixes(tree, passes), key=lambda p: (len(p), -p[-1]))  # then lowest end
    return torch.tensor(path, device=tokens.device), best[path[-1]]


# --- typical acceptance -------------------------------------------------------------------------
# Medusa/Hydra's lossy rule: accept token x at parent distribution p iff
# p(x) > min(eps, alpha * exp(-H(p))), so uncertain (high-entropy) positions accept more.


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
    """Longest accepted path (ties: highest sum of log p, then the first candidate); bonus ~
    logits_to_probs at its end.

    p = softmax(logits / temperature) without top-p; top_p only shapes the bonus. Temperature must
    be >= GREEDY_BELOW: as it goes to 0, p becomes one-hot, the threshold becomes eps and the rule
    becomes greedy, so below it use greedy() instead (logits / 0 is not defined)."""
    if is_greedy(temperature):
        raise ValueError(
            f"typical acceptance needs temperature > 0, at least GREEDY_BELOW = {GREEDY_BELOW}, "
            f"got {temperature}; use greedy below it"
        )
    check_shapes(logits, tokens, tree)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, V)
    entropy = torch.special.entr(logp.exp()).sum(-1)  # (N,) -sum p log p
    threshold = (alpha * torch.exp(-entropy)).clamp(max=eps)  # (N,)
    parent = tree.parent.clamp(min=0)  # (N,) the root's -1 read as 0: the root is never tested
    token_logp = logp[parent, tokens]  # (N,) log p of each node's token at its parent
    passes = (token_logp.exp() > threshold[parent]).tolist()
    score = token_logp.tolist()

    def longest_then_likeliest(prefix):
        return len(prefix), sum(score[node] for node in prefix[1:])

    path = max(_accepted_prefixes(tree, passes), key=longest_then_likeliest)
    bonus = sample(logits_to_probs(logits[path[-1]], temperature, top_p), generator)
    return torch.tensor(path, device=tokens.device), int(bonus)


# --- speculative sampling -----------------------------------------------------------------------
# Lossless sampling on a tree whose children are deterministic top-k picks (SpecInfer's rule):
# the emitted tokens are distributed exactly as if the base model had sampled them one by one.


def speculative(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tree: Tree,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, int]:
    """Walk down from the root; at each node try its children in rank order; bonus ~ final residual.

    With q' the residual at the current node (q' = q = the node's probs on arrival), child c is
    accepted with probability q'(c); on rejection q'(c) is set to 0 and q' renormalised before the
    next child; when no child is accepted the bonus is drawn from q'. Why it is lossless: the first
    child c is emitted with probability q'(c), and any other token t only after c is rejected
    (probability 1 - q'(c)), then from the renormalised residual q'(t) / (1 - q'(c)); the product is
    q'(t) again, so by induction over the children every token is emitted with probability q(t)."""
    check_shapes(logits, tokens, tree)
    probs = logits_to_probs(logits, temperature, top_p)  # (N, V)
    draws = torch.rand(tree.num_nodes - 1, device=probs.device, generator=generator)  # (N-1,)
    u = [0.0] + draws.tolist()  # u[c]: child c's uniform draw; the root is not drafted
    token = tokens.tolist()
    nodes = [0]  # the accepted path
    while True:
        node = nodes[-1]
        rejected = []  # the tokens of the children rejected here: zero in q'
        mass = 1.0  # 1 - q(rejected tokens), so that q'(t) = q(t) / mass
        accepted = None
        for c in tree.children[node]:
            held = 0.0 if token[c] in rejected else float(probs[node, token[c]])  # a repeat: 0
            if u[c] * mass < held:  # u < q'(c)
                accepted = c
                break
            rejected.append(token[c])
            mass -= held
        if accepted is None:
            break
        nodes.append(accepted)
    residual = probs[nodes[-1]].clone()  # (V,) q at the end of the path, the rejected tokens zeroed
    residual[rejected] = 0.0
    bonus = sample(residual / residual.sum(), generator)
    return torch.tensor(nodes, device=tokens.device), int(bonus)


# --- speculative sampling of sampled drafts -----------------------------------------------------
# Leviathan et al. / Chen et al.: a draft model samples a chain x_1..x_G from its own p; the base
# model's q decides. The tree rule above is this rule with p one-hot (a deterministic pick): it
# accepts x with probability q(x) and on rejection draws from q without x, renormalised.


def leviathan(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, int]:
    """Accept x_i with probability min(1, q(x_i) / p(x_i)), stop at the first rejection; bonus ~
    norm(max(0, q - p)) at that position, or ~ q after the last draft if all were accepted.

    logits (G+1, V): row i is the base model after node i; tokens (G+1,): the root, then x_1..x_G;
    draft_probs (G, V): row i-1 is the p that x_i was sampled from. Why it is lossless, at one
    position: x is emitted as the draft with probability p(x) min(1, q(x)/p(x)) = min(p(x), q(x)),
    and after a rejection, which happens with probability 1 - sum_y min(p(y), q(y)) =
    sum_y max(0, q(y) - p(y)) = Z, from the residual with probability max(0, q(x) - p(x)) / Z;
    the sum is min(p, q)(x) + max(0, q - p)(x) = q(x). Each next position is the same argument
    given the accepted prefix, so the emitted tokens follow the base model's own distribution."""
    G = len(tokens) - 1
    assert logits.dim() == 2 and logits.shape[0] == G + 1, (
        f"logits must be (G+1={G + 1}, V), not {tuple(logits.shape)}"
    )
    assert draft_probs.shape == (G, logits.shape[1]), (
        f"draft_probs must be (G={G}, V), not {tuple(draft_probs.shape)}"
    )
    q = logits_to_probs(logits, temperature, top_p)  # (G+1, V)
    u = torch.rand(G, device=q.device, generator=generator)  # (G,) one draw a draft
    n = 0  # drafts accepted
    for i, x in enumerate(tokens[1:].tolist()):
        if u[i] * draft_probs[i, x] >= q[i, x]:  # rejected: u >= q(x) / p(x), p(x) > 0
            break
        n += 1
    residual = q[G] if n == G else (q[n] - draft_probs[n]).clamp(min=0)  # (V,)
    if residual.sum() <= 0:  # q == p up to rounding: the rejection a rounding artefact, draw from q
        residual = q[n]
    bonus = sample(residual / residual.sum(), generator)
    return torch.arange(n + 1, device=tokens.device), int(bonus)
