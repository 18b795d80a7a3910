r"""The candidate tree: which drafted tokens the base model verifies in one forward pass.

Each draft head k proposes its top-k tokens for position t+1+k. A tree picks which combinations
to verify, as a list of paths of ranks: (0,) is head 1's top-1 token, (0, 2) is head 2's third
choice placed under it, and so on. The root (node 0, depth 0) is the token the base model itself
emitted last step; it is in every tree but never in the path list. All N nodes go through the
base model at once, each attending only to the cached prefix, itself and its ancestors:

    cartesian([2, 2]) = (0,) (1,) (0,0) (0,1) (1,0) (1,1)        mask   0123456
                                                                    0   1......
                 [0] root                                           1   11.....
               /          \                                         2   1.1....
          [1] r0          [2] r1                                    3   11.1...
          /    \          /    \                                    4   11..1..
     [3] r0  [4] r1   [5] r0  [6] r1                                5   1.1..1.
                                                                    6   1.1...1

Nodes are sorted by (depth, path): parents come before children, the mask is lower-triangular.
Pure data, no model: build() runs once per generation, with plain Python loops on small lists.

    build(paths) -> Tree           chain(n), cartesian(topk) -> paths    tree.to(device) -> Tree
    save(paths, file), load(file)  parse(spec) -> paths (the --tree flag)      ascii(tree) -> str

Run `python tree.py [--tree chain:3]` for a picture; test: `python -m pytest -q tests/test_tree.py`.
Shape legend: N tree nodes (root included), L leaves.
"""

import argparse
import itertools
import json
import os
import re
import sys
from dataclasses import dataclass, replace

import torch

MAX_NODES = 1024  # root included; the (N, N) mask and one forward over N tokens must stay small
MAX_RANK = 2**31  # a rank is a top-k index, below any vocabulary (catalog.load_tree checks)

Path = tuple[int, ...]

# --- the tree -----------------------------------------------------------------------------------
# Everything drafting and verification need, computed once from the paths.


@dataclass(frozen=True)
class Tree:
    paths: list[Path]  # non-root nodes, sorted by (depth, path); node i+1 <-> paths[i]
    mask: torch.Tensor  # (N, N) bool: mask[i, j] = j is i or an ancestor of i
    depth: torch.Tensor  # (N,) long, root 0; position of node i = prefix_len + depth[i]
    parent: torch.Tensor  # (N,) long, root -1
    rank: torch.Tensor  # (N,) long, rank of the node's token in head depth[i]'s top-k; root -1
    retrieve: torch.Tensor  # (L, max_depth+1) long: node indices root..leaf, right-padded with -1
    children: list[list[int]]  # children[i] = i's children sorted by rank (verification order)

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:  # = number of draft heads the tree needs
        return max((len(p) for p in self.paths), default=0)

    @property
    def by_depth(self) -> list[torch.Tensor]:
        # node indices at depth 1..max_depth: drafting runs depth by depth
        return [torch.nonzero(self.depth == d).flatten() for d in range(1, self.max_depth + 1)]

    def to(self, device) -> "Tree":
        """Its tensors copied to `device`, once: drafters hold the copy there."""
        return replace(
            self, **{k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        )


def _validate(paths) -> list[Path]:
    """Return the paths as sorted tuples, or raise ValueError naming the first bad one."""
    if isinstance(paths, (str, bytes)) or not hasattr(paths, "__iter__"):
        raise ValueError(f"tree paths must be a list of tuples of ints, got {paths!r}")
    seen = set()
    for p in paths:
        if not (isinstance(p, (tuple, list)) and all(type(r) is int for r in p)):  # no bool, float
            raise ValueError(f"tree path {p!r} is not a tuple of ints")
        p = tuple(p)
        if not p:
            raise ValueError("tree path () is empty; the root is implicit and must not be listed")
        if any(r < 0 for r in p):
            raise ValueError(f"tree path {p} has a negative rank")
        if any(r >= MAX_RANK for r in p):
            raise ValueError(
                f"tree path {p} has a rank >= {MAX_RANK}; ranks index a head's top-k tokens"
            )
        if p in seen:
            raise ValueError(f"tree path {p} appears twice")
        seen.add(p)
    if len(seen) + 1 > MAX_NODES:
        raise ValueError(
            f"tree has {len(seen) + 1} nodes (root included), over MAX_NODES={MAX_NODES}; use a "
            "smaller tree"
        )
    ordered = sorted(seen, key=lambda p: (len(p), p))
    for p in ordered:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(
                f"tree path {p} has no parent: {p[:-1]} is missing (must be prefix-closed)"
            )
    return ordered


def build(paths) -> Tree:
    """Validate paths and build the mask and index tensors. Raises ValueError on a bad tree."""
    paths = _validate(paths)
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    n = len(index)
    parent = [-1] + [index[p[:-1]] for p in paths]
    children = [[] for _ in range(n)]
    mask = torch.eye(n, dtype=torch.bool)  # (N, N)
    # paths are sorted: a parent comes before its children, siblings in rank order
    for i in range(1, n):
        children[parent[i]].append(i)
        mask[i] |= mask[parent[i]]  # a node sees what its parent sees, and itself
    max_depth = max((len(p) for p in paths), default=0)
    rows = []
    for leaf in (i for i in range(n) if not children[i]):
        row = [leaf]
        while parent[row[-1]] != -1:
            row.append(parent[row[-1]])
        rows.append(row[::-1] + [-1] * (max_depth + 1 - len(row)))
    return Tree(
        paths=paths,
        mask=mask,
        depth=torch.tensor([0] + [len(p) for p in paths]),  # (N,)
        parent=torch.tensor(parent),  # (N,)
        rank=torch.tensor([-1] + [p[-1] for p in paths]),  # (N,)
        retrieve=torch.tensor(rows),  # (L, max_depth+1)
        children=children,
    )


# --- making paths -------------------------------------------------------------------------------
# Two dense shapes; tuning.sparse grows a tree to measured acceptance rates.


def chain(n: int) -> list[Path]:
    """Each head's top-1 only, n deep. chain(0) = [] is a root-only tree: plain decoding."""
    if not isinstance(n, int) or n < 0 or n + 1 > MAX_NODES:
        raise ValueError(f"chain depth must be an int in [0, {MAX_NODES - 1}], got {n!r}")
    return [(0,) * d for d in range(1, n + 1)]


def cartesian(topk: list[int]) -> list[Path]:
    """Dense product: head d contributes its top-topk[d-1] under every node at depth d-1."""
    if not all(isinstance(k, int) and k >= 1 for k in topk):
        raise ValueError(f"cartesian top-k values must be ints >= 1, got {topk!r}")
    sizes = list(itertools.accumulate(topk, lambda a, b: a * b))
    if 1 + sum(sizes) > MAX_NODES:
        raise ValueError(
            f"cartesian({list(topk)}) has {1 + sum(sizes)} nodes, over MAX_NODES={MAX_NODES}; use "
            "smaller top-k values"
        )
    return [
        p for d in range(1, len(topk) + 1) for p in itertools.product(*(range(k) for k in topk[:d]))
    ]


# --- tree files, specs and pictures -------------------------------------------------------------
# The --tree flag's values (generate.py's through catalog.parse_tree too), its tree files (JSON
# parsed as data and validated by build(), never evaluated) and the picture `python tree.py` prints.


def save(paths, file) -> None:
    """Write {"paths": [[0], [0, 1], ...]}, one path per line, sorted."""
    rows = ",\n  ".join(json.dumps(list(p)) for p in build(paths).paths)
    with open(file, "w") as f:
        f.write('{"paths": [\n  ' + rows + "\n]}\n")


def load(file) -> list[Path]:
    """Paths from a file written by save(); every error is a ValueError that names the file."""
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, RecursionError) as e:  # malformed JSON, not UTF-8, nested too deep
        raise ValueError(f"{file}: not a JSON tree file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("paths"), list):
        raise ValueError(f'{file}: expected a JSON object {{"paths": [[0], [0, 1], ...]}}')
    try:
        return build(data["paths"]).paths
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def parse(spec: str) -> list[Path]:
    """The --tree value: 'chain:4', 'cartesian:4,3,2' (or '4,3,2'), or a path to a JSON file."""
    compact = "".join(spec.split())
    if m := re.fullmatch(r"chain:([0-9]+)", compact):
        return chain(int(m[1]))
    if m := re.fullmatch(r"(?:cartesian:)?([0-9]+(?:,[0-9]+)*)", compact):
        return cartesian([int(k) for k in m[1].split(",")])
    if os.path.isfile(spec):
        return load(spec)
    raise ValueError(
        f"{spec!r} is not a tree: expected 'chain:N', 'cartesian:K1,K2,...' (or 'K1,K2,...'), "
        "or the path of an existing JSON tree file"
    )


def ascii(tree: Tree) -> str:
    """The nodes as an indented tree ([index] rank r), then the mask as rows of '1' / '.'."""
    n = tree.num_nodes
    leaves = len(tree.retrieve)
    head = f"tree: {n} node{'s' * (n != 1)}, depth {tree.max_depth}, "
    head += f"{leaves} {'leaf' if leaves == 1 else 'leaves'}"
    lines = [head, "[0] root"]

    stack = [(c, " ", c == tree.children[0][-1]) for c in reversed(tree.children[0])]
    while stack:  # depth-first, without recursion (a chain may be 1023 deep)
        i, indent, last = stack.pop()
        lines.append(f"{indent}+-[{i}] r{tree.paths[i - 1][-1]}  {tree.paths[i - 1]}")
        below = indent + ("   " if last else "|  ")
        kids = tree.children[i]
        stack += [(c, below, c == kids[-1]) for c in reversed(kids)]
    width = len(str(tree.num_nodes - 1))
    lines += ["", "mask (row i attends to column j):"]
    lines.append(" " * (width + 1) + "".join(str(j % 10) for j in range(tree.num_nodes)))
    for i, row in enumerate(tree.mask.tolist()):
        lines.append(f"{i:>{width}} " + "".join("1" if x else "." for x in row))
    return "\n".join(lines)


# --- command line -------------------------------------------------------------------------------
# argparse alone (the tree needs nothing of the project): a mistake is one line and exit code 2, as
# cli.py's convention has it for every other script.


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage + message and exit; we want one line
        raise ValueError(f"{message} (see --help)")


def build_parser():
    p = Parser(
        description="Draw a candidate tree and its attention mask.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--tree",
        default="cartesian:2,2",
        help="chain:N | cartesian:4,3,2 | a tree JSON file (as generate.py --tree)",
    )
    return p


def main(argv=None) -> int:
    """`python tree.py [--tree SPEC]`: draw a tree. Bad input: one line on stderr, exit code 2."""
    args = None
    try:
        args = build_parser().parse_args(argv)
        print(ascii(build(parse(args.tree))))
    except (ValueError, OSError) as e:
        where = "--tree: " if args else ""  # the tree, or a flag
        print(f"error: {where}{' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
