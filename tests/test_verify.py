"""Tests for verify.py: the sampling primitive, and each verifier against an independent reference.

greedy and typical are compared with brute force over every root-to-node path of many random trees;
speculative sampling (on a tree of top-k picks, and Leviathan's rule on a chain of sampled drafts)
is checked to be lossless by comparing the empirical joint distribution of the first two emitted
tokens with the exact one, and a deliberately broken residual rule must fail the same check. Each
fast twin in specdec/fast/verifiers.py (what the decode engines run) must return the same (nodes,
bonus) as its readable rule on many random trees, and take the same draws from the generator. Run:
`python -m pytest -q tests/test_verify.py`. Shapes: N tree nodes, V vocab, G drafts in a chain.
"""

import itertools
import math
import random

import pytest
import torch

from specdec.fast import verifiers as fast
from tree import build, cartesian, chain
from verify import GREEDY_BELOW, greedy, leviathan, logits_to_probs, sample, speculative, typical

# --- helpers ------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_thread():
    """The tensors here are tiny: extra OpenMP threads only add overhead, and stall on a busy
    CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_paths(rng: random.Random, max_depth: int = 4, max_children: int = 3) -> list[tuple]:
    """A random prefix-closed set of rank paths (ranks need not be contiguous, as in sparse
    trees)."""
    paths, frontier = [], [()]
    for _ in range(max_depth):
        frontier = [p + (r,) for p in frontier for r in range(max_children) if rng.random() < 0.5]
        paths += frontier
    return paths


def node_paths(tree) -> list[list[int]]:
    """For every node, its root-to-node node indices, built from tree.paths alone."""
    index = {(): 0} | {p: i + 1 for i, p in enumerate(tree.paths)}
    return [[0]] + [[index[p[:k]] for k in range(len(p) + 1)] for p in tree.paths]


def edges(path: list[int]):
    """(parent, child) pairs along a root-to-node path."""
    return zip(path, path[1:])


def is_root_path(nodes: list[int], tree) -> bool:
    return nodes[0] == 0 and all(tree.parent[b] == a for a, b in edges(nodes))


def softmax(row: list[float], temperature: float = 1.0) -> list[float]:
    m = max(row)
    e = [math.exp((x - m) / temperature) for x in row]
    return [x / sum(e) for x in e]


def typical_ok(p: list[float], x: int, eps: float = 0.09, alpha: float = 0.3) -> bool:
    entropy = -sum(q * math.log(q) for q in p if q > 0)
    return p[x] > min(eps, alpha * math.exp(-entropy))


# --- logits_to_probs and sample -----------------------------------------------------------------


def test_temperature_zero_is_one_hot_at_argmax():
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))  # (B, V)
    probs = logits_to_probs(logits, 0.0)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 7).float())
    assert sample(probs, None).tolist() == logits.argmax(-1).tolist()


def test_tiny_temperatures_are_greedy_not_nan():
    """Below GREEDY_BELOW sampling is greedy; at 1e-40, logits / T would overflow to inf and NaN."""
    logits = 30 * torch.randn(5, 7, generator=torch.Generator().manual_seed(0))  # (B, V)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), 7).float()
    for temperature in (1e-40, 1e-30, GREEDY_BELOW / 2):
        assert torch.equal(logits_to_probs(logits, temperature, 0.9), one_hot)
    assert torch.isfinite(logits_to_probs(logits, GREEDY_BELOW)).all()
    assert torch.isnan(torch.softmax(logits / 1e-40, -1)).any()  # what the threshold prevents


@pytest.mark.parametrize(
    "top_p, kept", [(1.0, [0, 1, 2, 3]), (0.85, [0, 1, 2]), (0.75, [0, 1]), (0.4, [0]), (1e-6, [0])]
)
def test_top_p_keeps_smallest_nucleus(top_p, kept):
    p = torch.tensor([0.3, 0.5, 0.05, 0.15])  # by rank: token 1, 0, 3, 2
    order = [1, 0, 3, 2]
    probs = logits_to_probs(p.log(), 1.0, top_p)
    want = torch.zeros(4)
    want[[order[k] for k in kept]] = p[[order[k] for k in kept]]
    assert torch.allclose(probs, want / want.sum(), atol=1e-6)


def test_probs_sum_to_one_and_temperature_scales():
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(6, 50, generator=g)  # (B, V)
    for temperature in (0.0, 0.3, 1.0, 2.5):
        for top_p in (0.1, 0.9, 1.0):
            probs = logits_to_probs(logits, temperature, top_p)
            assert probs.shape == logits.shape and (probs >= 0).all()
            assert torch.allclose(probs.sum(-1), torch.ones(6), atol=1e-5)
    assert torch.allclose(logits_to_probs(logits, 2.0), torch.softmax(logits / 2, -1))
    assert sample(logits_to_probs(logits[0], 1.0), g).shape == ()
    with pytest.raises(ValueError):
        logits_to_probs(logits, 1.0, top_p=0.0)


# --- greedy -------------------------------------------------------------------------------------


def greedy_reference(logits, tokens, tree):
    """Walk every root-to-node path; keep the deepest fully accepted one, lowest end index on
    ties."""
    best = logits.argmax(-1).tolist()
    tok = tokens.tolist()
    accepted = [path for path in node_paths(tree) if all(tok[b] == best[a] for a, b in edges(path))]
    path = min(accepted, key=lambda path: (-len(path), path[-1]))
    return path, best[path[-1]]


def test_greedy_matches_brute_force_on_random_trees():
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    lengths = []
    for _ in range(300):
        tree = build(random_paths(rng))
        n, vocab = tree.num_nodes, 4
        logits = torch.randn(n, vocab, generator=g)  # (N, V)
        best = logits.argmax(-1)
        # half the drafted tokens copy the parent's argmax, so long acceptances happen
        copy = [i > 0 and rng.random() < 0.5 for i in range(n)]
        tokens = torch.tensor(
            [int(best[tree.parent[i]]) if copy[i] else rng.randrange(vocab) for i in range(n)]
        )
        nodes, bonus = greedy(logits, tokens, tree)
        want_nodes, want_bonus = greedy_reference(logits, tokens, tree)
        assert nodes.dtype == torch.long and nodes.tolist() == want_nodes and bonus == want_bonus
        assert is_root_path(nodes.tolist(), tree) and len(nodes) - 1 <= tree.max_depth
        lengths.append(len(nodes) - 1)
    assert max(lengths) >= 3, "the random trees should exercise deep acceptances"


def test_greedy_root_only_tree_is_plain_decoding():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])  # (1, V)
    nodes, bonus = greedy(logits, torch.tensor([3]), build(chain(0)))
    assert nodes.tolist() == [0] and bonus == 1


def test_greedy_chain_accepts_the_agreeing_prefix():
    tree = build(chain(3))
    logits = torch.eye(4)[[1, 2, 0, 3]] * 5  # (N, V): argmax after node i is 1, 2, 0, 3
    nodes, bonus = greedy(logits, torch.tensor([3, 1, 2, 1]), tree)
    assert nodes.tolist() == [0, 1, 2] and bonus == 0
    nodes, bonus = greedy(logits, torch.tensor([3, 1, 2, 0]), tree)
    assert nodes.tolist() == [0, 1, 2, 3] and bonus == 3


# --- typical acceptance -------------------------------------------------------------------------


def typical_reference(logits, tokens, tree, temperature):
    """Every root-to-node path accepted by the formula; the longest, then the highest sum of log
    p."""
    rows = [softmax(r, temperature) for r in logits.tolist()]
    tok = tokens.tolist()
    accepted = [
        path
        for path in node_paths(tree)
        if all(typical_ok(rows[a], tok[b]) for a, b in edges(path))
    ]
    return max(
        accepted,
        key=lambda path: (len(path), sum(math.log(rows[a][tok[b]]) for a, b in edges(path))),
    )


@pytest.mark.parametrize(
    "p",
    [
        [0.5, 0.3, 0.15, 0.05],  # H = 1.14: threshold = eps = 0.09
        [0.97, 0.01, 0.01, 0.01],  # peaked: only the top token passes
        [0.25] * 4,  # threshold = 0.3 * exp(-ln 4) = 0.075 < eps
        [0.01] * 100,  # flat: 0.01 < eps, but > 0.3 * 0.01, so accepted
        [0.6] + [0.4 / 99] * 99,  # long tail below the threshold
    ],
)
def test_typical_accepts_exactly_by_the_formula(p):
    tree = build(chain(1))
    logits = torch.tensor([p, p]).log()  # (N, V)
    for x in range(len(p)):
        nodes, _ = typical(
            logits, torch.tensor([0, x]), tree, 1.0, 1.0, generator=torch.Generator()
        )
        assert (len(nodes) == 2) == typical_ok(p, x), f"token {x} with p={p[x]}"


def test_typical_prefers_longest_then_highest_log_p():
    # root p = [0.5, 0.3, 0.15, 0.05]: tokens 0, 1, 2 pass (threshold 0.09), token 3 does not
    root = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    flat = torch.zeros(4)
    tree = build(cartesian([3]))  # nodes 1, 2, 3 carry tokens 3, 1, 0
    logits = torch.stack([root, flat, flat, flat])  # (N, V)
    tokens = torch.tensor([0, 3, 1, 0])
    assert typical(logits, tokens, tree, 1.0, 1.0)[0].tolist() == [
        0,
        3,
    ]  # not node 2: log 0.5 > log 0.3
    tree = build([(0,), (1,), (2,), (1, 0)])  # node 4 = (1, 0) hangs under node 2
    logits = torch.stack([root, flat, flat, flat, flat])  # (N, V)
    tokens = torch.tensor([0, 3, 1, 0, 2])
    assert typical(logits, tokens, tree, 1.0, 1.0)[0].tolist() == [
        0,
        2,
        4,
    ]  # longer wins over log 0.5


def test_typical_matches_brute_force_and_samples_bonus():
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    for trial in range(200):
        tree = build(random_paths(rng))
        n, vocab = tree.num_nodes, 8
        temperature, top_p = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.7, 1.0])
        logits = 3 * torch.randn(n, vocab, generator=g)  # (N, V)
        # siblings carry distinct tokens, as top-k picks do
        picks = [rng.sample(range(vocab), vocab) for _ in range(n)]
        # (N,)
        tokens = torch.tensor([0] + [picks[tree.parent[i]][tree.rank[i]] for i in range(1, n)])
        seeded = torch.Generator().manual_seed(trial)
        nodes, bonus = typical(logits, tokens, tree, temperature, top_p, generator=seeded)
        want = typical_reference(logits, tokens, tree, temperature)
        assert nodes.tolist() == want
        probs = logits_to_probs(logits[want[-1]], temperature, top_p)
        assert bonus == int(sample(probs, torch.Generator().manual_seed(trial)))


def test_typical_needs_positive_temperature():
    tree = build(chain(1))
    with pytest.raises(ValueError, match="temperature > 0"):
        typical(torch.zeros(2, 4), torch.tensor([0, 1]), tree, 0.0, 1.0)


# --- speculative sampling -----------------------------------------------------------------------
# A 'model' is a function of the whole prefix; the tree holds a 'draft' model's top-2 at each node.

VOCAB, ROOT = 4, 0


def raw_logits(prefix: tuple) -> torch.Tensor:
    """The base model's logits after `prefix`: fixed, and different for every prefix."""
    seed = int("9" + "".join(str(t) for t in prefix))
    return 1.5 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))  # (V,)


def draft_top2(prefix: tuple) -> list[int]:
    """A different model's two most likely tokens: deterministic top-k picks, often wrong."""
    seed = int("7" + "".join(str(t) for t in prefix))
    return (
        torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)).topk(2).indices.tolist()
    )


def one_step_inputs():
    """logits, tokens for the cartesian([2, 2]) tree drafted after the prefix (ROOT,)."""
    tree = build(cartesian([2, 2]))
    prefixes = [(ROOT,)]
    for i in range(1, tree.num_nodes):
        parent = prefixes[int(tree.parent[i])]
        prefixes.append(parent + (draft_top2(parent)[int(tree.rank[i])],))
    tokens = torch.tensor([p[-1] for p in prefixes])  # (N,)
    logits = torch.stack([raw_logits(p) for p in prefixes])  # (N, V)
    return logits, tokens, tree


def joint_counts(verify, draws: int, temperature: float, top_p: float) -> torch.Tensor:
    """Counts of the first two emitted tokens (a, b); after a lone bonus, b comes from the model."""
    logits, tokens, tree = one_step_inputs()
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(draws):
        nodes, bonus = verify(logits, tokens, tree, temperature, top_p, g)
        emitted = tokens[nodes[1:]].tolist() + [bonus]
        if len(emitted) == 1:
            q = logits_to_probs(raw_logits((ROOT, bonus)), temperature, top_p)  # (V,)
            emitted.append(int(sample(q, g)))
        counts[emitted[0], emitted[1]] += 1
    return counts


def exact_joint(temperature: float, top_p: float) -> torch.Tensor:
    """P(a, b) = q(a | ROOT) * q(b | ROOT, a), with q the base model's sampling distribution."""

    def q(prefix):
        return logits_to_probs(raw_logits(prefix), temperature, top_p)  # (V,)

    return torch.stack([q((ROOT,))[a] * q((ROOT, a)) for a in range(VOCAB)])  # (V, V)


def chi_square(counts: torch.Tensor, joint: torch.Tensor) -> float:
    """Pearson's statistic over the cells the target can produce; anything else counts as
    infinite."""
    if (counts[joint == 0] > 0).any():
        return math.inf
    expected = joint[joint > 0] * counts.sum()
    return float(((counts[joint > 0] - expected) ** 2 / expected).sum())


# 15 degrees of freedom at most: the statistic is 15 +- 5.5 when lossless, P(> 45) < 1e-4
LIMIT = 45.0
SETTINGS = [(1.0, 1.0), (0.7, 0.9)]


@pytest.mark.parametrize("temperature, top_p", SETTINGS)
def test_speculative_is_lossless(temperature, top_p):
    logits, tokens, tree = one_step_inputs()
    assert len(set(tokens[1:3].tolist())) == 2, "siblings are distinct top-k picks"
    counts = joint_counts(speculative, 16_000, temperature, top_p)
    joint = exact_joint(temperature, top_p)
    assert chi_square(counts, joint) < LIMIT
    assert 0.5 * (counts / counts.sum() - joint).abs().sum() < 0.02  # total variation


def broken_speculative(mistake: str):
    """speculative() with one deliberate error in the residual rule (a local copy, for the test)."""

    def verify(logits, tokens, tree, temperature, top_p, generator):
        probs = logits_to_probs(logits, temperature, top_p)  # (N, V)
        nodes, residual = [0], probs[0].clone()
        while True:
            accepted = None
            for c in tree.children[nodes[-1]]:
                if torch.rand((), generator=generator) < residual[tokens[c]]:
                    accepted = c
                    break
                if mistake != "keep rejected token":
                    residual[tokens[c]] = 0.0
                if mistake != "no renormalising":
                    residual /= residual.sum()
            if accepted is None:
                break
            nodes.append(accepted)
            residual = probs[accepted].clone()
        return torch.tensor(nodes), int(sample(residual, generator))

    return verify


@pytest.mark.parametrize("mistake", ["keep rejected token", "no renormalising"])
def test_broken_residual_rule_fails_the_same_check(mistake):
    temperature, top_p = SETTINGS[0]
    counts = joint_counts(broken_speculative(mistake), 4_000, temperature, top_p)
    assert chi_square(counts, exact_joint(temperature, top_p)) > 4 * LIMIT


def test_speculative_rejects_a_duplicate_sibling_of_a_rejected_token():
    tree = build(cartesian([2]))
    logits = torch.tensor([0.5, 0.5, 0.0, 0.0]).log().expand(3, 4)  # (N, V)
    tokens = torch.tensor([0, 1, 1])  # both children carry token 1
    g = torch.Generator().manual_seed(0)
    ends = [speculative(logits, tokens, tree, 1.0, 1.0, g)[0].tolist() for _ in range(500)]
    assert [0, 2] not in ends and 200 < ends.count([0, 1]) < 300


# --- Leviathan's rule on a chain of sampled drafts ----------------------------------------------
# The draft 'model' is another fixed function of the prefix; the chain x1, x2 is sampled from it.


def draft_probs(prefix: tuple) -> torch.Tensor:
    """The draft model's p after `prefix`: fixed, unlike the base model's, at temperature 1."""
    seed = int("5" + "".join(str(t) for t in prefix))
    return torch.softmax(
        1.5 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)), -1
    )  # (V,)


def chain_counts(rule, draws: int, temperature: float, top_p: float) -> torch.Tensor:
    """Counts of the first two emitted tokens when `rule` verifies a freshly sampled chain of 2."""
    g = torch.Generator().manual_seed(99)
    logits = {
        p: raw_logits(p)
        for n in range(1, 4)
        for p in itertools.product(range(VOCAB), repeat=n)
        if p[0] == ROOT
    }
    p = {prefix: draft_probs(prefix) for prefix in logits}
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(draws):
        x1 = int(sample(p[(ROOT,)], g))
        x2 = int(sample(p[(ROOT, x1)], g))
        prefixes = [(ROOT,), (ROOT, x1), (ROOT, x1, x2)]
        nodes, bonus = rule(
            torch.stack([logits[q] for q in prefixes]),
            torch.tensor([ROOT, x1, x2]),
            torch.stack([p[q] for q in prefixes[:2]]),
            temperature,
            top_p,
            g,
        )
        emitted = [x1, x2][: len(nodes) - 1] + [bonus]
        if len(emitted) == 1:
            emitted.append(
                int(sample(logits_to_probs(logits[(ROOT, bonus)], temperature, top_p), g))
            )
        counts[emitted[0], emitted[1]] += 1
    return counts


@pytest.mark.parametrize("temperature, top_p", SETTINGS)
def test_leviathan_is_lossless(temperature, top_p):
    counts = chain_counts(leviathan, 16_000, temperature, top_p)
    joint = exact_joint(temperature, top_p)
    assert chi_square(counts, joint) < LIMIT
    assert 0.5 * (counts / counts.sum() - joint).abs().sum() < 0.02  # total variation


def test_leviathan_with_a_resample_from_q_fails_the_same_check():
    """On rejection, drawing from q instead of norm(max(0, q - p)) over-weights what p proposes."""

    def broken(logits, tokens, probs, temperature, top_p, generator):
        q = logits_to_probs(logits, temperature, top_p)  # (G+1, V)
        for i, x in enumerate(tokens[1:].tolist()):
            if torch.rand((), generator=generator) * probs[i, x] >= q[i, x]:
                return torch.arange(i + 1), int(sample(q[i], generator))
        return torch.arange(len(tokens)), int(sample(q[-1], generator))

    counts = chain_counts(broken, 4_000, *SETTINGS[0])
    assert chi_square(counts, exact_joint(*SETTINGS[0])) > 4 * LIMIT


def test_leviathan_accepts_a_draft_the_base_model_likes_more():
    """q(x) >= p(x): accepted whatever the uniform draw; all accepted: the bonus comes after the
    last."""
    # (G+1, V) peaked at 1, 2, 0
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0], [9.0, 0.0, 0.0]])
    p = torch.full((2, 3), 1 / 3)  # (G, V)
    for seed in range(20):
        nodes, bonus = leviathan(
            logits, torch.tensor([0, 1, 2]), p, 1.0, 1.0, torch.Generator().manual_seed(seed)
        )
        assert nodes.tolist() == [0, 1, 2] and bonus in (0, 1, 2)
    nodes, bonus = leviathan(
        logits, torch.tensor([0, 1, 2]), p, 0.5, 1.0, torch.Generator().manual_seed(0)
    )
    assert nodes.tolist() == [0, 1, 2] and bonus == 0


# --- the fast twins -----------------------------------------------------------------------------
# Same inputs, same seed: the same (nodes, bonus), and the generator left in the same state.


def random_tokens(rng: random.Random, tree, vocab: int) -> torch.Tensor:
    """Drafted tokens with repeats among siblings (vocab is small), as some drafters make."""
    return torch.tensor([rng.randrange(vocab) for _ in range(tree.num_nodes)])  # (N,)


def run_both(readable, twin, *args, seed: int, **kwargs):
    """(nodes, bonus, generator state) of each rule on the same inputs, from the same seed."""
    out = []
    for rule in (readable, twin):
        g = torch.Generator().manual_seed(seed)
        nodes, bonus = rule(*args, generator=g, **kwargs)
        assert nodes.dtype == torch.long and isinstance(bonus, int)
        out.append((nodes.tolist(), bonus, g.get_state()))
    return out


def assert_same(out):
    (nodes_a, bonus_a, state_a), (nodes_b, bonus_b, state_b) = out
    assert (nodes_a, bonus_a) == (nodes_b, bonus_b)
    assert torch.equal(state_a, state_b), "the twin took other draws from the generator"


def test_fast_greedy_equals_readable():
    rng, g = random.Random(2), torch.Generator().manual_seed(2)
    for _ in range(300):
        tree = build(random_paths(rng))
        logits = torch.randn(tree.num_nodes, 3, generator=g)  # (N, V) 3 tokens: many agree
        tokens = random_tokens(rng, tree, 3)
        nodes, bonus = fast.greedy(logits, tokens, tree)
        want_nodes, want_bonus = greedy(logits, tokens, tree)
        assert nodes.tolist() == want_nodes.tolist() and bonus == want_bonus


def test_fast_typical_equals_readable():
    rng, g = random.Random(3), torch.Generator().manual_seed(3)
    for trial in range(300):
        tree = build(random_paths(rng))
        temperature, top_p = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.7, 1.0])
        logits = 2 * torch.randn(tree.num_nodes, 4, generator=g)  # (N, V)
        tokens = random_tokens(rng, tree, 4)
        args = (logits, tokens, tree, temperature, top_p)
        assert_same(run_both(typical, fast.typical, *args, seed=trial))
    with pytest.raises(ValueError, match="temperature > 0"):
        fast.typical(torch.zeros(2, 4), torch.tensor([0, 1]), build(chain(1)), 0.0, 1.0)


def test_fast_speculative_equals_readable():
    rng, g = random.Random(4), torch.Generator().manual_seed(4)
    depths = []
    for trial in range(300):
        tree = build(random_paths(rng))
        temperature, top_p = rng.choice([0.5, 1.0]), rng.choice([0.6, 1.0])
        logits = 2 * torch.randn(tree.num_nodes, 4, generator=g)  # (N, V)
        tokens = random_tokens(rng, tree, 4)
        out = run_both(
            speculative, fast.speculative, logits, tokens, tree, temperature, top_p, seed=trial
        )
        assert_same(out)
        depths.append(len(out[0][0]) - 1)
    assert max(depths) >= 3, "the random trees should exercise deep acceptances"


def test_fast_leviathan_equals_readable():
    rng, g = random.Random(5), torch.Generator().manual_seed(5)
    accepted = []
    for trial in range(300):
        n_drafts = rng.randrange(5)
        temperature, top_p = rng.choice([0.5, 1.0]), rng.choice([0.6, 1.0])
        logits = 2 * torch.randn(n_drafts + 1, 4, generator=g)  # (G+1, V)
        if rng.random() < 0.2:  # the draft is the base model itself: q == p, all accepted
            probs = logits_to_probs(logits[:-1], temperature, top_p)  # (G, V)
        else:
            probs = torch.softmax(2 * torch.randn(n_drafts, 4, generator=g), -1)  # (G, V)
        drafts = [int(sample(p, g)) for p in probs]
        tokens = torch.tensor([0] + drafts)  # (G+1,)
        out = run_both(
            leviathan, fast.leviathan, logits, tokens, probs, temperature, top_p, seed=trial
        )
        assert_same(out)
        accepted.append(len(out[0][0]) - 1)
    assert 0 in accepted and 4 in accepted
