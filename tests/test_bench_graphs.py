"""bench.py's GPU-minded methods on a CPU: hf-compiled (transformers' static cache and its own
torch.compile), compiled once in the warm-up and never again, giving plain decoding's greedy
reply; experiments/gpu_check.py's tiny run."""

import os

import pytest
import torch

from specdec.benching import methods as catalogue
from test_bench_cli import ROOT, run_bench, short_run

QUIET = dict(capture_output=True, text=True, cwd=ROOT)


@pytest.fixture
def quick_compile(monkeypatch):
    """torch.compile's graph capture (fullgraph) without inductor's code generation, which takes
    minutes on a CPU: what hf-compiled wires is checked, not how fast inductor's kernels are."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(catalogue, "HF_COMPILE", dict(fullgraph=True, backend="eager", mode=None))
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


def test_the_gpu_check_runs_tiny_on_a_cpu_and_writes_its_report(tmp_path):
    """experiments/gpu_check.py --tiny: every section, on a CPU, in seconds."""
    import subprocess
    import sys

    script = os.path.join(ROOT, "experiments", "gpu_check.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = tmp_path / "check.md"
    argv = [sys.executable, script, "--tiny", "--rows", "1", "--nodes", "1,4", "--out", out]
    done = subprocess.run(argv, env=env, timeout=120, **QUIET)
    assert done.returncode == 0, done.stderr
    report = out.read_text()
    assert "| 1 | 4 |" in report and "| hydra++ heads | 2 of 2 |" in report
    assert "| plain, replayed (graphs.py) |" in report and "failed" not in report
    assert "| hf-compiled (static cache, torch.compile) |" in report


def test_the_gpu_check_says_what_it_does_and_ctrl_c_is_one_line(tmp_path):
    """On a CPU it says so before the minutes of a full-size run, then each section as it starts;
    Ctrl-C: one line, exit 130, no traceback."""
    from conftest import ctrl_c_after

    argv = ["experiments/gpu_check.py", "--rows", "1", "--nodes", "1", "--out", tmp_path / "c.md"]
    code, _, err = ctrl_c_after(argv, "[gpu-check] building", 1.0)
    if not torch.cuda.is_available():
        assert "no CUDA device: the full-size check runs on the CPU" in err, err
    assert code == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("[gpu-check] interrupted by Ctrl-C"), err


def test_cuda_graphs_on_a_cpu_runs_the_static_step_and_the_footer_counts_it(
    capsys, tmp_path, tiny_model_dir
):
    """--cuda-graphs on where there is no CUDA: a notice, our methods through graphs.py's static
    step (one wrapper for the model), the same replies, and a footer line with its counts."""
    code, out, err = run_bench(
        capsys,
        *short_run(tmp_path, tiny_model_dir, limit=2),
        "--methods",
        "plain,lookup",
        "--batch-size",
        "2",
        "--cuda-graphs",
        "on",
    )
    assert code == 0 and "| lookup |" in out, err
    assert "--cuda-graphs on: cpu has no CUDA graphs" in err and "differs" not in err
    footer = [line for line in err.splitlines() if "static steps, cuda graphs off" in line]
    assert len(footer) == 1 and "outside them: " in footer[0] and "prompt prefill" in footer[0], err
    code, out, err = run_bench(capsys, *short_run(tmp_path, tiny_model_dir), "--methods", "plain")
    assert code == 0 and "static steps" not in err and "cuda graphs" not in err  # auto: off
