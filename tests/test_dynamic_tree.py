"""experiments/dynamic_tree.py decodes its own tree: a subclass that overrides draft() is what the
step calls (the one drafter protocol), its tree differs from the chain it was built on, and greedy
decoding through it keeps plain greedy's tokens."""

import importlib.util
import os

import torch

from specdec.engines import decode
from conftest import draft_one
from test_generate import random_heads, small  # noqa: F401 (a fixture)

HERE = os.path.dirname(os.path.abspath(__file__))


def dynamic_tree():
    path = os.path.join(HERE, "..", "experiments", "dynamic_tree.py")
    spec = importlib.util.spec_from_file_location("dynamic_tree", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its command line runs under __main__ only
    return module


def test_the_dynamic_tree_is_what_decodes(small):
    heads = random_heads(small, "hydra", k=3)
    drafter = dynamic_tree().DynamicTree(heads, budget=6)
    prompt = [1, 2, 3, 4, 5]
    _, hidden = small(torch.tensor([prompt]), torch.arange(5), None, None)
    drafter.start(prompt, hidden, 64)
    d = draft_one(drafter, 3)
    assert d.tree.num_nodes == 7 and d.tree.num_nodes != drafter.tree.num_nodes  # not the chain
    assert max(len(p) for p in d.tree.paths) <= 3 and len({p[:1] for p in d.tree.paths}) > 1
    sizes = []
    real = drafter.grow
    drafter.grow = lambda root: sizes.append(1) or real(root)
    plain = decode.generate(small, prompt, 30)
    spec = decode.generate(small, prompt, 30, drafter)
    assert spec.tokens == plain.tokens and len(sizes) == spec.steps - 1
