"""drafters.py's contracts, on tiny random models (CPU, seeded) and a few on the default model.

Greedy output is token-identical to plain greedy decoding whatever the drafter (lookup as a chain
and as a tree, the first layers, a draft model, heads + lookup in one tree, Jacobi, lookahead);
sampling with a draft model, the first layers, Jacobi or lookahead follows the base model's own
distribution (chi-square over the first three tokens), and a broken residual rule fails the same
check; lookup accepts long runs when the answer is in the prompt verbatim; the draft model's KV
cache holds exactly the accepted sequence; Jacobi accepts its whole block once it has converged;
every node of lookahead's forward sees exactly its trajectory (window) or its n-gram (verified).
Run: `python -m pytest -q tests/test_drafters.py`. Shapes: N tree nodes, V vocabulary.
"""

import collections
import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import drafters as D
from specdec import eagle3
from specdec.engines import decode
from specdec import rows
import tree as tree_lib
import verify as verify_lib
from conftest import tiny_config, draft_one
from test_generate import greedy_runs, random_heads


def tiny(seed, **kw):
    torch.manual_seed(seed)
    return rows.Model(tiny_config(**kw)).eval().requires_grad_(False)


def noisy_copy(base, scale=0.3):
    """The base model with noise on every weight: a draft model that is often but not always
    right."""
    torch.manual_seed(1)
    copy = rows.Model(base.cfg).eval().requires_grad_(False)
    copy.load_state_dict(
        {k: v + scale * v.std() * torch.randn_like(v) for k, v in base.state_dict().items()}
    )
    return copy


@pytest.fixture(scope="module")
def small():
    """A 12-token vocabulary: random models repeat themselves, so every drafter gets accepted."""
    return tiny(0, vocab_size=12)


def drafter(name, base, gamma=3):
    """A fresh drafter for `base` by name; 'model' drafts with a noisy copy of it."""
    if name == "lookup":
        return D.Lookup(gamma, 3, 1, "cpu")
    if name == "lookup-tree":
        return D.Lookup(gamma, 3, 3, "cpu")
    if name == "layers:1":
        return D.ModelDrafter(base, gamma, 0.0, 1.0, None, range(1), "layers:1")
    if name == "model":
        return D.ModelDrafter(noisy_copy(base), gamma, 0.0, 1.0, None)
    if name == "hydra+lookup":
        heads = D.HeadsDrafter(
            random_heads(base, "hydra"), tree_lib.build(tree_lib.cartesian([2, 2]))
        )
        return catalog.heads_and_lookup(heads, gamma, 3, 1, "cpu")
    if name == "jacobi":
        return D.Jacobi(gamma, "cpu")
    if name.startswith("lookahead"):  # lookahead:W,N,G
        return D.Lookahead(*map(int, name.partition(":")[2].split(",")), "cpu")
    if name == "pass":  # random [LA] tokens, added to `base` (tests/test_pass.py has trained ones)
        return D.PaSS(
            base,
            torch.randn(gamma, base.cfg.dim, generator=torch.Generator().manual_seed(0)),
            gamma,
            2,
        )
    raise ValueError(name)


NAMES = ["lookup", "lookup-tree", "layers:1", "model", "hydra+lookup"]


# --- greedy: token-identical to plain decoding --------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_plain_tiny(small, name):
    runs = greedy_runs(small, drafter(name, small))
    assert all(len(r.sources) == len(r.tokens) for r in runs)
    assert sum(sum(r.accepted) for r in runs) > 0, (
        "no draft was ever accepted: the test would not exercise the drafter"
    )


def test_draft_model_equal_to_the_base_is_always_right(small):
    """The base model as its own draft model: if the draft cache holds the accepted sequence, every
    draft is accepted (gamma + 1 tokens a step); any slip in its bookkeeping would show here."""
    r = decode.generate(small, [1, 2, 3, 4], 41, D.ModelDrafter(small, 4, 0.0, 1.0, None))
    assert r.accepted == [4] * 8 and r.steps == 9


class Checked(D.ModelDrafter):
    """A ModelDrafter that, after every step, compares its cache with a fresh forward of the
    accepted sequence and checks that what is not cached is exactly `pending`."""

    def start(self, prompt, hidden, max_len, cached=0):
        super().start(prompt, hidden, max_len, cached)
        self.seq, self.checked = list(prompt), 0

    def accept(self, accepted):
        super().accept(accepted)
        self.seq += accepted.ids
        n = self.cache.length
        assert self.seq[n:] == self.pending
        fresh = self.model.new_cache(n, num_layers=len(self.layers) if self.layers else None)
        self.model(torch.tensor([self.seq[:n]]), torch.arange(n), None, fresh, layers=self.layers)
        assert torch.allclose(self.cache.k[..., :n, :], fresh.k, atol=1e-5)
        assert torch.allclose(self.cache.v[..., :n, :], fresh.v, atol=1e-5)
        self.checked += 1


@pytest.mark.parametrize("which", ["layers:1", "another model"])
def test_draft_cache_holds_the_accepted_sequence(small, which):
    d = (
        Checked(small, 3, 0.0, 1.0, None, range(1))
        if which == "layers:1"
        else Checked(noisy_copy(small), 3, 0.0, 1.0, None)
    )
    r = decode.generate(small, [3, 1, 4, 1, 5], 40, d)
    assert d.checked == r.steps - 1  # every step but the prefill: the last one too
    assert 0 < sum(r.accepted) < 3 * len(r.accepted), "want partial acceptance: the cut-back path"


# --- on the default model, in fp32 --------------------------------------------------------------

COPY = (
    "Repeat this sentence exactly, word for word: The quiet river carried seven paper boats past "
    "the old mill."
)


@pytest.fixture(scope="module")
def copy_plain(default_model):
    """The prompt, the reply's stop tokens and plain decoding's reply (13 tokens, EOS included)."""
    model, tok = default_model
    prompt, eos = checkpoint.encode(tok, COPY), set(model.cfg.eos_ids) | {tok.eos_token_id}
    return prompt, eos, decode.generate(model, prompt, 24, eos_ids=eos)


@pytest.mark.parametrize(
    "name", ["lookup", "heads+lookup", "layers:27", "model", "jacobi", "lookahead:4,3,4", "pass"]
)
def test_greedy_equals_plain_default_model(default_model, copy_plain, name):
    model, _ = default_model
    prompt, eos, plain = copy_plain
    # the shipped [LA] tokens, passed with each forward: the model stays as loaded
    if name == "pass":
        d = catalog.pass_drafter(os.path.join(catalog.SHIPPED, "pass"), 2, 2, model)
        r = decode.generate(model, prompt, 24, d, eos_ids=eos)
        assert r.tokens == plain.tokens and r.stopped == "eos" and sum(r.accepted) > 0
        assert type(model.embed_tokens) is torch.nn.Embedding
        return
    if name == "heads+lookup":  # as --draft heads+lookup builds it
        heads = random_heads(model, "hydra++", k=3, scale=0.05)
        d = catalog.heads_and_lookup(
            D.HeadsDrafter(heads, tree_lib.build(tree_lib.cartesian([2, 2, 1]))), 10, 3, 1, "cpu"
        )
    elif name == "layers:27":  # of 30: some drafts are right (with fewer layers almost none are)
        d = D.ModelDrafter(model, 4, 0.0, 1.0, None, range(27), "layers:27")
    elif name == "model":
        # the model as its own draft model: the only one at hand with its tokenizer
        d = D.ModelDrafter(model, 4, 0.0, 1.0, None)
    else:
        d = drafter(name, model, gamma=4) if name != "lookup" else D.Lookup(10, 3, 1, "cpu")
    r = decode.generate(model, prompt, 24, d, eos_ids=eos)
    assert r.tokens == plain.tokens and r.stopped == "eos"
    # Jacobi's guesses are rarely right on a real model: the tiny ones test it
    assert sum(r.accepted) > 0 or name == "jacobi"
    if "lookup" in name:  # the reply copies the prompt: lookup's chain is accepted whole
        assert max(r.accepted) >= 8 and r.steps <= 4, (r.accepted, r.steps)


# --- prompt lookup ------------------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_latest_longest_match():
    lk = D.Lookup(3, 3, 1, "cpu")
    lk.start([1, 2, 3, 4, 5, 3, 6, 2, 3, 7, 3, 9, 1, 2], None, 64)
    assert lk.continuations(8) == []  # 8 never occurred
    assert lk.continuations(3) == [[4, 5, 3]]  # (1, 2, 3) beats the later (2, 3) and (3,)
    lk.start([1, 2, 3, 4, 5, 3, 6, 2, 3, 7, 3, 9, 8, 2], None, 64)
    assert lk.continuations(3) == [[7, 3, 9]]  # no (8, 2, 3); the latest (2, 3)
    lk.accept(D.Accepted([3, 7]))  # the text grows: ... 8, 2, 3, 7 and root 3
    assert lk.continuations(3) == [[9, 8, 2]]  # (3, 7, 3) at 8..10
    three = D.Lookup(2, 1, 3, "cpu")
    three.start([2, 1, 2, 3, 2, 4, 2, 1], None, 64)
    assert three.continuations(2) == [[1, 2], [4, 2], [3, 2]]  # latest first, distinct
    d = draft_one(three, 2)  # [1, 2], [4, 2], [3, 2] share no prefix: 7 nodes
    assert d.tree.num_nodes == 7 and d.tokens.tolist() == [2, 1, 4, 3, 2, 2, 2]
    assert D.Lookup(3, 3, 1, "cpu").max_nodes == 4 and three.max_nodes == 7


def test_lookup_with_shortest_2_ignores_one_token_matches():
    text = [1, 2, 3, 4, 5, 6, 7, 9, 3]  # root 3 after 9: only (3,) matched before
    one, two = D.Lookup(3, 3, 1, "cpu"), D.Lookup(3, 3, 1, "cpu", shortest=2)
    one.start(text[:-1], None, 64)
    two.start(text[:-1], None, 64)
    assert one.continuations(3) == [[4, 5, 6]] and two.continuations(3) == []
    assert draft_one(two, 3).tree.num_nodes == 1  # no proposal: the root alone
    assert two.continuations(9) == [] and two.continuations(7) == []
    two.start([1, 2, 3, 4, 5, 2], None, 64)  # (2, 3) matched: proposed
    assert two.continuations(3) == [[4, 5, 2]]


def test_adapted_lookup_shrinks_after_misses_and_grows_after_whole_chains():
    lk = D.Lookup(4, 1, 1, "cpu", adapt=True)
    lk.start([5, 1, 2, 3, 4, 6, 7], None, 64)
    assert draft_one(lk, 1).tokens.tolist() == [
        1,
        2,
        3,
        4,
        6,
    ]  # root, then the whole gamma at first
    lk.accept(D.Accepted([1, 2, 3]))  # 2 of 4 kept: 1 token fewer
    assert lk.length == 3 and draft_one(lk, 4).tokens.tolist() == [4, 6, 7, 1]
    lk.accept(D.Accepted([4]))  # none kept: 1 fewer again
    assert lk.length == 2 and draft_one(lk, 8).tokens.tolist() == [
        8
    ]  # no match: nothing proposed ...
    lk.accept(D.Accepted([8]))
    assert lk.length == 2  # ... and nothing to learn from
    assert draft_one(lk, 6).tokens.tolist() == [6, 7, 1]
    lk.accept(D.Accepted([6, 7, 1]))  # the whole chain kept: 2 more (up to gamma)
    assert lk.length == 4
    fixed = D.Lookup(4, 1, 1, "cpu")
    fixed.start([5, 1, 2, 3, 4, 6, 7], None, 64)
    draft_one(fixed, 1), fixed.accept(D.Accepted([1]))
    assert fixed.length == 4 and draft_one(fixed, 2).tokens.tolist() == [
        2,
        3,
        4,
        6,
        7,
    ]  # without adapt it never moves


def test_a_step_without_a_lookup_match_ends_the_copying_streak():
    lk = D.Lookup(4, 1, 1, "cpu", adapt=True)
    lk.start([5, 1, 2, 3, 4, 6, 7], None, 64)
    # the whole chain at full length: copying
    (draft_one(lk, 1), lk.accept(D.Accepted([1, 2, 3, 4, 6])))
    assert lk.copying and lk.length == 4
    assert draft_one(lk, 8).tokens.tolist() == [8]  # no match: nothing proposed ...
    lk.accept(D.Accepted([8]))
    assert not lk.copying and lk.length == 4  # ... the streak ends, the length stays


def test_lookup_with_no_match_drafts_a_root_only_tree():
    lk = D.Lookup(5, 3, 1, "cpu")
    lk.start([1, 2, 3], None, 64)
    d = draft_one(lk, 9)
    assert d.tree.num_nodes == 1 and d.mask is None and d.tokens.tolist() == [9]


def copy_run(lk, prompt, answer, vocab):
    """Decode `answer` with `lk`'s drafts and greedy verification, the base model replaced by an
    oracle that says answer[k] at reply position k whatever came before: (steps, accepted per
    step)."""
    lk.start(prompt, None, 256)
    out, accepted = [answer[0]], []
    while len(out) < len(answer):
        d = draft_one(lk, out[-1])
        at = [
            min(len(out) + int(depth), len(answer) - 1) for depth in d.depth
        ]  # every node, computed-only ones too
        logits = F.one_hot(torch.tensor([answer[k] for k in at]), vocab).float()  # (N, V)
        n = d.candidates
        nodes, bonus = verify_lib.greedy(logits[:n], d.tokens[:n], d.tree)
        kept = d.tokens[nodes].tolist()
        out += kept[1:] + [bonus]
        accepted.append(len(nodes) - 1)
        lk.accept(D.Accepted(kept, logits=logits))
    assert out[: len(answer)] == answer
    return len(accepted), accepted


@pytest.mark.parametrize("matches", [1, 3])
def test_lookup_accepts_long_runs_when_the_answer_is_in_the_prompt(matches):
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 500, (130,), generator=g).tolist()
    answer = torch.randint(500, 1000, (60,), generator=g).tolist()  # never in the noise
    steps, accepted = copy_run(
        D.Lookup(10, 3, matches, "cpu"), noise[:30] + answer + noise[30:50], answer, 1000
    )
    # 11 tokens a step: the whole chain, then the bonus
    assert steps <= 6 and accepted[:5] == [10] * 5
    steps, accepted = copy_run(D.Lookup(10, 3, matches, "cpu"), noise[50:], answer, 1000)
    assert steps == 59 and not any(accepted)  # nothing to copy: every step is a plain one


@pytest.mark.parametrize("matches", [1, 3])
def test_lookup_drafts_the_whole_gamma_on_repetitive_text(matches):
    # "hello, hello, hello, ": the latest match ends where the text ends, so what followed it is one
    # period; the continuation repeats that period up to gamma tokens, not stopping after one
    hello = [5, 6, 7]  # "hello", ",", " "
    lk = D.Lookup(10, 3, matches, "cpu")
    lk.start(hello * 3, None, 64)
    assert lk.continuations(5) == [(hello * 5)[1:11]]  # 6, 7, 5, 6, 7, ...: one, all matches agree
    lk.start([4, 4, 4], None, 64)
    assert lk.continuations(4) == [[4] * 10]  # period 1
    steps, accepted = copy_run(D.Lookup(10, 3, matches, "cpu"), hello * 3, hello * 20, 1000)
    assert accepted[:5] == [10] * 5 and steps == 6  # the whole gamma and the bonus, every step


# --- merging trees ------------------------------------------------------------------------------


def test_graft_shares_prefixes_and_ranks_new_children_last():
    nodes = {(0,): (5, 1), (1,): (6, 1), (0, 0): (7, 2)}
    D.graft(nodes, D.chains([[5, 7, 8]], 1), offset=2)  # shares (0,) and (0, 0)
    D.graft(nodes, D.chains([[6, 9]], 1), offset=2)  # shares (1,)
    D.graft(nodes, D.chains([[4]], 1), offset=2)  # a third child of the root
    assert nodes == {
        (0,): (5, 1),
        (1,): (6, 1),
        (0, 0): (7, 2),
        (0, 0, 0): (8, 3),
        (1, 0): (9, 3),
        (2,): (4, 3),
    }
    d = D.Shapes("cpu").draft(0, nodes)
    assert d.tree.paths == [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)]
    assert d.tokens.tolist() == [0, 5, 6, 4, 7, 9, 8] and d.source == [0, 1, 1, 3, 2, 3, 3]


def test_graft_never_overwrites_a_node_when_a_tree_file_skips_ranks():
    nodes = {(0,): (5, 1), (2,): (6, 1)}  # a tree file may give ranks 0 and 2 only
    D.graft(nodes, D.chains([[4]], 1), offset=2)
    assert nodes == {(0,): (5, 1), (2,): (6, 1), (3,): (4, 3)}


def test_merged_tree_holds_both_drafters_candidates(small):
    heads = D.HeadsDrafter(random_heads(small, "hydra"), tree_lib.build(tree_lib.cartesian([2, 2])))
    lookup = D.Lookup(4, 3, 1, "cpu")
    merged = D.HeadsPlusLookup(heads, lookup, "cpu")
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    _, hidden = small(torch.tensor([prompt]), torch.arange(len(prompt)))
    merged.start(prompt, hidden, 64)
    d, h, lk = draft_one(merged, 3), draft_one(heads, 3), draft_one(lookup, 3)
    assert lk.tokens.tolist() == [3, 4, 5, 6, 1]

    def paths(x):  # the token sequence root..node of every node
        return {tuple(x.tokens[x.tree.mask[i]].tolist()) for i in range(x.tree.num_nodes)}

    assert paths(d) == paths(h) | paths(lk)  # every candidate of both, each prefix once
    assert d.tree.num_nodes == len(paths(d))
    assert merged.legend == ["base model", "head 1", "head 2", "lookup"] and merged.max_depth == 4


def test_merged_verifies_lookup_alone_while_it_copies(small):
    heads = D.HeadsDrafter(random_heads(small, "hydra"), tree_lib.build(tree_lib.cartesian([2, 2])))
    lookup = D.Lookup(4, 3, 1, "cpu", adapt=True)
    merged = D.HeadsPlusLookup(heads, lookup, "cpu")
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    _, hidden = small(torch.tensor([prompt]), torch.arange(len(prompt)))
    merged.start(prompt, hidden, 64)
    assert draft_one(merged, 3).tree.num_nodes > 5  # heads' 6 nodes and lookup's 4
    accepted = [3, 4, 5, 6, 1]  # lookup's whole chain kept, at full length
    h = small(torch.tensor([prompt + accepted]), torch.arange(len(prompt) + 5))[1][:, -5:]
    merged.accept(D.Accepted(accepted, h, torch.arange(len(prompt), len(prompt) + 5)))
    d = draft_one(merged, 2)  # copying: lookup's chain alone
    assert d.tokens.tolist() == [2, 3, 4, 5, 6] and d.source == [0, 3, 3, 3, 3]
    merged.accept(D.Accepted([2, 9], h[:, :2], torch.arange(13, 15)))  # broken: back to both
    assert draft_one(merged, 4).tree.num_nodes > 5


def test_merged_with_a_floor_keeps_the_first_trees_size(small):
    # 6 nodes
    heads = D.HeadsDrafter(random_heads(small, "hydra"), tree_lib.build(tree_lib.cartesian([2, 2])))
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]  # root 3: lookup proposes 4, 5, 6, 1, 2 (up to gamma)
    _, hidden = small(torch.tensor([prompt]), torch.arange(len(prompt)))

    def seqs(x):  # the token sequence root..node of every node below the root, in tree order
        return [tuple(x.tokens[x.tree.mask[i]].tolist()) for i in range(1, x.tree.num_nodes)]

    for floor, gamma, kept in [(3, 3, 3), (3, 5, 3), (1, 5, 1), (3, 1, 5), (None, 3, 6)]:
        merged = D.HeadsPlusLookup(heads, D.Lookup(gamma, 3, 1, "cpu"), "cpu", floor=floor)
        merged.start(prompt, hidden, 64)
        chain = {tuple([3, 4, 5, 6, 1, 2][:n]) for n in range(2, gamma + 2)}
        assert set(seqs(draft_one(merged, 3))) == set(seqs(draft_one(heads, 3))[:kept]) | chain, (
            floor,
            gamma,
        )


# --- sampling is lossless -----------------------------------------------------------------------


def exact_joint(model, prompt, n):
    """P(first n tokens) under plain sampling at temperature 1, by enumeration."""
    joint = {}
    for seq in itertools.product(range(model.cfg.vocab_size), repeat=n):
        p = 1.0
        for i in range(n):
            ids = torch.tensor([prompt + list(seq[:i])])
            logits, _ = model(ids, torch.arange(ids.shape[1]))
            p *= torch.softmax(logits[0, -1].double(), -1)[seq[i]].item()
        joint[seq] = p
    return joint


def chi_square(model, make_drafter, n_samples, prompt=(1, 2)):
    """Pearson's statistic of the first three tokens of speculative sampling against the exact
    joint."""
    prompt = list(prompt)
    g = torch.Generator().manual_seed(0)
    d = make_drafter(g)
    counts = collections.Counter(
        tuple(decode.generate(model, prompt, 3, d, "sample", 1.0, 1.0, g).tokens)
        for _ in range(n_samples)
    )
    ref = exact_joint(model, prompt, 3)
    return sum((counts[s] - n_samples * p) ** 2 / (n_samples * p) for s, p in ref.items())


def peaky(seed, **kw):
    m = tiny(seed, vocab_size=4, dim=16, n_heads=2, n_kv_heads=1, **kw)
    with torch.no_grad():
        m.lm_head.weight.mul_(3)  # peakier distributions: drafts get accepted and rejected
    return m


# chi-square with 63 degrees of freedom (4^3 cells): its 99.9% quantile is 103
LIMIT = 103


def test_draft_model_sampling_matches_base_distribution():
    base, small_one = peaky(0, n_layers=1), peaky(1, n_layers=1)
    assert chi_square(base, lambda g: D.ModelDrafter(small_one, 2, 1.0, 1.0, g), 2000) < LIMIT


def test_layers_sampling_matches_base_distribution():
    base = peaky(0, n_layers=2)
    assert (
        chi_square(base, lambda g: D.ModelDrafter(base, 2, 1.0, 1.0, g, range(1), "layers:1"), 2000)
        < LIMIT
    )


def test_broken_residual_rule_is_caught(monkeypatch):
    """Leviathan's rule with the resample drawn from q instead of norm(max(0, q - p)) over-weights
    what the draft proposes: the same check fails by far."""

    def broken(logits, tokens, draft_probs, temperature, top_p, generator):
        q = verify_lib.logits_to_probs(logits, temperature, top_p)  # (G+1, V)
        for i, x in enumerate(tokens[1:].tolist()):
            if torch.rand((), generator=generator) * draft_probs[i, x] >= q[i, x]:
                return torch.arange(i + 1), int(verify_lib.sample(q[i], generator))
        return torch.arange(len(tokens)), int(verify_lib.sample(q[-1], generator))

    monkeypatch.setattr(decode.fast_verify, "leviathan", broken)  # the twin decode runs
    base, small_one = peaky(0, n_layers=1), peaky(1, n_layers=1)
    assert chi_square(base, lambda g: D.ModelDrafter(small_one, 2, 1.0, 1.0, g), 2000) > 2 * LIMIT


@pytest.mark.parametrize("name", ["jacobi", "lookahead:3,2,2", "pass"])
def test_parallel_sampling_matches_base_distribution(name):
    """Jacobi's guesses, lookahead's n-grams and PaSS's chain are fixed before the step: the tree
    rule is exact."""
    base = peaky(0, n_layers=1)
    assert chi_square(base, lambda g: drafter(name, base, gamma=2), 2000) < LIMIT


def test_sampled_drafts_carry_their_distribution(small):
    g = torch.Generator().manual_seed(0)
    d = D.ModelDrafter(small, 3, 0.8, 0.9, g)
    d.start([1, 2, 3], None, 32)
    draft = draft_one(d, 4)
    assert draft.probs.shape == (3, 12) and torch.allclose(draft.probs.sum(-1), torch.ones(3))
    assert (
        draft.probs.gather(1, draft.tokens[1:, None]) > 0
    ).all()  # each draft was drawn from its p
    greedy = D.ModelDrafter(small, 3, 0.0, 1.0, None)
    greedy.start([1, 2, 3], None, 32)
    assert draft_one(greedy, 4).probs is None  # picked, not sampled: verified by the tree rule


# --- parallel decoding: Jacobi and lookahead ------------------------------------------------------

PARALLEL = ["jacobi", "lookahead:3,3,2", "lookahead:2,2,3", "lookahead:1,4,2", "lookahead:4,4,4"]


@pytest.mark.parametrize("name", PARALLEL)
def test_parallel_greedy_equals_plain_where_nothing_is_accepted_and_where_a_reply_ends_in_a_draft(
    name,
):
    """Two models: one whose next token is set by the last one (Jacobi's guesses, made from wrong
    tokens, are never right: steps accept nothing) and one that settles into repeating a token
    (whole blocks are accepted). Replies cut by the length limit and by an EOS at many places."""
    nothing = drafted = inside = 0
    for model in (tiny(0, vocab_size=12), tiny(2, vocab_size=4)):
        for seed in range(2):
            prompt = torch.randint(
                0, model.cfg.vocab_size, (5 + seed,), generator=torch.Generator().manual_seed(seed)
            ).tolist()
            plain = decode.generate(model, prompt, 40).tokens
            for n in (1, 2, 3, 5, 8, 13, 21, 34, 40):
                r = decode.generate(model, prompt, n, drafter(name, model))
                assert r.tokens == plain[:n] and len(r.sources) == n, (name, n)
                nothing, drafted = nothing + r.accepted.count(0), drafted + sum(r.accepted)
                # the last step's bonus was never emitted
                inside += len(r.tokens) - 1 - sum(r.accepted) == r.steps - 2
            eos = plain[10]
            r = decode.generate(model, prompt, 40, drafter(name, model), eos_ids={eos})
            assert r.tokens == plain[: plain.index(eos) + 1] and r.stopped == "eos"
    assert nothing and drafted and inside, (nothing, drafted, inside)


def test_jacobi_accepts_the_whole_block_once_it_has_converged():
    """An oracle that says answer[k] at reply position k whatever the guesses before it: the first
    step's guesses are padding (nothing accepted) and its outputs are all right, so the next step
    accepts the whole block of 4; after a whole block only padding is left, and so on."""
    answer = list(range(100, 160))
    steps, accepted = copy_run(D.Jacobi(4, "cpu"), [1, 2, 3], answer, 200)
    assert accepted == [0, 4] * 10 and steps == 20  # 59 tokens after the first: 6 every 2 steps
    zero = tiny(0, vocab_size=12)
    # equal logits everywhere: argmax says token 0, the model repeats it
    zero.lm_head.weight.zero_()
    r = decode.generate(zero, [3, 1, 4], 21, D.Jacobi(4, "cpu"))
    # converged from the first step: 5 tokens a step
    assert r.tokens == [0] * 21 and r.accepted == [4] * 4


def test_lookahead_verifies_the_ngrams_its_window_traced():
    """On the oracle the window's outputs are right wherever it stands; after N-1 steps its levels
    hold them, the next root starts one of its n-grams, and all N-1 tokens of it are accepted."""
    answer = list(range(100, 160))
    steps, accepted = copy_run(D.Lookahead(3, 3, 2, "cpu"), [1, 2, 3], answer, 200)
    assert accepted[:4] == [0, 0, 0, 2] and max(accepted) == 2 and steps < len(answer) - 1


def test_lookahead_mask_each_node_sees_its_trajectory_or_its_ngram(small):
    """Brute force from the definitions, then the model itself: window node (level l, column r)
    continues the sequence root, c_1..c_r, then its column's levels 1..l, at consecutive
    positions; a verification node continues the root and its n-gram up to itself. Its logits
    equal a plain causal forward over the prompt and that sequence."""
    la = D.Lookahead(3, 4, 3, "cpu")  # W = 3, N = 4: the chain c_1 c_2, levels 1 and 2 of 3 columns
    prompt = [1, 2, 3, 4, 5, 6, 7]
    la.start(prompt, None, 64)
    la.pool[5] = [(8, 9, 10), (1, 4, 6), (1, 2, 3)]  # two of them share their first token
    d = draft_one(la, 5)
    n, N = d.candidates, len(d.tokens)
    # the shared token once and d.source == [0] + [1] * (n - 1)
    assert n == 1 + 3 + 1 + 2 + 2 and N == n + 2 + 2 * 3
    window = {cell: n + i for i, cell in enumerate(la.cells)}
    window[0, 0] = 0
    follows = {}  # node -> the nodes of its sequence, by definition
    for i, path in enumerate([()] + d.tree.paths):
        follows[i] = [j for j, p in enumerate([()] + d.tree.paths) if path[: len(p)] == p]
        gram = d.tokens[follows[i][1:]].tolist()
        assert i == 0 or any(list(g[: len(gram)]) == gram for g in la.pool[5])
    for (level, r), i in window.items():
        if i:
            follows[i] = [window[0, j] for j in range(r + 1)] + [
                window[k, r] for k in range(1, level + 1)
            ]
    for i in range(N):
        assert d.mask[i].nonzero().flatten().tolist() == sorted(follows[i]), i
        # one node a position, no gaps
        assert d.depth[follows[i]].tolist() == list(range(int(d.depth[i]) + 1))
    cache = small.new_cache(64)
    small(torch.tensor([prompt]), torch.arange(len(prompt)), None, cache)
    cache.keep(range(len(prompt)))
    logits, _ = small(d.tokens[None], len(prompt) + d.depth, d.mask, cache)  # (1, N, V)
    for i in range(N):
        seq = prompt + d.tokens[follows[i]].tolist()
        alone, _ = small(torch.tensor([seq]), torch.arange(len(seq)))
        assert torch.allclose(logits[0, i], alone[0, -1], atol=1e-5), i


def test_lookahead_pool_keeps_the_latest_ngrams_and_starts_collecting_once_the_window_is_filled():
    la = D.Lookahead(2, 3, 2, "cpu")  # W = 2, N = 3: chain c_1, level 1 of 2 columns
    la.start([7, 8, 9], None, 64)
    assert la.levels == [[7], [8, 9]] and la.cells == [(0, 1), (1, 0), (1, 1)]
    vocab = 16

    def step(root, outputs):  # one step whose window tops (column 0, 1) say `outputs`
        d = draft_one(la, root)
        logits = torch.zeros(len(d.tokens), vocab)  # (N, V)
        for r, t in enumerate(outputs):
            logits[d.candidates + la.cells.index((1, r)), t] = 1
        la.accept(D.Accepted([root], logits=logits))

    step(1, [2, 3])
    assert la.pool == {} and la.levels == [[9], [2, 3]]  # the first step fills level 1
    step(4, [5, 6])
    assert la.pool == {4: [(2, 5)], 9: [(3, 6)]} and la.levels == [[3], [5, 6]]
    step(4, [7, 8])
    assert la.pool[4] == [(2, 5), (5, 7)] and la.pool[3] == [(6, 8)]
    la._add(4, (2, 5))  # seen again: now the latest
    la._add(4, (1, 1))  # a third: the oldest goes (G = 2)
    assert la.pool[4] == [(2, 5), (1, 1)]
    d = draft_one(la, 4)
    assert d.tokens[: d.candidates].tolist() == [
        4,
        1,
        2,
        1,
        5,
    ]  # the latest first: (1, 1) ranks before (2, 5)


def test_a_drafter_of_one_names_it_in_the_singular(small):
    """The banner names each drafter's size; one is "1 token", never "1 tokens"."""
    names = [
        D.HeadsDrafter(random_heads(small, "medusa"), tree_lib.build([])).name,
        D.Lookup(1, 2, 1, "cpu").name,
        D.ModelDrafter(small, 1, 0.0, 1.0, None).name,
        D.Jacobi(1, "cpu").name,
        D.Lookahead(1, 2, 1, "cpu").name,
    ]
    assert names == [
        "heads: medusa, tree: 1 node",
        "lookup: n-grams 2..1, up to 1 token",
        "draft model, 1 token a step",
        "jacobi: 1 guess a step",
        "lookahead: window 1, 2-grams, up to 1 guess",
    ]


# --- one protocol, one registry -------------------------------------------------------------------


def test_every_drafter_is_a_drafter_and_every_kind_builds_one(small, tmp_path):
    """Each drafter above, and each --draft kind of catalog.DRAFTERS built as load_drafter builds
    it, implements drafters.Drafter: the methods and attributes decode.step relies on."""
    for name in [*NAMES, "jacobi", "lookahead:3,3,2", "pass"]:
        assert isinstance(drafter(name, small), D.Drafter), name
    heads = random_heads(small, "hydra")
    built = dict(
        settings={},
        model=small,
        heads=heads,
        tree=tree_lib.build(tree_lib.cartesian([2, 2])),
        draft_model=noisy_copy(small),
        temperature=0.0,
        top_p=1.0,
        generator=None,
    )
    args = {"layers": 1, "skip": (0,), "pass": None}
    for kind, k in catalog.DRAFTERS.items():
        if kind == "pass":  # needs a folder of [LA] tokens: tests/test_pass.py loads one
            continue
        settings = catalog.DRAFT_DEFAULTS.get("lookup" if kind == "heads+lookup" else kind, {})
        layer = {"heads": eagle3.build(small)} if kind == "eagle3" else {}  # its layer as heads
        d = catalog.make_drafter(
            kind, **built | layer | {"arg": args.get(kind), "settings": settings}
        )
        assert isinstance(d, D.Drafter), kind
        assert isinstance(d.row(), D.Drafter), kind
    assert set(catalog.PARALLEL) == {"jacobi", "lookahead", "pass"}


def test_something_that_lacks_a_method_is_no_drafter():
    class Half:
        name, legend, max_nodes, max_depth = "half", ["base model"], 1, 0

        def draft(self, rows, roots):
            return []

    assert not isinstance(Half(), D.Drafter)


def test_merged_cuts_lookup_to_its_share_of_the_budget(small):
    """Rows sharing a budget of E nodes past the roots: lookup's chain takes at most E // B nodes a
    row (none where that is 0: drafting does not pay there), its length state as after a match."""
    tree = tree_lib.build(tree_lib.cartesian([2, 2]))
    heads = D.HeadsShared(random_heads(small, "hydra"), tree, {1: 2, 2: 2, 4: 0})
    merged = D.HeadsPlusLookup(heads, D.Lookup(4, 3, 1, "cpu", adapt=True), "cpu")
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]  # root 3: lookup proposes 4, 5, 6, 1
    _, hidden = small(torch.tensor([prompt]), torch.arange(len(prompt)))
    rows = [merged.row() for _ in range(4)]
    for r in rows:
        r.start(prompt, hidden, 64)

    def lookups(d):  # the lookup-drafted tokens of a row's draft, in tree order
        return [t for t, s in zip(d.tokens.tolist(), d.source) if s == 3]

    assert [lookups(d) for d in merged.draft(rows, [3] * 4)] == [[]] * 4  # E = 0
    assert all(r.lookup.proposed == [] and r.lookup.length == 4 for r in rows)
    assert [lookups(d) for d in merged.draft(rows[:2], [3] * 2)] == [[4]] * 2  # 2 // 2
    assert lookups(merged.draft(rows[:1], [3])[0]) == [4, 5]  # 2 // 1
    lookup = D.Lookup(4, 3, 1, "cpu", adapt=True)
    alone = D.HeadsPlusLookup(D.HeadsDrafter(heads.heads, tree), lookup, "cpu")
    alone.start(prompt, hidden, 64)
    assert lookups(alone.draft([alone], [3])[0]) == [4, 5, 6, 1]  # one row, no budget: whole
