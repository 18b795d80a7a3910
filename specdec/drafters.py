"""Drafters: whoever fills the tree, the engines' step (decode.py) verifies it alike.

A drafter proposes candidate tokens after the last emitted one (the root) as a tree (a chain is a
tree with one path); verification does not care who drafted. Every drafter is a `Drafter` (the
protocol below, the one the loop and the engines rely on):

    HeadsDrafter(heads, tree)                      Medusa / Hydra heads fill a fixed tree, depth by
                                                   depth (generate.py's fill_tree, for many rows)
    HeadsByBatch(heads, trees)                     ... a tree by the number of rows decoding
    HeadsShared(heads, tree, budgets, depths)      ... one budget of nodes a step for all the rows,
                                                   given to the nodes the heads are surest of
    Plain(device)                                  drafts nothing: plain decoding, the root alone
    Lookup(gamma, ngram, matches, device)          prompt lookup: copy what followed the last n
                                                   tokens earlier in the text
    ModelDrafter(model, gamma, temperature, ...)   a smaller model (or the base, layers skipped)
                                                   drafts a chain
    HeadsPlusLookup(heads, lookup, device)         both trees in one (catalog.heads_and_lookup)
    Jacobi(gamma, device)                          the model's own outputs of last step, as guesses
    Lookahead(window, ngram, guesses, device)      n-grams from a window of Jacobi trajectories
    PaSS(model, embeddings, gamma, guesses)        learned [LA] tokens: the model drafts for itself
    specdec.eagle3.Eagle3Drafter(module, tree)     EAGLE-3: a decoder layer over fused features
                                                   (ReadsFeatures, below), in its own file

A new drafter is one class that implements Drafter (here, or in your own file) and one line,
catalog.register("name", build, defaults): README, "Adding a drafter".
Test: `python -m pytest -q tests/test_drafters.py`. Shapes: N tree nodes (root included), G drafted
tokens of a chain, V vocabulary, D hidden, T new tokens, P parents at one depth, M window nodes.
"""

import copy
import itertools
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

import model as model_lib
import tree as tree_lib
import verify as verify_lib
from specdec import rows as rows_lib
from specdec.cli import plural

# --- the draft: a tree and its tokens -----------------------------------------------------------
# Trees here change from step to step (a lookup finds a match or not, of some length), but only
# among a few shapes: each is built and moved to the device once, and looked up by its paths.
# A drafter fills {path: (token, source)}; paths are tree.py's, ranks in insertion order.


@dataclass
class Draft:
    tokens: torch.Tensor  # (N,) on the device: node 0 the root, the drafts, any computed-only nodes
    tree: tree_lib.Tree  # the candidates, nodes [0, tree.num_nodes), its tensors on the device
    mask: torch.Tensor | None  # (N, N) on the device: tree.mask, computed-only rows; None: N = 1
    depth: torch.Tensor  # (N,) on the device: node i sits at position prefix + depth[i]
    source: list  # (n,) who drafted each candidate: an index into the legend, 0 = the root
    probs: torch.Tensor | None = None  # (N-1, V) sampled drafts: the p each was drawn from
    extra: torch.Tensor | None = None  # (K, D) embeddings of token ids past the vocabulary (PaSS)

    @property
    def candidates(self) -> int:
        """Nodes [0, candidates) are the tree the verifiers walk and KVCache.keep may keep. Any node
        after them is computed only: it rides in the same forward under the same mask, no verifier
        reads it, its KV entries are never kept, and the drafter reads its logits in accept()."""
        return self.tree.num_nodes


@dataclass
class Accepted:
    """What a step kept of one row's Draft and what the base model computed there: the drafter's
    accept() reads it, as does whoever learns from the step (online.py, the data stage)."""

    ids: list  # the root and the accepted drafts: their ids, now in the cache
    hidden: torch.Tensor | None = None  # (1, n, D) the base model's final hidden states at them
    positions: torch.Tensor | None = None  # (n,) their positions in the sequence
    logits: torch.Tensor | None = None  # (N, V) its logits at every node of the draft, kept or not
    nodes: list = None  # (n,) the kept tokens' nodes in the draft, the root (0) first
    bonus: int = 0  # the base model's own token after them: emitted, not in the cache yet
    sources: list = None  # who drafted each emitted token (the kept drafts, then the bonus: 0)
    features: torch.Tensor | None = None  # (1, n, F*D) a ReadsFeatures drafter's layer inputs

    @property
    def tokens(self) -> list:
        """What the step emits: the accepted drafts, then the bonus."""
        return self.ids[1:] + [self.bonus]


@runtime_checkable
class Drafter(Protocol):
    """What decode.step and the engines ask of a drafter, and all they ask."""

    name: str  # what drafts, for the banner: "heads: hydra++, tree: 6 nodes"
    legend: list  # who drafted a token, by index: 0 the base model (--show colours by it)
    max_nodes: int  # the most nodes a draft holds (computed-only ones included): sizes the cache
    max_depth: int  # the deepest node: acceptance is counted by depth up to it

    def row(self, generator=None) -> "Drafter":
        """A drafter for one more sequence of a batch: the same weights and settings, its own state
        (start() makes it) and generator (for sampled drafts)."""

    def start(self, prompt: list, hidden: torch.Tensor, max_len: int, cached: int = 0) -> None:
        """A new sequence: the prompt ids, the base model's hidden states over them (1, T, D) (a
        ReadsFeatures drafter: its layers' inputs, (1, T, F*D)), room for max_len positions;
        cached > 0: the last sequence goes on (a conversation's next turn), its state for
        prompt[:cached] kept, `hidden` the rest's."""

    def draft(self, rows: list, roots: list) -> list:
        """The Draft of each row (this drafter's row()s, or [itself] alone), rooted at its last
        token: one call a step for every row (the heads run once for all)."""

    def accept(self, accepted: Accepted) -> None:
        """What the step kept of this row's draft, and what the base model computed there."""


@runtime_checkable
class ReadsFeatures(Protocol):
    """A drafter that reads the base model's inner layers, not only its final hidden states
    (EAGLE-3): `features` names them (layer indices, ascending; layer l's input is read). The loop
    then runs the forward with rows.Model's `features` and hands their inputs, side by side
    (F*D wide), to start() in place of the final hidden states and to accept() in
    Accepted.features. A drafter without it costs the forward nothing."""

    features: tuple


def features_of(drafter) -> tuple:
    """The layers whose inputs `drafter` reads (ReadsFeatures), () for every other drafter."""
    return tuple(drafter.features) if isinstance(drafter, ReadsFeatures) else ()


@dataclass(frozen=True)
class Window:
    """Computed-only nodes that follow every tree of a drafter: what each sees among the root
    (column 0) and the window's own nodes (columns 1..M), and its position past the root."""

    sees: torch.Tensor  # (M, 1+M) bool
    depth: torch.Tensor  # (M,) long

    def after(self, t: tree_lib.Tree):
        """The mask and depths of tree t followed by the window. The tree never sees the window; the
        window sees the root and nothing else of the tree."""
        n, m = t.num_nodes, len(self.depth)
        mask = torch.zeros(n + m, n + m, dtype=torch.bool)  # (N, N)
        mask[:n, :n], mask[n:, 0], mask[n:, n:] = t.mask, self.sees[:, 0], self.sees[:, 1:]
        return mask, torch.cat([t.depth, self.depth])  # (N, N), (N,)


class Shapes:
    """tree.build(paths) on the device, with its mask and depths; a Window's nodes follow each."""

    def __init__(self, device, window: Window | None = None):
        self.device = device
        self.window = window
        self.built = {}

    def __call__(self, paths):
        key = frozenset(paths)
        if key not in self.built:
            t = tree_lib.build(list(paths))
            mask, depth = self.window.after(t) if self.window else (t.mask, t.depth)  # (N, N), (N,)
            mask = mask.to(self.device) if len(mask) > 1 else None  # the root alone: causal
            self.built[key] = (t.to(self.device), mask, depth.to(self.device))
        return self.built[key]

    def draft(self, root: int, nodes: dict, computed=()) -> Draft:
        """nodes {path: (token, source)} -> the Draft: the tree's tokens in order, then computed."""
        tree, mask, depth = self(nodes)
        tokens = [root] + [nodes[p][0] for p in tree.paths] + list(computed)
        source = [0] + [nodes[p][1] for p in tree.paths]
        return Draft(torch.tensor(tokens, device=self.device), tree, mask, depth, source)


def graft(nodes: dict, branch: dict, offset: int = 0) -> dict:
    """Add the nodes of `branch` ({path: (token, source)}, prefix-closed) to `nodes`, in place. A
    branch node whose parent already has a child holding its token is that child (a shared prefix
    is verified once); the others become new children, ranked after those already there, so the
    verifiers try the first drafter's candidates first. Sources are shifted by `offset`."""
    child = {(p[:-1], t): p for p, (t, _) in nodes.items()}  # (parent path, token) -> path
    free = Counter()  # parent path -> its next free rank
    for p in nodes:  # (a tree file may skip ranks)
        free[p[:-1]] = max(free[p[:-1]], p[-1] + 1)
    where = {(): ()}  # branch path -> path in nodes
    for p in sorted(branch, key=lambda p: (len(p), p)):  # parents first
        token, source = branch[p]
        parent = where[p[:-1]]
        if (parent, token) not in child:
            new = parent + (free[parent],)
            free[parent] += 1
            child[parent, token], nodes[new] = new, (token, source + offset)
        where[p] = child[parent, token]
    return nodes


def chains(tokens: list, source: int) -> dict:
    """Chains of token ids under the root, grafted into one tree as {path: (token, source)}."""
    nodes = {}
    for chain in tokens:
        graft(nodes, {(0,) * d: (t, source) for d, t in enumerate(chain, start=1)})
    return nodes


def draft_nodes(d: Draft) -> dict:
    """A Draft's nodes below the root, as {path: (token, source)}: what Shapes.draft takes."""
    return {p: (t, s) for p, t, s in zip(d.tree.paths, d.tokens[1:].tolist(), d.source[1:])}


# --- draft heads ---------------------------------------------------------------------------------
# Fill the tree with tokens: node (d, r) gets the r-th best token of head d. Hydra heads depend on
# the tokens above them, so the tree is filled depth by depth, one batched head call per depth.


@dataclass
class DepthPlan:  # what drafting needs at one depth d, computed once per tree
    nodes: torch.Tensor  # (n,) node indices at depth d
    rank: torch.Tensor  # (n,) rank of each node's token in its head's top-k
    row: torch.Tensor  # (n,) which parent row each node hangs under
    paths: torch.Tensor  # (P, d) node indices root..parent for each distinct parent
    k: int  # top-k needed at this depth


def draft_plan(tree):
    """The plan of every depth, its index tensors made once, on the tree's device (tree.to)."""
    plan = []
    for d, nodes in enumerate(tree.by_depth, start=1):
        parents, row = torch.unique(tree.parent[nodes], return_inverse=True)
        paths = tree.mask[parents].nonzero()[:, 1].view(len(parents), d)
        plan.append(DepthPlan(nodes, tree.rank[nodes], row, paths, int(tree.rank[nodes].max()) + 1))
    return plan


def fill_trees(heads, h, roots, plan, num_nodes):
    """generate.fill_tree's twin for B rows at once: h (B, D) the draft states of B rows, roots (B,)
    their last emitted tokens -> tokens (B, N) for every node of each row's tree; each depth's head
    runs once for every row's parents."""
    B = len(roots)
    tokens = roots[:, None].repeat(1, num_nodes)  # (B, N)
    for d, at in enumerate(plan, start=1):
        P = len(at.paths)
        # (B*P, D), or (B, D) for Medusa: row b's parents are rows [b*P, (b+1)*P) of the paths
        z = heads.head(d, h, tokens[:, at.paths].flatten(0, 1))
        top = heads.project(z, d).topk(at.k, dim=-1).indices  # (B*P | B, k)
        # Medusa's heads read h alone, so a row's guesses are the same under each of its P parents
        top = heads.full_ids(top).view(B, -1, at.k).expand(-1, P, -1)  # (B, P, k) base ids
        tokens[:, at.nodes] = top[:, at.row, at.rank]
    return tokens


class HeadsDrafter:
    """Heads as a drafter: one fixed tree, filled from the draft state h = heads.context over the
    base model's hidden states of the accepted tokens."""

    def __init__(self, heads, tree):
        assert tree.max_depth <= heads.cfg.num_heads, "tree deeper than the heads"
        self.heads = heads
        self.tree = tree.to(heads.lm_head.weight.device)  # index tensors there once
        self.plan = draft_plan(self.tree)
        self.depth = self.tree.depth
        self.mask = self.tree.mask if tree.num_nodes > 1 else None
        self.source = tree.depth.tolist()  # node i: head depth[i]'s guess, 0 the base model's
        self.name = f"heads: {heads.cfg.kind}, tree: {plural(tree.num_nodes, 'node')}"
        self.legend = ["base model"] + [f"head {d}" for d in range(1, tree.max_depth + 1)]
        self.max_nodes = tree.num_nodes
        self.max_depth = tree.max_depth

    def row(self, generator=None):  # start() makes the state (h, Hydra++'s prefix cache)
        return copy.copy(self)

    def start(self, prompt, hidden, max_len, cached=0):
        if not cached:
            self.cache = self.heads.new_cache(max_len)  # Hydra++'s PrefixMLP keeps one, else None
        elif self.cache is not None:  # it holds the whole last sequence (accept() every step)
            self.cache.length = cached
        positions = torch.arange(cached, len(prompt), device=hidden.device)
        self.h = self.heads.context(hidden, positions, self.cache)[:, -1]  # (1, D)

    def draft(self, rows, roots):
        if not rows:
            return []
        h = torch.cat([r.h for r in rows])  # (B, D)
        roots = torch.tensor(roots, device=h.device)  # (B,)
        tokens = fill_trees(self.heads, h, roots, self.plan, self.tree.num_nodes)  # (B, N)
        return [Draft(t, self.tree, self.mask, self.depth, self.source) for t in tokens]

    def accept(self, accepted):
        h = self.heads.context(accepted.hidden, accepted.positions, self.cache)  # (1, n, D)
        self.h = h[:, -1]  # (1, D)


class HeadsByBatch(HeadsDrafter):
    """Heads whose tree follows the batch: trees {B: tree.Tree} by the number of live rows, each
    used from its B up to the next (bench.py --tune-tree chooses them: at each batch size the
    nested sub-tree of the tuned tree that is expected to accept the most tokens a second, down to
    the root alone, plain decoding). Whatever the tree, accept() moves the draft state on over
    every token kept (Hydra++'s prefix layer too), so a row drafts again as soon as a smaller batch
    lets it. Each row drafts the same tree; greedy rows stay token-identical to plain decoding."""

    def __init__(self, heads, trees: dict):
        assert 1 in trees, f"trees by batch size need one for batch 1, got {sorted(trees)}"
        self.by_batch = {B: HeadsDrafter(heads, t) for B, t in sorted(trees.items())}
        super().__init__(heads, trees[1])  # row(), start() and accept() as HeadsDrafter's
        self.max_nodes = max(t.num_nodes for t in trees.values())
        self.max_depth = max(t.max_depth for t in trees.values())
        self.legend = ["base model"] + [f"head {d}" for d in range(1, self.max_depth + 1)]
        sizes = [f"{B}: {plural(d.max_nodes, 'node')}" for B, d in self.by_batch.items()]
        self.name = f"heads: {heads.cfg.kind}, tree by batch size ({', '.join(sizes)})"

    def tree_for(self, rows: int) -> HeadsDrafter:
        """The heads' drafter of the tree used at `rows` live rows."""
        return self.by_batch[max(B for B in self.by_batch if B <= max(rows, 1))]

    def draft(self, rows, roots):
        return self.tree_for(len(rows)).draft(rows, roots)


# --- one budget shared by the batch --------------------------------------------------------------
# B rows of one tree are B times its nodes: past a few tokens a step is no longer free, and most of
# those nodes are guesses the heads themselves doubt. So the batch gets one budget of E nodes past
# the roots, and they go to the nodes whose paths the heads are most confident of, in any row: the
# product of the heads' probabilities along the path (a child is never more likely than its
# parent, so the E best nodes always form trees). A row whose heads are sure drafts a deep chain,
# an unsure one its root alone (Tetris; adaptive verification in DSpark).


def fill_scored(heads, h, roots, plan, num_nodes):
    """fill_trees, and how sure the heads are of each node: tokens (B, N) as fill_trees's, and
    log-confidence (B, N) fp32, the sum of the log-probabilities the heads gave the tokens on the
    node's path (the root's 0)."""
    B = len(roots)
    tokens = roots[:, None].repeat(1, num_nodes)  # (B, N)
    confidence = torch.zeros(B, num_nodes, device=h.device)  # (B, N) log-probabilities
    for d, at in enumerate(plan, start=1):
        P = len(at.paths)
        z = heads.head(d, h, tokens[:, at.paths].flatten(0, 1))  # (B*P | B, D)
        logits = heads.project(z, d)  # (B*P | B, V')
        top = logits.topk(at.k, dim=-1).indices  # (B*P | B, k): fill_trees's picks
        logits = logits.float()
        logp = logits.gather(-1, top) - logits.logsumexp(-1, keepdim=True)  # (B*P | B, k)
        top = heads.full_ids(top).view(B, -1, at.k).expand(-1, P, -1)  # (B, P, k) base ids
        logp = logp.view(B, -1, at.k).expand(-1, P, -1)  # (B, P, k)
        tokens[:, at.nodes] = top[:, at.row, at.rank]
        parents = at.paths[at.row, -1]  # (n,) each node's parent
        confidence[:, at.nodes] = confidence[:, parents] + logp[:, at.row, at.rank]
    return tokens, confidence


class RowView(model_lib.KVCache):
    """Slot `slot` of a page's rows.RowsCache as a model.KVCache of its own: a row's one-sequence
    calls (heads.context at its start) read and write it in place."""

    def __init__(self, page, slot):
        self.page, self.slot = page, slot
        self.k = page.cache.k[:, slot : slot + 1]  # (1, 1, Hkv, S, Dh): views
        self.v = page.cache.v[:, slot : slot + 1]
        self.length = 0
        self.max_len = page.cache.max_len


@dataclass
class Page:
    cache: rows_lib.RowsCache  # (1 layer, size rows, ...)
    owners: list  # per slot: a weak reference to the row drafting there, or None (free)

    def live(self):
        return [(s, o()) for s, o in enumerate(self.owners) if o is not None and o() is not None]

    def fits(self, members):
        """Whether one forward over the members' new tokens stays within the page's slots."""
        start = max(row.cache.length for _, row in self.live())
        return start + max(hidden.shape[1] for _, hidden, _ in members) <= self.cache.max_len

    def forward(self, prefix, members):
        """Hydra++'s prefix layer (heads.PrefixMLP) over each member's (row, new hidden states
        (1, n, D), their positions (n,)), in one call for the page's slots from the first member's
        to the last's (a batch of 4 rows costs 4 slots, not the page's): their entries kept in
        their slots, as PrefixMLP.forward keeps a row's -> each member's last output (D,)."""
        lo = min(r.cache.slot for r, _, _ in members)
        hi = max(r.cache.slot for r, _, _ in members) + 1
        cache = self.cache.view(lo, hi)
        cache.lengths = [0] * (hi - lo)
        for s, row in self.live():  # every live row's length: the new tokens go past them all
            if lo <= s < hi:
                cache.lengths[s - lo] = row.cache.length
        T = max(hidden.shape[1] for _, hidden, _ in members)
        x = members[0][1].new_zeros(hi - lo, T, members[0][1].shape[-1])  # (slots, T, D)
        positions = torch.zeros(hi - lo, T, dtype=torch.long, device=x.device)  # (slots, T)
        new = [0] * (hi - lo)
        for r, hidden, at in members:
            s = r.cache.slot - lo
            n = hidden.shape[1]
            x[s, :n], positions[s, :n], new[s] = hidden[0], at, n
        start = cache.length
        cos, sin = prefix.rope(positions, x.dtype)  # (slots, 1, T, Dh)
        mask = rows_lib.attention_mask(T, start, None, cache.key_mask(T), x.device)
        y = prefix.norm(prefix.block(x, cos, sin, mask, (cache.k[0], cache.v[0], start)))
        cache.keep(*[range(n) for n in new])
        for r, _, _ in members:
            r.cache.length = cache.lengths[r.cache.slot - lo]
        return [y[r.cache.slot - lo, new[r.cache.slot - lo] - 1] for r, _, _ in members]


class Pages:
    """Hydra++'s prefix-layer caches of a batch's rows side by side, `size` rows a page (one
    rows.RowsCache), so that one call catches up the rows of a page. A row takes a free slot at its
    start; the slot is free again once the row is gone (a weak reference) or starts anew."""

    def __init__(self, heads, size=16):
        self.heads, self.size = heads, size
        self.pages = []

    def take(self, row, max_len) -> RowView:
        for page in self.pages:  # the row's old slot first: it starts anew
            page.owners = [None if o is not None and o() is row else o for o in page.owners]
        for page in self.pages:
            if page.cache.max_len >= max_len:
                for s, owner in enumerate(page.owners):
                    if owner is None or owner() is None:
                        page.owners[s] = weakref.ref(row)
                        return RowView(page, s)
        w = self.heads.prefix.norm.weight
        cache = rows_lib.RowsCache(self.heads.prefix.cfg, self.size, max_len, w.device, w.dtype)
        self.pages.append(Page(cache, [weakref.ref(row)] + [None] * (self.size - 1)))
        return RowView(self.pages[-1], 0)

    def grouped(self, waiting):
        """[(page, its rows' entries among `waiting`)]: entries (row, ...) by the row's page."""
        by = {}
        for entry in waiting:
            page = entry[0].cache.page
            by.setdefault(id(page), (page, []))[1].append(entry)
        return list(by.values())


class HeadsShared(HeadsDrafter):
    """Heads whose batch shares one budget: budgets {B: E}, E nodes past the roots for a step of B
    live rows (from its B up to the next; bench.py --tune-tree chooses them), given to the nodes of
    `tree` (every row's candidates; depths {B: d}: its nodes down to depth d alone, fewer heads to
    run) the heads are most confident of, whichever rows they are in. At E = 0 nothing is drafted:
    the step is plain decoding. The draft state still follows every kept token: accept() queues
    what the step kept and the next draft catches up on all of it in one call, so a row drafts as
    it would have when the budget comes back. Lossless whatever the split: each row's draft is a
    tree the verifiers check like any other. origin: where the budgets come from, for the banner
    (the file bench.py tuned, or catalog's rule where none was)."""

    def __init__(self, heads, tree, budgets: dict, depths: dict | None = None, origin=None):
        assert 1 in budgets, f"budgets by batch size need one for batch 1, got {sorted(budgets)}"
        super().__init__(heads, tree)
        self.budgets = dict(sorted(budgets.items()))
        self.depths = {B: (depths or {}).get(B, tree.max_depth) for B in self.budgets}
        # nodes are in order of depth: the tree's first upto[d] nodes are those down to depth d
        self.upto = [int((tree.depth <= d).sum()) for d in range(tree.max_depth + 1)]
        self.kept = {}  # the nodes a row drafts (a tuple) -> (Draft fields, their index tensor)
        self.heads_prefix = getattr(heads, "prefix", None) is not None  # Hydra++'s prefix layer
        self.pages = Pages(heads) if self.heads_prefix else None
        sizes = ", ".join(f"{B}: {E}" for B, E in self.budgets.items())  # rows: nodes
        origin = f", {origin}" if origin else ""
        self.name = (
            f"heads: {heads.cfg.kind}, tree: {plural(tree.num_nodes, 'node')}, shared by a batch "
            f"(nodes past the roots by batch size{origin}: {sizes})"
        )

    def budget(self, rows: int) -> tuple:
        """(E, d): a step of `rows` live rows drafts E nodes past the roots, down to depth d."""
        B = max(B for B in self.budgets if B <= max(rows, 1))
        d = min(self.depths[B], self.tree.max_depth)
        return min(self.budgets[B], rows * (self.upto[d] - 1)), d

    def start(self, prompt, hidden, max_len, cached=0):
        if cached:  # the last sequence goes on: its state holds all of it first
            self.catch_up([self])
            if self.cache is not None:
                self.cache.length = cached
        else:  # Hydra++: the prefix layer's cache is a row of a page the batch shares
            self.cache = self.pages.take(self, max_len) if self.heads_prefix else None
        self.pending = []  # (hidden (1, n, D), positions (n,)) kept since the last draft
        positions = torch.arange(cached, len(prompt), device=hidden.device)
        self.h = self.heads.context(hidden, positions, self.cache)[:, -1]  # (1, D)

    def accept(self, accepted):
        self.pending.append((accepted.hidden, accepted.positions))

    def catch_up(self, rows):
        """The draft state of each row over every token it kept since the last draft: Hydra++'s
        prefix layer runs once for the rows of a page (Pages), not once a row."""
        waiting = []  # (row, its kept hidden states (1, n, D), their positions (n,))
        for r in rows:
            if r.pending:
                hidden = torch.cat([h for h, _ in r.pending], dim=1)
                waiting.append((r, hidden, torch.cat([p for _, p in r.pending])))
                r.pending = []
        if not self.heads_prefix:  # Medusa, Hydra: the last hidden state itself
            for r, hidden, _ in waiting:
                r.h = hidden[:, -1]
            return
        for page, members in self.pages.grouped(waiting):
            if len(members) > 1 and page.fits(members):
                for (r, _, _), y in zip(members, page.forward(self.heads.prefix, members)):
                    r.h = y[None]  # (1, D)
                continue
            for r, hidden, positions in members:  # alone, or past the page's slots: one call each
                r.h = self.heads.context(hidden, positions, r.cache)[:, -1]  # (1, D)

    def draft(self, rows, roots):
        if not rows:
            return []
        E, depth = self.budget(len(rows))
        N = self.upto[depth]
        device = self.tree.depth.device
        if E == 0:  # plain decoding: the roots alone
            return [self.keep(torch.tensor([r], device=device), (0,)) for r in roots]
        self.catch_up(rows)
        h = torch.cat([r.h for r in rows])  # (B, D)
        roots = torch.tensor(roots, device=device)  # (B,)
        tokens, confidence = fill_scored(self.heads, h, roots, self.plan[:depth], N)  # (B, N)
        self.confidence = confidence  # (tuning reads it)
        # the E surest nodes past the roots; ties in node order, so a parent comes before its child
        best = torch.sort(confidence[:, 1:].flatten(), descending=True, stable=True).indices[:E]
        nodes = [[0] for _ in rows]
        for i in sorted(best.tolist()):
            nodes[i // (N - 1)].append(i % (N - 1) + 1)
        return [self.keep(t, tuple(n)) for t, n in zip(tokens, nodes)]

    def keep(self, tokens, nodes):
        """The Draft of the candidates `nodes` (indices into the tree, the root first) of a row's
        filled tree `tokens` (N,)."""
        if nodes not in self.kept:
            t = tree_lib.build([self.tree.paths[i - 1] for i in nodes[1:]]).to(
                self.tree.depth.device
            )
            mask = t.mask if t.num_nodes > 1 else None
            index = torch.tensor(nodes, device=t.depth.device)
            self.kept[nodes] = (t, mask, t.depth, t.depth.tolist(), index)
        t, mask, depth, source, index = self.kept[nodes]
        return Draft(tokens[index], t, mask, depth, source)


# --- plain decoding -----------------------------------------------------------------------------
# The baseline is a drafter too: it proposes nothing, so every step's tree is its root alone.


class Plain:
    name, legend, max_nodes, max_depth = "heads: none (plain decoding)", ["base model"], 1, 0

    def __init__(self, device):
        self.shapes = Shapes(device)

    def row(self, generator=None):
        return self

    def start(self, prompt, hidden, max_len, cached=0):
        pass

    def draft(self, rows, roots):
        return [self.shapes.draft(root, {}) for root in roots]

    def accept(self, accepted):
        pass


# --- prompt lookup ------------------------------------------------------------------------------
# LLMA / prompt lookup decoding: where the reply copies the prompt (summaries, extraction, names in
# a translation, code edits), the tokens that followed the last few tokens the previous time they
# occurred are a good guess. An index from every n-gram (n <= ngram) of the text to where it ended
# makes each lookup a dictionary access; it grows with the text.


class Lookup:
    """Match the last n tokens (n = ngram down to `shortest`, 1 unless given) of prompt + reply
    against earlier text and propose the up to gamma tokens that followed: the latest match as a
    chain, or the `matches` latest distinct continuations (longer n first) merged into a tree."""

    def __init__(
        self, gamma: int, ngram: int, matches: int, device, adapt: bool = False, shortest: int = 1
    ):
        assert gamma >= 1 and ngram >= 1 and matches >= 1, (
            f"need gamma, ngram, matches >= 1, got {gamma}, {ngram}, {matches}"
        )
        assert 1 <= shortest <= ngram, f"need 1 <= shortest <= ngram, got {shortest}, {ngram}"
        self.gamma = gamma
        self.ngram = ngram
        self.matches = matches
        self.adapt = adapt
        self.shortest = shortest
        self.shapes = Shapes(device)
        self.name = (
            f"lookup: n-grams {ngram}..{shortest}, up to {plural(gamma, 'token')}"
            + (f", {matches} matches" if matches > 1 else "")
            + (", length adapted" if adapt else "")
        )
        self.legend = ["base model", "lookup"]
        self.max_nodes = 1 + gamma * matches
        self.max_depth = gamma

    def row(self, generator=None):  # start() makes the state (the text, its index)
        return copy.copy(self)

    def start(self, prompt, hidden, max_len, cached=0):  # cached: the index is rebuilt, a few ms
        self.text = []  # the committed text
        self.ends = {}  # n-gram -> indices just after each occurrence
        self.length = self.gamma  # tokens proposed a step (adapt)
        self.proposed = []  # what the last step proposed
        self.copying = False  # (adapt) see accept()
        self._extend(prompt)

    def _extend(self, tokens):
        for t in tokens:
            self.text.append(t)
            i = len(self.text)
            for n in range(1, min(self.ngram, i) + 1):
                self.ends.setdefault(tuple(self.text[i - n : i]), []).append(i)

    def continuations(self, root: int) -> list:
        """Up to `matches` distinct continuations of text + [root], latest occurrence first."""
        text, found = self.text, []
        seen = text + [root]  # what the next token follows
        for n in range(min(self.ngram, len(text) + 1), self.shortest - 1, -1):
            key = tuple(text[len(text) - n + 1 :]) + (root,)
            for j in reversed(self.ends.get(key, ())):
                # what followed the occurrence, seen[j:]. Where that runs into the end (repetitive
                # text: "hello, hello, hello,"), the match says the text repeats with the period
                # p = len(seen) - j, so the continuation goes on as seen[j : j + p] again and again
                p = len(seen) - j
                follow = [seen[j + k % p] for k in range(self.length)]
                if follow not in found:
                    found.append(follow)
                    if len(found) == self.matches:
                        return found
        return found

    def draft(self, rows, roots):
        return [row.propose(root) for row, root in zip(rows, roots)]

    def propose(self, root):
        self.proposed = self.continuations(root)
        return self.shapes.draft(root, chains(self.proposed, 1))

    def accept(self, accepted):
        tokens = accepted.ids
        # adapt (transformers' "heuristic" schedule for assisted generation): after a step that kept
        # a whole proposed continuation, propose 2 tokens more (up to gamma), else 1 fewer (at least
        # 1). Where the reply does not copy, the chain shrinks to a token and costs the step almost
        # nothing; where it copies, it grows back within steps. copying: the last step kept a whole
        # continuation proposed at the full gamma (HeadsPlusLookup then verifies its chain alone).
        # A step with no match proposed nothing: the length stays, and the streak ends there.
        if self.adapt and self.proposed:
            kept = tokens[1:]
            whole = any(kept[: len(f)] == f for f in self.proposed)
            self.copying = whole and self.length == self.gamma
            self.length = min(self.gamma, self.length + 2) if whole else max(1, self.length - 1)
        elif self.adapt:
            self.copying = False
        self._extend(tokens)


# --- a draft model, or the base model with layers skipped -----------------------------------------
# Leviathan et al. / Chen et al.: a small model with the base's tokenizer drafts gamma tokens one at
# a time; the base verifies the chain in one forward. Self-speculative decoding (Zhang et al., Draft
# & Verify; LayerSkip) is the same with the base model itself, some of its layers skipped, as the
# small model (model.Transformer.forward's layers=, on the base's own weights).


class ModelDrafter:
    """Drafts a chain of gamma tokens with `model` (or only its `layers`, indices): greedily at
    temperature 0, else sampled from its own p = logits_to_probs(logits, temperature, top_p), which
    the Draft carries for verify.leviathan.

    KV cache: as the base model's, slots [0, length) hold the accepted sequence, in order. `pending`
    are accepted tokens not fed yet: the whole prompt at the start, later the last draft x_G when it
    was accepted (drafted, never fed). draft() feeds pending + [root] (root: the bonus) in one
    forward and x_1..x_{G-1} one by one, each forward appending its tokens for the next to attend to
    (length += T: keep(range(T)) without its index check, a GPU sync). accept() cuts length back to
    the accepted prefix: rejected drafts' entries beyond it are garbage, as in a KVCache."""

    def __init__(
        self,
        model,
        gamma: int,
        temperature: float,
        top_p: float,
        generator,
        layers=None,
        name="draft model",
    ):
        assert gamma >= 1, f"gamma must be >= 1, got {gamma}"
        self.model = model
        self.gamma = gamma
        self.layers = None if layers is None else tuple(layers)
        self.temperature = temperature
        self.top_p = top_p
        self.generator = generator
        self.shapes = Shapes(model.device)
        self.paths = tree_lib.chain(gamma)
        sampled = "" if verify_lib.is_greedy(temperature) else ", sampled"
        self.name = f"{name}, {plural(gamma, 'token')} a step{sampled}"
        self.legend = ["base model", name]
        self.max_nodes = 1 + gamma
        self.max_depth = gamma

    def row(self, generator=None):  # start() makes the state (its cache, what it has not fed)
        other = copy.copy(self)
        other.generator = generator  # the row's own draws, as a sequence alone has (None: torch's)
        return other

    def start(self, prompt, hidden, max_len, cached=0):
        if not cached:
            runs = None if self.layers is None else len(self.layers)
            self.cache = self.model.new_cache(max_len, num_layers=runs)
        # its cache holds a prefix of the accepted sequence, maybe shorter than `cached`: fed later
        self.cache.length = min(self.cache.length, cached)
        self.pending = list(prompt[self.cache.length :])

    def _next(self, tokens):
        """Feed tokens (1, T) after the cache (appended) -> the next draft (), its p (V,) | None."""
        n = tokens.shape[1]
        positions = torch.arange(self.cache.length, self.cache.length + n, device=tokens.device)
        logits, _ = self.model(
            tokens, positions, None, self.cache, last_only=True, layers=self.layers
        )
        self.cache.length += n
        if verify_lib.is_greedy(self.temperature):
            return logits[0, -1].argmax(), None  # ()
        p = verify_lib.logits_to_probs(logits[0, -1].float(), self.temperature, self.top_p)  # (V,)
        return verify_lib.sample(p, self.generator), p

    def draft(self, rows, roots):
        return [row.chain(root) for row, root in zip(rows, roots)]

    def chain(self, root):
        dev = self.model.device
        self.fed = self.cache.length + len(self.pending) + 1  # the accepted sequence, root included
        x, p = self._next(torch.tensor([self.pending + [root]], device=dev))
        drafts, probs = [x], [p]
        for _ in range(self.gamma - 1):
            x, p = self._next(x.view(1, 1))
            drafts.append(x)
            probs.append(p)
        self.drafts = torch.stack(drafts)  # (G,)
        tree, mask, depth = self.shapes(self.paths)
        tokens = torch.cat([torch.tensor([root], device=dev), self.drafts])  # (N,) = (G+1,)
        sampled = None if verify_lib.is_greedy(self.temperature) else torch.stack(probs)  # (G, V)
        return Draft(tokens, tree, mask, depth, [0] + [1] * self.gamma, sampled)

    def accept(self, accepted):
        tokens, drafts, k = accepted.ids, self.drafts.tolist(), 0
        while k < len(tokens) - 1 and k < self.gamma - 1 and tokens[1 + k] == drafts[k]:
            k += 1  # accepted drafts whose keys are in the cache
        self.cache.length = self.fed + k  # cut back to the accepted prefix
        self.pending = list(tokens[1 + k :])


# --- heads and lookup in one tree ----------------------------------------------------------------
# SpecInfer-style merging: the heads' tree, then lookup's grafted onto it, shared prefixes once;
# one forward verifies both. verify.py's tree rules are exact for any tree fixed before
# verification (heads' top-k picks, lookup's copies), so the merged tree keeps them exact.


class HeadsPlusLookup:
    """While lookup copies (Lookup.copying), its chain alone: the heads' draft() is skipped, sound
    as a HeadsDrafter keeps no state between draft() and accept(). floor: None grafts both trees
    whole; a number keeps the step near the heads' tree's size (tuned for the machine), lookup's L
    nodes replacing the heads' last L (the deepest, least likely) down to `floor`."""

    def __init__(self, heads, lookup, device, floor=None):
        self.heads = heads
        self.lookup = lookup
        self.shapes = Shapes(device)
        self.floor = floor
        self.offset = len(heads.legend) - 1  # lookup's sources follow the heads' in the legend
        self.name = f"{heads.name} + {lookup.name}"
        self.legend = heads.legend + lookup.legend[1:]
        self.max_nodes = heads.max_nodes + lookup.max_nodes - 1
        self.max_depth = max(heads.max_depth, lookup.max_depth)

    def row(self, generator=None):
        pair = copy.copy(self)
        pair.heads, pair.lookup = self.heads.row(generator), self.lookup.row(generator)
        return pair

    def start(self, prompt, hidden, max_len, cached=0):
        self.heads.start(prompt, hidden, max_len, cached)
        self.lookup.start(prompt, hidden, max_len, cached)

    def draft(self, rows, roots):
        """The heads' trees of the rows that want one are drafted in one call. Where the heads
        share a budget of E nodes past the roots among B rows, lookup's chains are cut to E // B
        nodes a row (none at 0: drafting does not pay there): outside the budget, at 4 and 8 rows
        they cost a batch more than they saved."""
        cap, copied = self.lookup_cap(len(rows)), []
        for row, root in zip(rows, roots):
            d = row.lookup.propose(root)
            if cap is not None and any(len(c) > cap for c in row.lookup.proposed):
                row.lookup.proposed = [c[:cap] for c in row.lookup.proposed] if cap else []
                d = row.lookup.shapes.draft(root, chains(row.lookup.proposed, 1))
            copied.append(draft_nodes(d))
        # on a copying streak the heads' nodes would only cost the step
        wanted = [
            i for i, (row, c) in enumerate(zip(rows, copied)) if not (c and row.lookup.copying)
        ]
        trees = self.heads.draft([rows[i].heads for i in wanted], [roots[i] for i in wanted])
        heads = dict(zip(wanted, trees))
        return [
            row.merged(r, c, heads.get(i)) for i, (row, r, c) in enumerate(zip(rows, roots, copied))
        ]

    def lookup_cap(self, rows):
        """The nodes lookup's chain may take a row at a step of `rows` rows (None: no limit)."""
        budget = getattr(self.heads, "budget", None)  # HeadsShared: one budget for the rows
        return None if budget is None else budget(rows)[0] // rows

    def merged(self, root, copied, heads):
        """One row's draft: lookup's nodes `copied` grafted on the heads' Draft (None: alone)."""
        if heads is None:
            return self.shapes.draft(root, graft({}, copied, self.offset))
        if not copied:
            return heads  # nothing to graft (no lookup match): the heads' tree as it is
        nodes = draft_nodes(heads)
        if self.floor is not None:  # dicts keep the tree's order: a prefix of it is a tree
            nodes = dict(list(nodes.items())[: max(len(nodes) - len(copied), self.floor)])
        return self.shapes.draft(root, graft(nodes, copied, self.offset))

    def accept(self, accepted):
        self.heads.accept(accepted)
        self.lookup.accept(accepted)


# --- Jacobi decoding -----------------------------------------------------------------------------
# Santilli et al. 2023: append m guesses ([PAD] at first) to the sequence as a causal chain; the
# model's output at each is the greedy next token given the guesses before it. The guesses equal to
# the output before them are accepted (verify.greedy: at least the bonus token is new), the outputs
# after them are the next step's guesses. Its fixed point is greedy decoding: lossless.


class Jacobi:
    """m guesses a step as a chain. Where last step's outputs do not reach (the start, or after a
    whole block was accepted), the last guess (or the root) is repeated: the block's padding."""

    def __init__(self, gamma: int, device):
        assert gamma >= 1, f"gamma must be >= 1, got {gamma}"
        self.gamma = gamma
        self.shapes = Shapes(device)
        self.name = f"jacobi: {plural(gamma, 'guess')} a step"
        self.legend = ["base model", "jacobi"]
        self.max_nodes = 1 + gamma
        self.max_depth = gamma

    def row(self, generator=None):  # start() makes the state (the guesses)
        return copy.copy(self)

    def start(
        self, prompt, hidden, max_len, cached=0
    ):  # cached or not: from the prompt's ids alone
        self.guesses = []

    def draft(self, rows, roots):
        return [row.guess(root) for row, root in zip(rows, roots)]

    def guess(self, root):
        pad = self.guesses[-1] if self.guesses else root
        guesses = (self.guesses + [pad] * self.gamma)[: self.gamma]
        return self.shapes.draft(root, chains([guesses], 1))

    def accept(self, accepted):
        # nodes 0..k were kept (the root and k guesses) and the bonus is the output at node k; the
        # output at node k+i guesses the token i places after the bonus
        self.guesses = accepted.logits[len(accepted.ids) :].argmax(-1).tolist()  # (m-k,)


# --- lookahead decoding --------------------------------------------------------------------------
# Fu et al. 2024: Jacobi's guesses are poor as a chain, but the trajectories its iterations trace
# hold good n-grams. One forward carries two branches after the root that never see each other.
# The window (computed only): W columns of N-1 levels of Jacobi iterations, here W = 3, N = 4:
#     offset      0    1    2    3    4    5
#     chain      root  c1   c2                   the oldest level, a causal chain after the root
#     level 1          a0   a1   a2              level l, column r sits at offset r + l and sees the
#     level 2               b0   b1   b2         root, c_1..c_r and its column up to itself: the
#     outputs                    o0   o1   o2    sequence its Jacobi trajectory continues
# Each step adds the W n-grams (c_r, a_r, b_r, o_r), c_0 = the root, to a pool keyed by their first
# token and moves every level down one (chain = level 1 without a0, level 1 = level 2, level 2 =
# outputs). The verification branch: up to G pool n-grams that start with the root, merged by
# chains() into a tree like any other. The window shifts one position a step whatever was accepted,
# as the authors' code does; it starts as prompt tokens and yields n-grams once every level holds
# model outputs, after N-2 steps (the authors fill its levels one by one, with a changing shape).


class Lookahead:
    """cells[i] = (level, column) of window node i; the root is (0, 0). Mask: (l, r) sees (l', r')
    iff l' = 0 and r' <= r, or r' = r and 1 <= l' <= l."""

    def __init__(self, window: int, ngram: int, guesses: int, device):
        assert window >= 1 and ngram >= 2 and guesses >= 1, (
            f"need window >= 1, ngram >= 2, guesses >= 1, got {window}, {ngram}, {guesses}"
        )
        self.W = window
        self.N = ngram
        self.G = guesses
        chain = [(0, r) for r in range(1, window)]  # the oldest level, after the root
        self.cells = chain + [(l, r) for l in range(1, ngram - 1) for r in range(window)]
        index = {cell: i for i, cell in enumerate([(0, 0)] + self.cells)}  # (0, 0) is the root
        sees = torch.zeros(len(self.cells), len(index), dtype=torch.bool)  # (M, 1+M)
        for i, (level, r) in enumerate(self.cells):
            seen = [index[0, j] for j in range(r + 1)] + [index[k, r] for k in range(1, level + 1)]
            sees[i, seen] = True
        depth = torch.tensor([level + r for level, r in self.cells], dtype=torch.long)  # (M,)
        self.shapes = Shapes(device, Window(sees, depth))
        self.top = [index[ngram - 2, r] for r in range(window)]  # column tops, in [root, window]
        self.name = f"lookahead: window {window}, {ngram}-grams, up to {plural(guesses, 'guess')}"
        self.legend = ["base model", "lookahead"]
        self.max_depth = ngram - 1
        self.max_nodes = 1 + guesses * (ngram - 1) + len(self.cells)

    def row(self, generator=None):  # start() makes the state (the window, the pool)
        return copy.copy(self)

    def start(
        self, prompt, hidden, max_len, cached=0
    ):  # cached or not: from the prompt's ids alone
        fill = itertools.cycle(prompt)
        self.levels = [
            [next(fill) for _ in range(self.W - (level == 0))] for level in range(self.N - 1)
        ]
        self.pool = {}  # first token -> the latest distinct n-grams after it, oldest first
        self.steps = 0

    def draft(self, rows, roots):
        return [row.guess(root) for row, root in zip(rows, roots)]

    def guess(self, root):
        nodes = chains(reversed(self.pool.get(root, [])), 1)  # the latest first: tried first
        d = self.shapes.draft(root, nodes, computed=[t for level in self.levels for t in level])
        self.n = d.candidates
        return d

    def accept(self, accepted):
        # window node i follows the n candidates
        at = [self.n + i - 1 if i else 0 for i in self.top]
        new = accepted.logits[at].argmax(-1).tolist()  # (W,) the next token of every trajectory
        if self.steps >= self.N - 2:
            starts = [accepted.ids[0]] + self.levels[0]  # c_0 = this step's root, then the chain
            for r in range(self.W):
                self._add(starts[r], tuple(level[r] for level in self.levels[1:]) + (new[r],))
        stack = self.levels + [new]
        self.levels = [stack[1][1:]] + stack[2:]
        self.steps = self.steps + 1

    def _add(self, first, gram):
        grams = self.pool.setdefault(first, [])
        if gram in grams:
            grams.remove(gram)
        grams.append(gram)
        del grams[: -self.G]  # keep the G latest


# --- PaSS: learned lookahead tokens -------------------------------------------------------------
# Monea et al. 2023: K embeddings [LA]_1..[LA]_K (pass_tokens.py trains them, the model frozen) are
# new tokens; after the sequence, the model's outputs at them guess the K tokens after its next one.
# The first [LA]'s G likeliest tokens are siblings, the first leading a chain of the other [LA]s'
# choices. The last accepted node is known only after the step, so a group of K [LA]s (computed
# only) follows every node: the one after the last accepted drafts the next tree. K = G = 2:
#     node   root  d1  d1' d2  |  a1 a2  |  b1 b2  |  b1' b2'  |  c1 c2   (groups after root, d1,
#     depth    0    1   1   2  |  1  2   |  2  3   |  2   3    |  3  4    d1', d2)


class PaSS:
    """The tree drawn above; the first step, without [LA] outputs yet, guesses the root."""

    def __init__(self, model, embeddings, gamma: int, guesses: int = 1):
        assert 1 <= gamma <= len(embeddings) and guesses >= 1, (
            f"need 1 <= gamma <= {len(embeddings)}, guesses >= 1"
        )
        K = gamma
        G = guesses
        self.K = K
        self.G = G
        self.dev = model.device
        t = tree_lib.build([(r,) for r in range(G)] + [(0,) * d for d in range(2, K + 1)])
        n = t.num_nodes
        self.tree = t.to(self.dev)
        # the [LA] tokens: ids past the vocabulary, embedded by rows given to the model with them
        V = model.embed_tokens.num_embeddings
        self.extra = embeddings[:K].to(self.dev, model.dtype)  # (K, D): ids V .. V+K-1
        self.la = list(range(V, V + K)) * n  # a group after each node
        # the mask: the tree's, then each group sees what its node sees, its node, itself causally
        mask = torch.zeros(n * (K + 1), n * (K + 1), dtype=torch.bool)
        mask[:n, :n] = t.mask
        depth = t.depth.tolist()
        for g in range(n):
            rows = slice(n + g * K, n + g * K + K)
            mask[rows, :n] = t.mask[g]
            mask[rows, rows] = torch.ones(K, K, dtype=torch.bool).tril()
            depth += range(depth[g] + 1, depth[g] + K + 1)
        self.mask = mask.to(self.dev)
        self.depth = torch.tensor(depth, device=self.dev)
        firsts = f", {G} first guesses" if G > 1 else ""
        self.name = f"pass: {plural(K, '[LA] token')}{firsts}"
        self.legend = ["base model", "[LA] tokens"]
        self.max_nodes = n * (K + 1)
        self.max_depth = K

    def row(self, generator=None):  # start() makes the state (the last step's guesses)
        return copy.copy(self)

    def start(
        self, prompt, hidden, max_len, cached=0
    ):  # cached or not: from the prompt's ids alone
        self.first = self.rest = None

    def draft(self, rows, roots):
        return [row.guess(root) for row, root in zip(rows, roots)]

    def guess(self, root):
        self.drafted = self.first or [root] * self.G  # (G,)
        rest = self.rest or [root] * (self.K - 1)  # (K-1,)
        drafts = [self.drafted[p[0]] if len(p) == 1 else rest[len(p) - 2] for p in self.tree.paths]
        tokens = torch.tensor([root] + drafts + self.la, device=self.dev)  # (N,)
        source = [0] + [1] * len(drafts)
        return Draft(tokens, self.tree, self.mask, self.depth, source, extra=self.extra)

    def accept(self, accepted):
        first = self.tree.num_nodes + accepted.nodes[-1] * self.K
        group = accepted.logits[first : first + self.K]  # (K, V)
        self.first = group[0].topk(self.G).indices.tolist()
        self.rest = group[1:].argmax(-1).tolist()
