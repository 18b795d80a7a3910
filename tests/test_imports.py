"""Every import resolves in a clean environment made from requirements.txt (what .ci/run builds):
each top-level module that a .py file of the project imports, at the top or inside a function, is
the standard library's, the project's own, one that requirements.txt installs, or an optional one:
imported under try/except ImportError, with an entry in GUARDED below naming the tests that run
both branches (installed and not). A test that passes only because this machine has a package
fails here, and so does an import that only a rarely run script or branch makes.

Test: `python -m pytest -q tests/test_imports.py`. Imports by name at run time (importlib) are
not seen.
"""

import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- the allowlists -------------------------------------------------------------------------------
# requirements.txt's distributions whose module is named otherwise (the rest: the name itself)
MODULE_OF = {"huggingface-hub": "huggingface_hub"}

# requirements.txt's distributions that no file imports, and why they are listed all the same
NOT_IMPORTED = {
    "gguf": "transformers reads the default model's GGUF file with it",
    "accelerate": "transformers loads the GGUF file with it",
    "ruff": "a command, run by tests/test_style.py",
}

# (file, module) imported under try/except ImportError: the tests that run both branches. A new
# optional package, e.g. a guarded `import triton` in exact.py, gets its line here:
#     ("exact.py", "triton"): ("tests/test_exact.py::test_...",  # triton there (or faked)
#                              "tests/test_exact.py::test_..."),  # triton missing
GUARDED = {
    ("specdec/benching/methods.py", "llama_cpp"): (
        "tests/test_bench_cli.py::test_methods_all_runs_llama_cpp_where_installed",
        "tests/test_bench_cli.py::test_a_benchmark_of_the_default_model_says_how_to_add_llama_cpp",
    ),
}

# (file, module) imported without a guard of its own, only ever reached through one in GUARDED,
# or in another environment than requirements.txt's, behind a test's skip
BEHIND_A_GUARD = {
    ("specdec/benching/vllm_worker.py", "vllm"): "run only in vLLM's own virtual environment "
    "(requirements-vllm.txt), as the process of one of bench.py's vLLM engines (in_vllm.py finds "
    "a python that imports vllm first, else refuses), by "
    "tests/test_vllm.py::test_medusa_heads_in_vllm_keep_plain_greedy_replies_and_are_accepted and "
    "tests/test_vllm.py::test_bench_runs_vllm_beside_plain_decoding, "
    "which skip where vLLM is not installed",
    (
        "specdec/loading/checkpoint.py",
        "llama_cpp",
    ): "default_gguf_as, called only for bench.py's llama.cpp methods "
    "(tests/test_bench_cli.py::test_llama_cpp_methods_decode_the_same_prompt_ids_on_torch_threads)",
}


# --- the checker ----------------------------------------------------------------------------------


def catches_import_error(handler):
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names
    )


def imports(source):
    """[(top-level module, line, guarded)] of every absolute import in `source`, function-level ones
    included; guarded: inside the body of a try whose handlers catch ImportError."""
    found = []

    def visit(node, guarded):
        if isinstance(node, ast.Import):
            found.extend((a.name.split(".")[0], node.lineno, guarded) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.module.split(".")[0], node.lineno, guarded))
        for field, value in ast.iter_fields(node):
            body_of_guard = (
                isinstance(node, ast.Try)
                and field == "body"
                and any(catches_import_error(h) for h in node.handlers if h.type is not None)
            )
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    visit(child, guarded or body_of_guard)

    visit(ast.parse(source), False)
    return found


def unlisted(path, source, required, project):
    """One line for each import in `source` (the file `path`, relative to the root) that a clean
    environment with the modules `required` would not have, nor explain."""
    lines = []
    for module, line, guarded in imports(source):
        if module in sys.stdlib_module_names or module in project or module in required:
            continue
        if (path, module) in (GUARDED if guarded else BEHIND_A_GUARD):
            continue
        why = (
            "imported under try/except ImportError; name the tests that run both branches in "
            "tests/test_imports.py's GUARDED"
            if guarded
            else "not in requirements.txt, nor the standard library's or the project's"
        )
        lines.append(f"{path}:{line}: import {module}: {why}")
    return lines


def requirements():
    """The distribution names requirements.txt lists, as written."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        lines = [line.split("#")[0].strip() for line in f]
    return [re.split(r"[\s<>=!~;\[]", line)[0] for line in lines if line]


def module_of(dist):
    return MODULE_OF.get(dist, dist)


def project_files():
    """{path relative to the root: source} of every .py file, hidden folders and virtual
    environments left out."""
    files = {}
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [
            s
            for s in subfolders
            if not s.startswith(".")
            and s != "__pycache__"
            and not os.path.exists(os.path.join(folder, s, "pyvenv.cfg"))
        ]
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    files[os.path.relpath(path, ROOT)] = f.read()
    return files


def test_every_import_is_installed_by_requirements_or_guarded_and_tested():
    files = project_files()
    assert {"bench.py", "tests/test_imports.py", "experiments/merged_rules.py"} <= set(files)
    project = {os.path.basename(p)[:-3] for p in files} | {"specdec"}  # the package
    required = {module_of(d) for d in requirements()}
    lines = [
        line
        for p, source in sorted(files.items())
        for line in unlisted(p, source, required, project)
    ]
    assert not lines, "\n".join(lines)


def test_the_allowlists_are_current():
    """Each entry names an import that is there, as it says (guarded or not), and tests that
    exist; each distribution requirements.txt lists is imported somewhere or says why not."""
    files = project_files()
    seen = {(p, m, g) for p, source in files.items() for m, _, g in imports(source)}
    for path, module in GUARDED:
        assert (path, module, True) in seen, f"GUARDED: no guarded import {module} in {path}"
    for path, module in BEHIND_A_GUARD:
        assert (path, module, False) in seen, f"BEHIND_A_GUARD: no import {module} in {path}"
    tests = [t for named in GUARDED.values() for t in named] + [
        t for why in BEHIND_A_GUARD.values() for t in re.findall(r"tests/\S+::\w+", why)
    ]
    for test in tests:
        path, name = test.split("::")
        assert f"\ndef {name}(" in files.get(path, ""), f"{test}: no such test"
    imported = {m for _, m, _ in seen}
    for dist in requirements():
        assert (module_of(dist) in imported) != (dist in NOT_IMPORTED), (
            f"requirements.txt's {dist}: imported, or in NOT_IMPORTED with a reason; not both"
        )
    for dist in set(MODULE_OF) | set(NOT_IMPORTED):
        assert dist in requirements(), f"{dist}: not in requirements.txt"


def test_the_checker_finds_an_unlisted_import():
    source = """
import os
import numpy as np
from tree import build
try:
    import llama_cpp
except (ModuleNotFoundError, OSError):
    llama_cpp = None


def plot():
    import matplotlib.pyplot as plt
    try:
        import triton
    except ImportError:
        pass
    try:
        import yaml
    except Exception:
        pass
"""
    assert imports(source) == [
        ("os", 2, False),
        ("numpy", 3, False),
        ("tree", 4, False),
        ("llama_cpp", 6, True),
        ("matplotlib", 12, False),
        ("triton", 14, True),
        ("yaml", 18, False),  # `except Exception` is no guard of an import
    ]
    methods = "specdec/benching/methods.py"
    lines = unlisted(methods, source, {"numpy", "matplotlib"}, {"tree"})
    assert [line.split(":")[:3] for line in lines] == [
        [methods, "14", " import triton"],  # guarded but not in GUARDED
        [methods, "18", " import yaml"],
    ]  # llama_cpp: methods.py's is in GUARDED
    missing = unlisted(methods, source, {"numpy"}, {"tree"})
    assert f"{methods}:12: import matplotlib: not in requirements.txt" in missing[0]
    assert unlisted("tuning.py", source, {"numpy"}, {"tree"})[0].startswith(
        "tuning.py:6: import llama_cpp: imported under try/except ImportError"
    )
