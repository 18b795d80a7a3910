"""tuning.sparse and tuning.expected_tau: the greedy sparse-tree search against brute force."""

import itertools
import random

import pytest

import tree as T
from specdec import tuning


def random_acc(rng, heads, ranks, sort=True):
    """acc[k][r], each head's row falling with the rank (as measured acceptance does) if sort."""
    acc = []
    for _ in range(heads):
        row = [rng.random() for _ in range(ranks)]
        total = sum(row) / rng.uniform(0.3, 1.0)  # a head's ranks hold at most all of its mass
        acc.append(sorted((x / total for x in row), reverse=sort))
    return acc


def all_nodes(acc):
    """Every node the search may take: depth <= len(acc), rank < len(acc[depth-1])."""
    return [
        p
        for d in range(1, len(acc) + 1)
        for p in itertools.product(*(range(len(a)) for a in acc[:d]))
    ]


def candidates(acc, taken):
    """Brute force: nodes not taken whose parent is taken (or the root) and whose previous sibling
    is taken."""
    taken = set(taken)
    return [
        p
        for p in all_nodes(acc)
        if p not in taken
        and (len(p) == 1 or p[:-1] in taken)
        and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in taken)
    ]


def test_prefix_closed_and_sized():
    rng = random.Random(0)
    for _ in range(20):
        acc = random_acc(rng, rng.randint(1, 4), rng.randint(1, 5), sort=rng.random() < 0.5)
        for budget in range(0, min(len(all_nodes(acc)), 40) + 1):
            paths = tuning.sparse(acc, budget)
            assert len(paths) == len(set(paths)) == budget
            assert all(len(p) == 1 or p[:-1] in paths for p in paths)  # prefix-closed
            assert all(p[-1] == 0 or p[:-1] + (p[-1] - 1,) in paths for p in paths)  # ranks 0..k-1
            assert paths == T.build(paths).paths  # a valid, sorted tree


def test_each_greedy_choice_is_the_likeliest_candidate():
    rng = random.Random(1)
    for _ in range(20):
        acc = random_acc(rng, 3, 3, sort=rng.random() < 0.5)
        n = len(all_nodes(acc))
        for budget in range(1, n + 1):
            before, after = set(tuning.sparse(acc, budget - 1)), set(tuning.sparse(acc, budget))
            assert before < after  # the search only grows the tree
            (new,) = after - before
            best = max(tuning.path_prob(acc, p) for p in candidates(acc, before))
            assert tuning.path_prob(acc, new) == pytest.approx(best)


def test_greedy_is_optimal_when_acceptance_falls_with_rank():
    """With sorted rows, no other valid tree of the same size has a higher expected tau."""
    rng = random.Random(2)
    for _ in range(5):
        acc = random_acc(rng, 2, 3)  # 3 + 9 = 12 possible nodes
        nodes = all_nodes(acc)
        for budget in range(1, 7):
            best = max(
                tuning.expected_tau(acc, s)
                for s in itertools.combinations(nodes, budget)
                if all(len(p) == 1 or p[:-1] in s for p in s)
            )
            assert tuning.expected_tau(acc, tuning.sparse(acc, budget)) == pytest.approx(best)


def test_expected_tau_is_monotone_in_the_budget():
    rng = random.Random(3)
    acc = random_acc(rng, 4, 10)
    taus = [tuning.expected_tau(acc, tuning.sparse(acc, b)) for b in range(0, 65)]
    assert taus[0] == 1.0
    assert all(a <= b for a, b in zip(taus, taus[1:]))
    assert taus[-1] < 1 + len(acc)  # at most one accepted token per head


def test_expected_tau_by_hand():
    acc = [[0.5, 0.2], [0.4, 0.1]]
    assert tuning.expected_tau(acc, [(0,), (1,), (0, 0)]) == pytest.approx(
        1 + 0.5 + 0.2 + 0.5 * 0.4
    )
    assert tuning.expected_tau(acc, []) == 1.0


def test_chain_when_top1_dominates():
    acc = [[0.95, 0.02, 0.01], [0.9, 0.03, 0.01], [0.85, 0.04, 0.01], [0.8, 0.05, 0.01]]
    for n in range(1, 5):
        assert tuning.sparse(acc, n) == T.chain(n)


def test_bad_input():
    acc = [[0.5, 0.2], [0.4]]
    with pytest.raises(ValueError):
        tuning.sparse(acc, 5)  # only 2 + 2 = 4 nodes exist
    with pytest.raises(ValueError):
        tuning.sparse(acc, -1)
    for bad in ([], [[]], [[1.5]], [[0.5, "x"]], "0.5"):
        with pytest.raises(ValueError):
            tuning.sparse(bad, 1)
