"""bench.py's GPU-minded methods on a CPU: hf-compiled (transformers' static cache and its own
torch.compile), compiled once in the warm-up and never again, giving plain decoding's greedy
reply."""

import pytest
import torch

import bench as B
from test_bench_cli import run_bench, short_run


@pytest.fixture
def quick_compile(monkeypatch):
    """torch.compile's graph capture (fullgraph) without inductor's code generation, which takes
    minutes on a CPU: what hf-compiled wires is checked, not how fast inductor's kernels are."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(B, "HF_COMPILE", dict(fullgraph=True, backend="eager", mode=None))
    yield counters
    torch._dynamo.reset()


def test_hf_compiled_compiles_once_in_the_warm_up_and_gives_plain_decodings_reply(
    capsys, tmp_path, tiny_model_dir, quick_compile
):
    code, out, err = run_bench(
        capsys,
        *short_run(tmp_path, tiny_model_dir, limit=3, max_new_tokens=6),
        "--methods",
        "plain,hf,hf-compiled",
    )
    assert code == 0 and "| hf-compiled |" in out, err
    assert "hf-compiled: compiled and warmed up in" in err and "differs" not in err
    assert quick_compile["stats"]["unique_graphs"] == 1  # prompts of other lengths: no recompile


def test_hf_compiled_is_left_out_of_all_on_a_cpu(capsys, tmp_path, tiny_model_dir):
    code, out, err = run_bench(capsys, *short_run(tmp_path, tiny_model_dir), "--methods", "all")
    assert code == 0 and "| hf |" in out and "| hf-compiled |" not in out, err
