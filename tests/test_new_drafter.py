"""Adding a drafter is one class and one registration line (README, "Adding a drafter"): the
README's example, registered here, drafts through generate.py's command line, and its greedy
replies are plain decoding's, token for token.

Test: `python -m pytest -q tests/test_new_drafter.py`.
"""

import copy
import inspect
import os
import re

import pytest

from specdec import drafters
from specdec.loading import catalog
import generate as G


class Repeat:  # the README's example, as it is printed there
    """Guesses that the last token repeats, `gamma` times: right in runs of a token, else cheap."""

    legend = ["base model", "repeat"]  # who drafted a token, by index: --show colours by it

    def __init__(self, gamma, device):
        self.gamma = gamma
        self.shapes = drafters.Shapes(device)  # trees built once, looked up by their paths
        self.name = f"repeat: {gamma} a step"
        self.max_nodes = 1 + gamma  # the root and its drafts: sizes the KV cache
        self.max_depth = gamma

    def row(self, generator=None):  # one more sequence of a batch: its own copy
        return copy.copy(self)

    def start(self, prompt, hidden, max_len, cached=0):  # a new sequence: nothing to remember
        pass

    def draft(self, rows, roots):  # one Draft per row: a chain of the root, repeated
        return [
            self.shapes.draft(root, drafters.chains([[root] * self.gamma], 1)) for root in roots
        ]

    def accept(self, accepted):  # what the base model kept of the draft: nothing to learn
        pass


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(catalog, "DRAFTERS", dict(catalog.DRAFTERS))
    monkeypatch.setattr(catalog, "DRAFT_DEFAULTS", dict(catalog.DRAFT_DEFAULTS))
    catalog.register("repeat", lambda b: Repeat(b.settings["gamma"], b.model.device), {"gamma": 3})


def reply(capsys, *argv):
    assert G.cli_main([str(a) for a in argv]) == 0
    out, err = capsys.readouterr()
    return out, err


def test_a_registered_drafter_decodes_losslessly_from_the_command_line(
    registered, tiny_model_dir, capsys
):
    argv = ["--model", tiny_model_dir, "--raw", "--max-new-tokens", "24", "--prompt"]
    for prompt in ("the the the", "a b c d"):
        plain, _ = reply(capsys, *argv, prompt, "--heads", "none")
        drafted, err = reply(capsys, *argv, prompt, "--draft", "repeat")
        assert "repeat: 3 a step" in err  # its name on the banner: it drafted
        assert drafted == plain
    _, err = reply(capsys, *argv, "x", "--draft", "repeat", "--gamma", "5")
    assert "repeat: 5 a step" in err  # the size flags reach it, its default beside the others'


def test_the_readme_shows_this_example():
    readme = open(
        os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8"
    ).read()
    source = inspect.getsource(Repeat).replace(
        "  # the README's example, as it is printed there", ""
    )
    assert source in readme


def test_an_unknown_drafter_lists_the_registered_ones(registered, tiny_model_dir, capsys):
    code = G.cli_main(["--model", tiny_model_dir, "--prompt", "x", "--draft", "nope"])
    assert code == 2
    err = capsys.readouterr().err
    assert re.search(r"unknown drafter; use heads, .*repeat", err)
