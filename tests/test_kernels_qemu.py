"""kernels.c's NEON path run, not only compiled, on a machine that is not ARM: built for aarch64
with tests/kernels_harness.c (its functions called on numbers read from stdin) and run under
qemu-user, checked as tests/test_kernels.py checks the paths the CPU runs: its product (bf16 and
int8 weights) is the bf16 product, its attention is model.attend, its decoder layer is model.Block
(to bf16 rounding), and every row or query is the same bits alone as with others. Skipped where no
aarch64 C compiler (Debian: gcc-aarch64-linux-gnu) or no qemu-aarch64 (qemu-user or
qemu-user-static) is installed; on an ARM machine it runs natively. Tiny shapes: qemu is slow.
Run: `python -m pytest -q tests/test_kernels_qemu.py`. Shapes: B batch, T new tokens, S keys, H
query heads, Hkv key/value heads, Dh head size, D hidden.
"""

import ctypes
import os
import platform
import shutil
import struct
import subprocess

import pytest
import torch

from specdec.fast import kernels
import model as model_lib
from specdec import rows as rows_lib
from conftest import tiny_config
from specdec.fast.kernels import Kernels
from test_kernels import close_as_readable, spread_norms

ARM = platform.machine().lower() in kernels.ARM
COMPILER = os.environ.get("CC", "cc") if ARM else "aarch64-linux-gnu-gcc"
QEMU = None if ARM else shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels_harness.c")
C = Kernels(attention="cpu-bf16", packed=True, glue=True, native=True)  # kernels.c's twins

pytestmark = pytest.mark.skipif(
    shutil.which(COMPILER) is None or not (ARM or QEMU),
    reason=f"needs {COMPILER} and, off ARM, qemu-aarch64 (gcc-aarch64-linux-gnu, qemu-user)",
)


@pytest.fixture(scope="module")
def neon(tmp_path_factory):
    """neon(*calls) -> each call's outputs: kernels.c's NEON path built with the harness (static:
    qemu needs no aarch64 library folder) and run once for all the calls, each (name, arguments in
    the C function's order, the shapes of the bf16 arrays it writes)."""
    program = str(tmp_path_factory.mktemp("neon") / "kernels_harness")
    flags = [f for f in kernels.CFLAGS if f not in ("-shared", "-fPIC")] + kernels.PATHS["neon"][1]
    static = [] if ARM else ["-static"]
    build = [COMPILER, *flags, *static, HARNESS, "-lm", "-o", program]  # it includes kernels.c
    built = subprocess.run(build, capture_output=True, timeout=300)
    assert built.returncode == 0, built.stderr.decode(errors="replace")

    def run(*calls):
        stdin = b"".join(encode(a) for name, args, _ in calls for a in (name, *args))
        # two threads: the outputs shared out between them, as on any multi-core CPU
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        ran = subprocess.run(
            [QEMU, program] if QEMU else [program],
            input=stdin,
            capture_output=True,
            timeout=300,
            env=env,
        )
        assert ran.returncode == 0, ran.stderr.decode(errors="replace")
        shapes = [torch.Size(shape) for _, _, written in calls for shape in written]
        numbers = torch.frombuffer(bytearray(ran.stdout), dtype=torch.bfloat16)
        assert len(numbers) == sum(shape.numel() for shape in shapes)
        parts = numbers.split([shape.numel() for shape in shapes])
        arrays = iter(part.view(shape) for part, shape in zip(parts, shapes))
        return [[next(arrays) for _ in written] for _, _, written in calls]

    return run


def encode(arg):
    """One argument as the harness reads it: its byte count (int64), then its bytes."""
    if arg is None:  # NULL
        data = b""
    elif isinstance(arg, str):
        data = arg.encode()
    elif isinstance(arg, int):
        data = struct.pack("<q", arg)
    elif isinstance(arg, float):
        data = struct.pack("<f", arg)
    else:  # a tensor, as it lies in memory
        data = arg.contiguous().flatten().view(torch.uint8).numpy().tobytes()
    return struct.pack("<q", len(data)) + data


def linear(x, weight, bias=None, add=None):
    """linear_bf16's call for x (M, K) bf16 and a NativeWeight: y (M, N)."""
    M, K = x.shape
    N = weight.out
    return "linear_bf16", (x, M, K, weight.packed, weight.scale, N, bias, add), [(M, N)]


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_neon_product_is_the_bf16_product_and_each_row_alone(int8, neon):
    """linear_bf16 on NEON: bf16 rows times a bf16 weight (or int8_weight's, widened), exact
    products summed in fp32, bias and add inside the one rounding to bf16, outputs not a multiple
    of its blocks (40); 1 (both blocks of outputs a pass), 3 (one), 8 (half of one) and 13 rows
    (tiles of 6 and 7); each row the same bits alone, in a call of 13 and in smaller ones."""
    torch.manual_seed(0)
    w, bias = (torch.randn(40, 38) * 0.1).bfloat16(), torch.randn(40).bfloat16()
    x, add = torch.randn(13, 38).bfloat16(), torch.randn(13, 40).bfloat16()
    packed = kernels.NativeWeight(w, int8=int8)
    if int8:  # the weight int8 stands for, unrounded: q * scale
        q, scale = kernels.int8_weight(w)
        w = q.float() * scale.float()[:, None]
    counts = (1, 3, 8, 13)
    calls = [linear(x[:M], packed, bias, add[:M]) for M in counts]
    calls += [linear(x[r : r + 1], packed, bias, add[r : r + 1]) for r in range(13)]
    calls.append(linear(x, packed))  # no bias, no add: NULL
    outputs = [y for (y,) in neon(*calls)]
    ys, alone, bare = outputs[: len(counts)], torch.cat(outputs[len(counts) : -1]), outputs[-1]
    want = x.float() @ w.float().T + bias.float() + add.float()
    for M, y in zip(counts, ys):
        torch.testing.assert_close(y.float(), want[:M], atol=1e-3, rtol=2**-8)  # one rounding
        assert torch.equal(y, alone[:M])
    assert (ys[-1].float() - want).abs().max() > 0  # it is bf16, not fp32
    torch.testing.assert_close(bare.float(), x.float() @ w.float().T, atol=1e-3, rtol=2**-8)


def attend(q, k_cache, v_cache, S, mask):
    """attend_bf16's call for q (B, H, T, Dh) over the first S slots of the caches (B, Hkv, slots,
    Dh), rows spaced by the cache's length; mask (B, T, S) bool or None (causal): y (B, T, H,
    Dh)."""
    B, H, T, Dh = q.shape
    Hkv = k_cache.shape[1]
    row, head = k_cache.stride(0), k_cache.stride(1)
    args = (q, B, H, T, Dh, k_cache, v_cache, Hkv, S, row, head, mask, Dh**-0.5)
    return "attend_bf16", args, [(B, T, H, Dh)]


@pytest.mark.parametrize(
    "T,S,tree", [(1, 9, False), (4, 10, False), (5, 13, True)], ids=["step", "causal", "tree"]
)
def test_neon_attention_is_model_attend_and_each_query_alone(T, S, tree, neon):
    """attend_bf16 on NEON: model.attend (fp32) to bf16 rounding for B = 2 rows of a cache longer
    than S (a decode step; a causal block after a cached prefix, no mask; a tree after one, each
    row its own mask), Dh a chunk and a half (12), S not a multiple of the lanes; and each query
    the same bits alone, over just the keys it sees."""
    torch.manual_seed(0)
    B, H, Hkv, Dh, slots = 2, 4, 2, 12, 16
    q = torch.randn(B, H, T, Dh).bfloat16()  # (B, H, T, Dh)
    k_cache, v_cache = torch.randn(2, B, Hkv, slots, Dh).bfloat16()  # (B, Hkv, slots, Dh) each
    mask = None  # causal: query t sees keys up to S - T + t
    seen = (torch.arange(S) <= S - T + torch.arange(T)[:, None]).expand(B, T, S)  # (B, T, S)
    if tree:  # some of the prefix (a row's padding hidden), then each node, itself and some before
        prefix = torch.rand(B, T, S - T) > 0.3
        nodes = (torch.rand(B, T, T) > 0.5).tril() | torch.eye(T, dtype=torch.bool)
        mask = seen = torch.cat([prefix, nodes], -1)  # (B, T, S)
    calls = [attend(q, k_cache, v_cache, S, mask)]
    for b in range(B):
        for t in range(T):  # query t of row b alone: the keys it sees side by side, no mask
            k, v = (c[b : b + 1, :, :S][:, :, seen[b, t]].contiguous() for c in (k_cache, v_cache))
            calls.append(attend(q[b : b + 1, :, t : t + 1], k, v, int(seen[b, t].sum()), None))
    (got,), *alone = neon(*calls)
    k, v = k_cache[:, :, :S].float(), v_cache[:, :, :S].float()
    want = model_lib.attend(q.float(), k, v, seen[:, None])
    torch.testing.assert_close(got.transpose(1, 2).float(), want, atol=1e-2, rtol=2**-7)
    assert torch.equal(torch.cat([y for (y,) in alone]), got.reshape(B * T, 1, H, Dh))


def layer_fields(block):
    """kernels.NativeLayer's fields for a block under kernels.use(.., C), in its order: the numbers,
    and for each address the tensor there (None for NULL)."""
    layer = kernels.native_layer(block)
    assert layer is not None, "kernels.c takes this layer"
    attn, mlp = block.self_attn, block.mlp
    products = (attn.packed[0], attn.o_proj.packed, mlp.packed, mlp.down_proj.packed)
    tensors = [*block.parameters(), layer.bias, *(t for p in products for t in (p.packed, p.scale))]
    at = {t.data_ptr(): t for t in tensors if t is not None}  # address -> tensor
    fields = []
    for name, kind in layer._fields_:
        value = getattr(layer, name)
        fields.append(at[value] if kind is ctypes.c_void_p and value is not None else value)
    return fields


def block(fields, x, cos, sin, k_cache, v_cache, start, mask):
    """block_bf16's call for the layer's fields (layer_fields), x (B, T, D), cos and sin (B, T,
    Dh), the caches (B, Hkv, slots, Dh) with the new keys' slots from `start`, mask (B, T, start +
    T) bool or None: out (B, T, D), then the caches as the call left them."""
    B, T, D = x.shape
    row, head = k_cache.stride(0), k_cache.stride(1)
    args = (*fields, x, B, T, cos, sin, k_cache, v_cache, row, head, start, mask)
    return "block_bf16", args, [(B, T, D), k_cache.shape, v_cache.shape]


FAMILY = {  # every part of the layer kernels.c has: Qwen2's biases, Qwen3's q/k norms, GeGLU
    "llama-like": {},
    "qwen-like, GeGLU, Dh 12": {
        "qkv_bias": True,
        "qk_norm": True,
        "activation": "gelu_pytorch_tanh",
        "head_dim": 12,
    },
}


@pytest.mark.parametrize("family", FAMILY)
def test_neon_block_is_model_block_and_each_row_alone(family, neon):
    """block_bf16 on NEON: model.Block in bf16 (to bf16 rounding: as close to the fp32 layer as
    PyTorch's bf16 layer is), output and the cache it writes, for B = 2 rows of a tree of 3 new
    tokens after a cached prefix of 5, each row its own positions and hidden padding, in a cache
    longer than that; and each row the same bits alone."""
    B, T, start = 2, 3, 5
    cfg = tiny_config(**FAMILY[family])
    torch.manual_seed(0)
    layer = spread_norms(model_lib.Block(cfg))
    x = torch.randn(B, T, cfg.dim)  # (B, T, D)
    positions = start + torch.arange(T) + torch.tensor([[0], [4]])  # (B, T)
    cos, sin = model_lib.Rope(cfg)(positions)  # (B, 1, T, Dh) each
    tree = (torch.rand(T, T) > 0.5).tril() | torch.eye(T, dtype=torch.bool)  # (T, T)
    key_mask = torch.rand(B, start + T) > 0.3  # (B, S)
    key_mask[:, start:] = True  # padding is in the prefix
    mask = rows_lib.attention_mask(T, start, tree, key_mask, x.device)  # (B, 1, T, S)
    cache = torch.randn(2, B, cfg.n_kv_heads, start + T + 3, cfg.head_dim)  # k, v

    def readable(dtype):  # model.Block's output and caches, flattened (fp32)
        m = model_lib.Block(cfg).to(dtype)
        m.load_state_dict(layer.state_dict())
        k, v = cache.to(dtype).clone()
        with torch.inference_mode():
            y = m(x.to(dtype), cos.to(dtype), sin.to(dtype), mask, (k, v, start))
        return torch.cat([y.float().flatten(), k.float().flatten(), v.float().flatten()])

    fast = model_lib.Block(cfg).bfloat16()
    fast.load_state_dict(layer.state_dict())
    fields = layer_fields(kernels.use(fast, C))
    inputs = [t.bfloat16() for t in (x, cos[:, 0], sin[:, 0], *cache)]  # (B, T, D), (B, T, Dh)..
    rows = [mask[:, 0], *inputs]  # mask (B, T, S), then the inputs: one batch row each below
    calls = [block(fields, *inputs, start, mask[:, 0])]
    for b in range(B):
        mask_b, *inputs_b = (t[b : b + 1] for t in rows)
        calls.append(block(fields, *inputs_b, start, mask_b))
    (out, k, v), *alone = neon(*calls)
    got = torch.cat([out.float().flatten(), k.float().flatten(), v.float().flatten()])
    close_as_readable(got, readable(torch.bfloat16), readable(torch.float32))
    for b, (out_b, k_b, v_b) in enumerate(alone):
        assert torch.equal(out_b, out[b : b + 1])
        assert torch.equal(k_b, k[b : b + 1]) and torch.equal(v_b, v[b : b + 1])
