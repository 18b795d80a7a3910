"""exact.py's contract: each row of its product, norm and attention comes out with the same bits
alone or with 1, 3, 17 or 64 neighbours (more rows, more queries of a tree, more batch rows), and
within bf16's rounding of PyTorch's; so a tiny model run through them scores a tree's nodes exactly
as one-token forwards do, and greedy speculative decoding in bf16 is token-identical to plain.

Off a GPU the kernels run under triton's interpreter (TRITON_INTERPRET=1, read when triton.jit
decorates them: load_exact() imports exact so), on tiny shapes; on a GPU the same tests run the
compiled kernels on CUDA. Without triton those skip, and the guard's errors are checked.
Run: `python -m pytest -q tests/test_exact.py`. Shapes as exact.py's; N tree nodes, P prefix.
"""

import contextlib
import copy
import importlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specdec import drafters
from specdec.engines import decode
from specdec.fast import kernels
import model as model_lib
from specdec import rows
from conftest import tiny_config

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NEIGHBOURS = [1, 3, 17, 64]


@contextlib.contextmanager
def interpreter():
    """TRITON_INTERPRET=1 off a GPU while the block runs: triton reads it as triton.jit decorates a
    kernel (importing exact) and again as it launches one (this file's tests); then as before."""
    before = os.environ.get("TRITON_INTERPRET")
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if not CUDA and before is None:
            del os.environ["TRITON_INTERPRET"]
        elif not CUDA:
            os.environ["TRITON_INTERPRET"] = before


def load_exact():
    """exact, its kernels decorated for this machine: compiled for CUDA, else interpreted."""
    with interpreter():
        module = importlib.import_module("specdec.fast.exact")
        if not CUDA and module.triton is not None and not module.INTERPRETED:  # imported before
            module = importlib.reload(module)
    return module


@pytest.fixture(scope="module", autouse=True)
def interpreted_here():
    with interpreter():
        yield


exact = load_exact()
# the interpreter's numpy warns where e^x overflows to inf (the GPU's does not): x / inf = 0
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
needs_triton = pytest.mark.skipif(exact.triton is None, reason="triton is not installed")


# fp32 as well as bf16: an fp32 result shows another order of the same sums in its last bits,
# where bf16's rounding hides most of them (one output in thousands flips; a near-tie's token)
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def rand(*shape, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def some_rows(n):
    """A few places among n + 1 rows: the first, the 8th (another register block of a CPU's BLAS
    tile), the middle, the last."""
    return sorted({0, 7, n // 2, n} & set(range(n + 1)))


def random_tree(N, seed):
    """The (N, N) mask of a random tree (node i's parent before it) and each node's path, root
    first."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)]
    mask = torch.eye(N, dtype=torch.bool)
    paths = [[0]]
    for i in range(1, N):
        mask[i] |= mask[parents[i]]
        paths.append(paths[parents[i]] + [i])
    return mask.to(DEVICE), paths


# --- the kernels, row by row ---------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("n", NEIGHBOURS)
@pytest.mark.parametrize("K, N, bias", [(70, 40, False), (130, 100, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_is_the_same_with_neighbours(n, K, N, bias, dtype):
    x = rand(n + 1, K, seed=n, dtype=dtype)  # (n+1, K)
    w = rand(N, K, seed=1, dtype=dtype) / K**0.5  # (N, K)
    b = rand(N, seed=2, dtype=dtype) if bias else None
    together = exact.linear(x, w, b)  # (n+1, N)
    for i in some_rows(n):
        assert torch.equal(together[i], exact.linear(x[i : i + 1], w, b)[0]), i
    reference = F.linear(x.float(), w.float(), None if b is None else b.float())  # (n+1, N)
    torch.testing.assert_close(together.float(), reference, **TOLERANCE[dtype])


@needs_triton
@pytest.mark.parametrize("n", NEIGHBOURS)
@pytest.mark.parametrize("D", [32, 1100])  # one block of lanes; two, the second part empty
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_row_is_the_same_with_neighbours(n, D, dtype):
    norm = model_lib.RMSNorm(D, 1e-5).to(DEVICE, dtype)
    norm.weight.data = rand(D, seed=3, dtype=dtype)
    x = rand(n + 1, D, seed=n, dtype=dtype) * 3  # (n+1, D)
    together = exact.rms_norm(x, norm.weight, norm.eps)  # (n+1, D)
    for i in some_rows(n):
        assert torch.equal(together[i], exact.rms_norm(x[i : i + 1], norm.weight, norm.eps)[0]), i
    with torch.no_grad():
        torch.testing.assert_close(together, norm(x), **TOLERANCE[dtype])  # ~1 ulp


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NEIGHBOURS)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])  # SwiGLU, GeGLU
def test_activation_row_is_the_same_with_neighbours(n, activation, dtype):
    mlp = model_lib.MLP(tiny_config(activation=activation))
    gate = rand(n + 1, 300, seed=n, dtype=dtype) * 3  # (n+1, hidden): two blocks of columns
    up = rand(n + 1, 300, seed=n + 1, dtype=dtype)
    gelu = activation != "silu"
    together = exact.act_mul(gate, up, gelu)  # (n+1, hidden)
    for i in some_rows(n):
        alone = exact.act_mul(gate[i : i + 1], up[i : i + 1], gelu)[0]
        assert torch.equal(together[i], alone), i
    torch.testing.assert_close(together, mlp.act(gate) * up, **TOLERANCE[dtype])


def plain_decoding(q, k, v, prefix, path, start):
    """What plain decoding computes for the last node of `path`: its query alone, over the
    prefix's P keys and the path's keys in consecutive slots after them. q (1, H, N, Dh); k, v
    (1, Hkv, S, Dh), the tree's keys from slot `start` -> (H, Dh)."""
    slots = torch.tensor(list(range(prefix)) + [start + i for i in path], device=DEVICE)
    one = q[:, :, path[-1] : path[-1] + 1]  # (1, H, 1, Dh)
    return exact.attend(one, k[:, :, slots], v[:, :, slots], None)[0, :, 0]  # (H, Dh)


@needs_triton
@pytest.mark.parametrize("n", NEIGHBOURS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_node_is_plain_decoding_with_neighbours(n, dtype):
    """A tree of n+1 nodes over a batch of 2 whose second row is 3 slots shorter (a gap before the
    tree): every node of both rows gets the bits of its query alone over its path's keys."""
    N, P, H, Hkv, Dh = n + 1, 11, 2, 1, 16  # grouped: both heads read key/value head 0
    lengths = [P, P - 3]
    q = rand(2, H, N, Dh, seed=n, dtype=dtype)  # (B, H, N, Dh)
    k = rand(2, Hkv, P + N, Dh, seed=n + 1, dtype=dtype)  # (B, Hkv, S, Dh)
    v = rand(2, Hkv, P + N, Dh, seed=n + 2, dtype=dtype)
    tree_mask, paths = random_tree(N, seed=n)  # (N, N)
    slots = torch.arange(P + N, device=DEVICE)  # (S,)
    key_mask = (slots < torch.tensor(lengths, device=DEVICE)[:, None]) | (slots >= P)  # (B, S)
    mask = rows.attention_mask(N, P, tree_mask, key_mask, DEVICE)  # (B, 1, N, S)
    y = exact.attend(q, k, v, mask)  # (B, H, N, Dh)
    for b in range(2):
        for node in sorted({0, N // 2, N - 1}):
            alone = plain_decoding(q[b : b + 1], k[b : b + 1], v[b : b + 1], lengths[b],
                                   paths[node], P)  # fmt: skip
            assert torch.equal(y[b, :, node], alone), (b, node)
    reference = model_lib.attend(q.float(), k.float(), v.float(), mask)  # (B, H, N, Dh)
    torch.testing.assert_close(y.float(), reference, **TOLERANCE[dtype])


@needs_triton
def test_attention_causal_without_a_mask():
    q, k, v = rand(1, 4, 6, 16, seed=0), rand(1, 2, 6, 16, seed=1), rand(1, 2, 6, 16, seed=2)
    y = exact.attend(q, k, v, None)  # (1, 4, 6, 16), S = T: SDPA's is_causal
    reference = model_lib.attend(q.float(), k.float(), v.float(), None)
    torch.testing.assert_close(y.float(), reference, rtol=2e-2, atol=2e-2)


# --- a model through them ------------------------------------------------------------------------


def tiny(dtype=torch.bfloat16, **kw):
    torch.manual_seed(0)
    m = rows.Model(tiny_config(**kw)).eval().requires_grad_(False)
    return m.to(DEVICE, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_forward_scores_each_node_as_one_token_forwards(dtype):
    m = exact.use(tiny(dtype, n_layers=1, qkv_bias=True, qk_norm=True))  # every layer kind
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]], device=DEVICE)  # (1, P)
    P = prompt.shape[1]
    tree_mask, paths = random_tree(9, seed=0)  # (N, N)
    nodes = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    depth = torch.tensor([len(p) - 1 for p in paths], device=DEVICE)  # (N,)
    prefilled = m.new_cache(64)
    m(prompt, torch.arange(P, device=DEVICE), None, prefilled)
    tree_logits, _ = m(nodes, P + depth, tree_mask, copy.deepcopy(prefilled))  # (1, N, V)
    for node in (5, 8):
        cache = copy.deepcopy(prefilled)
        for i, j in enumerate(paths[node]):  # one token at a time, as plain decoding feeds them
            logits, _ = m(nodes[:, j : j + 1], torch.tensor([P + i], device=DEVICE), None, cache)
            cache.keep([0])
        assert torch.equal(logits[0, 0], tree_logits[0, node]), node


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_scores_its_tree_alone_as_in_a_batch(dtype):
    """Two sequences of different lengths in one cache (the shorter one's gap hidden), one tree
    each: every node of a row gets the logits that row gets in a batch of its own."""
    m = exact.use(tiny(dtype, n_layers=1))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2]]
    tree_mask, paths = random_tree(6, seed=1)  # (N, N)
    depth = torch.tensor([len(p) - 1 for p in paths], device=DEVICE)  # (N,)
    nodes = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    batch = m.new_cache(32, batch=2)
    alone = []
    for b, prompt in enumerate(prompts):
        cache = m.new_cache(32)
        m(torch.tensor([prompt], device=DEVICE), torch.arange(len(prompt), device=DEVICE), None,
          cache)  # fmt: skip
        batch.put([b], cache)
        logits, _ = m(nodes[b : b + 1], len(prompt) + depth, tree_mask, cache)  # (1, N, V)
        alone.append(logits[0])
    positions = torch.stack([len(p) + depth for p in prompts])  # (B, N)
    together, _ = m(nodes, positions, tree_mask, batch)  # (B, N, V)
    for b in range(2):
        assert torch.equal(together[b], alone[b]), b


@needs_triton
def test_greedy_speculative_is_plain_decoding_in_bf16():
    m = exact.use(tiny(vocab_size=12, n_layers=1))  # 12 tokens: random models repeat
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    plain = decode.generate(m, prompt, 12)
    r = decode.generate(m, prompt, 12, drafters.Lookup(3, 3, 3, DEVICE))  # trees of up to 10 nodes
    assert r.tokens == plain.tokens
    assert r.steps < plain.steps, "no draft was accepted: the tree path went untested"


@needs_triton
def test_use_swaps_layers_and_back():
    m = tiny()
    kernels.use(m)  # whatever fast twins this machine runs, taken out by exact.use
    before = {k: v.clone() for k, v in m.state_dict().items()}
    exact.use(m)
    assert exact.in_use(m)
    assert type(m.layers[0].self_attn) is exact.ExactAttention
    assert type(m.lm_head) is exact.ExactLinear
    assert type(m) is exact.ExactTransformer
    exact.use(m, False)
    assert not exact.in_use(m)
    assert type(m.layers[0].mlp.down_proj) is torch.nn.Linear
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


@needs_triton
def test_where_autograd_records_the_readable_layers_run():
    """A model being trained (parameters that want gradients) runs model.py's layers: the same
    logits as the readable model's, and a backward."""
    readable = tiny(torch.float32)
    m = exact.use(tiny(torch.float32)).requires_grad_(True)
    tokens = torch.tensor([[1, 2, 3]], device=DEVICE)
    logits, _ = m(tokens, torch.arange(3, device=DEVICE))
    assert torch.equal(logits, readable(tokens, torch.arange(3, device=DEVICE))[0])
    logits.sum().backward()
    assert m.lm_head.weight.grad is not None


# --- the guard -----------------------------------------------------------------------------------


def test_without_triton_use_says_so(monkeypatch):
    monkeypatch.setattr(exact, "triton", None)
    m = tiny()
    with pytest.raises(exact.TritonMissing, match="pip install triton"):
        exact.use(m)
    assert not exact.in_use(m)


@pytest.mark.skipif(CUDA, reason="the CPU's refusal")
def test_on_the_cpu_without_the_interpreter_use_says_so(monkeypatch):
    monkeypatch.setattr(exact, "triton", exact.triton or object())
    monkeypatch.setattr(exact, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        exact.use(tiny())


# Each kernel compiled for an H100 (sm_90) as triton would on one, in a process without the
# interpreter: the GPU's branch (tensor cores) is built and checked off a GPU too.
COMPILE = """
import triton
from specdec.fast import exact
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(kernel, types, **constexprs):
    names = kernel.arg_names
    signature = dict(zip(names, types + ["constexpr"] * len(constexprs)))
    try:
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    except TypeError:  # another triton's ASTSource (3.9's is the one this script speaks)
        raise SystemExit("another compile API")
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
    ptx = build(exact.linear_kernel, [f"*{dtype}"] * 4 + ["i32"] * 6, HAS_BIAS=True, DOT=True,
                PRECISION=precision, BM=exact.BLOCK_M, BN=exact.BLOCK_N, BK=exact.BLOCK_K)
    print(dtype, "product on tensor cores:", "mma" in ptx)
build(exact.rms_norm_kernel, ["*bf16"] * 3 + ["i32"] * 3 + ["fp32"], HAS_WEIGHT=True, BD=1024)
build(exact.act_mul_kernel, ["*bf16"] * 3 + ["i32"] * 4, GELU=True, BH=exact.BLOCK_H)
build(exact.attend_kernel, ["*bf16"] * 3 + ["*i32"] * 2 + ["*bf16"] + ["i32"] * 5 + ["fp32"]
      + ["i32"] * 9, BN=exact.BLOCK_KEYS, BD=64)
print("built")
"""


@needs_triton
def test_kernels_build_for_an_h100():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", COMPILE], cwd=root, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    if "another compile API" in r.stderr or ("ptxas" in r.stderr and "not found" in r.stderr):
        pytest.skip("this triton compiles ahead of time otherwise, or has no ptxas")
    assert r.returncode == 0 and "built" in r.stdout, r.stderr[-2000:]
    assert "bf16 product on tensor cores: True" in r.stdout, r.stdout


# --- on a GPU: the default model's shapes --------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_default_shapes_rows_are_the_same_on_cuda():
    """SmolLM2-135M's MLP product and attention (9 heads over 3, Dh 64, 700 cached slots): a row
    alone and among 63 others (a tree of 64) and 8 batch rows."""
    x = rand(8 * 64, 576, seed=0)  # (B*N, D)
    w = rand(1536, 576, seed=1) / 24  # (hidden_dim, D)
    assert torch.equal(exact.linear(x, w)[:1], exact.linear(x[:1], w))
    q = rand(8, 9, 64, 64, seed=2)  # (B, H, N, Dh)
    k, v = rand(8, 3, 764, 64, seed=3), rand(8, 3, 764, 64, seed=4)  # (B, Hkv, S, Dh)
    tree_mask, paths = random_tree(64, seed=0)
    mask = rows.attention_mask(64, 700, tree_mask, None, DEVICE)  # (1, 1, N, S)
    y = exact.attend(q, k, v, mask)  # (B, H, N, Dh)
    for node in (0, 17, 63):
        alone = plain_decoding(q[:1], k[:1], v[:1], 700, paths[node], 700)  # (H, Dh)
        assert torch.equal(y[0, :, node], alone), node


# --- the cost script -----------------------------------------------------------------------------


def test_cost_script_has_help():
    """experiments/exact_cost.py --help (its --tiny run, on the CPU, takes some 10 s: not here)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, os.path.join(root, "experiments", "exact_cost.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "--tiny" in r.stdout, r.stderr
