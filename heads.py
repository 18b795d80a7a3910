"""Draft heads: small modules that read the base model's hidden state and guess the tokens after
its next one, so that one forward pass of the base model can verify several guesses at once.

    Medusa head k   z = h + SiLU(W h + b) (num_layers such blocks): guesses x_{t+1+k} from h_t
    Hydra head k    z = h + MLP(concat[h, E(x_{t+1}), ..., E(x_{t+k})]): also sees the tokens
                    drafted before it on the same tree path, so drafting runs depth by depth
    Hydra++         Hydra heads reading h from a PrefixMLP: one extra decoder layer over the base
                    hidden states of the whole accepted sequence, with its own KV cache

Every head ends with an LM head (LMHead below). W and the last MLP layer start at zero, so an
untrained Medusa or Hydra head is the base LM head.

    heads = build(HeadsConfig("hydra", num_heads=4), base)   # base: a model.Transformer
    cache = heads.new_cache(max_len)                        # Hydra++ only, else None
    h = heads.context(hidden, positions, cache)             # (B, T, D) the state heads draft from
    z = heads.head(d, h[:, -1], paths)                      # drafting, depth d: (B*P, D) or (B, D)
    z = heads(h, tokens)                                    # training: (B, T, K, D)
    z = heads(h, tokens, at=(b, t))                         # training at N positions: (N, K, D)
    logits = heads.project(z, d)                            # (..., V'); full_ids(ids): base ids

The package's loader (specdec/loading/checkpoint.py) saves and loads them.
Test: `python -m pytest -q tests/test_heads.py`.
Shapes: B batch, T time, D hidden, K heads, V' head vocabulary (V, or the kept tokens), P parent
nodes (tree nodes at one depth), d the depth = the head drafting it (1-based).
"""

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import Block, Config, KVCache, RMSNorm, Rope, attention_mask, lm_head_fingerprint

KINDS = ("medusa", "hydra", "hydra++")


class HeadsError(ValueError):
    """Heads could not be built or loaded; the message says why."""


@dataclass
class HeadsConfig:
    kind: str  # "medusa" | "hydra" | "hydra++"
    num_heads: int  # K; head k (1-based) predicts x_{t+1+k}, k after the base model's next token
    num_layers: int = 1  # residual blocks per Medusa head / hidden layers of each Hydra MLP
    dim: int = 0  # D of the base model (build() fills it in)
    vocab_size: int = 0  # V of the base model (build() fills it in)
    own_lm_head: bool = False  # True: a trainable LM head per head (Medusa-1); False: the base's
    kept_tokens: int = 0  # 0: the full vocabulary; else heads predict over this many ids (kept_ids)
    base_name: str = ""  # identity of the base model (model.cfg.name)
    base_fingerprint: str = ""  # model.lm_head_fingerprint(base): heads refuse another base model


# --- the vocabulary projection ------------------------------------------------------------------
# The base LM head's rows (all V, or V' kept), frozen and shared by all heads, or copied (Medusa-1).


class LMHead(nn.Module):
    def __init__(self, base, num_heads: int, own: bool, kept_ids):
        super().__init__()
        rows = base.lm_head.weight.detach()  # (V, D), the base's own storage
        if kept_ids is not None:
            rows = rows[kept_ids]  # (V', D), a small copy made once
        if own:  # trainable, saved: K copies initialised from the base LM head
            self.weight = nn.Parameter(rows.repeat(num_heads, 1, 1))  # (K, V', D)
        else:  # frozen, not saved, one matrix for every head
            self.register_buffer("weight", rows, persistent=False)  # (V', D)

    def forward(self, z, d=None):
        if self.weight.dim() == 2:
            return F.linear(z, self.weight)  # (..., V')
        if d is None:  # z (..., K, D): head k through its own matrix
            assert z.shape[-2] == len(self.weight), (
                f"need z (..., K={len(self.weight)}, D), got {tuple(z.shape)}"
            )
            return torch.einsum("...kd,kvd->...kv", z, self.weight)  # (..., K, V')
        return F.linear(z, self.weight[d - 1])  # (P, V')


# --- Medusa -------------------------------------------------------------------------------------
# Head k reads h_t alone.


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, cfg: HeadsConfig, base, kept_ids):
        super().__init__()
        self.cfg = cfg
        # a fresh ResBlock per layer and head (the reference code's [block] * n repeats one)
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(cfg.dim) for _ in range(cfg.num_layers)))
            for _ in range(cfg.num_heads)
        )
        self.lm_head = LMHead(base, cfg.num_heads, cfg.own_lm_head, kept_ids)
        self.register_buffer("kept_ids", kept_ids)  # (V',) or None; saved

    def context(self, hidden, positions, cache=None):
        return hidden  # (B, T, D)

    def new_cache(self, max_len):
        return None

    def head(self, d, h, path):
        """Head d from the draft states h (R, D); path is ignored: a row serves all its parents."""
        return self.blocks[d - 1](h)  # (R, D)

    def forward(self, h, tokens, at=None):
        """Every head at every position (B, T, K, D), or at the positions at = (b, t): (N, K, D)."""
        assert h.shape[:2] == tokens.shape, (
            f"h (B, T, D) vs tokens (B, T): {tuple(h.shape)}, {tuple(tokens.shape)}"
        )
        if at is not None:
            h = h[at]  # (N, D)
        return torch.stack([head(h) for head in self.blocks], dim=-2)  # (B, T, K, D) | (N, K, D)

    def project(self, z, d=None):
        return self.lm_head(z, d)  # (..., V')

    def full_ids(self, ids):
        return ids if self.kept_ids is None else self.kept_ids[ids]


# --- Hydra and Hydra++ --------------------------------------------------------------------------
# Head k reads concat[h, E(root), E(draft_1), ..., E(draft_{k-1})], E the base's embedding, frozen.


def hydra_mlp(d_in: int, dim: int, num_layers: int) -> nn.Sequential:
    """num_layers hidden layers of width D with SiLU, then a Linear to D that starts at zero."""
    layers = []
    for i in range(num_layers):
        layers += [nn.Linear(d_in if i == 0 else dim, dim), nn.SiLU()]
    out = nn.Linear(dim, dim)
    nn.init.zeros_(out.weight)
    nn.init.zeros_(out.bias)
    return nn.Sequential(*layers, out)


class PrefixMLP(nn.Module):
    """Hydra++'s extra layer, named as the Hydra paper names it, though it is a whole decoder layer
    (attention and MLP), not an MLP: shaped as the base model's (model.Block, with its own
    weights; rope as the base's), then an RMSNorm. o_proj and down_proj start at zero, so at
    first the layer passes x through: the output is RMSNorm(x). Its KV cache holds exactly the
    accepted sequence: the caller feeds only hidden states of accepted positions, and every call
    commits all of them (keep(range(T))), so slots [0, length) are positions 0..length-1 and
    nothing beyond `length` is ever read."""

    def __init__(self, base_cfg: Config):
        super().__init__()
        self.cfg = replace(base_cfg, n_layers=1)
        self.block = Block(self.cfg)
        self.norm = RMSNorm(self.cfg.dim, self.cfg.norm_eps)
        nn.init.zeros_(self.block.self_attn.o_proj.weight)
        nn.init.zeros_(self.block.mlp.down_proj.weight)
        self.rope = Rope(self.cfg)  # fp32 frequencies, as the base model's

    def forward(self, x, positions, cache=None):
        B, T, _ = x.shape
        start = 0 if cache is None else cache.length
        if cache is not None:
            assert B == 1, f"the PrefixMLP cache holds one sequence, got a batch of {B}"
            if start + T > cache.max_len:
                raise ValueError(
                    f"PrefixMLP cache full: {start} + {T} positions > {cache.max_len} slots"
                )
        cos, sin = self.rope(positions, x.dtype)  # (B|1, 1, T, Dh)
        mask = attention_mask(T, start, None, x.device)  # causal, cached prefix visible
        kv = None if cache is None else (cache.k[0], cache.v[0], start)
        y = self.norm(self.block(x, cos, sin, mask, kv))  # (B, T, D)
        if cache is not None:
            cache.keep(range(T))
        return y


class HydraHeads(nn.Module):
    def __init__(self, cfg: HeadsConfig, base, kept_ids):
        super().__init__()
        self.cfg = cfg
        self.prefix = PrefixMLP(base.cfg) if cfg.kind == "hydra++" else None
        self.mlps = nn.ModuleList(
            hydra_mlp((k + 1) * cfg.dim, cfg.dim, cfg.num_layers)
            for k in range(1, cfg.num_heads + 1)
        )
        self.register_buffer("embed", base.embed_tokens.weight.detach(), persistent=False)  # (V, D)
        self.lm_head = LMHead(base, cfg.num_heads, cfg.own_lm_head, kept_ids)
        self.register_buffer("kept_ids", kept_ids)  # (V',) or None; saved

    def context(self, hidden, positions, cache=None):
        """Hydra: hidden itself. Hydra++: the PrefixMLP over it (a cache appends and keeps it)."""
        return hidden if self.prefix is None else self.prefix(hidden, positions, cache)  # (B, T, D)

    def new_cache(self, max_len):
        if self.prefix is None:
            return None
        w = self.prefix.norm.weight
        return KVCache(self.prefix.cfg, max_len, w.device, w.dtype)

    def head(self, d, h, path):
        """Head d for the parents of R rows: h (R, D) their draft states; path (R*P, d) token ids
        root..parent, row r's parents at [r*P, (r+1)*P)."""
        P = path.shape[0] // len(h)
        assert path.shape == (len(h) * P, d), (
            f"head {d} needs paths (R*P, {d}) for R = {len(h)}, got {tuple(path.shape)}"
        )
        h = h.repeat_interleave(P, 0)  # (R*P, D)
        tokens = F.embedding(path, self.embed).flatten(1)  # (R*P, d*D)
        return h + self.mlps[d - 1](torch.cat([h, tokens], dim=-1))  # (R*P, D)

    def forward(self, h, tokens, at=None):
        """As MedusaHeads.forward, teacher-forced: head k at t reads concat[h_t, E(tokens[t+1]),
        ..., E(tokens[t+k])], token 0 past the end (the caller masks those out of the loss)."""
        B, T, D = h.shape
        assert tokens.shape == (B, T), (
            f"h (B, T, D) vs tokens (B, T): {tuple(h.shape)}, {tuple(tokens.shape)}"
        )
        e = F.embedding(F.pad(tokens, (0, self.cfg.num_heads)), self.embed)  # (B, T+K, D)
        # later[j-1][:, t] = E(tokens[t+j])
        later = [e[:, j : j + T] for j in range(1, self.cfg.num_heads + 1)]
        if at is not None:
            h, later = h[at], [x[at] for x in later]  # (N, D) each
        z = [
            h + mlp(torch.cat([h, *later[:k]], dim=-1)) for k, mlp in enumerate(self.mlps, start=1)
        ]
        return torch.stack(z, dim=-2)  # (B, T, K, D) | (N, K, D)

    def project(self, z, d=None):
        return self.lm_head(z, d)  # (..., V')

    def full_ids(self, ids):
        return ids if self.kept_ids is None else self.kept_ids[ids]


# --- building -----------------------------------------------------------------------------------
# Fresh heads for a base model, checked against it (checkpoint.load_heads builds them this way too).


def _check_base(cfg: HeadsConfig, base) -> None:
    pairs = {  # name: (what the heads were trained for, what the base model has)
        "dim": (cfg.dim, base.cfg.dim),
        "vocab_size": (cfg.vocab_size, base.cfg.vocab_size),
        "LM head fingerprint": (cfg.base_fingerprint, lm_head_fingerprint(base)),
    }
    diff = [f"{k} {have} != {want}" for k, (have, want) in pairs.items() if have != want]
    if diff:
        raise HeadsError(
            f"heads were trained for {cfg.base_name}, not {base.cfg.name} ({', '.join(diff)}); "
            "use them with that model, or train heads for this one with train.py"
        )


def _check_kept(kept_ids, cfg: HeadsConfig, vocab_size: int):
    if kept_ids is None:
        if cfg.kept_tokens:
            raise HeadsError(f"kept_tokens={cfg.kept_tokens} but no kept_ids were given")
        return None
    ids = torch.as_tensor(kept_ids)
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or len(ids) == 0:
        raise HeadsError(
            f"kept_ids must be a non-empty 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}"
        )
    if cfg.kept_tokens not in (0, len(ids)):
        raise HeadsError(f"kept_tokens={cfg.kept_tokens} but {len(ids)} kept_ids were given")
    if ids.min() < 0 or ids.max() >= vocab_size or len(ids.unique()) != len(ids):
        raise HeadsError(f"kept_ids must be distinct token ids in [0, {vocab_size})")
    return ids.long()


def build(cfg: HeadsConfig, base, kept_ids=None) -> nn.Module:
    """Fresh heads for `base` (model.Transformer), on its device and in its dtype. Fills in the
    base's identity (dim, vocab_size, name, fingerprint) and kept_tokens; raises HeadsError."""
    if cfg.kind not in KINDS:
        raise HeadsError(f"unknown head kind '{cfg.kind}'; choose one of {', '.join(KINDS)}")
    if cfg.num_heads < 1 or cfg.num_layers < 1 or cfg.kept_tokens < 0:
        raise HeadsError(
            f"need num_heads, num_layers >= 1 and kept_tokens >= 0, got {cfg.num_heads}, "
            f"{cfg.num_layers} and {cfg.kept_tokens}"
        )
    kept_ids = _check_kept(kept_ids, cfg, base.cfg.vocab_size)
    cfg = replace(
        cfg,
        dim=cfg.dim or base.cfg.dim,
        vocab_size=cfg.vocab_size or base.cfg.vocab_size,
        base_name=cfg.base_name or base.cfg.name,
        base_fingerprint=cfg.base_fingerprint or lm_head_fingerprint(base),
        kept_tokens=0 if kept_ids is None else len(kept_ids),
    )
    _check_base(cfg, base)
    if kept_ids is not None:
        kept_ids = kept_ids.to(base.device)
    heads = (MedusaHeads if cfg.kind == "medusa" else HydraHeads)(cfg, base, kept_ids)
    return heads.to(device=base.device, dtype=base.dtype)  # no-op for the shared base buffers
