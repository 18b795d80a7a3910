"""Row-invariant GPU kernels: the twins of model.py's linear layers (nn.Linear), model.attend,
model.RMSNorm and model.MLP's activation, each row of whose results comes out with the same bits
however many rows (tree nodes, batch rows) come with it.

    exact.use(model)                 # its products, norms, activations and attention through here
    exact.use(model, False)          # back to the readable layers
    exact.in_use(model)              # -> True where they run
    y = exact.linear(x, w, b)        # F.linear's arithmetic: x (..., K) @ w (N, K)^T + b
    y = exact.rms_norm(x, w, eps)    # model.RMSNorm's, (..., D)
    y = exact.act_mul(gate, up)      # model.MLP's act(gate) * up, (..., hidden_dim)
    y = exact.attend(q, k, v, mask)  # model.attend's, (B, H, T, Dh)

Why: greedy speculative decoding is lossless only if the base model scores a tree's node exactly as
plain decoding scores the same token (a one-token forward). On a CPU kernels.c computes each row
alone. On a GPU cuBLAS and SDPA pick their algorithm, tile and reduction order by shape (1 row or
64, split-K or not), so in bf16 a node's logits differ from plain decoding's in the last bits and a
near-tie can flip a token. The kernels here (Triton; the batch-invariant approach of Thinking
Machines' batch_invariant_ops) fix each reduction's order once, whatever the number of rows:
  - the product: one tile shape for every M, K summed in BLOCK_K steps in order, no split-K; fp32
    sums, rounded once;
  - the norm: one program a row, its squares summed in an order fixed by D;
  - attention: one program a (batch row, head, query); the query's visible keys are listed first,
    in order (as kernels.c's attend_one does), then the online softmax runs over that list in
    blocks of BLOCK_KEYS. A masked key is not a zero inside a block but absent from the list: a
    tree's node, whose ancestors sit at scattered slots, gets the blocks plain decoding gets, whose
    path sits in consecutive slots, and a batch row's gap changes nothing.
The rest of a forward (embedding, rope, residual adds) works element by element, the same way for
every element. The kernels are for inference: where autograd records, the readable layers run.
Their cost against PyTorch's on a GPU: `python experiments/exact_cost.py`.

Triton is optional (the CPU wheel of torch does not bring it): without it importing this file works
and use() raises TritonMissing. With TRITON_INTERPRET=1 set before triton is imported, the kernels
run on the CPU (slowly, through numpy): that is how tests/test_exact.py checks them off a GPU.
Test: `python -m pytest -q tests/test_exact.py`. Shapes: B batch, T new tokens (queries), S cache
slots, H query heads, Hkv key/value heads, Dh head size, M rows, K inputs, N outputs, D hidden.
"""

from __future__ import annotations  # the kernels' `tl.constexpr` annotations read without triton

import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from specdec.fast import kernels
import model
from specdec import rows

try:
    import triton
    import triton.language as tl
except ImportError:  # the readable layers still run; use() says what is missing
    triton = None


class TritonMissing(ImportError):
    pass


def jit(**options):
    """triton.jit(**options) where triton is installed; else the plain function, never called.

    Triton compiles a kernel again for an integer argument equal to 1 or divisible by 16 (the
    compiler then knows it), and another build may lay its sums out in another order; so every
    argument that varies with the number of rows (M, T, S and a stride that grows with them) is
    named in do_not_specialize: one build of a kernel for a model's layer, whatever the step."""

    def decorate(fn):
        return triton.jit(fn, **options) if triton is not None else fn

    return decorate


# whether the kernels below run on the CPU: TRITON_INTERPRET=1 where triton.jit decorated them
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check(device):
    """Raise unless the kernels can run on `device`: triton installed, and a CUDA device or the
    interpreter."""
    if triton is None:
        raise TritonMissing(
            "exact kernels need triton (pip install triton); the readable path runs without it"
        )
    if torch.device(device).type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"exact kernels run on a CUDA device, or on the CPU under TRITON_INTERPRET=1; "
            f"got {device}"
        )


# --- the product ---------------------------------------------------------------------------------
# One tile shape for every number of rows: a row's outputs are sums over K in BLOCK_K steps, in
# order, each step one tl.dot of the same shape, whatever M is. cuBLAS would pick another kernel,
# and for a few rows often split K across programs: another order of the same sums.

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64


@jit(do_not_specialize=["M"])
def linear_kernel(
    x, w, b, y, M, N, K, sxm, swn, sym,  # tensors, sizes, row strides
    HAS_BIAS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)  # (BM,)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)  # (BN,)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)  # (BK,)
        xs = tl.load(
            x + rows[:, None] * sxm + ks[None, :],
            mask=(rows[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )  # (BM, BK)
        ws = tl.load(
            w + cols[None, :] * swn + ks[:, None],
            mask=(cols[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )  # (BK, BN)
        if DOT:  # a GPU's tensor cores: every row of a tile computed alike
            acc = tl.dot(xs, ws, acc, input_precision=PRECISION)  # (BM, BN), fp32
        else:  # the interpreter: the sums written out, in one order for every row (linear())
            acc += tl.sum(xs.to(tl.float32)[:, :, None] * ws.to(tl.float32)[None, :, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = y + rows[:, None] * sym + cols[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def linear(x, weight, bias=None):
    """F.linear's twin: x (..., K) @ weight (N, K)^T + bias (N,) -> (..., N) in x's dtype, every
    row summed in the same order whatever the other rows. fp32 stays fp32 (no tf32).

    Under the interpreter tl.dot is numpy's matmul, whose BLAS sums a tile's rows in different
    orders (from its 7th row on, on x86) and which multiplies bf16's bits as integers (triton
    3.9): there the kernel writes the products and their sum out instead."""
    K = x.shape[-1]
    N = weight.shape[0]
    assert weight.shape[1] == K, f"x has {K} inputs, the weight {weight.shape[1]}"
    x2 = x.reshape(-1, K).contiguous()  # (M, K)
    weight = weight.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)  # (M, N)
    if M:
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        linear_kernel[grid](
            x2, weight, bias if bias is not None else weight, y, M, N, K,
            x2.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, DOT=not INTERPRETED,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
        )  # fmt: skip
    return y.view(*x.shape[:-1], N)


# --- the norm ------------------------------------------------------------------------------------
# One program a row; its squares summed in chunks of BD lanes (D rounded up to a power of 2, at
# most 1024), lane by lane, then across the lanes: an order fixed by D alone. The roundings are
# model.RMSNorm's: x * rsqrt(mean(x^2) + eps) rounded to x's dtype, then times the weight, rounded
# again.


@jit()  # rows are programs: no argument varies with them
def rms_norm_kernel(x, w, y, D, sx, sy, eps, HAS_WEIGHT: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0)
    sums = tl.zeros((BD,), dtype=tl.float32)  # (BD,)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        xs = tl.load(x + row * sx + ds, mask=ds < D, other=0.0).to(tl.float32)
        sums += xs * xs
    inv = 1.0 / tl.sqrt(tl.sum(sums, axis=0) / D + eps)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        xs = tl.load(x + row * sx + ds, mask=ds < D, other=0.0).to(tl.float32)
        out = (xs * inv).to(y.dtype.element_ty)
        if HAS_WEIGHT:
            ws = tl.load(w + ds, mask=ds < D, other=0.0).to(tl.float32)
            out = (ws * out.to(tl.float32)).to(y.dtype.element_ty)
        tl.store(y + row * sy + ds, out, mask=ds < D)


def rms_norm(x, weight, eps):
    """model.RMSNorm's twin: x (..., D), weight (D,) or None -> (..., D) in x's dtype."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()  # (M, D)
    y = torch.empty_like(x2)  # (M, D)
    if len(x2):
        rms_norm_kernel[(len(x2),)](
            x2, weight if weight is not None else x2, y, D, x2.stride(0), y.stride(0), eps,
            HAS_WEIGHT=weight is not None, BD=min(1024, triton.next_power_of_2(D)),
        )  # fmt: skip
    return y.view(x.shape)


# --- the gated activation ------------------------------------------------------------------------
# act(gate) * up, element by element: on a GPU PyTorch's would do, but on a CPU its vectorised loops
# give the elements past the last full vector a scalar path (SiLU's exp differs there in fp32's
# last bit), so which path an element takes depends on how many come with it. Here one program a
# (row, block of BLOCK_H columns): an element's arithmetic is the same wherever its row is.
# Rounded as model.MLP rounds: act(gate) in the model's dtype, then the product.

BLOCK_H = 256


@jit()  # as rms_norm_kernel
def act_mul_kernel(gate, up, y, H, sg, su, sy, GELU: tl.constexpr, BH: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)  # (BH,)
    g = tl.load(gate + row * sg + cols, mask=cols < H, other=0.0).to(tl.float32)
    u = tl.load(up + row * su + cols, mask=cols < H, other=0.0).to(tl.float32)
    if GELU:  # tanh's approximation: g/2 (1 + tanh(z)) = g sigmoid(2z)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * z))
    else:  # SiLU: g sigmoid(g)
        a = g / (1.0 + tl.exp(-g))
    a = a.to(y.dtype.element_ty).to(tl.float32)
    tl.store(y + row * sy + cols, (a * u).to(y.dtype.element_ty), mask=cols < H)


def act_mul(gate, up, gelu=False):
    """model.MLP's act(gate) * up: gate, up (..., H) -> (..., H); SiLU, or GELU's tanh form."""
    H = gate.shape[-1]
    g2 = gate.reshape(-1, H).contiguous()  # (M, H)
    u2 = up.reshape(-1, H).contiguous()  # (M, H)
    y = torch.empty_like(g2)  # (M, H)
    if len(g2):
        grid = (len(g2), triton.cdiv(H, BLOCK_H))
        act_mul_kernel[grid](
            g2, u2, y, H, g2.stride(0), u2.stride(0), y.stride(0), GELU=gelu, BH=BLOCK_H
        )
    return y.view(gate.shape)


# --- attention -----------------------------------------------------------------------------------
# A query's visible keys, listed in order (visible_keys), are what it reads: the kernel walks that
# list in blocks of BLOCK_KEYS (online softmax: running max, rescaled sums), so a query's blocks are
# the same whichever slots its keys sit in, however many queries and batch rows come with it. Keys
# past the end of its list score -inf and add exact zeros. Scores, softmax and the weighted sum of
# values in fp32, the output rounded once.

BLOCK_KEYS = 32


@dataclass
class Visible:
    """What attend() reads of a forward's mask, worked out once for all of the forward's layers
    (ExactTransformer): each query's visible slots, in ascending order, then the others."""

    mask: torch.Tensor | None  # the mask it was made from: (B|1, 1, T, S) bool, or None (causal)
    keys: torch.Tensor  # (B, T, S) int32: query t of row b reads slots keys[b, t, :counts[b, t]]
    counts: torch.Tensor  # (B, T) int32


def visible_keys(mask, B, T, S, device) -> Visible:
    """mask (B|1, 1, T, S) bool or None (causal: query t sees slots up to S - T + t) -> Visible."""
    seen = mask
    if mask is None:
        slots = torch.arange(S, device=device)  # (S,)
        seen = slots <= torch.arange(S - T, S, device=device)[:, None]  # (T, S)
    seen = seen.reshape(-1, T, S).expand(B, T, S)  # (B, T, S)
    keys = torch.argsort((~seen).to(torch.int8), dim=-1, stable=True)  # (B, T, S) visible first
    counts = seen.sum(-1, dtype=torch.int32)  # (B, T)
    return Visible(mask, keys.to(torch.int32).contiguous(), counts.contiguous())


@jit(do_not_specialize=["T", "S", "sqb", "skb", "svb"])
def attend_kernel(
    q, k, v, keys, counts, y,  # tensors
    H, T, GROUP, Dh, S, scale,  # sizes: GROUP query heads a key/value head
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs,  # strides of q, k, v (batch, head, time)
    BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    g = h // GROUP  # its key/value head
    ds = tl.arange(0, BD)  # (BD,)
    qs = tl.load(q + b * sqb + h * sqh + t * sqt + ds, mask=ds < Dh, other=0.0).to(tl.float32)
    n = tl.load(counts + b * T + t)
    listed = keys + (b * T + t) * S
    top = tl.full((), float("-inf"), tl.float32)  # the running max of the scores
    total = tl.zeros((), dtype=tl.float32)  # the running sum of e^(score - top)
    acc = tl.zeros((BD,), dtype=tl.float32)  # (BD,) the running weighted sum of values
    for j0 in range(0, n, BN):
        js = j0 + tl.arange(0, BN)  # (BN,) places in the list
        slots = tl.load(listed + js, mask=js < n, other=0)  # (BN,)
        seen = (js[:, None] < n) & (ds[None, :] < Dh)  # (BN, BD)
        at = slots[:, None] * sks + ds[None, :]  # (BN, BD) the keys' numbers, in their head
        ks = tl.load(k + b * skb + g * skh + at, mask=seen, other=0.0)
        scores = tl.sum(ks.to(tl.float32) * qs[None, :], axis=1) * scale  # (BN,)
        scores = tl.where(js < n, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=0))
        shrink = tl.exp(top - new_top)
        p = tl.exp(scores - new_top)  # (BN,), 0 past the list's end
        at = slots[:, None] * svs + ds[None, :]  # (BN, BD) the values'
        vs = tl.load(v + b * svb + g * svh + at, mask=seen, other=0.0)
        total = total * shrink + tl.sum(p, axis=0)
        acc = acc * shrink + tl.sum(p[:, None] * vs.to(tl.float32), axis=0)
        top = new_top
    out = y + ((b * H + h) * T + t) * Dh + ds
    tl.store(out, (acc / total).to(y.dtype.element_ty), mask=ds < Dh)


def attend(q, k, v, mask):
    """model.attend's twin: q (B, H, T, Dh); k, v (B, Hkv, S, Dh) (a cache's view will do); mask
    (B|1, 1, T, S) bool, None (causal) or the Visible of one -> (B, H, T, Dh), each query computed
    alone."""
    B, H, T, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    assert H % Hkv == 0, f"{H} query heads cannot share {Hkv} key/value heads"
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and q.stride(-1) == 1, "Dh must be contiguous"
    seen = mask if isinstance(mask, Visible) else visible_keys(mask, B, T, S, q.device)
    assert seen.keys.shape == (B, T, S), f"the mask is for {tuple(seen.keys.shape)}, not {B, T, S}"
    y = torch.empty(B, H, T, Dh, device=q.device, dtype=q.dtype)  # (B, H, T, Dh)
    attend_kernel[(T, B * H)](
        q, k, v, seen.keys, seen.counts, y,
        H, T, H // Hkv, Dh, S, Dh**-0.5,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        BN=BLOCK_KEYS, BD=triton.next_power_of_2(Dh),
    )  # fmt: skip
    return y


# --- the layers ----------------------------------------------------------------------------------
# As kernels.use does, use() swaps a layer's class in place (the same parameters, the same
# state_dict): model.Attention keeps its forward and gets attend() from here (project() runs its
# linear layers, which are swapped too); the MLP runs its products and act_mul(); the transformer
# hands its layers the mask's Visible.


def autograd(*tensors):
    """Whether autograd records an op on these tensors: the kernels have no backward, so then the
    readable layer runs (a model frozen with requires_grad_(False) runs the kernels, no_grad or
    not)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class ExactLinear(nn.Linear):
    """nn.Linear's twin: linear()."""

    def forward(self, x):
        if autograd(x, self.weight, self.bias):
            return super().forward(x)
        return linear(x, self.weight, self.bias)


class ExactRMSNorm(model.RMSNorm):
    """model.RMSNorm's twin: rms_norm()."""

    def forward(self, x):
        if autograd(x, self.weight):
            return super().forward(x)
        return rms_norm(x, self.weight, self.eps)


class ExactMLP(model.MLP):
    """model.MLP with act_mul() from here (its linear layers swapped too)."""

    def forward(self, x):
        gate, up = self.gate_up(x)  # (B, T, hidden_dim) each
        if autograd(gate, up):
            return self.down_proj(self.act(gate) * up)
        gelu = isinstance(self.act, nn.GELU)
        return self.down_proj(act_mul(gate, up, gelu))  # (B, T, D)


class ExactAttention(model.Attention):
    """model.Attention with attend() from here."""

    def attend(self, q, k, v, mask):
        if autograd(q, k, v):
            return super().attend(q, k, v, mask.mask if isinstance(mask, Visible) else mask)
        return attend(q, k, v, mask)  # (B, H, T, Dh)


class ExactTransformer(rows.Model):
    """model.Transformer whose layers get the forward's mask as a Visible, sorted once for all
    of them (not once a layer)."""

    def run_layers(self, x, cos, sin, attn_mask, cache, start, layers=None, sizes=None):
        B, T, _ = x.shape
        seen = visible_keys(attn_mask, B, T, start + T, x.device)  # start is 0 without a cache
        return super().run_layers(x, cos, sin, seen, cache, start, layers, sizes)  # (B, T, D)


TWINS = {
    nn.Linear: ExactLinear,
    model.RMSNorm: ExactRMSNorm,
    model.Attention: ExactAttention,
    model.MLP: ExactMLP,
    rows.Model: ExactTransformer,
}
READABLE = {twin: readable for readable, twin in TWINS.items()}


def in_use(module: nn.Module) -> bool:
    return any(type(m) in READABLE for m in module.modules())


def use(module: nn.Module, exact: bool = True) -> nn.Module:
    """Run `module`'s linear layers, RMSNorms, MLP activations and attention (a base model's: all
    of its products, norms and attention) through the kernels here; exact=False: the readable
    layers. Any fast twins kernels.use() put in are taken out first (their products pick kernels
    by shape too); call use(model, False) before kernels.use() on a model that runs these.
    Raises TritonMissing without triton, ValueError off CUDA without the interpreter. Returns
    the module."""
    if exact:
        check(next(module.parameters()).device)
    kernels.use(module, kernels.Kernels())  # the readable classes, without prepacked copies
    for m in module.modules():
        if type(m) in READABLE:
            m.__class__ = READABLE[type(m)]
        if exact and type(m) in TWINS:
            m.__class__ = TWINS[type(m)]
    return module
