"""kernels.py's fast twins against the readable layers and functions they stand for (CPU, tiny
random models, seeded).

One test a pair: PackedLinear and nn.Linear, FastAttention and model.Attention (a decode step, a
tree, a batch with a key mask, a prefill; Llama-, Qwen2- and Qwen3-like), FastMLP and model.MLP
(SwiGLU, GeGLU), FastLMHead and heads.LMHead, the whole model fast and readable (fp32 to rounding,
bf16 as close to fp32 as the readable path is), fused_batch_loss and train.batch_loss (value and
both gradients). Also: use() swaps layers in place and back (same parameters, same state_dict); the
loaders apply it; a kernel this build lacks falls back with one notice; off the CPU none of the fast
paths is reached. kernels.c (bf16): its product (bf16 and int8 weights), attention and decoder layer
against the readable ones, each row's bits the same alone as with others, and greedy speculative
decoding equal to plain in bf16 through it. Cases this CPU lacks (no oneDNN prepacking, no native
bf16, kernels.c not built) are skipped with the reason. Run: `python -m pytest -q
tests/test_kernels.py`. Shapes: B batch, T new tokens, S keys, D hidden, M predictions, V
vocabulary, k teacher top-k.
"""

import os
import platform
import shutil
import subprocess

import pytest
import torch
import torch.nn as nn

from specdec.loading import catalog
from specdec.loading import checkpoint
import heads as heads_lib
from specdec.fast import kernels
from specdec.training import losses
import model as model_lib
from specdec import rows
import train
import tree as tree_lib
from conftest import tiny_config
from specdec.fast.kernels import Kernels, block_native

PACKED = Kernels.choose("cpu", torch.float32, 0).packed  # oneDNN prepacking in this torch build
ONEDNN_BF16 = PACKED and kernels.onednn_bf16()  # oneDNN's bf16 native here
BF16 = Kernels.choose("cpu", torch.bfloat16, 0)  # Kernels(): no fast bf16 here
needs_packing = pytest.mark.skipif(not PACKED, reason="this torch build has no oneDNN prepacking")
needs_bf16 = pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN has no native bf16 on this CPU")
FAST = Kernels(attention="cpu-bf16", packed=PACKED, glue=True)  # every oneDNN twin this build runs
C = Kernels(attention="cpu-bf16", packed=True, glue=True, native=True)  # kernels.c's twins


@pytest.fixture(params=kernels.runnable_paths() or [None], ids=str)
def native_path(request, monkeypatch):
    """kernels.c forced onto each path this CPU executes in turn (SPECDEC_KERNELS); skipped where
    it has none, or where the path does not build (no C compiler)."""
    if request.param is None:
        pytest.skip("kernels.c has no path for this CPU")
    monkeypatch.setenv("SPECDEC_KERNELS", request.param)
    kernels.native.cache_clear()
    if kernels.native_library() is None:
        pytest.skip(f"kernels.c's {request.param} path not built here: {kernels.native_reason()}")
    yield request.param
    kernels.native.cache_clear()  # the next test sees the path its own environment picks


def close_as_readable(fast, readable, exact):
    """bf16: the fast result is as close to the fp32 one (`exact`) as the readable bf16 one is."""
    errors = [(x.float() - exact).abs().max().item() for x in (fast, readable)]
    assert errors[0] <= 2 * errors[1] + 1e-2 * exact.abs().max().item(), errors


# --- choosing and switching ---------------------------------------------------------------------


def test_off_the_cpu_no_fast_path_is_reached(monkeypatch, capsys):
    """CUDA (and any device but the CPU) keeps the readable path: Kernels.choose answers Kernels()
    without asking oneDNN anything, and use() on a model there swaps nothing and prepacks nothing;
    a forward there with CUDA's kernels (expanded-kv attention, int8 or int4 weights) reaches no CPU
    kernel."""

    def unreachable(*a, **k):
        raise AssertionError("a CPU-only fast path was reached")

    for name in ("prepack", "linear", "attend", "rms_norm", "rope"):
        monkeypatch.setattr(kernels, name, unreachable)
    monkeypatch.setattr(torch, "_weight_int8pack_mm", unreachable)
    monkeypatch.setattr(kernels, "int4_pack", unreachable)
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", unreachable)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", unreachable)
    # the one GPU twin: attention that keeps SDPA's fused kernels
    cuda = Kernels(attention="expanded-kv")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert (
            Kernels.choose("cuda", dtype)
            == Kernels.choose(torch.device("cuda", 1), dtype, 10**9)
            == cuda
        )
        assert Kernels.choose("meta", dtype) == Kernels()
    with torch.device("meta"):
        meta = rows.Model(tiny_config())
    for m in (meta, meta.to(torch.bfloat16)):
        kernels.use(m)
        assert kernels.in_use(m) == Kernels() and not any(
            type(x) in kernels.READABLE for x in m.modules()
        )
        kernels.use(m, cuda)  # as on a GPU: only the attention layers swap
        assert {type(x) for x in m.modules() if type(x) in kernels.READABLE} == {
            kernels.FastAttention
        }
        forward_as_on_a_gpu(m)
        for quant in ("int8", "int4"):  # quantized weights off the CPU: widened, no CPU kernel
            kernels.quantize(m, quant)
            forward_as_on_a_gpu(m)
        # fbgemm's fp16 product: refused off the CPU
        with pytest.raises(ValueError, match="a CPU kernel"):
            kernels.quantize(m, "fp16")
        kernels.use(m, Kernels())
    assert capsys.readouterr().err == ""


def forward_as_on_a_gpu(m):
    """A prefill and a tree step through m (on the meta device, so nothing is computed)."""
    with torch.inference_mode():
        cache, dev = m.new_cache(16), m.device
        m(torch.ones(1, 5, dtype=torch.long, device=dev), torch.arange(5, device=dev), None, cache)
        cache.keep(range(5))
        tree = tree_lib.build(tree_lib.cartesian([2])).to(dev)
        m(torch.ones(1, 3, dtype=torch.long, device=dev), 5 + tree.depth, tree.mask, cache)


def test_use_swaps_in_place_and_kernels_restores_the_readable_classes(tiny):
    """use() changes classes only: the same parameters (the same storage) and state_dict keys,
    fast or readable; use(..., Kernels()) leaves exactly the readable classes, no prepacked copy."""
    heads = heads_lib.build(heads_lib.HeadsConfig("hydra++", num_heads=2), tiny)
    for module in (tiny, heads):
        classes = [type(m) for m in module.modules()]
        storage = {k: v.data_ptr() for k, v in module.state_dict().items()}
        kernels.use(module, FAST)
        assert kernels.in_use(module) == FAST
        assert {k: v.data_ptr() for k, v in module.state_dict().items()} == storage
        assert any(type(m) in kernels.READABLE for m in module.modules())
        kernels.use(module, Kernels())
        assert [type(m) for m in module.modules()] == classes and kernels.in_use(
            module
        ) == Kernels()
        assert not any({"packed", "kernels", "rotary"} & set(vars(m)) for m in module.modules())
        assert {k: v.data_ptr() for k, v in module.state_dict().items()} == storage


@needs_packing
def test_fused_products_are_packed_once(tiny):
    """q, k, v (and gate, up) go through their layer's one fused product: not also each alone."""
    kernels.use(tiny, Kernels(packed=True))
    attn, mlp = tiny.layers[0].self_attn, tiny.layers[0].mlp
    assert type(attn) is kernels.FastAttention and type(mlp) is kernels.FastMLP
    assert all(
        type(m) is nn.Linear
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
    )
    assert all(type(m) is kernels.PackedLinear for m in (attn.o_proj, mlp.down_proj, tiny.lm_head))


def test_loaders_run_the_kernels_chosen_for_the_device_and_dtype(tiny_model_dir, tmp_path):
    model, _ = checkpoint.load(tiny_model_dir)
    assert kernels.in_use(model) == Kernels.choose("cpu", torch.float32, 0)
    checkpoint.save_heads(
        heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=2), model), tmp_path
    )
    assert kernels.in_use(checkpoint.load_heads(tmp_path, model)) == Kernels.choose(
        "cpu", torch.float32, 0
    )


def test_missing_fast_kernel_falls_back_to_the_readable_path(tiny, monkeypatch, capsys):
    """A kernel this build lacks: one notice on stderr, the readable path, the same logits."""

    def missing(*weights, product="onednn"):
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr(kernels, "prepack", missing)
    tokens = torch.randint(0, 64, (1, 6))
    ref = tiny(tokens, torch.arange(6))[0]
    kernels.use(tiny, Kernels(attention="cpu-bf16", packed=True))
    assert kernels.in_use(tiny) == Kernels() and not any(
        type(m) in kernels.READABLE for m in tiny.modules()
    )
    assert capsys.readouterr().err.count("notice: fast kernels unavailable") == 1
    torch.testing.assert_close(tiny(tokens, torch.arange(6))[0], ref)


# --- the pairs -----------------------------------------------------------------------------------


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_packed_linear_equals_nn_linear(dtype):
    torch.manual_seed(0)
    for bias in (False, True):
        layer = nn.Linear(48, 40, bias=bias).to(dtype)
        xs = [
            torch.randn(1, 48, dtype=dtype),
            torch.randn(3, 5, 48, dtype=dtype),
        ]  # (1, D), (B, T, D)
        with torch.inference_mode():
            want = [layer(x) for x in xs]
            kernels.use(layer, Kernels(packed=True))
            assert type(layer) is kernels.PackedLinear
            got = [layer(x) for x in xs]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=tol, rtol=tol)
        # under autograd: nn.Linear's product
        x = torch.randn(2, 48, dtype=dtype, requires_grad=True)
        layer(x).sum().backward()
        torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(2, -1))


@pytest.mark.parametrize("B,T,S", [(1, 1, 9), (1, 5, 12), (3, 1, 12), (2, 4, 10)])
def test_attend_equals_model_attend(B, T, S):
    """kernels.attend (fp32 SDPA for one query, grouped matmuls for a batch) computes model.attend:
    in fp32, with no mask and with a tree and key mask."""
    torch.manual_seed(0)
    q, k, v = torch.randn(B, 4, T, 8), torch.randn(B, 2, S, 8), torch.randn(B, 2, S, 8)
    masks = [None, torch.rand(B, 1, T, S) > 0.3]
    masks[1][..., -1] = True  # every query sees at least one key
    for mask in masks:
        torch.testing.assert_close(
            kernels.attend(q, k, v, mask), model_lib.attend(q, k, v, mask), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize(
    "T,S,tree", [(1, 9, False), (1, 40, False), (6, 6, False), (7, 30, True), (20, 50, True)]
)
def test_kernels_c_attention_is_model_attend_and_each_query_alone(T, S, tree, native_path):
    """kernels.attend_native: model.attend in bf16 (a decode step, a causal block, a tree after a
    cached prefix) on the cache's views (rows spaced by the cache's length), and each query the
    same bits alone as with the others: the nodes a plain step would see, in the same order."""
    torch.manual_seed(0)
    H, Hkv, Dh, slots = 6, 2, 24, 64  # Dh: a chunk and a half
    q = torch.randn(1, H, T, Dh).bfloat16()  # (1, H, T, Dh)
    k_cache, v_cache = torch.randn(2, 1, Hkv, slots, Dh).bfloat16()  # (1, Hkv, slots, Dh) each
    k, v = k_cache[:, :, :S], v_cache[:, :, :S]  # (1, Hkv, S, Dh) views
    mask = None
    if tree:  # the prefix, then each node sees itself and some earlier nodes
        nodes = (torch.rand(T, T) > 0.5).tril() | torch.eye(T, dtype=torch.bool)
        mask = torch.cat([torch.ones(T, S - T, dtype=torch.bool), nodes], 1)[
            None, None
        ]  # (1, 1, T, S)
    got = kernels.attend_native(q, k, v, mask)  # (1, H, T, Dh)
    want = model_lib.attend(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2**-7)
    # query t alone, as a plain step sees it: the keys it sees side by side, no mask
    for t in range(T):
        seen = torch.arange(S) <= S - T + t if mask is None else mask[0, 0, t]  # (S,) bool
        alone = kernels.attend_native(q[:, :, t : t + 1], k[:, :, seen], v[:, :, seen], None)
        assert torch.equal(alone, got[:, :, t : t + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_rope_equal_the_readable_ones(dtype):
    """FastRMSNorm (one layer norm of [x, -x]): model.RMSNorm's values, to fp32 rounding, and in
    bf16 within one ulp (it rounds once where the readable rounds twice), for a hidden state and
    for heads; under autograd the readable forward. rope() on q and k at once: apply_rope's bits."""
    torch.manual_seed(0)
    for shape in ((3, 5, 48), (2, 6, 4, 16)):  # (B, T, D), (B, H, T, Dh)
        norm = model_lib.RMSNorm(shape[-1], 1e-5).to(dtype)
        nn.init.normal_(norm.weight, 1, 0.3)
        # rows of every scale
        x = (torch.randn(shape) * torch.logspace(-2, 2, shape[-2])[:, None]).to(dtype)
        want = norm(x)
        kernels.use(norm, Kernels(glue=True))
        assert type(norm) is kernels.FastRMSNorm
        with torch.inference_mode():
            got = norm(x)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        else:  # each value the readable one or one of its two bf16 neighbours
            inf = torch.full_like(want, float("inf"))
            assert (
                (got == want)
                | (got == torch.nextafter(want, inf))
                | (got == torch.nextafter(want, -inf))
            ).all()
        # autograd: the readable one
        torch.testing.assert_close(norm(x.requires_grad_()), want, atol=0, rtol=0)
    cfg = tiny_config(head_dim=16)
    cos, sin = model_lib.Rope(cfg)(torch.tensor([3, 700, 2000]), dtype)  # (1, 1, T, Dh)
    q, k = torch.randn(2, 4, 3, 16, dtype=dtype), torch.randn(2, 2, 3, 16, dtype=dtype)
    sign = torch.tensor([-1, 1]).repeat_interleave(8).to(dtype)
    q2, k2 = kernels.rope(torch.cat([q, k], 1), cos, sin, sign).split([4, 2], 1)
    assert torch.equal(q2, model_lib.apply_rope(q, cos, sin)) and torch.equal(
        k2, model_lib.apply_rope(k, cos, sin)
    )


CASES = {
    "decode step": (1, 1, 8, False),
    "tree": (1, 5, 8, False),
    "batch with key mask": (3, 1, 8, True),
    "prefill": (1, 12, 0, False),
    "no cache": (2, 6, None, False),
}  # B, T, cached keys (None: no cache), key mask
# what model.py computes beyond Llama: q/k/v biases (Qwen2); q/k norms, heads wider than D / H
# (Qwen3)
FAMILY = {
    "llama-like": {},
    "qwen2-like": {"qkv_bias": True},
    "qwen3-like": {"qk_norm": True, "head_dim": 16},
    "gemma-like": {"activation": "gelu_pytorch_tanh"},
    "llama-like, Dh 32": {"head_dim": 32},
}  # kernels.c rotates whole chunks of 16 where Dh/2 is a multiple of 16


def spread_norms(module):
    """Norm weights away from 1, where a twin that skipped them would show."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.3)
    return module


def layer_case(readable, case, family):
    """model.Attention or model.Block of `family`, random, and run(dtype, kernels) -> the layer's
    output and its cache after one forward of `case` through those kernels, flattened (fp32)."""
    B, T, start, padded = CASES[case]
    cfg = tiny_config(**FAMILY[family])
    torch.manual_seed(0)
    layer = spread_norms(readable(cfg))
    x = torch.randn(B, T, cfg.dim)  # (B, T, D)
    cos, sin = model_lib.Rope(cfg)(torch.arange(start or 0, (start or 0) + T))
    tree = tree_lib.build([(0,), (1,), (0, 0), (0, 1)]).mask if case == "tree" else None  # (5, 5)
    key_mask = torch.rand(B, start + T) > 0.3 if padded else None
    mask = rows.attention_mask(T, start or 0, tree, key_mask, x.device)
    # k, v: prefix, then slots
    cache = torch.randn(2, B, cfg.n_kv_heads, (start or 0) + T, cfg.head_dim)

    def run(to, kernels_=Kernels()):
        m = readable(cfg).to(to)
        m.load_state_dict(layer.state_dict())
        kernels.use(m, kernels_)
        assert kernels_ == Kernels() or not PACKED or type(m) in kernels.READABLE
        k, v = cache.to(to).clone()
        with torch.inference_mode():
            y = m(x.to(to), cos.to(to), sin.to(to), mask, None if start is None else (k, v, start))
        # the output, the cache
        return torch.cat([y.float().flatten(), k.float().flatten(), v.float().flatten()])

    return run


@pytest.mark.parametrize("family", FAMILY)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
@pytest.mark.parametrize("readable", [model_lib.Attention, model_lib.Block])
def test_fast_attention_and_block_equal_the_readable_ones(readable, case, dtype, family):
    """One attention layer over a KV cache: FastAttention (fused q/k/v and their biases, o_proj
    prepacked, attend() above, q and k normed and rotated at once) gives model.Attention's output,
    q/k norms and wide heads included; one decoder layer: FastBlock (its norms and residual adds
    too) gives model.Block's. With the cache written as the readable layer writes it."""
    run = layer_case(readable, case, family)
    exact = run(torch.float32)
    if dtype == torch.float32:
        torch.testing.assert_close(run(torch.float32, FAST), exact, atol=1e-5, rtol=1e-5)
    else:
        close_as_readable(run(dtype, FAST), run(dtype), exact)


@pytest.mark.parametrize("family", FAMILY)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("readable", [model_lib.Attention, model_lib.Block])
def test_kernels_c_attention_and_block_equal_the_readable_ones(
    readable, case, family, native_path, monkeypatch
):
    """The same layers in bf16 through kernels.c: its products, its attention, and block_native,
    the whole layer in one call where it takes it (the rows of a batch over a cache), for each
    family."""
    run, start = layer_case(readable, case, family), CASES[case][2]
    calls = []
    monkeypatch.setattr(kernels, "block_native", lambda *a: calls.append(1) or block_native(*a))
    close_as_readable(run(torch.bfloat16, C), run(torch.bfloat16), run(torch.float32))
    assert len(calls) == (readable is model_lib.Block and start is not None)


def test_kernels_c_runs_the_layers_in_one_call_with_the_bits_of_one_by_one(native_path):
    """FastTransformer: through kernels.c the decoder layers run in one call (stack_native), with
    the bits each layer's own call (block_native) gives: the rows of a batch, one with a gap, a
    prefill and steps; a run of some layers (layers=); a layer with a hook runs alone (its hook
    sees it)."""
    torch.manual_seed(0)
    tiny = rows.Model(tiny_config(n_layers=3)).eval().requires_grad_(False)
    tiny = kernels.use(tiny.to(torch.bfloat16), C)
    assert type(tiny) is kernels.FastTransformer

    def decode(layers=None):  # logits of a prefill of 2 rows, then 3 steps, the second row behind
        cache, out = tiny.new_cache(16, batch=2, num_layers=layers and len(layers)), []
        with torch.inference_mode():
            tokens = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
            out.append(tiny(tokens, torch.arange(5), None, cache, layers=layers)[0])
            cache.lengths = [5, 3]
            for t in range(3):
                positions = torch.tensor([[5 + t], [3 + t]])
                out.append(tiny(tokens[:, t : t + 1], positions, None, cache, layers=layers)[0])
                cache.keep([0], [0])
        return torch.stack([o[:, -1] for o in out])  # (4, 2, V)

    one_call, by_layer, calls = [], [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "block_native", lambda *a: calls.append(1) or block_native(*a))
        for layers in (None, [0, 2]):
            one_call.append(decode(layers))
            assert not calls, "a layer ran alone though the stack takes them all"
            tiny.native_stack = dict.fromkeys(tiny.native_stack)  # every run: layer by layer
            by_layer.append(decode(layers))
            assert len(calls) == 4 * (3 if layers is None else 2)
            tiny.native_stack, calls[:] = {}, []
        hook = tiny.layers[1].register_forward_hook(lambda m, a, out: calls.append("hook"))
        assert torch.equal(decode(), by_layer[0]) and calls.count("hook") == 4
        hook.remove()
    for a, b in zip(one_call, by_layer):
        assert torch.equal(a, b)


def test_kernels_c_leaves_a_smaller_trees_padding_out_with_the_bits_of_the_padded_forward(
    native_path,
):
    """rows.Model.forward's sizes: rows whose trees are smaller than the largest are packed side by
    side in kernels.c (the padding is not computed); every row's own tokens get the logits and
    hidden states, and write the keys and values, of the padded forward, bit for bit."""
    torch.manual_seed(0)
    tiny = rows.Model(tiny_config(n_layers=2)).eval().requires_grad_(False)
    tiny = kernels.use(tiny.to(torch.bfloat16), C)
    g = torch.Generator().manual_seed(3)
    sizes, T = [4, 1, 2], 4
    tokens = torch.randint(0, 64, (3, T), generator=g)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    masks = torch.stack([tree] * 3)  # (B, T, T): each row's own tree, padding seeing itself
    masks[1:, :, :] &= torch.eye(T, dtype=torch.bool) | torch.ones(T, T, dtype=torch.bool).tril()

    def step(sizes):
        cache = tiny.new_cache(16, batch=3)
        with torch.inference_mode():
            tiny(
                torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(1)),
                torch.arange(6),
                None,
                cache,
            )
            cache.keep(*[range(6), range(4), range(5)])
            positions = torch.tensor(cache.lengths)[:, None] + torch.tensor([0, 1, 1, 2])
            logits, hidden = tiny(tokens, positions, masks, cache, sizes=sizes)
        return logits, hidden, cache

    padded, packed = step(None), step(sizes)
    assert not torch.equal(packed[1][1, 1:], padded[1][1, 1:]), "the padding was computed"
    for b, n in enumerate(sizes):
        assert torch.equal(packed[0][b, :n], padded[0][b, :n])
        assert torch.equal(packed[1][b, :n], padded[1][b, :n])
        slots = slice(6, 6 + n)  # where every row's new entries went
        assert torch.equal(packed[2].k[:, b, :, slots], padded[2].k[:, b, :, slots])
        assert torch.equal(packed[2].v[:, b, :, slots], padded[2].v[:, b, :, slots])


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
@needs_packing
def test_fast_mlp_equals_mlp(dtype, activation):
    """SwiGLU and Gemma's GeGLU: the twin fuses the products, the activation is the readable
    one's."""
    torch.manual_seed(0)
    mlp = model_lib.MLP(tiny_config(activation=activation)).to(dtype)
    x = torch.randn(2, 3, 32, dtype=dtype)  # (B, T, D)
    with torch.inference_mode():
        want = mlp(x)
        kernels.use(mlp, Kernels(packed=True))
        assert type(mlp) is kernels.FastMLP
        got = mlp(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@needs_packing
@pytest.mark.parametrize("kept", [False, True])
def test_fast_lm_head_equals_lm_head(tiny, kept):
    """The heads' frozen shared LM head (all tokens or the kept ones) prepacked; a trainable one per
    head (a (K, V', D) weight) keeps the readable class."""
    ids = torch.arange(0, 64, 3) if kept else None
    heads = heads_lib.build(heads_lib.HeadsConfig("medusa", num_heads=2), tiny, ids)
    own = heads_lib.build(heads_lib.HeadsConfig("medusa", num_heads=2, own_lm_head=True), tiny, ids)
    z = torch.randn(5, 32)  # (P, D)
    with torch.inference_mode():
        want = heads.project(z, 1)
        kernels.use(heads, Kernels(packed=True))
        kernels.use(own, Kernels(packed=True))
        assert type(heads.lm_head) is kernels.FastLMHead and type(own.lm_head) is heads_lib.LMHead
        torch.testing.assert_close(heads.project(z, 1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(BF16 == Kernels(), reason="no fast bf16 kernels on this CPU")
@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra++"])
def test_loaded_heads_draft_the_same_through_their_twins(tmp_path, kind):
    """checkpoint.load_heads prepacks every layer a drafting step runs (the MLPs' linear layers,
    the frozen LM head, Hydra++'s decoder layer) from the loaded weights, not build()'s zero-
    initialised ones: the logits of each depth, and Hydra++'s context, match the readable path's."""
    torch.manual_seed(0)
    base = rows.Model(tiny_config(max_seq_len=64)).eval().requires_grad_(False)
    heads = heads_lib.build(heads_lib.HeadsConfig(kind, num_heads=2), base, torch.arange(0, 64, 2))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    checkpoint.save_heads(heads, tmp_path, dtype=torch.float32)
    base = kernels.use(base.to(dtype=torch.bfloat16))
    loaded = checkpoint.load_heads(tmp_path, base)
    assert kernels.in_use(loaded) == BF16
    if BF16.packed:
        mlps = loaded.blocks if kind == "medusa" else loaded.mlps
        assert type(loaded.lm_head) is kernels.FastLMHead
        assert all(
            type(m) is kernels.PackedLinear for m in mlps.modules() if isinstance(m, nn.Linear)
        )
    h, path = torch.randn(1, 5, 32).bfloat16(), torch.tensor([[3, 5], [7, 1]])

    def outputs():
        context = loaded.context(h, torch.arange(5))  # (1, 5, D)
        return [context.float()] + [
            loaded.project(loaded.head(d, context[:, -1], path[:, :d]), d).float() for d in (1, 2)
        ]

    with torch.inference_mode():
        fast = outputs()
        kernels.use(loaded, Kernels())
        readable = outputs()
        stale = heads_lib.build(
            heads_lib.HeadsConfig(kind, num_heads=2), base, torch.arange(0, 64, 2)
        )
        stale = stale.context(h, torch.arange(5)).float()  # zero-initialised
    for f, r in zip(fast, readable):
        assert (f - r).abs().max() < 0.05 * r.abs().max(), (f - r).abs().max()
    if kind == "hydra++":  # a layer prepacked from the zero-initialised weights would be far off
        assert (fast[0] - stale).abs().max() > 10 * (fast[0] - readable[0]).abs().max()


# --- the whole model -----------------------------------------------------------------------------


def operations(fn):
    """How many operations fn() sends through PyTorch's dispatcher (not those they call inside)."""
    ops = ("aten::", "mkldnn::")
    with torch.profiler.profile() as p:
        fn()
    return sum(
        e.name.startswith(ops) and not (e.cpu_parent and e.cpu_parent.name.startswith(ops))
        for e in p.events()
    )


@needs_packing
def test_a_decode_step_runs_a_third_fewer_operations_a_layer_through_the_twins(tiny):
    """What Kernels.glue is for: beyond its products, a decode step's time goes to the small
    operations between them, each a trip through the dispatcher. Counted for one layer (a step
    through both layers less a step through the first): the twins Kernels.choose picks for fp32
    run at most two thirds of the readable layer's."""
    tokens, positions = torch.ones(1, 1, dtype=torch.long), torch.tensor([8])
    per_layer = {}
    for name, k in (("readable", Kernels()), ("fast", Kernels.choose("cpu", torch.float32, 0))):
        kernels.use(tiny, k)
        cache = tiny.new_cache(16)
        with torch.inference_mode():
            tiny(torch.ones(1, 8, dtype=torch.long), torch.arange(8), None, cache)
            cache.keep(range(8))
            per_layer[name] = operations(lambda: tiny(tokens, positions, None, cache)) - operations(
                lambda: tiny(tokens, positions, None, cache, layers=[0])
            )
    assert per_layer["fast"] <= 2 / 3 * per_layer["readable"], per_layer


@needs_packing
@pytest.mark.parametrize("family", FAMILY)
def test_prepacked_fp32_linears_match_the_readable_path(family):
    """fp32 on a CPU: the prepacked linear layers and the glue twins (Kernels.choose's pick where
    oneDNN is there) give the readable path's logits to fp32 rounding, for a prefix, a tree and a
    padded batch."""
    torch.manual_seed(0)
    tiny = spread_norms(rows.Model(tiny_config(**FAMILY[family]))).eval().requires_grad_(False)
    tree = tree_lib.build([(0,), (1,), (0, 0), (0, 1)])
    tokens = torch.randint(0, 64, (2, 12))
    out = {}
    with torch.inference_mode():
        for name, k in (("readable", Kernels()), ("packed", Kernels(packed=True, glue=True))):
            kernels.use(tiny, k)
            assert (type(tiny.lm_head) is kernels.PackedLinear) == k.packed
            cache = tiny.new_cache(32, batch=2)
            prefix, _ = tiny(tokens, torch.arange(12), None, cache)
            cache.keep(range(12), range(9))  # row 1 right-padded: its slots 9-11 are hidden
            logits, _ = tiny(tokens[:, : tree.num_nodes], 12 + tree.depth, tree.mask, cache)
            out[name] = torch.cat([prefix, logits], 1)
    torch.testing.assert_close(out["packed"], out["readable"], atol=1e-5, rtol=1e-5)


def test_fast_kernels_match_readable_path_in_bf16(tiny):
    """The bf16 forward with the fast kernels Kernels.choose picks here (kernels.c, or oneDNN's
    prepacked linears where bf16 is native to it) stays as close to the fp32 result as the
    readable bf16 path does: same prefix, tree and batch."""
    tiny32 = tiny
    tiny16 = rows.Model(tiny.cfg).eval().requires_grad_(False)
    tiny16.load_state_dict(tiny32.state_dict())
    tiny16 = tiny16.to(dtype=torch.bfloat16)
    tree = tree_lib.build([(0,), (1,), (0, 0), (0, 1)])
    tokens = torch.randint(0, 64, (2, 12))
    with torch.inference_mode():
        errors = {}
        for name, k in (("readable", Kernels()), ("fast", BF16)):
            kernels.use(tiny16, k)
            out = []
            for m in (tiny32, tiny16):
                cache = m.new_cache(32, batch=2)
                m(tokens, torch.arange(12), None, cache)
                cache.keep(range(12), range(12))
                logits, _ = m(tokens[:, : tree.num_nodes], 12 + tree.depth, tree.mask, cache)
                out.append(logits.float())
            errors[name] = (out[0] - out[1]).abs().max().item()
    assert errors["fast"] < 2 * errors["readable"] + 0.05, errors


# --- the training loss ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["teacher", "next-token"])
def test_fused_batch_loss_has_the_readable_losses_values_and_gradients(kind, dtype):
    """kernels.fused_batch_loss against train.batch_loss over the logits of the same LM head
    (shared, or one per head), products in `dtype`: the value and the gradients of z and of the LM
    head."""
    # 600 rows (several blocks and a partial one), D = 24, over 300 tokens; some top-k ids not kept
    # (-1), some rows whose teacher puts all its mass in its top-k (r = 0), one whose head puts all
    # its mass there too (1 - s below the 1e-6 clamp), and both losses: teacher and next-token (p =
    # 1)
    g = torch.Generator().manual_seed(0)
    M, D, V, k = 600, 24, 300, 5
    assert M > 2 * kernels.sizes("cpu").loss_rows and M % kernels.sizes("cpu").loss_rows
    z = torch.randn(M, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.6
    z[:, 0] = 0  # dimension 0 is row 7's alone:
    z[7] = 0
    z[7, 0] = 40  # its logits are 40 weight[:, 0]:
    weight[:, 0] = -1
    weight[:k, 0] = 0  # 0 on tokens 0..4, -40 elsewhere
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(M)])
    ids[7] = torch.arange(k)
    ids[torch.rand(M, k, generator=g) < 0.1] = -1
    p = torch.rand(M, k, generator=g).softmax(-1) * torch.rand(M, 1, generator=g)
    p[::3] = p[::3] / p[::3].sum(-1, keepdim=True)  # r = 0
    target = torch.randint(-1, V, (M,), generator=g)
    j = torch.randint(0, 3, (M,), generator=g)  # head - 1
    per_head = weight.repeat(3, 1, 1)
    per_head[..., 1:] += 0.1 * torch.randn(3, V, D - 1, generator=g)  # column 0 (row 7's) the same

    def logits_of(z_, w_):  # the LM head, in the products' dtype: (M, V')
        if w_.dim() == 2:
            return z_.to(dtype) @ w_.to(dtype).T
        return (z_.to(dtype)[:, None] @ w_.to(dtype)[j].transpose(-1, -2))[:, 0]

    for w in (weight, per_head):
        za, wa = z.clone().requires_grad_(), w.clone().requires_grad_()
        want = train.batch_loss(kind, logits_of(za, wa), j + 1, ids, p, target)  # heads from 1
        (want * 3).backward()  # any upstream gradient
        zb, wb = z.clone().requires_grad_(), w.clone().requires_grad_()
        got = kernels.fused_batch_loss(kind, zb, wb, j, ids, p, target, dtype)
        (got * 3).backward()
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-4)
        for mine, readable_grad in ((zb.grad, za.grad), (wb.grad, wa.grad)):
            if dtype == torch.float32:  # the same sums in another order
                torch.testing.assert_close(mine, readable_grad, atol=1e-6, rtol=1e-4)
            # bf16 roundings of dL/dlogits (1 ulp of a -1 is 0.008) differ here and there: compare
            # in norm
            else:
                assert (mine - readable_grad).norm() < 1e-2 * readable_grad.norm()
        # a frozen LM head gets no gradient and needs none
        zc = z.clone().requires_grad_()
        (kernels.fused_batch_loss(kind, zc, w, j, ids, p, target, dtype) * 3).backward()
        torch.testing.assert_close(zc.grad, zb.grad)


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("kind", ["teacher", "next-token"])
def test_train_forward_gives_the_same_loss_and_gradients_readable_or_fused(tiny, kind, own):
    """train.py's --loss-impl: TrainForward's readable loss (the heads' LM head, then batch_loss)
    and its fused twin, on a collated batch of Hydra++ heads: the same loss and weight gradients."""
    g = torch.Generator().manual_seed(0)
    n, kept = 24, torch.arange(0, 64, 2)
    data = dict(
        offsets=torch.tensor([0, 11, n]),
        ids=torch.randint(1, 64, (n,), generator=g),
        loss=torch.rand(n, generator=g) > 0.3,
        hidden=torch.randn(n, 32, generator=g).half(),
        top_ids=torch.randint(0, 64, (n, 4), generator=g),
        top_p=(torch.rand(n, 4, generator=g).softmax(-1) * 0.9).half(),
    )
    batch = losses.collate(data, [0, 1], losses.to_kept_map(kept, 64), 3, "cpu")
    heads = heads_lib.build(
        heads_lib.HeadsConfig("hydra++", num_heads=3, own_lm_head=own), tiny, kept
    ).train()
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    loss, grads = {}, {}
    for impl in ("readable", "fused"):
        heads.zero_grad()
        readable = train.batch_loss if impl == "readable" else None
        loss[impl] = losses.TrainForward(heads, readable)(batch, kind)
        loss[impl].backward()
        grads[impl] = [p.grad for p in heads.parameters()]
    torch.testing.assert_close(loss["fused"], loss["readable"], atol=1e-6, rtol=1e-5)
    for fused, readable in zip(grads["fused"], grads["readable"]):
        torch.testing.assert_close(fused, readable, atol=1e-6, rtol=1e-4)


# --- weight-only int8 and int4 -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_is_the_product_with_its_dequantized_weight(dtype):
    """int8 and int4: each weight within half a step of the layer's, the CPU kernel's product that
    of x with widen()'s weight (to fp32 rounding, or bf16's)."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 48).to(dtype)
    x = torch.randn(2, 3, 64, dtype=dtype)  # (B, T, in)
    q8, scale = kernels.int8_weight(layer.weight)
    q4, scale_zero = kernels.int4_weight(layer.weight)
    assert q8.dtype == torch.int8 and q8.abs().max() <= 127
    assert q4.shape == (48, 64) and q4.max() <= 15 and scale_zero.shape == (64 // 32, 48, 2)
    step4 = scale_zero[..., 0].T.repeat_interleave(32, 1)  # (48, 64) each weight's scale
    for q, s, packed, step in (
        (q8, scale, q8, scale[:, None]),
        (q4, scale_zero, kernels.int4_pack(q4), step4),
    ):
        w = kernels.widen(q, s).float()  # (48, 64)
        # of scale, zero and w in dtype
        rounding = 2 * torch.finfo(dtype).eps * layer.weight.abs().max().float()
        assert ((w - layer.weight.float()).abs() <= 0.51 * step.float() + rounding).all()
        with torch.no_grad():
            got = kernels.quantized_linear(x, packed, s, layer.bias).float()  # (B, T, 48)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got, x.float() @ w.T + layer.bias.float(), atol=tol, rtol=tol)


def test_fp16_weights_multiply_in_fp32_and_rows_alone_where_the_cpu_says():
    """fbgemm's fp16 product: x times the weight rounded to fp16, summed in fp32, in every dtype;
    bias and `add` as linear() takes them. A row's result is the same bits whatever rows share the
    call (so a tree step and a plain step agree) exactly where fp16_rows_alone() says so: on
    AVX-512 CPUs, not on AVX2 ones, where fbgemm sums some row counts in another order."""
    torch.manual_seed(0)
    w, bias = torch.randn(96, 64) * 0.1, torch.randn(96)
    packed = kernels.prepack(w[:40], w[40:], product="fp16")
    x = torch.randn(1, 70, 64)  # (B, T, in)
    with torch.no_grad():
        y = kernels.linear(x, packed, bias, add=torch.ones(1, 70, 96))  # (B, T, out)
        torch.testing.assert_close(y, 1 + x @ w.half().float().T + bias, atol=1e-5, rtol=1e-5)
        whole = kernels.linear(x, packed)
        alone = [
            torch.equal(kernels.linear(x[:, a:b], packed), whole[:, a:b])
            for a in (0, 3)
            for b in range(a + 1, 70)
        ]
        assert all(alone) == kernels.fp16_rows_alone()
        got = kernels.linear(x.bfloat16(), packed)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(
            got.float(), x.bfloat16().float() @ w.half().float().T, atol=1e-2, rtol=1e-2
        )


@pytest.mark.parametrize("product", ["c", "c-int8"])
def test_kernels_c_product_is_the_bf16_product_and_each_row_alone(product, native_path):
    """kernels.c: bf16 rows times a bf16 weight (or int8_weight's, widened), exact products summed
    in fp32, bias and `add` inside the one rounding to bf16; outputs not a multiple of its blocks
    (100); a row's result the same bits whatever rows share the call, from 1 row to more than a
    tile's rows."""
    torch.manual_seed(0)
    w, bias = (torch.randn(100, 64) * 0.1).bfloat16(), torch.randn(100).bfloat16()
    packed = kernels.prepack(w[:40], w[40:], product=product)
    assert isinstance(packed, kernels.NativeWeight) and (packed.scale is not None) == (
        product == "c-int8"
    )
    # (B, T, in), (B, T, out)
    x, add = (
        torch.randn(1, 70, 64).bfloat16(),
        torch.randn(1, 70, 100).bfloat16(),
    )
    with torch.no_grad():
        y = kernels.linear(x, packed, bias, add)  # (B, T, out)
        assert y.dtype == torch.bfloat16 and y.shape == (1, 70, 100)
        if product == "c-int8":  # the weight int8 stands for, unrounded: q * scale
            q, scale = kernels.int8_weight(w)
            w = q.float() * scale.float()[:, None]
        want = x.float() @ w.float().T + bias.float() + add.float()
        torch.testing.assert_close(y.float(), want, atol=1e-3, rtol=2**-8)  # one bf16 rounding
        assert (y.float() - want).abs().max() > 0  # it is bf16, not fp32
        for a, b in [(0, 1), (3, 8), (9, 25), (60, 70)] + [(0, n) for n in range(2, 17)]:
            assert torch.equal(kernels.linear(x[:, a:b], packed, bias, add[:, a:b]), y[:, a:b])
        # any leading shape
        assert torch.equal(kernels.linear(x, packed), kernels.linear(x[0], packed)[None])


def test_kernels_c_runs_each_path_this_cpu_executes_and_only_for_bf16(native_path):
    """Forced onto a path (SPECDEC_KERNELS), kernels.c builds that path's code, and Kernels.choose
    runs it for bf16, never for fp32; native_reason() is None."""
    assert kernels.native_path() == native_path and kernels.native_reason() is None
    assert kernels.native_library().kernels_isa().decode() == native_path
    assert Kernels.choose("cpu", torch.bfloat16, 0) == C
    assert not Kernels.choose("cpu", torch.float32, 0).native


def test_the_banner_names_the_path_a_bf16_step_runs(native_path):
    """generate.py's banner on a CPU: bf16 through kernels.c names its path (the tuned files read
    are that path's); fp32 runs PyTorch's kernels and names none."""
    import types

    from specdec import terminal

    def banner(dtype):
        m = types.SimpleNamespace(dtype=dtype, cfg=types.SimpleNamespace(name="m"))
        dec = types.SimpleNamespace(model=m, drafter=types.SimpleNamespace(name="heads: none"))
        draft = types.SimpleNamespace(kind="none", heads="none")
        return terminal.banner_line(dec, draft, device="cpu", quantize="none", threads=2)

    assert (
        banner(torch.bfloat16)
        == f"[m on cpu, bfloat16 (kernels.c: {native_path}), heads: none, 2 threads]"
    )
    assert banner(torch.float32) == "[m on cpu, float32, heads: none, 2 threads]"


def test_kernels_c_off_or_not_to_be_had_leaves_pytorch_one_notice(monkeypatch, tmp_path, capsys):
    """A path this CPU cannot run, forced (avx512-bf16 without AVX512-BF16; NEON on x86): one
    notice, no build, PyTorch's kernels, never its code. A compiler that fails: one notice,
    nothing half-written left. Turned off (SPECDEC_KERNELS=off, SPECDEC_NO_C=1): no notice, not
    even tried. native_reason() says why in each case."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    runnable = kernels.runnable_paths()
    foreign = next(p for p in ("avx512-bf16", "neon", "avx2") if p not in runnable)
    cases = [
        ({"SPECDEC_KERNELS": foreign}, "this CPU cannot run it", 1),
        ({"SPECDEC_KERNELS": "sse"}, "is none of", 1),
        ({"SPECDEC_KERNELS": "off"}, "turned off", 0),
        ({"SPECDEC_NO_C": "1", "CC": "false"}, "turned off", 0),
    ]
    if runnable:
        cases.append(({"SPECDEC_KERNELS": runnable[0], "CC": "false"}, "(false exited with 1)", 1))
    try:
        for env, why, notices in cases:
            with monkeypatch.context() as m:
                for name, value in env.items():
                    m.setenv(name, value)
                kernels.native.cache_clear()
                assert kernels.native_library() is None and why in kernels.native_reason()
                assert not Kernels.choose("cpu", torch.bfloat16, 0).native
                kernels.native_library()  # asked again: no second notice
                assert capsys.readouterr().err.count("notice: ") == notices, env
    finally:
        kernels.native.cache_clear()
    assert list(tmp_path.iterdir()) == []  # no library, whole or partial


def test_each_path_and_cpu_keeps_its_own_build(monkeypatch):
    """The cached library's name keys the path and the CPU's features (besides the source, the
    compiler and its flags, torch): a home folder shared by two machines never loads the other's."""
    names = {path: kernels.library_file(path) for path in kernels.PATHS}
    assert len(set(names.values())) == len(names)
    assert all(path in name for path, name in names.items())
    monkeypatch.setattr(kernels, "cpu_flags", lambda: kernels.PATHS["avx2"][0])  # another CPU
    assert all(kernels.library_file(path) != name for path, name in names.items())


SKYLAKE_SP = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512cd", "avx512dq"}


@pytest.mark.parametrize(
    "flags, best",
    [
        (SKYLAKE_SP | {"avx512_vnni"}, "avx512f"),  # Skylake to Ice Lake: AVX-512, no BF16
        (SKYLAKE_SP | {"avx512_bf16"}, "avx512-bf16"),  # Cooper Lake, Sapphire Rapids, Zen 4
        ({"avx2", "fma", "f16c", "avx512f", "avx512cd"}, "avx2"),  # Knights Landing: no BW, VL
        ({"avx2", "fma", "f16c"}, "avx2"),
    ],
)
def test_the_best_path_the_cpus_flags_allow_is_chosen(monkeypatch, flags, best):
    """Chosen from /proc/cpuinfo's flags, best first: AVX-512 without BF16 (the Xeons most clouds
    rent) gets its own path, between AVX512-BF16 and AVX2; forced onto a path it lacks, a CPU
    runs none (one notice, tested above); the tuned files name the path (tree-cpu-PATH-...)."""
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    monkeypatch.delenv("SPECDEC_NO_C", raising=False)
    assert list(kernels.PATHS)[:3] == ["avx512-bf16", "avx512f", "avx2"]
    assert kernels.native_path() == best and kernels.runnable_paths()[0] == best
    assert catalog.tuned_tree_file("h", "cpu", torch.bfloat16) == os.path.join(
        "h", f"tree-cpu-{best}-bfloat16.json"
    )
    monkeypatch.setenv("SPECDEC_KERNELS", "avx512f")
    path, why = kernels.native_choice()
    assert path == ("avx512f" if "avx512f" in kernels.runnable_paths() else None)
    assert path or why == f"SPECDEC_KERNELS=avx512f: this CPU cannot run it (it runs: {best})"


@pytest.mark.parametrize("path", kernels.PATHS)
def test_every_path_compiles(path, tmp_path, monkeypatch):
    """Each path's code compiles with its flags, whatever this CPU runs: the x86 ones with an x86
    C compiler (gcc takes -mavx512bf16 on any x86 CPU), NEON with an aarch64 one (here or a cross
    compiler, aarch64-linux-gnu-gcc); skipped where no such compiler is installed."""
    arm = platform.machine().lower() in kernels.ARM
    compiler = os.environ.get("CC", "cc") if (path == "neon") == arm else None
    if path == "neon" and not arm:
        compiler = "aarch64-linux-gnu-gcc"
    if compiler is None or shutil.which(compiler) is None:
        pytest.skip(f"no C compiler for {path} here")
    monkeypatch.setenv("CC", compiler)
    out = tmp_path / f"kernels-{path}.so"
    subprocess.run(
        kernels.build_command(path, str(out)), check=True, capture_output=True, timeout=300
    )
    assert f"{path}\0".encode() in out.read_bytes()  # kernels_isa(): that path's code, built


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_a_bf16_model_through_kernels_c_decodes_speculatively_as_it_decodes_plainly(
    quant, native_path
):
    """kernels.c's rows and queries do not depend on each other: in bf16, a tree step's products
    and attention give each node what a plain step gives it, and greedy speculative decoding keeps
    plain greedy's tokens."""
    from specdec import drafters
    from specdec.engines import decode

    steps = {"plain": 0, "spec": 0}
    for seed in range(10):  # (through oneDNN and SDPA, 1 of these 10 differs)
        torch.manual_seed(seed)
        base = rows.Model(tiny_config(vocab_size=64)).eval()
        heads = heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=2), base)
        for p in heads.parameters():
            p.data.normal_(0, 0.2)
        base.to(torch.bfloat16), heads.to(torch.bfloat16)
        kernels.use(base), kernels.use(heads)
        if quant != "none":
            kernels.quantize(base, quant)
        assert kernels.in_use(base).native and isinstance(
            base.layers[0].mlp.packed, kernels.NativeWeight
        )
        assert (base.layers[0].mlp.packed.scale is not None) == (quant == "int8")
        plain = decode.generate(base, [3, 4, 5], 40)
        spec = decode.generate(
            base,
            [3, 4, 5],
            40,
            drafters.HeadsDrafter(heads, tree_lib.build(tree_lib.cartesian([2, 2]))),
        )
        assert spec.tokens == plain.tokens
        steps["plain"], steps["spec"] = steps["plain"] + plain.steps, steps["spec"] + spec.steps
    assert steps["spec"] < steps["plain"]  # the heads' guesses were taken


@pytest.mark.parametrize("quant", ["fp16", "int8", "int4"])
def test_a_quantized_model_decodes_speculatively_as_it_decodes_plainly(quant):
    """Quantised weights change the model a little; the lossless contract holds against that
    model."""
    from specdec.engines import decode
    from specdec import drafters

    torch.manual_seed(0)
    base = rows.Model(tiny_config(vocab_size=64)).eval()
    heads = heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=2), base)
    for p in heads.parameters():
        p.data.normal_(0, 0.2)
    before = base.lm_head.weight.clone()
    readable = decode.generate(base, [3, 4, 5], 20)
    kernels.quantize(base, quant)
    assert type(base.lm_head) is kernels.PackedLinear and kernels.in_use(base).quant == quant
    assert (type(base.layers[0].mlp) is kernels.FastMLP) == (
        quant == "fp16"
    )  # fp16 keeps the fused products
    assert torch.equal(base.lm_head.weight, before)  # the weights themselves stay
    plain = decode.generate(base, [3, 4, 5], 20)
    spec = decode.generate(
        base,
        [3, 4, 5],
        20,
        drafters.HeadsDrafter(heads, tree_lib.build(tree_lib.cartesian([2, 2]))),
    )
    assert spec.tokens == plain.tokens and plain.tokens[:3] == readable.tokens[:3]
    kernels.use(base, kernels.Kernels())
    assert type(base.lm_head) is nn.Linear


def test_a_layer_the_int4_kernel_does_not_take_stays_readable():
    """The CPU's int4 kernel wants out a multiple of 16 and in of the group (32): a 72-token
    vocabulary's LM head stays nn.Linear."""
    m = rows.Model(tiny_config(vocab_size=72, tie_embeddings=True)).eval()
    kernels.quantize(m, "int4")
    assert (
        type(m.lm_head) is nn.Linear and type(m.layers[0].self_attn.q_proj) is kernels.PackedLinear
    )
    with torch.no_grad():
        m(torch.ones(1, 3, dtype=torch.long), torch.arange(3), None, m.new_cache(8))


def test_expanded_kv_attention_equals_the_readable_one_with_every_kind_of_mask(tiny):
    """The GPU twin, checked on the CPU: a tree mask, padding in a batch, a causal prefill."""
    torch.manual_seed(0)
    B, H, Hkv, T, S, Dh = 2, 4, 2, 5, 9, 8
    q, k, v = torch.randn(B, H, T, Dh), torch.randn(B, Hkv, S, Dh), torch.randn(B, Hkv, S, Dh)
    tree = torch.ones(T, T, dtype=torch.bool).tril()
    tree[3, 1] = False
    key_mask = torch.ones(B, S, dtype=torch.bool)
    key_mask[1, :2] = False
    for mask in (
        None,
        rows.attention_mask(T, S - T, tree, None, "cpu"),
        rows.attention_mask(T, S - T, None, key_mask, "cpu"),
    ):
        torch.testing.assert_close(
            kernels.attend_expanded(q, k, v, mask), model_lib.attend(q, k, v, mask)
        )


@pytest.mark.parametrize("mask", [None, "tree"])
def test_the_gpu_attention_never_lets_sdpa_pick_cudnn_and_restores_the_callers_choice(
    monkeypatch, mask
):
    """cuDNN's attention plans each new shape: a decode step (a new key length every step) paid
    1.4 ms of host time a layer for it on an H200. SDPA sees it off; the caller's flag comes back,
    on an error too."""
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or sdpa(*a, **k),
    )
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    if mask == "tree":
        mask = rows.attention_mask(3, 4, torch.ones(3, 3, dtype=torch.bool).tril(), None, "cpu")
    for before in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(before)
        try:
            kernels.attend_expanded(q, k, v, mask)
            with pytest.raises(RuntimeError):
                kernels.attend_expanded(q, k[..., :5], v, mask)  # Dh differs: SDPA refuses
            assert torch.backends.cuda.cudnn_sdp_enabled() is before
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
    assert seen and not any(seen)
