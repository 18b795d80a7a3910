"""tree.py: the mask, index tensors and path helpers agree with each other on every tree."""

import json
import random

import pytest
import torch

import tree as T


def check(t: T.Tree) -> None:
    """Every invariant of a built tree, stated against its own paths."""
    n = t.num_nodes
    assert n == len(t.paths) + 1
    assert t.paths == sorted(t.paths, key=lambda p: (len(p), p))
    index = {(): 0} | {p: i + 1 for i, p in enumerate(t.paths)}
    path = [()] + t.paths
    # mask: j is i or an ancestor of i; ancestor-closed, diagonal, lower-triangular, root column
    assert t.mask.shape == (n, n) and t.mask.dtype == torch.bool
    mask = t.mask.tolist()
    assert mask == [[path[i][: len(path[j])] == path[j] for j in range(n)] for i in range(n)]
    anc = [{j for j in range(n) if mask[i][j]} for i in range(n)]
    # mask[i,j], mask[j,k] => mask[i,k]
    assert all(anc[j] <= anc[i] for i in range(n) for j in anc[i])
    # diagonal, root, tril
    assert all(i in anc[i] and 0 in anc[i] and max(anc[i]) == i for i in range(n))
    # depth, parent, rank
    for x in (t.depth, t.parent, t.rank):
        assert x.shape == (n,) and x.dtype == torch.long
    depth, parent, rank = t.depth.tolist(), t.parent.tolist(), t.rank.tolist()
    assert depth[0] == 0 and parent[0] == -1 and rank[0] == -1
    for i in range(1, n):
        assert 0 <= parent[i] < i
        assert depth[i] == depth[parent[i]] + 1 == len(path[i])
        assert parent[i] == index[path[i][:-1]]
        assert rank[i] == path[i][-1]
    # children: inverse of parent, sorted by rank
    kids = [[] for _ in range(n)]
    for c in range(1, n):
        kids[parent[c]].append(c)
    assert t.children == kids
    assert all([rank[c] for c in k] == sorted(rank[c] for c in k) for k in kids)
    # retrieve: one root-to-leaf row per leaf, -1 padded
    leaves = [i for i in range(n) if not kids[i]]
    assert t.retrieve.shape == (len(leaves), t.max_depth + 1) and t.retrieve.dtype == torch.long
    rows = [[x for x in row if x >= 0] for row in t.retrieve.tolist()]
    assert sorted(r[-1] for r in rows) == leaves
    for row, nodes in zip(t.retrieve.tolist(), rows):
        assert row == nodes + [-1] * (len(row) - len(nodes))
        assert nodes[0] == 0 and all(parent[b] == a for a, b in zip(nodes, nodes[1:]))
    # by_depth partitions the non-root nodes
    assert len(t.by_depth) == t.max_depth
    assert [0] + torch.cat([torch.zeros(0, dtype=torch.long)] + t.by_depth).tolist() == list(
        range(n)
    )
    for d, idx in enumerate(t.by_depth, start=1):
        assert all(depth[i] == d for i in idx.tolist())


def random_paths(rng: random.Random, size: int) -> list[tuple]:
    """A random prefix-closed tree: grow by giving a random node its next-rank child."""
    paths, nxt = [], {(): 0}
    for _ in range(size):
        parent = rng.choice(list(nxt))
        child = parent + (nxt[parent] + rng.randrange(2),)  # sometimes skip a rank: sparse trees do
        if child in nxt:
            continue
        nxt[parent] = child[-1] + 1
        nxt[child] = 0
        paths.append(child)
    rng.shuffle(paths)
    return paths


# --- examples -----------------------------------------------------------------------------------


def test_cartesian_2_2_matches_docstring():
    t = T.build(T.cartesian([2, 2]))
    check(t)
    assert t.paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
    assert t.parent.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert t.retrieve.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]]
    assert t.children == [[1, 2], [3, 4], [5, 6], [], [], [], []]
    assert "1.1..1." in T.ascii(t) and "[0] root" in T.ascii(t)


def test_chain():
    assert T.chain(3) == [(0,), (0, 0), (0, 0, 0)]
    t = T.build(T.chain(4))
    check(t)
    assert t.num_nodes == 5 and t.max_depth == 4
    assert t.retrieve.tolist() == [[0, 1, 2, 3, 4]]
    assert torch.equal(t.mask, torch.ones(5, 5, dtype=torch.bool).tril())


def test_root_only_tree_is_plain_decoding():
    assert T.chain(0) == []
    t = T.build([])
    check(t)
    assert t.num_nodes == 1 and t.max_depth == 0 and t.by_depth == []
    assert t.retrieve.tolist() == [[0]] and t.mask.tolist() == [[True]]
    assert T.ascii(t)


def test_cartesian_counts():
    assert len(T.cartesian([4, 3, 2])) == 4 + 12 + 24
    assert len(T.cartesian([1, 1, 1])) == 3
    assert T.cartesian([]) == []
    t = T.build(T.cartesian([4, 3, 2]))
    check(t)
    assert (
        t.max_depth == 3 and len(t.retrieve) == 24 and [len(x) for x in t.by_depth] == [4, 12, 24]
    )


def test_order_of_input_does_not_matter():
    paths = T.cartesian([3, 2])
    assert T.build(paths[::-1]).paths == T.build(paths).paths
    assert T.build([[0], [0, 1], [0, 0]]).paths == [(0,), (0, 0), (0, 1)]  # lists accepted (JSON)


# --- invalid input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "paths, words",
    [
        ([(0, 1)], "(0,)"),  # not prefix-closed
        ([(0,), (0, 0, 1)], "(0, 0)"),
        ([(0,), (0, -1)], "negative"),
        ([()], "empty"),
        ([(0,), (0,)], "twice"),
        ([(0,), (0.0,)], "not a tuple of ints"),
        ([(0,), (True,)], "not a tuple of ints"),
        ([0, 1], "not a tuple of ints"),
        ("0,1", "list of tuples"),
        ([(r,) for r in range(T.MAX_NODES)], "MAX_NODES"),
    ],
)
def test_build_rejects(paths, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        T.build(paths)


def test_largest_allowed_tree():
    check(T.build([(r,) for r in range(T.MAX_NODES - 1)]))
    assert len(T.ascii(T.build(T.chain(T.MAX_NODES - 1))).splitlines()) > 2 * T.MAX_NODES
    with pytest.raises(ValueError):
        T.cartesian([32, 32])  # 1 + 32 + 1024 nodes, refused before it is generated
    with pytest.raises(ValueError):
        T.chain(T.MAX_NODES)
    with pytest.raises(ValueError):
        T.cartesian([2, 0])


@pytest.mark.parametrize(
    "spec",
    [
        "__import__('os')",
        "__import__('os').system('true')",
        "chain:",
        "chain:-1",
        "chain:2.5",
        "cartesian:",
        "cartesian:4,,2",
        "4,3,-2",
        "[(0,), (0, 1)]",
        "",
        "no_such_tree.json",
        "medusa",
    ],
)
def test_parse_rejects(spec):
    with pytest.raises(ValueError):
        T.parse(spec)


# --- parse, save, load --------------------------------------------------------------------------


def test_parse():
    assert T.parse("chain:4") == T.chain(4)
    assert T.parse("chain:0") == []
    assert T.parse("cartesian:4,3,2") == T.cartesian([4, 3, 2])
    assert T.parse("4,3,2") == T.parse(" 4, 3, 2 ") == T.cartesian([4, 3, 2])


def test_save_load_round_trip(tmp_path):
    for paths in (T.cartesian([3, 2, 2]), T.chain(0), random_paths(random.Random(0), 40)):
        file = tmp_path / "tree.json"
        T.save(paths, file)
        assert json.loads(file.read_text())["paths"] == [list(p) for p in T.build(paths).paths]
        assert T.load(file) == T.build(paths).paths
        assert T.parse(str(file)) == T.build(paths).paths


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"paths": [[0], [0, 1]', "Expecting"),  # malformed JSON
        ("[[0], [0, 1]]", "JSON object"),  # no "paths" key
        ('{"paths": "[[0]]"}', "JSON object"),
        ('{"paths": [[0, 1]]}', "no parent"),
        ('{"paths": [["__import__(\'os\')"]]}', "not a tuple of ints"),
    ],
)
def test_load_rejects(tmp_path, text, words):
    file = tmp_path / "bad.json"
    file.write_text(text)
    with pytest.raises(ValueError, match=words):
        T.load(file)


# --- property test ------------------------------------------------------------------------------


def test_random_trees():
    rng = random.Random(1234)
    for _ in range(200):
        paths = random_paths(rng, rng.randrange(0, 40))
        t = T.build(paths)
        check(t)
        assert sorted(t.paths) == sorted(paths)
        if paths:  # dropping a node that has children breaks prefix-closure
            inner = [p for p in paths if any(q[:-1] == p for q in paths)]
            if inner:
                gone = rng.choice(inner)
                with pytest.raises(ValueError, match="no parent"):
                    T.build([p for p in paths if p != gone])


# --- as a script ----------------------------------------------------------------------------------


def test_script_draws_a_tree_and_refuses_bad_arguments(capsys):
    """`python tree.py` runs main(): --help, --tree SPEC, one line and exit code 2 on bad input."""
    with pytest.raises(SystemExit) as e:
        T.main(["--help"])
    assert e.value.code == 0 and "--tree" in capsys.readouterr().out
    assert T.main(["--tree", "chain:2"]) == 0
    assert capsys.readouterr().out.startswith("tree: 3 nodes, depth 2, 1 leaf")
    assert T.main(["--tree", "chain:x"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --tree: 'chain:x' is not a tree")
        and len(err.strip().splitlines()) == 1
    )
    assert T.main(["extra"]) == 2
    assert capsys.readouterr().err.strip() == "error: unrecognized arguments: extra (see --help)"
