"""Self-speculative drafting with layers skipped (--draft skip, bench.py's skip and --tune-skip), on
tiny random models (CPU, seeded, fp32).

A forward over a subset of layers is the model without the others; greedy output with any skip set
is token-identical to plain decoding, and the draft's cache holds exactly the accepted sequence
after every cut-back; the search's teacher-forced acceptance is exactly what decoding accepts; the
set syntax, and bad sets and tuned files refused in one line (exit 2), before the model loads where
the syntax alone is wrong; --tune-skip picks a set on a tiny model and writes a file that --draft
skip and bench's skip then use. Run: `python -m pytest -q tests/test_skip.py`.
"""

import json

import pytest
import torch

from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import cli
from specdec import drafters as D
from specdec.engines import decode
from specdec import rows
from specdec import tuning
from conftest import save_tiny_model, tiny_config
from test_bench_cli import prompts_file, run_bench
from test_cli import check_one_line_error, run_cli
from test_drafters import Checked
from test_generate import greedy_runs


def tiny(seed, **kw):
    torch.manual_seed(seed)
    return rows.Model(tiny_config(**kw)).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def small():
    """Four layers, a 12-token vocabulary: random models repeat themselves, so drafts get
    accepted."""
    return tiny(0, vocab_size=12, n_layers=4)


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory):
    """A tiny random Llama of four layers saved as a folder the scripts load."""
    return save_tiny_model(tmp_path_factory.mktemp("four-layers"), num_hidden_layers=4)


def skipping(model, skipped, gamma=3, checked=False):
    kept = [i for i in range(model.cfg.n_layers) if i not in skipped]
    make = Checked if checked else D.ModelDrafter
    return make(model, gamma, 0.0, 1.0, None, kept, f"skip:{catalog.skip_spec(skipped)}")


# --- the model over a subset of its layers ------------------------------------------------------


def test_a_subset_of_layers_is_the_model_without_the_others(small):
    """layers=[0, 2, 3] is a three-layer model holding layers 0, 2 and 3's weights, final norm and
    LM head included, with and without a cache of three layers."""
    seq = torch.randint(0, 12, (1, 9), generator=torch.Generator().manual_seed(3))
    three = rows.Model(tiny_config(vocab_size=12, n_layers=3)).eval()
    rename = {"layers.0.": "layers.0.", "layers.2.": "layers.1.", "layers.3.": "layers.2."}
    three.load_state_dict(
        {
            next((k.replace(a, b) for a, b in rename.items() if k.startswith(a)), k): v
            for k, v in small.state_dict().items()
            if not k.startswith("layers.1.")
        }
    )
    ref, _ = three(seq, torch.arange(9))
    logits, _ = small(seq, torch.arange(9), layers=[0, 2, 3])
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits, small(seq, torch.arange(9))[0], atol=1e-3)
    cache = small.new_cache(16, num_layers=3)
    small(seq[:, :5], torch.arange(5), None, cache, layers=[0, 2, 3])
    cache.keep(range(5))
    logits, _ = small(seq[:, 5:], torch.arange(5, 9), None, cache, layers=[0, 2, 3])
    torch.testing.assert_close(logits, ref[:, 5:], atol=1e-5, rtol=1e-5)


# --- lossless, and the draft cache cut back on rejection ----------------------------------------


@pytest.mark.parametrize("skipped", [(1,), (0, 2), (1, 2, 3), (3,)])
def test_greedy_with_layers_skipped_equals_plain(small, skipped):
    runs = greedy_runs(small, skipping(small, skipped), seeds=3)
    assert sum(sum(r.accepted) for r in runs) > 0, (
        "no draft was ever accepted: the test would not exercise the drafter"
    )


def test_the_skip_draft_cache_holds_the_accepted_sequence(small):
    """After every step the draft's cache of its three layers equals a fresh forward of the accepted
    sequence, and what it has not fed is exactly its pending tokens (Checked)."""
    d = skipping(small, (1,), checked=True)
    r = decode.generate(small, [2, 7, 1, 8, 2, 8], 40, d)
    # checked after every step but the prefill: the last step's accept() runs too
    assert d.cache.k.shape[0] == 3 and d.checked == r.steps - 1
    assert 0 < sum(r.accepted) < 3 * len(r.accepted), "want partial acceptance: the cut-back path"


def test_teacher_forced_acceptance_is_what_decoding_accepts(small):
    """The search measures acceptance without decoding (tuning.draft_matches and
    accepted_per_step): step for step it is what greedy decoding with the same set accepts."""
    prompt = [2, 7, 1, 8, 2, 8]
    reply = decode.generate(small, prompt, 60).tokens
    for skipped, gamma in [((1,), 3), ((0, 2), 2), ((2,), 5)]:
        kept = [i for i in range(4) if i not in skipped]
        (matches,) = tuning.draft_matches(small, [(prompt, reply)], kept, chunk=7)
        r = decode.generate(small, prompt, 60, skipping(small, skipped, gamma))
        walked = tuning.accepted_per_step(matches, gamma)
        assert sum(walked) > 0 and len(walked) == r.steps - 1
        assert walked[:-1] == r.accepted[:-1], (walked, r.accepted)


# --- the set: its syntax, and bad sets ------------------------------------------------------------


def test_skip_sets_parse_and_print_back():
    assert catalog.parse_draft("skip:2,5,9-12") == ("skip", (2, 5, 9, 10, 11, 12))
    assert catalog.parse_draft("skip: 7, 3-4,3") == ("skip", (3, 4, 7))
    assert catalog.parse_draft("skip") == ("skip", None)
    assert catalog.skip_spec((2, 5, 9, 10, 11, 12)) == "2,5,9-12"
    assert catalog.skip_spec((0,)) == "0"
    assert catalog.default_skip(30) == tuple(range(16, 30, 2))


@pytest.mark.parametrize(
    "spec, words",
    [
        ("skip:", "names no layer to skip"),
        ("skip:3-1", "'3-1' is not a layer number nor a range"),
        ("skip:-1", "'-1' is not a layer number"),
        ("skip:1,,2", "'' is not a layer number"),
        ("skip:two", "'two' is not a layer number"),
    ],
)
def test_bad_skip_syntax_before_the_model_loads(no_model, capsys, spec, words):
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--draft", spec)[::2], words)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("skip:4", "the model has 4 layers, numbered 0 to 3; layer 4 is not one of them"),
        ("skip:0-3", "skips all 4 layers, which leaves nothing to draft with"),
    ],
)
def test_sets_the_model_cannot_run_are_refused(capsys, four_layer_dir, spec, words):
    argv = ["--model", four_layer_dir, "--prompt", "hi", "--dtype", "fp32", "--draft", spec]
    check_one_line_error(*run_cli(capsys, *argv)[::2], words)


def tuned_file(folder, base, **fields):
    saved = {"model": base.cfg.name, "path": catalog.cpu_path("cpu"), "skip": [1], "gamma": 2}
    file = catalog.tuned_tree_file(folder, "cpu", base.dtype, "skip")
    with open(file, "w") as f:
        json.dump(saved | fields, f)
    return file


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"model": "another"}, "tuned for another, not tiny"),
        ({"path": "cpu-elsewhere"}, "tuned on the cpu-elsewhere path"),
        ({"skip": [0, 1]}, "skips all 2 layers"),
        ({"skip": []}, "skips no layer"),
        ({"skip": "1"}, "not a settings file of bench.py --tune-skip"),
        ({"gamma": 0.5}, "not a settings file of bench.py --tune-skip"),
    ],
)
def test_a_tuned_file_for_another_model_or_path_is_refused(tmp_path, fields, words):
    model = tiny(0)
    tuned_file(tmp_path, model, **fields)
    with pytest.raises(cli.UsageError, match=words):
        catalog.tuned_skip(tmp_path, model)
    assert catalog.tuned_skip(tmp_path / "nothing-here", model) is None


# --- the search -----------------------------------------------------------------------------------


def test_the_search_picks_a_set_that_skip_then_uses(capsys, tmp_path, four_layer_dir):
    """--tune-skip on a tiny model prints the sets of its path against the first layers at equal
    cost and saves its choice; bench's skip method decodes with it, as plain does."""
    common = ["--model", four_layer_dir, "--prompts", prompts_file(tmp_path), "--limit", 2]
    common += ["--max-new-tokens", 8, "--dtype", "fp32", "--heads-dir", tmp_path]
    code, out, err = run_bench(capsys, *common, "--tune-skip", "--tune-repeats", 1)
    assert code == 0, err
    assert out.count("**<- chosen**") == 1 and "| first-N match |" in out
    file = catalog.tuned_tree_file(tmp_path, "cpu", torch.float32, "skip")
    saved = json.loads(open(file).read())
    assert saved["path"] == catalog.cpu_path("cpu") and 1 <= len(saved["skip"]) <= 3
    model = checkpoint.load(four_layer_dir, "cpu", torch.float32)[0]
    assert catalog.tuned_skip(tmp_path, model) == (tuple(saved["skip"]), saved["gamma"])
    code, out, err = run_bench(capsys, *common, "--methods", "skip", "--repeats", 1)
    assert code == 0 and "(tuned for this machine)" in err, err
    assert f"skip: layers {catalog.skip_spec(saved['skip'])} of 4 skipped" in err
    assert any(
        line.startswith("| skip |") and line.endswith("| yes |") for line in out.splitlines()
    ), out


def test_bench_refuses_a_named_skip_tuned_for_another_model(capsys, tmp_path, four_layer_dir):
    tuned_file(tmp_path, tiny(0), model="another")
    argv = ["--model", four_layer_dir, "--prompts", prompts_file(tmp_path), "--limit", 1]
    argv += ["--dtype", "fp32", "--heads-dir", tmp_path, "--methods", "skip"]
    check_one_line_error(*run_bench(capsys, *argv)[::2], "tuned for another, not")


def test_greedy_removal_skips_the_cheapest_layer_each_round_and_keeps_the_best_set():
    """Each layer costs its loss; a set scores 2 a layer skipped less what it lost."""
    loss = [5, 1, 3, 0.5, 4]
    seen = []

    def score(skipped):
        seen.append(skipped)
        return 2 * len(skipped) - sum(loss[i] for i in skipped)

    path, best = tuning.greedy_removal(5, score, width=2, patience=3)
    assert path == [(3,), (1, 3), (1, 2, 3), (1, 2, 3, 4)] and best == (1, 3)
    # round 1 tries every layer, each later one the 2 best of the round before
    assert len(set(seen)) == 5 + 2 + 2 + 2
    path, _ = tuning.greedy_removal(5, score, width=2, patience=1)
    assert path == [(3,), (1, 3), (1, 2, 3)]


def test_generate_drafts_with_a_given_set_or_the_untuned_one(capsys, four_layer_dir):
    """--draft skip:LAYERS decodes as plain does; plain skip with no set tuned for this model and
    machine skips catalog.default_skip's layers and says so."""
    argv = ["--model", four_layer_dir, "--prompt", "Count to five.", "--dtype", "fp32"]
    argv += ["--max-new-tokens", 12]
    plain = run_cli(capsys, *argv, "--heads", "none")
    given = run_cli(capsys, *argv, "--draft", "skip:1,3")
    untuned = run_cli(capsys, *argv, "--draft", "skip")
    assert plain[0] == given[0] == untuned[0] == 0
    assert plain[1] == given[1] == untuned[1] and plain[1].strip()
    assert "--draft skip: no skip set tuned for this model and machine" in untuned[2]
    assert "skipping layers 3 (bench.py --tune-skip searches one)" in untuned[2]
