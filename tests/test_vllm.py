"""Medusa heads and the EAGLE-3 layer exported by specdec.export load and serve in vLLM itself: the
default model greedy on 8 evaluation prompts through vLLM's engine, plain and with the shipped
Medusa heads (speculative_config method medusa) or EAGLE-3 layer (eagle3), fp32: every reply
token-identical, and vLLM's own counter of accepted draft tokens above zero. Each engine runs in a
process of its own (specdec/benching/in_vllm.py, vllm_worker.py). And bench.py runs vLLM beside
our plain decoding (its vllm and vllm-medusa methods): their rows in the same table, the same
replies.

Skipped where vLLM is not installed (requirements.txt leaves it out: it pins its own transformers
and torch build). Run it in vLLM's virtual environment (README, "Serve with vLLM"), Intel OpenMP
preloaded as vLLM's CPU build asks:
`LD_PRELOAD=venv-vllm/lib/libiomp5.so venv-vllm/bin/python -m pytest -q tests/test_vllm.py` (a few
minutes on 2 CPU cores).
"""

import importlib.util
import os
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (requirements-vllm.txt)", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))
import vllm_medusa  # noqa: E402

PROMPTS, NEW_TOKENS = 8, 64


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(base folder, heads folder): the default model and its shipped Medusa heads, fp32."""
    return vllm_medusa.export_default(str(tmp_path_factory.mktemp("vllm")))


def test_medusa_heads_in_vllm_keep_plain_greedy_replies_and_are_accepted(exported):
    base, heads = exported
    plain = vllm_medusa.serve_apart(base, None, "fp32", PROMPTS, NEW_TOKENS)
    medusa = vllm_medusa.serve_apart(base, heads, "fp32", PROMPTS, NEW_TOKENS)
    assert len(plain["ids"]) == PROMPTS and all(plain["ids"])
    same = sum(a == b for a, b in zip(medusa["ids"], plain["ids"]))
    assert same == PROMPTS, f"{same} of {PROMPTS} replies identical to plain"
    counters = medusa["counters"]
    assert counters["drafts"] > 0 and counters["accepted"] > 0, counters
    assert sum(counters["accepted_per_pos"]) == counters["accepted"]


def test_eagle3_layer_in_vllm_keeps_plain_greedy_replies_and_is_accepted(exported):
    """An EAGLE-3 layer for the default model (the shipped one, else a fresh one initialised from
    the base: none ships, results/eagle3-cpu.md), exported by specdec.export
    (LlamaForCausalLMEagle3), drafts in vLLM's own eagle3 method: replies plain's, some
    accepted."""
    base, _ = exported
    layer = vllm_medusa.export_eagle3(os.path.dirname(base))
    plain = vllm_medusa.serve_apart(base, None, "fp32", PROMPTS, NEW_TOKENS)
    eagle3 = vllm_medusa.serve_apart(base, layer, "fp32", PROMPTS, NEW_TOKENS)
    same = sum(a == b for a, b in zip(eagle3["ids"], plain["ids"]))
    assert same == PROMPTS, f"{same} of {PROMPTS} replies identical to plain"
    counters = eagle3["counters"]
    assert counters["drafts"] > 0 and counters["accepted"] > 0, counters


def test_bench_runs_vllm_beside_plain_decoding(capsys):
    """bench.py --methods plain,vllm,vllm-medusa on 2 prompts, 16 new tokens, fp32: vLLM's rows in
    the table, their replies plain decoding's, vLLM's counters beside vllm-medusa's tau."""
    import bench

    argv = ["--methods", "plain,vllm,vllm-medusa", "--limit", "2", "--max-new-tokens", "16"]
    code = bench.cli_main(argv + ["--repeats", "1", "--dtype", "fp32"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for name in ("vllm", "vllm-medusa"):
        assert rows[name].rstrip().endswith("| yes |"), rows[name]  # identical to plain
        assert f"[bench] {name}: vLLM " in err and "left out of tokens/s" in err
    assert "[bench] vllm-medusa: vLLM counted" in err
