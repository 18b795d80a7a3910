"""The base model: a Llama-family transformer in one file, with a pre-allocated KV cache and a
forward pass that takes an explicit tree attention mask.

    model = Transformer(Config(...))                   # the loader (specdec's checkpoint) fills one
    cache = model.new_cache(max_len=2048)
    logits, hidden = model(tokens, positions, mask, cache)    # (1, T, V), (1, T, D)
    cache.keep(idx)                                           # commit the accepted entries

The arithmetic is all here, in plain PyTorch: RMSNorm, rotary embeddings (plain, linear and Llama-3
scaling), grouped-query attention (Qwen2's q/k/v biases, Qwen3's q/k norms), SwiGLU or GeGLU MLP,
tied or untied LM head; the loader folds other families' constants into the weights. This file
holds one sequence; the engines' forward over many rows (specdec/rows.py) subclasses it
and the fast paths (specdec/fast/) are twins of its layers. Test: `python -m pytest -q
tests/test_model.py tests/test_families.py` (parity with transformers).

Shapes: B batch, T new tokens, S cache slots, D hidden, H query heads, Hkv key/value heads,
Dh head size, V vocabulary."""

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


# --- configuration ---------------------------------------------------------------------------
# One model's shapes; the loader (config_from_hf) reads them from a transformers config.json.


@dataclass
class Config:
    vocab_size: int = 256
    dim: int = 64  # D, hidden size
    n_layers: int = 2
    n_heads: int = 4  # H
    n_kv_heads: int = 2  # Hkv (grouped-query attention when < H)
    head_dim: int = 16  # Dh
    hidden_dim: int = 128  # MLP inner size
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {} | {"rope_type": "linear"|"llama3", ...}
    max_seq_len: int = 2048  # context length
    tie_embeddings: bool = False  # LM head shares the input embedding matrix
    qkv_bias: bool = False  # q, k and v projections add a bias (Qwen2)
    qk_norm: bool = False  # each head's q and k are RMS-normalised over Dh before rope (Qwen3)
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) | "gelu_pytorch_tanh" (GeGLU: Gemma)
    eos_ids: tuple = ()  # token ids that end a reply
    name: str = "random"  # for the banner; heads check the LM head itself (lm_head_fingerprint)


# --- rotary position embedding ---------------------------------------------------------------
# Each pair of channels (i, i + Dh/2) of q and k is rotated by the angle position * inv_freq[i].


def rope_frequencies(cfg: Config) -> torch.Tensor:
    inv_freq = 1.0 / cfg.rope_theta ** (
        torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
    )
    s = cfg.rope_scaling
    if s.get("rope_type") == "linear":
        inv_freq = inv_freq / s["factor"]
    elif s.get("rope_type") == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, blend in between.
        factor = s["factor"]
        lo = s["low_freq_factor"]
        hi = s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old / wavelen - lo) / (hi - lo)).clamp(0, 1)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelen > old / lo,
            inv_freq / factor,
            torch.where(wavelen < old / hi, inv_freq, blended),
        )
    return inv_freq.float()  # (Dh/2,)


def apply_rope(x, cos, sin):
    """x (B, H, T, Dh); cos, sin (B, 1, T, Dh)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Rope(nn.Module):
    """positions -> cos, sin of their rotation angles, from frequencies kept in fp32 whatever dtype
    the model is cast to (.to() recomputes them): in bf16 (8 mantissa bits) they would be off by up
    to 0.33%, 1.4 rad at position 1,000, and long-context logits would drift."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)  # (Dh/2,) fp32

    def _apply(self, fn, recurse=True):  # what .to() / .half() / .cuda() call on every tensor
        device = fn(self.inv_freq).device
        self.inv_freq = rope_frequencies(self.cfg).to(device)
        return self

    def forward(self, positions, dtype=torch.float32):
        """positions (B, T) or (T,) -> cos, sin (B|1, 1, T, Dh) in `dtype`, angles in fp32."""
        # (B, 1, T, Dh/2)
        angles = positions.view(-1, 1, positions.shape[-1], 1).float() * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)  # (B, 1, T, Dh)
        return angles.cos().to(dtype), angles.sin().to(dtype)


# --- KV cache ----------------------------------------------------------------------------------


class KVCache:
    """Pre-allocated keys and values of every layer for one sequence.

    Invariant: slots [0, length) hold the keys and values of the accepted sequence, in order, for
    positions 0..length-1. A forward of T new tokens (a tree's nodes) writes them to slots
    [length, length+T) and reads [0, length+T); `length` moves only when keep() commits the ones
    that were accepted. Everything at or beyond `length` is garbage (the rejected nodes): harmless,
    because no forward reads a slot >= length before overwriting it."""

    def __init__(self, cfg: Config, max_len: int, device, dtype):
        shape = (cfg.n_layers, 1, cfg.n_kv_heads, max_len, cfg.head_dim)  # (L, 1, Hkv, S, Dh)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self.max_len = max_len

    def keep(self, idx):
        """Commit the new entries idx (indices into the last forward's T, ascending: an accepted
        tree path) to slots length, length+1, ...: the entry of new token i moves from slot
        length + i down to its place on the path. Accepted nodes only, never one not verified."""
        for j, i in enumerate(idx):
            if i != j:  # a chain's accepted prefix is in place already
                self.k[:, :, :, self.length + j] = self.k[:, :, :, self.length + i]
                self.v[:, :, :, self.length + j] = self.v[:, :, :, self.length + i]
        self.length += len(idx)


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


def attend(q, k, v, mask):
    """Grouped-query attention. q (B, H, T, Dh); k, v (B, Hkv, S, Dh); mask (B|1, 1, T, S) bool or
    None: causal, with S = T or T = 1 (SDPA's is_causal, which its flash kernels run; a mask rules
    them out) -> (B, H, T, Dh). Query head h reads key/value head h // (H / Hkv)."""
    causal = mask is None and q.shape[2] > 1
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    # project() and attend() are methods so that a faster form of this layer can replace just them
    def project(self, x):
        """x (B, T, D) -> q (B, T, H*Dh), k and v (B, T, Hkv*Dh)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def attend(self, q, k, v, mask):
        return attend(q, k, v, mask)  # (B, H, T, Dh)

    def forward(self, x, cos, sin, attn_mask, kv):
        """x (B, T, D); attn_mask (B|1, 1, T, S) or None; kv (k_cache, v_cache, start) or None."""
        B, T, _ = x.shape
        c = self.cfg
        q, k, v = self.project(x)
        q = q.view(B, T, c.n_heads, c.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = k.view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        v = v.view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        if kv is not None:  # write the new entries after the prefix, then attend over all of it
            k_cache, v_cache, start = kv
            k_cache[:, :, start : start + T] = k
            v_cache[:, :, start : start + T] = v
            k, v = k_cache[:, :, : start + T], v_cache[:, :, : start + T]  # (B, Hkv, S, Dh)
        y = self.attend(q, k, v, attn_mask)  # (B, H, T, Dh)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, c.n_heads * c.head_dim))  # (B, T, D)


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.act = nn.SiLU() if cfg.activation == "silu" else nn.GELU(approximate="tanh")

    def gate_up(self, x):  # a method so that a faster form can compute both in one product
        return self.gate_proj(x), self.up_proj(x)  # (B, T, hidden_dim) each

    def forward(self, x):
        gate, up = self.gate_up(x)
        return self.down_proj(self.act(gate) * up)  # SwiGLU or GeGLU, (B, T, D)


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


def attention_mask(T, start, mask, device):
    """The (1, 1, T, start+T) bool mask of a forward of T new tokens after `start` cached ones:
    every new token sees the whole cached prefix and, among the new tokens, what `mask` (T, T)
    allows (None: causal). None where that is plain causal (nothing cached, or one new token)."""
    if mask is None:
        if T == 1 or start == 0:
            return None  # SDPA's own causal mask (its flash kernels)
        mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    assert mask.shape == (T, T), f"tree mask must be (T, T) = ({T}, {T}), got {tuple(mask.shape)}"
    prefix = torch.ones(T, start, dtype=torch.bool, device=device)  # (T, start) all seen
    return torch.cat([prefix, mask], dim=-1)[None, None]  # (1, 1, T, start+T)


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

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def new_cache(self, max_len=None) -> KVCache:
        return KVCache(self.cfg, max_len or self.cfg.max_seq_len, self.device, self.dtype)

    def forward(self, tokens, positions, mask=None, cache=None):
        """tokens (1, T) long: the new tokens; positions (T,) long; mask (T, T) bool with
        mask[i, j] = new token i may see new token j (None: causal); the cached prefix is always
        visible. cache: a KVCache (its invariant says where the new entries go). Returns the logits
        (1, T, V) and the final hidden states (1, T, D) after the final norm, which the LM head and
        the draft heads read."""
        B, T = tokens.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.max_len:
            raise ValueError(f"KV cache full: {start} + {T} tokens > {cache.max_len} slots")
        cos, sin = self.rope(positions, self.dtype)
        attn_mask = attention_mask(T, start, mask, tokens.device)  # (1, 1, T, start+T) | None
        x = self.embed_tokens(tokens)  # (B, T, D)
        for i, layer in enumerate(self.layers):  # layer i reads and extends cache.k[i], cache.v[i]
            kv = (cache.k[i], cache.v[i], start) if cache is not None else None
            x = layer(x, cos, sin, attn_mask, kv)
        hidden = self.norm(x)  # (B, T, D)
        return self.lm_head(hidden), hidden  # (B, T, V), (B, T, D)


def lm_head_fingerprint(model) -> str:
    """A short digest of the LM head (the sign pattern of a few rows, the same in any dtype):
    heads trained on one base model refuse to load on another."""
    w = model.lm_head.weight.detach()
    rows = w[:: max(1, w.shape[0] // 64)].float().cpu() > 0
    return hashlib.sha256(np.packbits(rows.numpy()).tobytes()).hexdigest()[:16]
