"""bench.py's command line on bad input: one line on stderr, "error: <what> ...; <fix>", exit code
2, no traceback, before the model loads where it can (an output folder that cannot be written is
found before the run, not after an hour of measuring); Ctrl-C prints what was measured so far and
exits 130.

Most cases call bench.cli_main(argv) in-process, with model.load replaced by a tripwire or on a tiny
random Llama saved to a folder (conftest.tiny_model_dir); Ctrl-C runs `python bench.py`.
"""

import ctypes
import json
import os
import pathlib
import shutil
import sys
import types

import pytest
import torch

from specdec import drafters
from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import cli
from specdec.fast import exact
from specdec.fast import kernels
import bench as B
from specdec.benching import in_vllm
from specdec.benching import methods as catalogue
from specdec.commands import bench as command
from specdec import tuning
from conftest import ctrl_c_after, save_tiny_model
from test_cli import check_one_line_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(capsys, *argv):
    code = B.cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def prompts_file(folder, n=3):
    path = os.path.join(folder, "prompts.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps({"id": f"p{i}", "category": "test", "prompt": f"Count to {i + 3}."})
                + "\n"
            )
    return path


def short_run(folder, model=None, limit=1, max_new_tokens=4, repeats=1):
    """The flags of a short bench run in fp32: `limit` of prompts_file(folder)'s prompts, on `model`
    (None: the default), `repeats` times (None: bench's default)."""
    argv = [] if model is None else ["--model", model]
    argv += ["--prompts", prompts_file(folder), "--limit", limit]
    argv += [] if repeats is None else ["--repeats", repeats]
    return argv + ["--max-new-tokens", max_new_tokens, "--dtype", "fp32"]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--limit", "-1"], "--limit -1: must be 0 (all prompts) or a number of prompts"),
        (["--threads", "-1"], "--threads -1: must be 0 (the idle cores) or a number of threads"),
        (["--repeats", "0"], "must be at least 1"),
        (["--prefix-len", "0"], "must be at least 1"),
        (["--batch-size", "0"], "--batch-size 0: use a number of rows of at least 1"),
        (["--batch-size", "-2"], "--batch-size -2: use a number of rows of at least 1"),
        (["--batch-size", "2,x"], "--batch-size 2,x: use a number of rows"),
        (["--batch-size", ","], "or a comma list of them (1,2,4,8,16)"),
        (["--temperature", "nan"], "--temperature nan: must be a number >= 0"),
        (["--seed", "-1"], "--seed -1"),
        (["--json", "/no/such/folder/bench.json"], "not a file in an existing folder"),
        (["--limit", "ten"], "invalid int value"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_flags_before_the_model_loads(no_model, capsys, argv, words):
    check_one_line_error(*run_bench(capsys, *argv)[::2], words)


def test_json_and_plots_are_checked_before_the_run(no_model, capsys, tmp_path, unwritable):
    file = tmp_path / "a-file"
    file.write_text("old results")
    for argv, words in [
        (["--json", tmp_path], "not a file in an existing folder"),
        (["--json", os.path.join(unwritable, "bench.json")], "cannot write there"),
        (["--plots", file], "is a file, not a folder"),
        (["--plots", unwritable], "cannot write there"),
        (["--plots", os.path.join(unwritable, "plots")], "cannot write there"),
    ]:
        check_one_line_error(*run_bench(capsys, *argv)[::2], f"{argv[0]} ", words)
    cli.writable_file("--json", str(file), "bench.json")  # a writable file passes, untouched
    assert file.read_text() == "old results"


def test_an_existing_json_file_is_kept_unless_overwrite(no_model, capsys, tmp_path):
    file = tmp_path / "bench.json"
    file.write_text("old results")
    check_one_line_error(
        *run_bench(capsys, "--json", file)[::2],
        f"--json {file}: the file exists",
        "add --overwrite",
    )
    prompts = prompts_file(tmp_path)
    check_one_line_error(
        *run_bench(capsys, "--json", prompts, "--prompts", prompts, "--overwrite")[::2],
        "is the --prompts file",
    )
    assert file.read_text() == "old results"
    command.check_args(command.build_parser().parse_args(["--json", str(file), "--overwrite"]))
    assert capsys.readouterr().err == ""
    command.check_args(command.build_parser().parse_args(["--overwrite"]))
    assert capsys.readouterr().err == "notice: --overwrite has no effect without --json\n"


def test_prompt_that_is_not_valid_unicode(no_model, capsys, tmp_path):
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "fine"}\n{"prompt": "an unpaired \\udc80 escape"}\n')
    check_one_line_error(
        *run_bench(capsys, "--prompts", file)[::2],
        f"--prompts {file}, line 2: not valid Unicode text",
    )


def test_a_category_or_id_that_is_not_a_string_is_refused_before_the_model_loads(
    no_model, capsys, tmp_path
):
    """A list would have crashed the tables after the measuring (unhashable)."""
    file = tmp_path / "p.jsonl"
    for line, words in [
        ('{"prompt": "Hi", "category": ["a"]}', '"category" is a list; give a string'),
        ('{"prompt": "Hi", "id": ["a"]}', '"id" is a list; give a string or a whole number'),
    ]:
        file.write_text('{"prompt": "fine"}\n' + line + "\n")
        check_one_line_error(
            *run_bench(capsys, "--prompts", file)[::2], f"--prompts {file}, line 2: {words}"
        )


def test_flags_without_effect_get_a_notice(capsys):
    command.check_args(command.build_parser().parse_args(["--max-budget", "8"]))
    assert capsys.readouterr().err == "notice: --max-budget has no effect without --tune-tree\n"
    command.check_args(
        command.build_parser().parse_args(
            ["--tune-tree", "--repeats", "2", "--temperature", "1e-9"]
        )
    )
    err = capsys.readouterr().err
    assert (
        "notice: --repeats has no effect with --tune-tree" in err
        and "--temperature has no effect with --tune-tree" in err
    )
    command.check_args(command.build_parser().parse_args(["--temperature", "1e-9"]))
    assert "the sampling methods decode greedily" in capsys.readouterr().err


def test_modes_that_exclude_each_other_are_refused_before_the_model_loads(no_model, capsys):
    for modes, words in [
        (["--tune-tree", "--tune-layers"], "--tune-tree, --tune-layers: one mode a run"),
        (
            ["--tune-tree", "--tune-layers", "--tune-skip", "--kernels"],
            "--kernels, --tune-tree, --tune-layers, --tune-skip: one mode a run",
        ),
        (["--tune-parallel", "--kernels"], "--kernels, --tune-parallel: one mode a run"),
    ]:
        check_one_line_error(*run_bench(capsys, *modes)[::2], words)


def test_method_names_are_checked_before_the_model_loads_in_every_mode(no_model, capsys):
    for mode in ([], ["--kernels"], ["--tune-layers"]):
        check_one_line_error(
            *run_bench(capsys, *mode, "--methods", "plain,foo")[::2],
            "--methods: unknown foo; choose from plain, hf,",
        )


def test_a_mode_names_the_flags_it_does_not_read(capsys):
    for argv, notices in [
        (["--kernels", "--methods", "plain", "--json", "k.json"], ["methods", "json"]),
        (["--tune-layers", "--methods", "plain", "--batch-size", "2"], ["methods", "batch-size"]),
        (["--tune-parallel", "--plots", "plots", "--max-gamma", "4"], ["max-gamma", "plots"]),
    ]:
        command.check_args(command.build_parser().parse_args(argv))
        mode = argv[0]
        assert capsys.readouterr().err.splitlines() == [
            f"notice: --{name} has no effect with {mode}" for name in notices
        ]
    command.check_args(command.build_parser().parse_args(["--max-gamma", "4"]))
    assert capsys.readouterr().err == (
        "notice: --max-gamma has no effect without --tune-layers or --tune-skip\n"
    )


def test_draft_model_not_of_a_supported_family(no_model, capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    check_one_line_error(
        *run_bench(capsys, "--draft-model", tmp_path, "--methods", "plain,assisted")[::2],
        "architecture 'gpt2' is not supported (supported: llama, mistral, qwen2, qwen3, phi3",
    )


def test_draft_model_with_another_tokenizer(capsys, monkeypatch, tmp_path, tiny_model_dir):
    """Found once the base tokenizer is loaded, before anything is measured."""
    draft = shutil.copytree(tiny_model_dir, tmp_path / "draft")
    spec = json.loads((draft / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["the"], vocab["and"] = vocab["and"], vocab["the"]  # the same tokens under other ids
    (draft / "tokenizer.json").write_text(json.dumps(spec))
    monkeypatch.setattr(
        B, "measure", lambda *a: pytest.fail("measured before the draft model was checked")
    )
    check_one_line_error(
        *run_bench(
            capsys,
            "--model",
            tiny_model_dir,
            "--draft-model",
            draft,
            "--methods",
            "plain,assisted",
            "--prompts",
            prompts_file(tmp_path),
            "--heads-dir",
            tmp_path,
        )[::2],
        "its tokenizer is not the base model's",
        "give a draft model with the same tokenizer",
    )


def test_model_config_json_damaged(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 16}))
    check_one_line_error(
        *run_bench(capsys, "--model", tmp_path, "--prompts", prompts_file(tmp_path))[::2],
        "config.json: field 'num_attention_heads' is missing",
    )


def test_ctrl_c_prints_what_was_measured_and_writes_it_marked_partial(tmp_path, tiny_model_dir):
    """Exit 130, the tables of the prompts every method ran, and --json and --plots of them, marked
    partial."""
    code, out, err = ctrl_c_after(
        [
            "bench.py",
            "--model",
            tiny_model_dir,
            "--methods",
            "plain",
            "--heads-dir",
            tmp_path,
            "--prompts",
            prompts_file(tmp_path),
            "--repeats",
            "100000",
            "--max-new-tokens",
            "4",
            "--dtype",
            "fp32",
            "--json",
            tmp_path / "bench.json",
            "--plots",
            tmp_path / "plots",
        ],
        "[bench] measuring",
        1.5,
    )  # every prompt measured many times over by then
    assert code == 130, err
    assert "Traceback" not in err
    assert "| plain |" in out and "prompts: 3" in out
    assert "interrupted by Ctrl-C: the results cover the 3 of 3 prompts" in err
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["partial"].startswith("interrupted by Ctrl-C: the results cover the 3 of 3")
    assert list(record["methods"]) == ["plain"] and record["machine"]["prompts"] == 3
    assert os.path.isfile(tmp_path / "plots" / "speedup.png")
    assert "marked partial" in err


def test_kernels_table_times_both_paths(capsys, tiny_model_dir):
    """--kernels: each kernel and whole step, readable path against the one chosen here, and the
    step's bandwidth floor, then exit 0."""
    code, out, err = run_bench(capsys, "--kernels", "--model", tiny_model_dir, "--dtype", "fp32")
    assert code == 0, err
    assert (
        "| op | readable path ms | fast path ms | speedup |" in out and "bandwidth floor ms" in out
    )
    for row in (
        "attention, 1 query (decode)",
        "weights in turn",
        "LM head",
        "whole decode step",
        "whole step of 16 tokens",
        "without Kernels.glue",
    ):
        assert row in out, row


def test_tree_tuning_keeps_the_smallest_tree_within_the_tie():
    """--tune-tree: sizes expected within 1% of the fastest tie, and the smallest of them wins; a
    size clearly faster than the smaller ones still wins."""
    rows = [
        {"budget": b, "tokens_per_s": t}
        for b, t in [(1, 104.4), (2, 116.1), (3, 127.9), (4, 127.9), (8, 128.0)]
    ]
    assert tuning.smallest_within(rows, tuning.TREE_TIE)["budget"] == 3
    rows[-1]["tokens_per_s"] = 140.0
    assert tuning.smallest_within(rows, tuning.TREE_TIE)["budget"] == 8
    assert tuning.smallest_within(rows, 0.0)["budget"] == 8


def saved_heads(folder, model_dir, kind="hydra++"):
    """Untrained heads of `kind` for the model in model_dir, saved as train.py saves them."""
    import heads as heads_lib

    base, _ = checkpoint.load(model_dir)
    checkpoint.save_heads(heads_lib.build(heads_lib.HeadsConfig(kind, num_heads=2), base), folder)
    return folder


def test_a_losing_tree_says_plain_decoding_is_faster_and_records_it(
    capsys, monkeypatch, tmp_path, tiny_model_dir
):
    """--tune-tree on heads that rarely hit, where a draft costs as much as a step: every tree is
    expected slower than plain decoding; the tuner says so in one line, and the saved tree records
    its expected speedup (tree.load still reads it)."""
    import tree as tree_lib

    folder = saved_heads(tmp_path / "heads-hydra++", tiny_model_dir)
    (folder / "eval.json").write_text(json.dumps({"rank_acceptance": [[0.02, 0.01], [0.02, 0.01]]}))
    monkeypatch.setattr(tuning, "timed", lambda fn, device: 0.001)  # a step, a draft: 1 ms each
    monkeypatch.setattr(tuning, "distance_to_floor", lambda model, device: {})
    code, out, err = run_bench(
        capsys,
        "--tune-tree",
        "--model",
        tiny_model_dir,
        "--heads",
        folder,
        "--heads-dir",
        tmp_path,
        "--prompts",
        prompts_file(tmp_path),
        "--max-budget",
        1,
        "--tune-repeats",
        1,
        "--dtype",
        "fp32",
        "--plots",
        f"{tmp_path}/plots/",  # as typed with a slash: the plot is plots/tree.png, not plots//
    )
    assert code == 0, err
    assert f"[plots] {tmp_path}/plots/tree.png\n" in err and (tmp_path / "plots/tree.png").exists()
    saved = pathlib.Path(catalog.tuned_tree_file(folder, "cpu", torch.float32))
    assert json.loads(saved.read_text())["expected_speedup"] == pytest.approx(1.02 / 2, abs=1e-3)
    assert tree_lib.load(str(saved)) == [(0,)] and "chosen: 1 node + root," in out
    lines = [line for line in err.splitlines() if "plain decoding is faster" in line]
    assert lines == [
        "notice: plain decoding is faster for these heads here (the best tree is "
        "expected at 0.51x); use --heads none"
    ], err


def step_ms_by_tokens(fn, device):
    """A fake clock for --tune-tree: a step is free up to 4 tokens, then 1/4 ms a token; drafting
    costs nothing (its closure holds a tree, a step's its tokens, and the rows' sizes where some
    rows' padding is left out)."""
    tokens, *rest = fn.__defaults__ or [None]
    if not torch.is_tensor(tokens):
        return 0.0
    n = sum(rest[-1]) if rest and isinstance(rest[-1], list) else tokens.numel()
    return 0.001 * max(1, n / 4)


def test_tune_tree_chooses_a_tree_for_each_batch_size_and_a_batch_follows_it(
    capsys, monkeypatch, tmp_path, tiny_model_dir
):
    """Where a step is free up to 4 tokens, a tree of 3 nodes pays alone, one node at 2 rows (4
    tokens) and none at 4 (plain decoding): --tune-tree saves that table beside the tree, and the
    budget 4 rows share (none: a node past 4 tokens costs more than it can bring), and a
    --batch-size run of the heads shares the budget of its live rows."""
    folder = saved_heads(tmp_path / "heads-hydra++", tiny_model_dir)
    (folder / "eval.json").write_text(json.dumps({"rank_acceptance": [[0.9, 0.5], [0.8, 0.4]]}))
    monkeypatch.setattr(tuning, "timed", step_ms_by_tokens)
    monkeypatch.setattr(tuning, "distance_to_floor", lambda model, device: {})
    decoded = []  # the budgets decoded for real: their tokens/s on the fake clock, as the model's
    real = tuning.decode_budgets

    def decode_budgets(model, heads, pool, budgets, prompts, B, eos, args):
        decoded.append((B, real(model, heads, pool, budgets, prompts, B, eos, args)))
        return [r | {"measured": r["tokens_per_s"]} for r in budgets]

    monkeypatch.setattr(tuning, "decode_budgets", decode_budgets)
    code, out, err = run_bench(
        capsys,
        *["--tune-tree", "--model", tiny_model_dir, "--heads", folder, "--heads-dir", tmp_path],
        *["--prompts", prompts_file(tmp_path), "--max-budget", 3, "--max-batch", 4],
        *["--tune-repeats", 1, "--dtype", "fp32"],
    )
    assert code == 0, err
    saved = json.loads(
        pathlib.Path(catalog.tuned_tree_file(folder, "cpu", torch.float32, "budget")).read_text()
    )
    assert {B: row["budget"] for B, row in saved["by_batch"].items()} == {"1": 3, "2": 1, "4": 0}
    assert "| 2 | 1 | 1.90 |" in out
    model, tokenizer = checkpoint.load(tiny_model_dir)
    flags = catalog.draft_flags("heads", {}, str(folder), "auto", None)
    decoding = dict(verify="auto", temperature=0.0, top_p=1.0)
    load = lambda size: catalog.load_drafter(
        flags, model, tokenizer, quantize="none", decoding=decoding, generator=None, batch_size=size
    )
    assert type(load(1)) is drafters.HeadsDrafter and load(1).max_nodes == 4
    shared = {int(B): row["extra"] for B, row in saved["shared"]["by_batch"].items()}
    assert sorted(shared) == [1, 2, 4] and shared[4] == 0
    assert [B for B, _ in decoded] == [1, 2, 4], "each batch size's best budgets decoded"
    for _, rows in decoded:  # plain decoding and the 2 budgets ranked best, each measured
        assert rows[0]["extra"] == 0 and len(rows) <= 3 and all(r["measured"] > 0 for r in rows)
    assert type(load(4)) is drafters.HeadsShared and load(4).budgets == shared
    assert load(4).budget(4)[0] == 0 and "shared by a batch" in load(4).name
    del saved["shared"]  # tuned before budgets were shared: every row the tree of the batch size
    pathlib.Path(catalog.tuned_tree_file(folder, "cpu", torch.float32, "budget")).write_text(
        json.dumps(saved)
    )
    assert load(4).name == "heads: hydra++, tree by batch size (1: 4 nodes, 2: 2 nodes, 4: 1 node)"
    assert load(4).by_batch[4].max_nodes == 1


def test_heads_folders_as_train_writes_them(capsys, tmp_path, tiny_model_dir):
    """--heads-dir takes a heads folder itself or a folder of heads-KIND/ folders (train.py's
    names);
    a heads method that --methods names and that is not there is an error, not a skip."""
    saved_heads(tmp_path / "heads-hydra++", tiny_model_dir)
    common = short_run(tmp_path, tiny_model_dir)
    for heads_dir in (tmp_path / "heads-hydra++", tmp_path):
        code, out, err = run_bench(
            capsys, *common, "--methods", "plain,hydra++", "--heads-dir", heads_dir
        )
        assert code == 0 and "| hydra++ |" in out, err
    check_one_line_error(
        *run_bench(capsys, *common, "--methods", "medusa", "--heads-dir", tmp_path)[::2],
        "--methods medusa: no medusa heads in --heads-dir",
    )


def test_a_missing_heads_dir_is_refused_before_the_model_loads(no_model, capsys, tmp_path):
    check_one_line_error(
        *run_bench(capsys, "--heads-dir", tmp_path / "typo", "--prompts", prompts_file(tmp_path))[
            ::2
        ],
        "--heads-dir",
        "no such folder",
    )


def test_another_model_skips_the_shipped_heads_unless_they_are_named(
    capsys, tmp_path, tiny_model_dir
):
    common = short_run(tmp_path, tiny_model_dir)
    code, out, err = run_bench(capsys, *common, "--methods", "plain,lookup,medusa")
    check_one_line_error(code, err, "--heads-dir", "heads were trained for")
    code, out, err = run_bench(capsys, *common, "--methods", "all")
    assert (
        code == 0
        and "medusa: skipped (no medusa heads for this model" in err
        and "| lookup |" in out
    ), err


def test_parallel_tuning_saves_a_choice_that_the_methods_then_use(capsys, tmp_path, tiny_model_dir):
    """--tune-parallel prints every setting it tried and saves its choice for this model, device and
    dtype in --heads-dir; bench's jacobi and lookahead methods then decode at it, as plain does."""
    common = short_run(tmp_path, tiny_model_dir, limit=2, max_new_tokens=6, repeats=None)
    common += ["--heads-dir", tmp_path]
    code, out, err = run_bench(capsys, *common, "--tune-parallel", "--tune-repeats", 1)
    assert code == 0, err
    saved = json.loads(
        open(catalog.tuned_tree_file(tmp_path, "cpu", torch.float32, "parallel")).read()
    )
    assert set(saved["jacobi"]) == {"gamma"} and set(saved["lookahead"]) == {
        "window",
        "ngram",
        "guesses",
    }
    assert (
        out.count("**<- chosen**") == 2
        and "| jacobi | gamma 4 |" in out
        and "| lookahead | window 4 ngram 3 guesses 4 |" in out
    )
    code, out, err = run_bench(capsys, *common, "--methods", "jacobi,lookahead", "--repeats", 1)
    assert code == 0 and err.count("(tuned for this machine)") == 2, err
    assert f"[bench] jacobi: {cli.plural(saved['jacobi']['gamma'], 'guess')} a step" in err
    for name in ("jacobi", "lookahead"):
        assert any(
            line.startswith(f"| {name} |") and line.endswith("| yes |") for line in out.splitlines()
        ), out


def test_parallel_tuning_climbs_to_the_best_neighbour_and_stops():
    from specdec import tuning

    grid = {"a": (1, 2, 3, 4, 5), "b": (1, 2, 3)}
    seen = []

    def score(s):
        seen.append(s)
        return -((s["a"] - 4) ** 2) - (s["b"] - 1) ** 2

    assert tuning.ascend({"a": 1, "b": 3}, grid, score) == {"a": 4, "b": 1}
    assert {"a": 5, "b": 1} in seen  # it looked past the top before stopping


@pytest.mark.parametrize("quant", ["fp16", "int8", "int4"])
def test_quantized_methods_run_beside_plain_and_say_how_many_replies_they_keep(
    capsys, tmp_path, tiny_model_dir, quant
):
    """plain-int8 (plain-int4) runs only when named, on an int8 (int4) copy of the model, in the
    same run as plain."""
    code, out, err = run_bench(
        capsys, *short_run(tmp_path, tiny_model_dir, limit=2), "--methods", f"plain,plain-{quant}"
    )
    assert code == 0 and f"| plain-{quant} |" in out, err
    assert (
        f"plain-{quant} decodes a changed copy of the model" in err
        and "of 2 replies keep the original" in err
    )


def test_llama_cpp_named_without_the_package_or_the_default_model_is_refused(
    no_model, capsys, monkeypatch, tmp_path
):
    """The llama.cpp methods are opt-in: named without llama-cpp-python, or with another model than
    the default one (which alone ships a GGUF file), a one-line error before the model loads."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    check_one_line_error(
        *run_bench(capsys, "--methods", "plain,llama.cpp-f16")[::2],
        "--methods llama.cpp-f16: needs llama-cpp-python",
        "pip install llama-cpp-python",
    )
    check_one_line_error(
        *run_bench(capsys, "--model", tmp_path, "--methods", "llama.cpp-q4_1")[::2],
        "--methods llama.cpp-q4_1: llama.cpp runs the default model's GGUF files only",
    )


def test_vllm_methods_are_listed_and_refused_cleanly_without_vllm(
    no_model, capsys, monkeypatch, tmp_path
):
    """vllm, vllm-medusa and vllm-eagle3 are in --help; named where no python imports vLLM (this
    one does not, and README's venv-vllm/bin/python is not there), with a --vllm-python that is
    not a file, with another model, or with a draft folder of the other kind: a one-line error
    before the model loads."""
    assert "vllm-eagle3" in command.build_parser().format_help()
    assert {"vllm", "vllm-medusa", "vllm-eagle3"} <= set(catalogue.METHODS)
    monkeypatch.setitem(sys.modules, "vllm", None)  # this python cannot import it
    monkeypatch.setattr(in_vllm, "VENV_PYTHON", str(tmp_path / "venv-vllm" / "bin" / "python"))
    check_one_line_error(
        *run_bench(capsys, "--methods", "plain,vllm")[::2],
        "--methods vllm: needs vLLM, which this python cannot import",
        "give --vllm-python",
    )
    check_one_line_error(
        *run_bench(capsys, "--methods", "vllm-medusa", "--vllm-python", tmp_path / "python")[::2],
        f"--methods vllm-medusa: --vllm-python {tmp_path / 'python'}: no such file",
    )
    check_one_line_error(
        *run_bench(capsys, "--model", tmp_path, "--methods", "vllm")[::2],
        "--methods vllm: vLLM serves the default model's export here",
    )
    monkeypatch.setattr(in_vllm, "find_python", lambda choice: sys.executable)  # as if found
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"]}))
    check_one_line_error(
        *run_bench(capsys, "--methods", "vllm-eagle3", "--vllm-eagle3", tmp_path)[::2],
        f"--methods vllm-eagle3: --vllm-eagle3 {tmp_path}: a medusa draft (its config.json), "
        "not eagle3",
    )


@pytest.fixture
def default_is_tiny(monkeypatch, tmp_path, tiny_model_dir):
    """--model default loads the tiny model; its GGUF file is tmp_path/shipped.Q4_1.gguf, the cache
    tmp_path/cache."""
    real = checkpoint.resolve
    monkeypatch.setattr(
        checkpoint,
        "resolve",
        lambda name: tiny_model_dir if name == checkpoint.DEFAULT else real(name),
    )
    monkeypatch.setattr(checkpoint, "default_gguf", lambda: str(tmp_path / "shipped.Q4_1.gguf"))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))


def test_methods_all_runs_llama_cpp_where_installed(default_is_tiny, capsys, monkeypatch, tmp_path):
    """--methods all is every available method: the llama.cpp ones too where llama-cpp-python is
    installed and the model is the default one."""
    fake, made, _, _ = fake_llama_cpp([7, 2])
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    code, out, err = run_bench(capsys, *one_prompt(tmp_path))
    assert code == 0 and "| plain |" in out, err
    for name in catalogue.LLAMA_CPP:
        assert f"| {name} |" in out, out
    assert "not run (they need llama-cpp-python" not in err


def test_plots_without_matplotlib_are_refused_first(no_model, capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    for mode in ([], ["--tune-tree"]):
        check_one_line_error(
            *run_bench(capsys, "--plots", tmp_path / "plots", *mode)[::2],
            f"--plots {tmp_path / 'plots'}: needs matplotlib",
            "pip install matplotlib",
        )
    assert not (tmp_path / "plots").exists()


def test_a_benchmark_of_the_default_model_says_how_to_add_llama_cpp(
    default_is_tiny, capsys, monkeypatch, tmp_path
):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    code, out, err = run_bench(capsys, *one_prompt(tmp_path))
    assert code == 0 and "| lookup |" in out and "llama.cpp" not in out, err
    assert (
        "llama.cpp-f16, llama.cpp-q8_0, llama.cpp-q4_1: not run (they need llama-cpp-python: "
        "pip install llama-cpp-python)"
    ) in err


def one_prompt(tmp_path):
    """The flags of a benchmark of one prompt, two new tokens, fp32, heads from tmp_path."""
    return (
        f"--prompts {prompts_file(tmp_path)} --limit 1 --repeats 1 --max-new-tokens 2 "
        f"--dtype fp32 --heads-dir {tmp_path}"
    ).split()


def fake_llama_cpp(reply):
    """A stand-in for llama-cpp-python: Llama records how it was made, the prompts it was given
    (the first eval() after reset()) and the tokens fed after each; its logits, read through
    llama_get_logits_ith, make `reply` then 0s the greedy continuation; llama_model_quantize
    records its call and writes the file."""
    made, prompts, quantized = [], [], []
    V = max(reply) + 1

    class Llama:
        ctx = "ctx"
        last = None  # the Llama that evaluated last: llama_get_logits_ith reads its logits

        def __init__(self, **kw):
            made.append(kw)
            self.fed = None  # the tokens evaluated after the prompt; None: its cache is empty

        def n_vocab(self):
            return V

        def reset(self):
            self.fed = None

        def eval(self, ids):
            if self.fed is None:
                prompts.append(list(ids))
                self.fed = []
            else:
                self.fed += list(ids)
            token = (reply + [0] * 100)[len(self.fed)]
            self.logits = (ctypes.c_float * V)(*[float(i == token) for i in range(V)])
            Llama.last = self

    def llama_get_logits_ith(ctx, i):
        assert (ctx, i) == ("ctx", -1), "the last token's logits"
        return ctypes.cast(Llama.last.logits, ctypes.POINTER(ctypes.c_float))

    class Params(ctypes.Structure):
        _fields_ = [("ftype", ctypes.c_int), ("allow_requantize", ctypes.c_bool)]

    def quantize(src, dst, params):
        quantized.append(
            (src.decode(), dst.decode(), params._obj.ftype, params._obj.allow_requantize)
        )
        open(dst, "wb").close()
        return 0

    return (
        types.SimpleNamespace(
            Llama=Llama,
            llama_get_logits_ith=llama_get_logits_ith,
            llama_model_quantize=quantize,
            llama_model_quantize_default_params=Params,
            LLAMA_FTYPE_MOSTLY_F16=1,
            LLAMA_FTYPE_MOSTLY_Q8_0=7,
        ),
        made,
        prompts,
        quantized,
    )


def test_llama_cpp_methods_decode_the_same_prompt_ids_on_torch_threads(
    default_is_tiny, capsys, monkeypatch, tmp_path, tiny_model_dir
):
    """llama.cpp-f16 decodes a GGUF file llama.cpp's quantiser wrote once into the cache,
    llama.cpp-q4_1 the shipped file; both get the prompts' ids in the chat template
    (checkpoint.encode), greedy, torch's threads, stop at EOS, and bench says how many replies keep
    plain decoding's."""
    fake, made, prompts, quantized = fake_llama_cpp([7, 2])  # 2: the model's EOS
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    shipped = tmp_path / "shipped.Q4_1.gguf"
    code, out, err = run_bench(
        capsys,
        *short_run(tmp_path, limit=2),
        "--methods",
        "plain,llama.cpp-f16,llama.cpp-q4_1",
        "--heads-dir",
        tmp_path,
        "--json",
        tmp_path / "bench.json",
    )
    assert code == 0 and "| llama.cpp-f16 |" in out and "| llama.cpp-q4_1 |" in out, err
    f16 = str(tmp_path / "cache" / "smollm2-135m-instruct-f16.gguf")
    assert quantized == [(str(shipped), f16 + ".tmp", 1, True)] and os.path.isfile(f16)
    assert [m["model_path"] for m in made] == [f16, str(shipped)]
    assert all(m["n_threads"] == m["n_threads_batch"] == torch.get_num_threads() for m in made)
    _, tokenizer = checkpoint.load(tiny_model_dir)
    assert set(map(tuple, prompts)) == {
        tuple(checkpoint.encode(tokenizer, f"Count to {i + 3}.")) for i in range(2)
    }
    res = json.loads((tmp_path / "bench.json").read_text())["methods"]
    assert [p["new_tokens"] for p in res["llama.cpp-f16"]["per_prompt"]] == [2, 2]  # 7, then EOS
    assert (
        "llama.cpp-f16 decodes a changed copy of the model" in err
        and "of 2 replies keep the original" in err
    )


def test_a_batch_size_reports_batched_throughput_beside_batch_1(capsys, tmp_path, tiny_model_dir):
    """--batch-size: the methods that batch decode the prompts B at a time too, at each size of a
    list; their rows sit beside the one-at-a-time ones, and greedy replies are the same. More than
    the prompts: a notice, and all of them at once."""
    saved_heads(tmp_path / "heads-hydra++", tiny_model_dir)
    code, out, err = run_bench(
        capsys, "--model", tiny_model_dir, "--prompts", prompts_file(tmp_path, n=5),
        "--repeats", 1, "--max-new-tokens", 6, "--dtype", "fp32", "--batch-size", "2,9",
        "--methods", "plain,lookup,hydra++,hydra++-lookup", "--heads-dir", tmp_path,
    )  # fmt: skip
    assert code == 0, err
    assert "notice: --batch-size 9: there are only 5 prompts; decoding at most 5 at a time" in err
    for name in ("plain", "lookup", "hydra++", "hydra++-lookup"):
        assert f"| {name} | 1 |" in out
        for size in (2, 5):
            (row,) = [line for line in out.splitlines() if line.startswith(f"| {name} | {size} |")]
            assert row.endswith("| yes |"), row


def test_counts_of_one_are_singular(capsys, tmp_path):
    """One prompt, a layers setting of one draft: "1 prompt", "1 token", not "1 prompts"."""
    model_dir = save_tiny_model(tmp_path / "model", num_hidden_layers=2)
    model = checkpoint.load(model_dir, "cpu", torch.float32)[0]
    tuned = {"model": model.cfg.name, "layers": 1, "gamma": 1}
    tuned["machine"] = {"hardware": "a test", "dtype": "float32"}
    file = catalog.tuned_tree_file(tmp_path, "cpu", torch.float32, "layers")
    pathlib.Path(file).write_text(json.dumps(tuned))
    code, out, err = run_bench(
        capsys, *short_run(tmp_path, model_dir), "--batch-size", 2,
        "--methods", "plain,layers", "--heads-dir", tmp_path,
    )  # fmt: skip
    assert code == 0, err
    assert "notice: --batch-size 2: there are only 1 prompt; decoding at most 1 at a time" in err
    assert "layers: the first 1 of 2 layers draft 1 token (tuned on a test, float32)" in err


def test_the_llama_cpp_anchor_decodes_greedily_one_eval_a_token(monkeypatch):
    """llama.cpp's row: its cache reset, the prompt evaluated once, then each token the argmax of
    the last token's logits, evaluated in turn; it ends at EOS or max_new without evaluating the
    last token."""
    fake, _, prompts, _ = fake_llama_cpp([4, 2, 5, 3])
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    llm = fake.Llama()
    run = catalogue.in_llama_cpp(llm, eos={5})
    out = run([7, 8, 9], 10, 0)
    assert (out.tokens, out.steps, out.accepted) == ([4, 2, 5], 3, [])  # EOS
    assert prompts == [[7, 8, 9]] and llm.fed == [4, 2]
    out = run([7], 2, 0)
    assert (out.tokens, out.steps) == ([4, 2], 2)  # max_new
    assert prompts == [[7, 8, 9], [7]] and llm.fed == [4]


@pytest.mark.parametrize("forced", ["off", *kernels.runnable_paths()])
def test_every_measurement_names_the_cpu_path_it_ran(monkeypatch, forced):
    """bench.py's and the tuners' machine line: on a CPU the device is cpu-PATH, kernels.c's path
    (cpu-generic where none runs), as the tuned files are named."""
    monkeypatch.setenv("SPECDEC_KERNELS", forced)
    want = "cpu-generic" if forced == "off" else f"cpu-{forced}"
    assert tuning.machine("cpu", torch.bfloat16)["device"] == want
    assert f"device: {want}," in tuning.machine_line(tuning.machine("cpu", torch.float32))


def test_an_online_method_reports_its_updates_in_words(capsys, tmp_path, tiny_model_dir):
    saved_heads(tmp_path / "heads-hydra++", tiny_model_dir)
    code, _, err = run_bench(
        capsys, *short_run(tmp_path, tiny_model_dir), "--methods", "hydra++-online",
        "--heads-dir", tmp_path,
    )  # fmt: skip
    assert code == 0, err
    assert "on 1 prompt, 1 repeat (Ctrl-C" in err
    line = [x for x in err.splitlines() if x.startswith("[bench] hydra++-online: ")][-1]
    assert " update" in line and "of the decoding time" in line and "{" not in line, line


@pytest.mark.parametrize(
    "triton, interpreted, argv, words",
    [
        (True, True, ["--quantize", "int8"], "--exact computes bf16 weights, not --quantize int8"),
        (False, True, [], "--exact: exact.py's kernels run on a CUDA GPU, not on cpu"),
        (True, False, [], "--exact: exact.py's kernels run on a CUDA GPU, not on cpu"),
    ],
)
def test_exact_is_refused_where_its_kernels_cannot_run(
    no_model, capsys, monkeypatch, triton, interpreted, argv, words
):
    """--exact needs triton and a CUDA device (Triton's interpreter is for the tests, even where it
    is on): one line, before the model loads."""
    monkeypatch.setattr(exact, "triton", exact.triton if triton else None)
    monkeypatch.setattr(exact, "INTERPRETED", interpreted)
    code, _, err = run_bench(capsys, "--exact", "--device", "cpu", *argv)
    check_one_line_error(code, err, words)


def test_a_plots_folder_with_a_trailing_slash_is_named_once(capsys, tmp_path, tiny_model_dir):
    folder = f"{tmp_path / 'plots'}/"
    argv = [*short_run(tmp_path, tiny_model_dir), "--methods", "plain", "--plots", folder]
    code, _, err = run_bench(capsys, *argv)
    assert code == 0 and "//" not in err and f"{folder}speedup.png" in err, err


def test_timing_trees_says_how_far_it_is_on_a_log_too(monkeypatch, capsys):
    from specdec import tuning

    monkeypatch.setattr(tuning, "PROGRESS_EVERY", -1)  # every repeat
    trees = [{"step": lambda: None, "draft": None, "expected_tau": 1.0} for _ in range(2)]
    tuning.time_trees(trees, 3, "cpu", rows=1)
    err = capsys.readouterr().err
    assert "[tune] timing 2 trees at 1 row: repeat 3 of 3" in err


def test_a_log_gets_progress_lines_where_no_bar_is_shown(
    capsys, tmp_path, tiny_model_dir, monkeypatch
):
    import bench as lesson

    monkeypatch.setattr(lesson, "LOG_EVERY", -1)  # a line after every run
    argv = [*short_run(tmp_path, tiny_model_dir, repeats=2), "--methods", "plain"]
    code, _, err = run_bench(capsys, *argv)  # pytest's stderr is no terminal
    assert code == 0 and "[bench] 2 of 2 runs" in err, err


def test_a_shared_budget_must_beat_plain_in_the_model_and_the_decode():
    """The batch's budget is kept only where the step model and the real decode (by the margin)
    both put it ahead of plain decoding: a noisy decode alone, or the model alone, keeps plain."""
    plain = {"tokens_per_s": 100.0, "measured": 100.0}
    ahead = 1 + tuning.SHARED_MARGIN
    assert tuning.beats_plain(plain, plain)
    assert tuning.beats_plain({"tokens_per_s": 101.0, "measured": 100.0 * ahead}, plain)
    assert not tuning.beats_plain({"tokens_per_s": 93.0, "measured": 107.0}, plain)  # model says no
    assert not tuning.beats_plain({"tokens_per_s": 120.0, "measured": 101.0}, plain)  # within noise
