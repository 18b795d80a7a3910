"""The lesson's files the package imports by their names (model, heads, tree, verify), checked to
be the repository's before anything imports them. A script's own folder comes first on Python's
path, so a model.py of the user's beside the script would stand in for the repository's, and fail
later as an AttributeError that names neither file; instead, one ImportError line names both.

    import specdec.lesson     # api.py's and checkpoint.py's first import of the project

It imports nothing of the project. Test: `python -m pytest -q tests/test_api.py`.
"""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
FILES = ("model", "heads", "tree", "verify")


def where(name):
    """The file `import name` reads (or read), or None where there is none."""
    if name in sys.modules:
        return getattr(sys.modules[name], "__file__", None)
    spec = importlib.util.find_spec(name)
    return spec.origin if spec else None


def check():
    """ImportError, in one line, for a lesson file that is not the repository's."""
    for name in FILES:
        path = where(name)
        if path and os.path.dirname(os.path.realpath(path)) != os.path.realpath(ROOT):
            raise ImportError(
                f"{path} stands in for the repository's {name}.py ({ROOT}), which specdec imports "
                f"by that name: your script's folder comes first on Python's path; rename your "
                f"{name}.py, or run the script from another folder"
            )


check()
