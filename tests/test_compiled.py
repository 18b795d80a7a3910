"""specdec/fast/compiled.py's contracts, on the CPU: the compiled step, given to generate.py's
lesson as its model (and heads), decodes the same tokens as the readable model in fp32, for plain
decoding and every head kind on trees of 1, 4, 16 and 64 nodes; after a warm-up, a 128-token
generation whose accept lengths change every step compiles nothing again (dynamo's counters, and
dynamo told to raise at a recompile); nothing breaks the graphs (fullgraph); inductor's C++ backend
compiles the same step; its cache goes under the user's cache folder unless they named one.

Most tests compile with dynamo's "eager" or "aot_eager" backends (the tracing and, for aot_eager,
the functionalised in-place writes, in a second), one with inductor (its C++ compiler: slower).
Test: `python -m pytest -q tests/test_compiled.py`.
"""

import os

import pytest
import torch
from torch._dynamo.utils import counters

import generate
import heads as heads_lib
import tree as tree_lib
from specdec import drafters
from specdec import rows
from specdec.engines import decode as decode_lib
from specdec.fast import compiled
from conftest import tiny_config
from test_generate import lesson_of, random_heads

# trees of 1, 4, 16 and 64 nodes, the root included
TREES = {
    1: [],
    4: tree_lib.chain(3),
    16: tree_lib.cartesian([3, 4]),
    64: tree_lib.cartesian([3, 4, 4]),
}
PROMPTS = [[3, 7, 1, 1, 9, 4], [5, 5, 2, 8, 0, 11, 6, 3, 10, 2]]


@pytest.fixture(scope="module")
def small():
    """A tiny model with a 12-token vocabulary, so that random drafts are often accepted."""
    torch.manual_seed(0)
    return rows.Model(tiny_config(vocab_size=12)).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def kinds(small):
    """Random heads of each kind: they draft junk, some of it accepted."""
    return {kind: random_heads(small, kind, k=3).requires_grad_(False) for kind in heads_lib.KINDS}


def decode(model, heads, size, n=40, prompts=PROMPTS):
    """generate.generate's (tokens, forwards) for each prompt on the tree of `size` nodes."""
    tree = tree_lib.build(TREES[size])
    return [generate.generate(model, p, n, heads, tree) for p in prompts]


# --- the same tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, size", [(None, 1)] + [(k, size) for k in heads_lib.KINDS for size in TREES], ids=str
)
def test_the_compiled_step_decodes_the_readable_models_tokens(small, kinds, kind, size):
    heads = kinds.get(kind)
    model, wrapped = compiled.wrap(small, heads, backend="eager")
    eager = decode(small, heads, size)
    fast = decode(model, wrapped, size)
    assert fast == eager
    plain = decode(small, None, 1)
    assert [tokens for tokens, _ in fast] == [tokens for tokens, _ in plain]
    assert not model.fallbacks, model.summary()
    if size >= 16 and kind is not None:  # the tree path ran: drafts were accepted and moved
        assert sum(f for _, f in fast) < sum(f for _, f in plain)
        assert model.keeps > 0, model.summary()


def test_model_pys_own_transformer_is_wrapped_as_well(small):
    """The lesson's model.Transformer (no rows.Model around it): the same tokens, and a forward on
    a cache of its own runs its four-argument forward eagerly."""
    lesson = lesson_of(small)
    model, _ = compiled.wrap(lesson, backend="eager")
    assert decode(model, None, 1) == decode(lesson, None, 1)
    assert not model.fallbacks
    model(torch.tensor([[1, 2]]), torch.arange(2), None, lesson.new_cache(8))
    assert model.fallbacks == {"cache outside the buffers": 1}


def test_a_prompt_longer_than_the_largest_bucket_is_forwarded_in_chunks(small, kinds):
    model, heads = compiled.wrap(small, kinds["hydra++"], backend="eager")
    prompt = [(7 * i) % 12 for i in range(150)]  # 64 + 64 + 22 tokens
    tree = tree_lib.build(TREES[16])
    fast = generate.generate(model, prompt, 20, heads, tree)
    assert fast == generate.generate(small, prompt, 20, kinds["hydra++"], tree)
    assert not model.fallbacks and not heads.fallbacks


def test_the_engines_loop_takes_it_as_its_model_as_the_command_line_would(small, kinds):
    """decode.generate (what generate.py's command line runs), with a heads drafter over the
    compiled heads: the same tokens, and every forward through the compiled step (a prefill's
    last_only included), every Hydra++ context through its compiled prefix layer."""
    model, heads = compiled.wrap(small, kinds["hydra++"], backend="eager")
    tree = tree_lib.build(TREES[16])
    for prompt in PROMPTS:
        eager = drafters.HeadsDrafter(kinds["hydra++"], tree)
        fast = drafters.HeadsDrafter(heads, tree)
        a = decode_lib.generate(small, prompt, 30, eager)
        b = decode_lib.generate(model, prompt, 30, fast)
        assert b.tokens == a.tokens and b.steps == a.steps
    assert not model.fallbacks and not heads.fallbacks, model.summary()
    assert model.keeps > 0


def test_a_quantized_model_is_refused_not_silently_unquantized(small, monkeypatch):
    from specdec.fast import kernels

    monkeypatch.setattr(kernels, "in_use", lambda module: kernels.Kernels(quant="int8"))
    with pytest.raises(ValueError, match="quantized to int8"):
        compiled.wrap(small)


# --- no recompilation -----------------------------------------------------------------------------


def test_a_128_token_generation_compiles_nothing_after_the_warm_up(small, kinds):
    """The warm-up (compiled.prepare) compiles every graph; then the accept lengths change every
    step (1 to 4 tokens) and no frame is compiled again; nothing ran eagerly."""
    torch._dynamo.reset()
    model, heads = compiled.wrap(small, kinds["hydra++"], backend="aot_eager")
    tree = tree_lib.build(tree_lib.cartesian([3, 2, 2]))  # 22 nodes: padded to 32
    prompt = PROMPTS[1]
    max_len = len(prompt) + 128 + tree.num_nodes
    compiled.prepare(model, heads, max_len, len(prompt), tree)
    frames = counters["frames"]["total"]
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        tokens, forwards = generate.generate(model, prompt, 128, heads, tree)
    assert counters["frames"]["total"] == frames
    assert counters["stats"]["unique_graphs"] == graphs
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not model.fallbacks and not heads.fallbacks
    assert forwards < 100 and model.keeps > 0  # accept lengths varied: some steps kept several
    plain, _ = generate.generate(small, prompt, 128)
    assert tokens == plain


def test_a_graph_break_is_an_error_not_a_slow_path(small, monkeypatch):
    """fullgraph=True: a step that cannot be one graph raises, it does not run in pieces."""
    torch._dynamo.reset()

    def breaks(*args):
        torch._dynamo.graph_break()
        return args[0]

    model, _ = compiled.wrap(small, backend="eager")
    monkeypatch.setattr(model, "keep_entries", model.compiler(breaks))
    cache = model.new_cache(32)
    with pytest.raises(Exception, match="graph_break|graph break"):
        cache.keep([0, 2])


def test_a_forward_it_cannot_serve_runs_the_readable_model_and_is_counted(small):
    model, _ = compiled.wrap(small, backend="eager")
    old = model.new_cache(32)
    model.new_cache(32)  # the buffers now hold this one
    tokens = torch.tensor([[1, 2, 3]])
    logits, _ = model(tokens, torch.arange(3), None, old)
    assert torch.allclose(logits, small(tokens, torch.arange(3))[0], atol=1e-5)
    assert model.fallbacks == {"cache outside the buffers": 1}
    assert "eager: 1 (cache outside the buffers 1)" in model.summary()
    with torch.inference_mode():  # a path longer than KEEP: moved eagerly, counted
        cache = model.new_cache(64)
        cache.length = 3
        cache.k.normal_()
        k = cache.k.clone()
        path = list(range(0, 2 * compiled.KEEP + 2, 2))  # KEEP + 1 entries
        cache.keep(path)
        assert torch.equal(cache.k[:, :, :, 3 : 3 + len(path)], k[:, :, :, [3 + i for i in path]])
    assert model.fallbacks[f"a keep of more than {compiled.KEEP}"] == 1


# --- inductor -------------------------------------------------------------------------------------


def test_inductor_compiles_the_step_and_its_keep_and_they_compute_the_readable_ones(
    small, tmp_path, monkeypatch
):
    """inductor's C++ backend on the CPU (two graphs: seconds each, on an idle machine): plain
    decoding from a one-token prompt gives the readable model's tokens without compiling again in
    a second generation, and keep moves the entries KVCache.keep moves."""
    torch._dynamo.reset()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the test's own
    model, _ = compiled.wrap(small)
    assert model.compiler.backend == "inductor" and model.compiler.mode == "default"
    prompt = [[5]]
    assert decode(model, None, 1, 24, prompt) == decode(small, None, 1, 24, prompt)
    frames = counters["frames"]["total"]
    assert decode(model, None, 1, 24, prompt) == decode(small, None, 1, 24, prompt)
    assert counters["frames"]["total"] == frames
    with torch.inference_mode():  # the loop's, in which the buffers were made
        cache = model.new_cache(32)
        cache.length = 5  # slots 5.. hold new entries 0, 1, 2, ...: keep 0, 2, 3
        cache.k.normal_()
        cache.v.normal_()
        k = cache.k.clone()
        v = cache.v.clone()
        cache.keep([0, 2, 3])
    assert cache.length == 8
    assert torch.equal(cache.k[:, :, :, :8], torch.cat([k[:, :, :, :6], k[:, :, :, 7:9]], dim=3))
    assert torch.equal(cache.v[:, :, :, :8], torch.cat([v[:, :, :, :6], v[:, :, :, 7:9]], dim=3))
    assert os.listdir(tmp_path / "inductor"), "inductor wrote nothing into its cache folder"


# --- the compile cache ----------------------------------------------------------------------------


def test_the_compile_cache_goes_under_the_users_cache_unless_they_named_one(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what torch._dynamo sets
    assert compiled.cache_dir() == str(tmp_path / "specdec" / "inductor")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert compiled.cache_dir() == str(tmp_path / "specdec" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compiled.cache_dir() == str(tmp_path / "mine")


def test_generate_py_compile_gives_the_tokens_of_the_readable_run(
    tiny_model_dir, monkeypatch, capsys
):
    """`python generate.py --compile` (its wrapping checked here through dynamo's aot_eager, as the
    tests above; inductor's own step is checked above) replies as without it, by generate.py's
    loop; --compile with a way of running that it does not serve is one line."""
    wrap = compiled.wrap
    monkeypatch.setattr(compiled, "wrap", lambda m, h=None: wrap(m, h, backend="aot_eager"))
    argv = ["--model", tiny_model_dir, "--prompt", "hi", "--raw", "--max-new-tokens", "12"]
    argv += ["--dtype", "fp32"]
    replies = []
    for flags in ([], ["--compile"]):
        assert generate.cli_main([*argv, *flags]) == 0
        out, err = capsys.readouterr()
        replies.append(out)
    assert "[compiled (aot_eager)" in err  # the footer: it ran compiled
    assert replies[0] == replies[1] and replies[0].strip()
    assert generate.cli_main([*argv, "--compile", "--quantize", "int8"]) == 2
    assert "--compile compiles the readable model's step" in capsys.readouterr().err
