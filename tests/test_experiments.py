"""The experiments keep running: each script in experiments/ is run as a script (its own sys.path
set-up included) with --help, which imports everything it uses and prints its usage, and
merged_rules.py decodes a prompt with each of its drafters on the default model. A rename in the
library that breaks an experiment fails here, not the next time someone reruns it.

Test: `python -m pytest -q tests/test_experiments.py`.
"""

import glob
import json
import os
import runpy
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(HERE, "experiments", "*.py")))


def run_script(path, args, monkeypatch):
    """Run experiments/NAME.py as `python experiments/NAME.py ARGS` would, in this process: the
    exit code (0 where it ends without sys.exit)."""
    monkeypatch.setattr(sys, "argv", [path, *map(str, args)])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put their folders first
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        return 0 if e.code is None else e.code
    return 0


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_each_experiment_answers_help(path, monkeypatch, capsys):
    assert run_script(path, ["--help"], monkeypatch) == 0
    with open(path) as f:
        opening = " ".join(f.readline().strip('"\n').split()[:5])  # the docstring's first words
    assert opening in " ".join(capsys.readouterr().out.split())


def test_the_experiments_are_all_here():
    names = {os.path.basename(p) for p in SCRIPTS}
    assert {"merged_rules.py", "dynamic_tree.py", "ablations.py"} <= names, names


def test_merged_rules_runs_each_drafter_on_a_prompt(monkeypatch, capsys, tmp_path):
    path = os.path.join(HERE, "experiments", "merged_rules.py")
    args = ["--limit", 1, "--max-new-tokens", 2, "--json", tmp_path / "done.json"]
    assert run_script(path, args, monkeypatch) == 0
    out = capsys.readouterr().out
    with open(tmp_path / "done.json") as f:
        done = json.load(f)  # variant -> category -> [tokens, seconds]
    assert len(done) == 6 and all(len(by_category) == 1 for by_category in done.values())
    for name, by_category in done.items():
        assert f"| {name} | " in out
        assert [tokens for tokens, _ in by_category.values()] == [2]
