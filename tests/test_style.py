"""The tree is formatted by ruff at 100 columns and passes its lint (pyproject.toml): a line over
100 columns, an unused import or an undefined name fails here, not in a reader's editor.

Test: `python -m pytest -q tests/test_style.py`.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ruff(*argv):
    return subprocess.run(
        [sys.executable, "-m", "ruff", *argv, "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_is_formatted():
    r = ruff("format", "--check")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_tree_passes_ruff_check():
    r = ruff("check", "--output-format", "concise")
    assert r.returncode == 0, r.stdout + r.stderr
