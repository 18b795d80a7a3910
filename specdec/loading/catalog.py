"""What a user may name on the command line, and what bench.py tuned beside the heads: the
shipped heads and their kinds, --heads, --tree, --draft and the drafters they build, checked
before a model loads where they can be. Used by generate.py, bench.py, tuning.py, joint.py and
export.py; it imports the teaching files, never the scripts.

    SHIPPED, JOINT_KINDS, shipped                the heads trained for the default model
    find_heads, heads_folder, load_heads         --heads: a kind's name, a folder, none or auto
    load_eagle3                                  --draft eagle3's layer: --heads auto or a folder
    parse_tree, load_tree                        --tree: a spec, or the tuned tree beside the heads
    tuned_tree_file, tuned_parallel              the files bench.py --tune-* saved for a machine
    DRAFT_DEFAULTS, parse_draft, draft_settings  --draft and the settings of its drafter
    DraftFlags, draft_flags                      --draft with --heads, --tree, --draft-model
    parse_skip, skip_spec, check_skip, tuned_skip   --draft skip[:LAYERS]: the layers it skips
    skip_set                                     the tuned skip set, else a default one
    load_draft_model, pass_drafter, make_drafter the drafter itself, once the model has loaded
    load_drafter                                 generate.py's drafter
    UNTUNED_BUDGETS, for_batches, batch_drafter  many rows: the tuned budget, else a safe rule
    check_online_save, save_online               where --online's adapted heads are saved
    heads_and_lookup                             --draft heads+lookup, with the rules that pay
    check_exact, load_model, cuda_graphs         --quantize, --exact and --cuda-graphs: the step

Test: `python -m pytest -q tests/test_cli.py tests/test_generate.py`.
"""

import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass

import torch

from specdec.loading import checkpoint
from specdec import drafters as drafters_lib
from specdec import eagle3 as eagle3_lib
from specdec.fast import exact
from specdec.fast import graphs
import heads as heads_lib
from specdec.fast import kernels
import tree as tree_lib
import verify as verify_lib
from specdec.cli import UsageError, check_seed, empty_folder, notice, plural

# the repository, two folders above this file
HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = os.path.join(HERE, "weights", "smollm2-135m-instruct")  # heads trained by train.py

# heads trained with the base model's last layers (joint.py)
JOINT_KINDS = (
    "medusa-2",
    "hydra++-2",
)


# --- heads: --heads -------------------------------------------------------------------------------


def shipped(folder):
    """Whether `folder` is SHIPPED or inside it: the heads that come with the repository."""
    return (os.path.abspath(folder) + os.sep).startswith(os.path.abspath(SHIPPED) + os.sep)


# The first 16 hex digits of the sha256 of each shipped kind's heads.safetensors, as shipped
# (tests/test_train_cli.py checks them): a shipped folder whose weights differ holds heads trained
# since, in place (train.py --retrain-shipped), and the banner says so.
SHIPPED_WEIGHTS = {
    "medusa": "53eaa70dc556f320",
    "hydra": "f7eb1ee44f959fdb",
    "hydra++": "f7bbe927d28ff4bb",
}


def retrained(folder):
    """Whether `folder` is a shipped kind's folder whose heads are no longer the ones shipped
    (their weights' digest differs from SHIPPED_WEIGHTS, or they are gone)."""
    want = SHIPPED_WEIGHTS.get(os.path.basename(os.path.normpath(folder)))
    if want is None or not shipped(folder):
        return False
    digest = hashlib.sha256()
    try:
        with open(os.path.join(folder, checkpoint.HEADS_WEIGHTS), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return True
    return digest.hexdigest()[:16] != want


def find_heads(name, flag="--heads"):
    """--heads -> the folder to load heads from, or None (plain decoding). A kind's name is the
    shipped heads of that kind; where none are shipped, a folder of that name (joint.py --out
    medusa-2, say) is the user's own. Loads nothing."""
    if name == "none":
        return None
    if name == "auto":
        folder = os.path.join(SHIPPED, "hydra++")
        return folder if os.path.isdir(folder) else None
    if name in heads_lib.KINDS + JOINT_KINDS + (eagle3_lib.KIND,):
        folder = os.path.join(SHIPPED, name)
        if os.path.isdir(folder):
            return folder
        if os.path.isdir(name):
            return name
        how = (
            f"python -m specdec.training.joint --init {name.removesuffix('-2')} --out FOLDER"
            if name in JOINT_KINDS
            else f"train.py --heads {name} --out FOLDER"
            + (" --data FILE" if name == eagle3_lib.KIND else "")
        )
        raise UsageError(
            f"{flag} {name}: no {name} heads are shipped in {SHIPPED}; train them with {how}, "
            f"then pass {flag} FOLDER"
        )
    if os.path.isdir(name):
        return name
    raise UsageError(
        f"{flag} {name}: not a heads folder nor one of none, auto, "
        f"{', '.join(heads_lib.KINDS + JOINT_KINDS + (eagle3_lib.KIND,))}"
    )


def check_heads_in(folder, where):
    """`folder` holds heads as checkpoint.save_heads writes them: a readable heads.json and the
    weights. `where`: the flag and its value, for the error. Reads heads.json only."""
    for file in (checkpoint.HEADS_CONFIG, checkpoint.HEADS_WEIGHTS):
        if not os.path.isfile(os.path.join(folder, file)):
            raise UsageError(
                f"{where}: no heads there ({file} missing); pass a folder train.py wrote (its "
                "--out)"
            )
    try:
        checkpoint.read_config(os.path.join(folder, checkpoint.HEADS_CONFIG))
    except ValueError as e:  # heads.HeadsError: a garbled heads.json
        raise UsageError(f"{where}: {e}; pass a folder train.py wrote (its --out)") from None


def heads_folder(heads_dir, kind):
    """The heads of `kind` for --heads-dir: the folder itself if it holds heads of that kind (what
    train.py or joint.py writes), else its KIND/ or heads-KIND/ (train.py's default name)
    sub-folder;
    or None. A joint kind (medusa-2) is heads of its frozen kind (medusa) with a LoRA delta."""
    frozen = kind.removesuffix("-2")
    for folder in (
        heads_dir,
        os.path.join(heads_dir, kind),
        os.path.join(heads_dir, "heads-" + kind),
    ):
        try:
            with open(os.path.join(folder, checkpoint.HEADS_CONFIG)) as f:
                if json.load(f).get("kind") == frozen and checkpoint.has_delta(folder) == (
                    kind != frozen
                ):
                    return folder
        except (OSError, ValueError, AttributeError):
            continue
    return None


def load_heads(name, model):
    """--heads: none, auto, a shipped kind, or a folder. Returns (heads or None, their folder).
    Heads trained jointly with the base model (joint.py) bring a LoRA delta: it is merged into the
    model's weights here, so the model is changed from then on (a notice says how)."""
    folder = find_heads(name)
    if folder is None:
        return None, None
    if eagle3_lib.is_eagle3(folder):
        raise UsageError(
            f"--heads {name}: {folder} holds an EAGLE-3 layer, which drafts with --draft eagle3; "
            "add it, or give heads that train.py --heads medusa | hydra | hydra++ wrote"
        )
    try:
        heads = checkpoint.load_heads(folder, model)
        if checkpoint.has_delta(folder):
            notice(
                checkpoint.merge_delta(model, folder)
                + "; --heads none decodes with the original model"
            )
        return heads, folder
    except heads_lib.HeadsError as e:
        if name == "auto":
            return None, None  # shipped heads belong to the default model; another model runs plain
        raise UsageError(f"--heads {name}: {e}") from None


def load_eagle3(name, model):
    """--heads with --draft eagle3: auto (or eagle3) = the shipped layer, a folder train.py
    --heads eagle3 wrote, or none (plain decoding). Returns (the layer or None, its folder); auto
    where none is shipped, or it was trained for another model, is plain decoding, as heads are."""
    if name == "none":
        return None, None
    folder = os.path.join(SHIPPED, eagle3_lib.KIND) if name == "auto" else find_heads(name)
    if name == "auto" and not os.path.isdir(folder):
        return None, None
    try:
        return eagle3_lib.load(folder, model), folder
    except heads_lib.HeadsError as e:
        if name == "auto":
            return None, None
        raise UsageError(f"--heads {name}: {e}") from None


# --- trees: --tree, and the tuned files beside the heads ------------------------------------------


def budget_file(folder, model, quant):
    """budget-DEVICE-DTYPE.json beside the heads (--quantize's, else the model's own), or None."""
    files = [
        tuned_tree_file(folder, model.device, model.dtype, "budget", q) for q in (quant, "none")
    ]
    return next((f for f in files if os.path.exists(f)), None)


def batch_trees(folder, model, tree, quant="none"):
    """{B: tree.Tree}: the trees by batch size that bench.py --tune-tree chose for this machine
    and saved beside the heads (budget_file), each used from B rows on, and `tree` (the heads'
    tree, the banner's) for a row alone; None where it chose none."""
    file = budget_file(folder, model, quant)
    if file is None:
        return None
    try:
        with open(file) as f:
            table = json.load(f)["by_batch"]
        trees = {
            int(B): tree_lib.build([tuple(p) for p in row["paths"]]) for B, row in table.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(
            f"{file}: not a table of trees by batch size ({e}); run bench.py --tune-tree again, "
            "or delete it"
        ) from None
    return trees | {1: tree}  # alone, a row drafts the banner's tree, as at --batch-size 1


def shared_budgets(folder, model, quant="none"):
    """(the tree every row draws its candidates from, {B: nodes past the roots}, {B: the depth they
    are drawn down to}, {B: expected speedup}): the budgets a batch shares that bench.py
    --tune-tree chose for this machine (budget_file's "shared"), each used from B rows on; None
    where it chose none."""
    file = budget_file(folder, model, quant)
    if file is None:
        return None
    try:
        with open(file) as f:
            shared = json.load(f).get("shared")
        if shared is None:
            return None
        pool = tree_lib.build([tuple(p) for p in shared["pool"]])
        rows = {int(B): row for B, row in shared["by_batch"].items()}
        budgets = {B: int(row["extra"]) for B, row in rows.items()}
        depths = {B: int(row.get("depth", pool.max_depth)) for B, row in rows.items()}
        assert 1 in budgets and all(E >= 0 for E in budgets.values()), "budgets from batch 1, >= 0"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, AssertionError) as e:
        raise UsageError(
            f"{file}: not a table of budgets by batch size ({e}); run bench.py --tune-tree again, "
            "or delete it"
        ) from None
    return pool, budgets, depths, {B: row.get("expected_speedup") for B, row in rows.items()}


def parse_tree(spec):
    """--tree spec -> paths (tree.parse: data only, nothing in it is ever evaluated)."""
    try:
        return tree_lib.parse(spec)
    except (ValueError, OSError) as e:
        raise UsageError(f"--tree: {e}") from None


def tuned_tree_file(folder, device, dtype, stem="tree", quant="none"):
    """Where bench.py --tune-tree saves the tree it chose for this machine, e.g.
    tree-cpu-avx2-bfloat16.json (tree-cpu-avx2-float32-fp16.json with --quantize fp16): the best
    tree depends on what a step of N tokens costs there, so on a CPU the file names the kernels.c
    path it runs (kernels.native_path(); "generic" where none does) besides the device and dtype.
    Stem "parallel": where --tune-parallel saves jacobi's, lookahead's and pass's settings;
    "layers": --tune-layers'; "skip": --tune-skip's."""
    name = f"{stem}-{cpu_path(device)}-{str(dtype).removeprefix('torch.')}"
    if quant != "none":
        name += f"-{quant}"
    return os.path.join(folder, name + ".json")


def cpu_path(device):
    """The device as a tuned file's name says it: cpu-PATH (kernels.native_path(), "generic" where
    none runs) on a CPU, else the device type."""
    where = torch.device(device).type
    return where + "-" + (kernels.native_path() or "generic") if where == "cpu" else where


def tuned_parallel(folder, model, kind):
    """The settings bench.py --tune-parallel saved in `folder` for `kind` (jacobi or lookahead) on
    this model, device and dtype, checked like the flags; {} if there are none."""
    file = tuned_tree_file(folder, model.device, model.dtype, "parallel")
    try:
        with open(file, encoding="utf-8") as f:
            saved = json.load(f)
        if saved.get("model") != model.cfg.name or kind not in saved:
            return {}
        settings = {k: saved[kind][k] for k in DRAFT_DEFAULTS[kind]}
    except OSError:
        return {}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise UsageError(
            f"{file}: not a settings file of bench.py --tune-parallel; run it again or delete the "
            "file"
        ) from None
    if not all(type(v) is int and v >= 1 for v in settings.values()):
        raise UsageError(
            f"{file}: {kind} settings {settings} are not all whole numbers >= 1; run bench.py "
            "--tune-parallel again"
        )
    check_sizes(kind, settings, f"{file}: ")
    return settings


def expected_speedup(file):
    """What bench.py --tune-tree expected of the tree in `file` against plain decoding, or None
    (a tree file written by hand, or before the tuner recorded it)."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f).get("expected_speedup")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def load_tree(spec, heads, heads_folder, quant="none"):
    """--tree: a spec, or auto = the tree saved next to the heads (the one tuned for this device,
    dtype and the base model's --quantize if there is one, else for the device and dtype, else
    tree.json), else a chain as deep as the heads."""
    if heads is None:
        return None
    weight = next(heads.parameters())
    saved = None
    if heads_folder:
        tuned = tuned_tree_file(heads_folder, weight.device, weight.dtype, quant=quant)
        if not os.path.exists(tuned):
            tuned = tuned_tree_file(heads_folder, weight.device, weight.dtype)
        saved = tuned if os.path.exists(tuned) else os.path.join(heads_folder, "tree.json")
    if spec != "auto":
        paths = parse_tree(spec)
    elif saved and os.path.exists(saved):
        paths, spec = parse_tree(saved), saved
        speedup = expected_speedup(saved)
        if speedup is not None and speedup < 1:
            notice(
                f"{saved}: bench.py --tune-tree expected these heads at {speedup:.2f}x plain "
                "decoding on "
                "this machine; --heads none (plain decoding) is faster here"
            )
        if weight.device.type != "cpu" and saved != tuned:
            notice(
                f"no tree tuned for {weight.device.type} and "
                f"{str(weight.dtype).removeprefix('torch.')} in {heads_folder}: "
                f"using {os.path.basename(saved)}, tuned on a CPU; bench.py --tune-tree picks one "
                "for this machine"
            )
    else:
        paths = tree_lib.chain(heads.cfg.num_heads)
    t = tree_lib.build(paths)
    if t.max_depth > heads.cfg.num_heads:
        raise UsageError(
            f"--tree {spec}: depth {t.max_depth} needs {t.max_depth} heads, the heads have "
            f"{heads.cfg.num_heads}; use a tree at most {heads.cfg.num_heads} deep"
        )
    vocab = heads.cfg.kept_tokens or heads.cfg.vocab_size
    if t.num_nodes > 1 and int(t.rank.max()) >= vocab:
        raise UsageError(
            f"--tree {spec}: rank {int(t.rank.max())} asks a head for its "
            f"top-{int(t.rank.max()) + 1} "
            f"tokens, the heads predict {vocab}; use smaller ranks"
        )
    return t


# --- drafters: --draft --------------------------------------------------------------------------
# Everything that needs no model is checked before one loads: a typo costs a second, not a load.


def parse_draft(spec):
    """--draft -> (kind, arg): kind is heads, lookup, heads+lookup, layers, skip, model, jacobi,
    lookahead or pass; arg is N for layers:N, the skipped layers for skip:LAYERS (None for skip:
    the tuned set), the [LA] tokens' folder for pass[:FOLDER] (the shipped ones without)."""
    if spec == "pass" or spec.startswith("pass:"):
        folder = spec[5:] or os.path.join(SHIPPED, "pass")
        if not os.path.isfile(os.path.join(folder, checkpoint.TOKENS_CONFIG)):
            raise UsageError(
                f"--draft {spec}: no [LA] tokens in {folder}; train them with "
                "python -m specdec.training.pass_tokens --out FOLDER, then --draft pass:FOLDER"
            )
        return "pass", folder
    if m := re.fullmatch(r"layers:(-?[0-9]+)", spec):
        if int(m[1]) < 1:
            raise UsageError(
                f"--draft {spec}: N is how many of the model's first layers draft, at least 1; "
                "use layers:1 or more"
            )
        return "layers", int(m[1])
    if spec.startswith("skip:"):
        return "skip", parse_skip(spec, spec[5:])
    if spec in DRAFTERS and spec != "layers":  # layers takes its N
        return spec, None
    kinds = [
        {"layers": "layers:N (N a number)", "skip": "skip[:LAYERS]"}.get(k, k) for k in DRAFTERS
    ]
    kinds = [k + "[:FOLDER]" if k == "pass" else k for k in kinds]
    raise UsageError(f"--draft {spec}: unknown drafter; use {', '.join(kinds[:-1])} or {kinds[-1]}")


# --- skip: which layers the self-speculative draft leaves out ------------------------------------
# Written as layer numbers from 0 and inclusive ranges, comma-separated: skip:2,5,9-12 skips layers
# 2, 5, 9, 10, 11 and 12 and drafts with the others. Plain `skip` takes the set bench.py --tune-skip
# saved for this model and machine.


def parse_skip(spec, text):
    """The LAYERS of --draft skip:LAYERS -> the skipped layers, sorted, each once. Needs no model:
    that the model has them is check_skip's, once it has loaded."""
    if not text.strip():
        raise UsageError(
            f"--draft {spec}: names no layer to skip; write the skipped layers (from 0) as e.g. "
            "skip:2,5,9-12, or plain skip for the tuned set"
        )
    skipped = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", part)
        if not m or (m[2] is not None and int(m[2]) < int(m[1])):
            raise UsageError(
                f"--draft {spec}: '{part}' is not a layer number nor a range FIRST-LAST; write the "
                "skipped layers (from 0) as e.g. skip:2,5,9-12"
            )
        skipped.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    return tuple(sorted(skipped))


def skip_spec(skipped):
    """(2, 5, 9, 10, 11, 12) -> "2,5,9-12": parse_skip's syntax, runs written as ranges."""
    runs = []
    for i in skipped:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_skip(where, skipped, n_layers):
    """A skip set that leaves the model something to draft with and is not the model itself."""
    if not skipped:
        raise UsageError(
            f"{where}: skips no layer, so the draft would be the model itself; name at least one "
            "layer to skip"
        )
    if skipped[-1] >= n_layers:
        raise UsageError(
            f"{where}: the model has {n_layers} layers, numbered 0 to {n_layers - 1}; layer "
            f"{skipped[-1]} is not one of them"
        )
    if len(skipped) == n_layers:
        raise UsageError(
            f"{where}: skips all {n_layers} layers, which leaves nothing to draft with; keep at "
            "least one"
        )


def default_skip(n_layers):
    """The set `skip` drafts with where none was tuned: every other layer of the second half."""
    return tuple(range(n_layers // 2 + 1, n_layers, 2))


def tuned_skip(folder, model):
    """The skipped layers and gamma bench.py --tune-skip saved in `folder` for this device, CPU
    path and dtype, or None where it saved none. A file for another model or CPU path is refused:
    its set says nothing about this one."""
    file = tuned_tree_file(folder, model.device, model.dtype, "skip")
    if not os.path.exists(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            saved = json.load(f)
        skipped, gamma = tuple(saved["skip"]), saved["gamma"]
        name, path = saved["model"], saved["path"]
        if not all(type(i) is int and i >= 0 for i in skipped + (gamma,)):
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise UsageError(
            f"{file}: not a settings file of bench.py --tune-skip; run it again or delete the file"
        ) from None
    if name != model.cfg.name:
        raise UsageError(
            f"{file}: tuned for {name}, not {model.cfg.name}; give the layers to skip, --draft "
            "skip:LAYERS (bench.py --tune-skip --model ... searches a set)"
        )
    if path != cpu_path(model.device):
        raise UsageError(
            f"{file}: tuned on the {path} path, this machine runs {cpu_path(model.device)}; run "
            "bench.py --tune-skip here or give the layers, --draft skip:LAYERS"
        )
    check_skip(file, tuple(sorted(set(skipped))), model.cfg.n_layers)
    check_sizes("skip", {"gamma": gamma}, f"{file}: ")
    return tuple(sorted(set(skipped))), gamma


def skip_set(folder, model):
    """(skipped layers, gamma, tuned): what bench.py --tune-skip saved in `folder` for this model
    and machine, else default_skip at DRAFT_DEFAULTS' gamma (tuned False)."""
    tuned = tuned_skip(folder, model)
    if tuned is None:
        return default_skip(model.cfg.n_layers), DRAFT_DEFAULTS["skip"]["gamma"], False
    return *tuned, True


def check_sizes(kind, settings, where):
    """The drafter's settings (as given by `where`) fit one forward of at most MAX_NODES nodes."""
    if (
        kind in ("lookup", "heads+lookup")
        and settings["gamma"] * settings["matches"] >= tree_lib.MAX_NODES
    ):
        raise UsageError(
            f"{where}gamma {settings['gamma']} x {where}matches {settings['matches']}: the lookup "
            "tree would be "
            f"over MAX_NODES={tree_lib.MAX_NODES}; use smaller values"
        )
    if kind in ("layers", "skip", "model", "jacobi") and settings["gamma"] >= tree_lib.MAX_NODES:
        raise UsageError(
            f"{where}gamma {settings['gamma']}: the chain would be over "
            f"MAX_NODES={tree_lib.MAX_NODES}; use a smaller {where}gamma"
        )
    nodes = (
        (settings["gamma"] + settings["guesses"]) * (settings["gamma"] + 1) if kind == "pass" else 0
    )  # PaSS.max_nodes
    if nodes > tree_lib.MAX_NODES:
        raise UsageError(
            f"{where}gamma {settings['gamma']}, {where}guesses {settings['guesses']}: a step "
            "would compute "
            f"{nodes} nodes, over MAX_NODES={tree_lib.MAX_NODES}; use smaller values"
        )
    if kind == "lookahead":
        w, n, g = settings["window"], settings["ngram"], settings["guesses"]
        if n < 2:
            raise UsageError(
                f"{where}ngram {n}: lookahead's n-grams are a first token and at least one more; "
                f"use {where}ngram 2 or more"
            )
        # drafters.Lookahead.max_nodes
        if 1 + g * (n - 1) + (w - 1) + (n - 2) * w > tree_lib.MAX_NODES:
            raise UsageError(
                f"{where}window {w}, {where}ngram {n}, {where}guesses {g}: a step would compute "
                f"{(w - 1) + (n - 2) * w} "
                f"window nodes and verify up to {g * (n - 1)}, over "
                f"MAX_NODES={tree_lib.MAX_NODES}; use smaller values"
            )


def draft_settings(kind, spec, given):
    """The settings of --draft `spec` (of `kind`): `given`, the flags among --gamma, --ngram,
    --matches, --window and --guesses that were set, over DRAFT_DEFAULTS; checks that each given
    flag is one the drafter takes and that together they fit a step. Loads nothing."""
    takes = DRAFT_DEFAULTS.get("lookup" if kind == "heads+lookup" else kind, {})
    for k, v in given.items():
        if k not in takes:
            users = [
                {"lookup": "lookup, heads+lookup", "layers": "layers:N", "skip": "skip"}.get(d, d)
                for d, t in DRAFT_DEFAULTS.items()
                if k in t
            ]
            users = ", ".join(users[:-1]) + " and " + users[-1] if len(users) > 1 else users[0]
            raise UsageError(f"--{k} does not apply to --draft {spec} (only to {users}); drop it")
        if v < 1:
            raise UsageError(f"--{k} {v}: must be at least 1")
    settings = takes | given
    check_sizes(kind, settings, "--")
    return settings


@dataclass
class DraftFlags:
    """generate.py's --draft and the flags that go with it, as the checks found them."""

    spec: str  # as given, for messages: "layers:2"
    kind: str  # heads, lookup, heads+lookup, layers, skip, model, jacobi, lookahead or pass
    arg: object  # N of layers:N, skip's layers (None: the tuned set), pass's folder; else None
    settings: dict  # the drafter's gamma, ngram, ...: the flags given over DRAFT_DEFAULTS
    given: dict  # the flags given among them (a tuned setting never overrides one)
    heads: str  # --heads: none, auto, a kind or a folder
    tree: str  # --tree: auto or a spec
    draft_model: str  # --draft-model, or None


def draft_flags(spec, given, heads, tree, draft_model):
    """--draft `spec` with the size flags `given`, --heads, --tree and --draft-model, checked
    before a model loads: each goes with the drafters that use it, and only those."""
    kind, arg = parse_draft(spec)
    draft = DraftFlags(
        spec, kind, arg, draft_settings(kind, spec, given), given, heads, tree, draft_model
    )
    with_heads = kind in ("heads", "heads+lookup", "eagle3")  # eagle3: its layer as the heads
    if heads == "none" and tree != "auto":
        raise UsageError("--tree needs draft heads; drop --tree or pass --heads")
    if not with_heads and tree != "auto":
        raise UsageError(
            f"--tree shapes the heads' tree, --draft {spec} has none; drop --tree or use "
            "--draft heads or heads+lookup"
        )
    if not with_heads and heads not in ("auto", "none"):
        raise UsageError(
            f"--heads {heads}: --draft {spec} drafts without heads; drop --heads or use --draft "
            "heads or heads+lookup"
        )
    if kind == "heads+lookup" and heads == "none":
        raise UsageError(
            "--draft heads+lookup needs heads, not --heads none; name them or use --draft lookup"
        )
    if kind == "model" and not draft_model:
        raise UsageError(
            "--draft model needs --draft-model NAME: a Llama-family folder or hub id with the "
            "same tokenizer as --model"
        )
    if kind != "model" and draft_model:
        raise UsageError(
            f"--draft-model is used by --draft model, not --draft {spec}; add --draft model or "
            "drop --draft-model"
        )
    return draft


def load_draft_model(name, model, tokenizer, device, dtype):
    """--draft-model: a Llama-family model whose vocabulary is the base model's, token for token."""
    try:
        draft_model, draft_tokenizer = checkpoint.load(name, device, dtype)
    except checkpoint.LoadError as e:
        raise UsageError(f"--draft-model {name}: {e}") from None
    ours, theirs = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if ours != theirs or draft_model.cfg.vocab_size != model.cfg.vocab_size:
        differ = len(set(ours.items()) ^ set(theirs.items()))
        raise UsageError(
            f"--draft-model {name}: its vocabulary differs from the model's ({len(theirs)} "
            f"against {len(ours)} "
            f"tokens, {differ} entries differ; embeddings of {draft_model.cfg.vocab_size} against "
            f"{model.cfg.vocab_size} rows); use a draft model with the same tokenizer"
        )
    return draft_model


def pass_drafter(folder, gamma, guesses, model):
    """--draft pass: the [LA] tokens in `folder`, trained for this model: `guesses` first tokens, a
    chain of gamma."""
    try:
        embeddings = checkpoint.load_tokens(folder, model)
    except heads_lib.HeadsError as e:
        raise UsageError(f"--draft pass: {e}") from None
    if gamma > len(embeddings):
        raise UsageError(
            f"--gamma {gamma}: {folder} holds {plural(len(embeddings), '[LA] token')}, so "
            "pass drafts at "
            f"most {len(embeddings)} a step; "
            f"use --gamma {len(embeddings)} or fewer"
        )
    return drafters_lib.PaSS(model, embeddings, gamma, guesses)


def heads_and_lookup(heads, gamma: int, ngram: int, matches: int, device):
    """The heads' drafter and prompt lookup in one tree, as --draft heads+lookup and bench's
    hydra++-lookup run them. Three rules make the pair pay where either alone would (each measured:
    results/merged-rules.md): lookup's chain adapts its length (Lookup.accept) and is verified alone
    while it copies; only matches of 2 tokens or more are proposed (a 1-token match in free writing
    is mostly a common token, and its chain costs nodes); and the step keeps about the heads' tuned
    size (HeadsPlusLookup's floor, 4), so that the small tuned CPU trees stay whole or nearly and
    larger ones are trimmed."""
    lookup = drafters_lib.Lookup(gamma, ngram, matches, device, adapt=True, shortest=min(2, ngram))
    return drafters_lib.HeadsPlusLookup(heads, lookup, device, floor=4)


@dataclass
class Build:
    """What a drafter is built from once the model has loaded (load_drafter fills it)."""

    arg: object  # parse_draft's: N of layers:N, the skipped layers of skip, pass's folder
    settings: dict  # gamma, ngram, ...: the flags given over the kind's defaults
    model: object  # the base model
    heads: object  # the loaded heads, or None
    tree: object  # their tree (tree.Tree), or None
    draft_model: object  # --draft-model's, or None
    temperature: float  # model drafters sample their drafts at it (0: greedy)
    top_p: float
    generator: object  # their generator


def heads_or_plain(b):  # the heads' drafter; at --heads none (or none for this model): plain
    if b.heads is None:
        return drafters_lib.Plain(b.model.device)
    return drafters_lib.HeadsDrafter(b.heads, b.tree)


def eagle3(b):  # EAGLE-3's layer on its tree; at --heads none (or none for this model): plain
    if b.heads is None:
        return drafters_lib.Plain(b.model.device)
    return eagle3_lib.Eagle3Drafter(b.heads, b.tree)


def lookup(b):
    s = b.settings
    return drafters_lib.Lookup(s["gamma"], s["ngram"], s["matches"], b.model.device)


def heads_plus_lookup(b):
    s = b.settings
    heads = drafters_lib.HeadsDrafter(b.heads, b.tree)
    return heads_and_lookup(heads, s["gamma"], s["ngram"], s["matches"], b.model.device)


def first_layers(b):  # layers:N, the model's first N layers
    gamma = b.settings["gamma"]
    run = range(b.arg)
    name = f"layers:{b.arg}"
    return drafters_lib.ModelDrafter(b.model, gamma, b.temperature, b.top_p, b.generator, run, name)


def skipped_layers(b):  # b.arg: the skipped layers (skip_layers resolves plain `skip` to a set)
    gamma = b.settings["gamma"]
    kept = [i for i in range(b.model.cfg.n_layers) if i not in b.arg]
    name = f"skip:{skip_spec(b.arg)}"
    return drafters_lib.ModelDrafter(
        b.model, gamma, b.temperature, b.top_p, b.generator, kept, name
    )


def draft_model(b):
    gamma = b.settings["gamma"]
    return drafters_lib.ModelDrafter(b.draft_model, gamma, b.temperature, b.top_p, b.generator)


def jacobi(b):
    return drafters_lib.Jacobi(b.settings["gamma"], b.model.device)


def lookahead(b):
    s = b.settings
    return drafters_lib.Lookahead(s["window"], s["ngram"], s["guesses"], b.model.device)


def pass_tokens(b):
    return pass_drafter(b.arg, b.settings["gamma"], b.settings["guesses"], b.model)


@dataclass(frozen=True)
class DraftKind:
    """One --draft kind: how it is built, and the size flags it takes with their defaults."""

    build: object  # Build -> the drafter (a drafters.Drafter)
    defaults: dict  # its settings among --gamma, --ngram, --matches, --window and --guesses
    parallel: bool = False  # the model drafts for itself at nodes it computes, never verifies


# Every --draft kind. A new drafter is one class (drafters.Drafter's protocol) and one line
# register("name", lambda b: TheClass(...), {"gamma": 4}), here or in a script that imports
# catalog before it calls generate.py's cli_main: --draft name then drafts with it, in the
# command line's checks, its flags' defaults and the banner alike (README: "Adding a drafter").
DRAFTERS = {}
DRAFT_DEFAULTS = {}  # kind -> its settings' defaults, for those that take any
PARALLEL = []  # the kinds whose model drafts for itself at nodes it computes, never verifies


def register(kind, build, defaults=None, parallel=False):
    """--draft `kind` builds its drafter with build(Build) (a drafters.Drafter); defaults: its
    settings among --gamma, --ngram, --matches, --window and --guesses, {name: value}."""
    assert re.fullmatch(r"[a-z][a-z0-9+_-]*", kind), f"a drafter's name is a word, got {kind!r}"
    DRAFTERS[kind] = DraftKind(build, dict(defaults or {}), parallel)
    if defaults:
        DRAFT_DEFAULTS[kind] = DRAFTERS[kind].defaults
    if parallel:
        PARALLEL.append(kind)


register("heads", heads_or_plain)
register("lookup", lookup, {"gamma": 10, "ngram": 3, "matches": 1})
register("heads+lookup", heads_plus_lookup)  # takes lookup's flags (draft_settings)
register("layers", first_layers, {"gamma": 4})
register("skip", skipped_layers, {"gamma": 4})
register("model", draft_model, {"gamma": 4})
register("jacobi", jacobi, {"gamma": 4}, parallel=True)
register("lookahead", lookahead, {"window": 4, "ngram": 3, "guesses": 4}, parallel=True)
register("pass", pass_tokens, {"gamma": 2, "guesses": 2}, parallel=True)
register("eagle3", eagle3)  # its layer comes as `heads`, with their --heads and --tree flags


def make_drafter(kind, *build, **by_name):
    """The drafter that --draft `kind` names, from Build's fields (in its order, or by name).
    Model drafters sample their drafts at `temperature` (0: greedy)."""
    return DRAFTERS[kind].build(Build(*build, **by_name))


# --- decoding: --temperature, --top-p, --verify and --seed ---------------------------------------


def check_sampling(temperature, top_p, verify, seed):
    """A temperature, a nucleus and a seed that sampling can use, and a rule that fits them: the
    command line's check, and the API's (in its keywords' words)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise UsageError(f"--temperature {temperature}: must be a number >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise UsageError(f"--top-p {top_p}: must be in (0, 1]")
    if verify == "greedy" and not verify_lib.is_greedy(temperature):
        raise UsageError(
            "--verify greedy decodes at temperature 0; drop --temperature or use --verify sample"
        )
    check_seed(seed)


# --- generate.py's drafter, once the model has loaded ---------------------------------------------
# What --draft, --heads, --tree and --online build from the checked DraftFlags: a tuned skip set or
# parallel settings read for this machine, the drafter, and --online's learner around it.


def skip_layers(model, settings, given):
    """--draft skip without LAYERS: the layers and gamma bench.py --tune-skip chose for this
    machine (the flags given still win), else a default set, with a notice."""
    skipped, gamma, tuned = skip_set(SHIPPED, model)
    if not tuned:
        notice(
            f"--draft skip: no skip set tuned for this model and machine in {SHIPPED}; skipping "
            f"layers {skip_spec(skipped)} (bench.py --tune-skip searches one)"
        )
        return skipped, settings
    file = tuned_tree_file(SHIPPED, model.device, model.dtype, "skip")
    speedup = expected_speedup(file)
    if speedup is not None and speedup < 1:
        notice(
            f"{file}: bench.py --tune-skip expected skip at {speedup:.2f}x plain decoding on this "
            "machine; --heads none (plain decoding) is faster here"
        )
    return skipped, settings | {"gamma": gamma} | given


def load_drafter(draft, model, tokenizer, *, quantize, decoding, generator, batch_size=1):
    """The drafter DraftFlags `draft` names, once the model is loaded: heads and their tree (tuned
    for --quantize; for --batch-size > 1 the budget a batch shares, else the trees by batch size,
    where they were tuned, unless a --tree is given), a draft model, checked against the model.
    Its drafts are sampled, from `generator`, where the verification rule needs them (Leviathan's),
    else greedy."""
    kind = draft.kind
    arg = draft.arg
    settings = draft.settings
    if kind in ("heads", "heads+lookup"):
        heads, folder = load_heads(draft.heads, model)
    elif kind == "eagle3":
        heads, folder = load_eagle3(draft.heads, model)
    else:
        heads, folder = None, None
    tree = load_tree(draft.tree, heads, folder, quantize)
    if kind == "heads+lookup" and heads is None:
        raise UsageError(
            f"--draft heads+lookup: no heads are shipped for {model.cfg.name}; train them with "
            "train.py and pass --heads FOLDER, or use --draft lookup"
        )
    L = model.cfg.n_layers
    if kind == "layers" and L == 1:
        raise UsageError(
            f"--draft {draft.spec}: the model has one layer, so no fewer can draft for it; use "
            "another --draft"
        )
    if kind == "layers" and arg >= L:
        raise UsageError(
            f"--draft {draft.spec}: the model has {L} layers, so N must be 1 to {L - 1} (all of "
            "them would be the model itself)"
        )
    draft_model = None
    if kind == "model":
        draft_model = load_draft_model(
            draft.draft_model, model, tokenizer, model.device, model.dtype
        )
    if kind == "skip" and arg is None:
        arg, settings = skip_layers(model, settings, draft.given)
    if kind == "skip":
        check_skip(f"--draft {draft.spec}", arg, model.cfg.n_layers)
    if kind in PARALLEL:  # what bench.py --tune-parallel chose, under the flags given
        settings = settings | tuned_parallel(SHIPPED, model, kind) | draft.given
        check_sizes(kind, settings, "--")
    sampled = decoding["temperature"] > 0 and decoding["verify"] in ("auto", "sample")
    drafter = make_drafter(
        kind,
        arg=arg,
        settings=settings,
        model=model,
        heads=heads,
        tree=tree,
        draft_model=draft_model,
        temperature=decoding["temperature"] if sampled else 0.0,  # Leviathan's rule, else greedy
        top_p=decoding["top_p"],
        generator=generator,
    )
    if batch_size > 1:
        drafter = for_batches(drafter, draft, model, quantize)
    if drafter.max_nodes > tree_lib.MAX_NODES:
        raise UsageError(
            f"--draft {draft.spec}: trees of up to {drafter.max_nodes} nodes, over "
            f"MAX_NODES={tree_lib.MAX_NODES}; use a smaller --tree or --gamma"
        )
    return drafter


# --- many rows: the budget a batch shares ---------------------------------------------------------
# bench.py --tune-tree --max-batch N tunes the nodes a batch of B rows shares a step for one
# machine (its kernels.c path), dtype and heads. Where no table matches (another path, another
# dtype, a user's own heads), every row drafting the single row's tree lost to plain decoding from
# 4 rows (0.80x at 4, 0.78x at 8 on an AVX2 CPU). The rule instead: a small budget the batch
# shares, shrinking with the rows and plain decoding from 4 rows: below what paid on every machine
# measured, at each batch size (results/batch-budget-cpu.md, "Where no table was tuned").
UNTUNED_BUDGETS = {1: 2, 2: 2, 4: 0}  # live rows -> nodes past the roots, from B rows to the next


def for_batches(drafter, draft, model, quantize):
    """What drafts for many rows at once where `drafter`, built from DraftFlags `draft`, drafts for
    one: batch_drafter's where the heads' --tree is auto (a --tree given: that tree every row),
    UNTUNED_BUDGETS where nothing was tuned for this machine."""
    if draft.tree != "auto" or draft.heads == "none":
        return drafter
    return batch_drafter(drafter, find_heads(draft.heads), model, quantize, UNTUNED_BUDGETS)


def batch_drafter(drafter, folder, model, quantize, untuned=None):
    """What drafts for many rows at once where `drafter` drafts for one: heads (from `folder`)
    share one budget a step among the rows, as bench.py --tune-tree chose it for this machine
    (else every row drafts the tree it chose for the batch size; where it chose neither, the rows
    share the budgets `untuned` {B: nodes}, or with None every row drafts the heads' tree),
    lookup's nodes beside them for heads+lookup; any other drafter as it is."""
    if isinstance(drafter, drafters_lib.HeadsPlusLookup):
        heads = batch_drafter(drafter.heads, folder, model, quantize, untuned)
        if heads is drafter.heads:
            return drafter
        return drafters_lib.HeadsPlusLookup(
            heads, drafter.lookup, drafter.shapes.device, floor=drafter.floor
        )
    if type(drafter) is not drafters_lib.HeadsDrafter:
        return drafter
    shared = shared_budgets(folder, model, quantize)
    if shared:  # one budget a step, given to the surest nodes of every row
        tuned = f"tuned in {os.path.basename(budget_file(folder, model, quantize))}"
        return drafters_lib.HeadsShared(drafter.heads, *shared[:3], origin=tuned)
    trees = batch_trees(folder, model, drafter.tree, quantize)
    if trees:
        return drafters_lib.HeadsByBatch(drafter.heads, trees)
    if untuned is None:
        return drafter
    missing = tuned_tree_file(folder, model.device, model.dtype, "budget", quantize)
    rule = f"the default rule, no {os.path.basename(missing)} tuned"  # the file --tune-tree writes
    return drafters_lib.HeadsShared(drafter.heads, drafter.tree, untuned, origin=rule)


def check_online_save(folder):
    """--online-save, before the model loads: a new or empty folder outside the shipped heads,
    where save_online writes nothing over a run's files."""
    if shipped(folder):
        raise UsageError(
            f"--online-save {folder}: inside the shipped heads' {SHIPPED}; give a new folder"
        )
    held = checkpoint.run_files(folder)
    if held:
        raise UsageError(
            f"--online-save {folder}: it holds {', '.join(held)} (heads or a train.py run), which "
            "saving would overwrite; give a new folder"
        )
    empty_folder("--online-save", folder)  # the heads and trees go in loose


def save_online(learner, folder, heads):
    """--online-save: the adapted heads, and the trees saved beside the --heads they started
    from."""
    checkpoint.save_heads(learner.master, folder)
    start = find_heads(heads)
    for name in os.listdir(start):
        if re.fullmatch(r"tree(-.+)?\.json", name):
            shutil.copyfile(os.path.join(start, name), os.path.join(folder, name))


# --- the GPU's step -------------------------------------------------------------------------------


def check_exact(device, quantize):
    """--exact: triton, a device its kernels run on (CUDA, or a CPU under Triton's interpreter),
    and the model's own weights."""
    if quantize != "none":
        raise UsageError(f"--exact computes bf16 weights, not --quantize {quantize}; drop one")
    try:
        exact.check(device)
    except (exact.TritonMissing, ValueError) as e:
        raise UsageError(f"--exact: {e}; or drop --exact") from None


def load_model(name, device, dtype, quantize, exact_kernels):
    """The model --model names and its tokenizer, its linear layers as --quantize asks or on
    exact.py's kernels (--exact, checked before the load)."""
    if exact_kernels:
        check_exact(device, quantize)
    model, tokenizer = checkpoint.load(name, device, dtype)
    if quantize != "none":
        kernels.quantize(model, quantize)
    if exact_kernels:
        exact.use(model)
    return model, tokenizer


def cuda_graphs(flag, device):
    """--cuda-graphs auto | on | off (graphs.wanted); on where there is no CUDA runs the static
    step that the graphs would replay, uncaptured (a check of it, not a speed-up), with a notice."""
    if flag == "on" and torch.device(device).type != "cuda":
        notice(
            f"--cuda-graphs on: {device} has no CUDA graphs; the static step runs uncaptured "
            "(graphs.py)"
        )
    return graphs.wanted(flag, device)
