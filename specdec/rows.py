"""Many rows in one forward: model.py's Transformer and KV cache as the engines run them.

model.py holds one sequence: one cache length, every token embedded from the vocabulary, logits at
every position, every layer. The machinery needs more of the same forward, and gets it here as
subclasses, never as arguments of the lesson's:

    model = Model(cfg)                      # specdec.loading.checkpoint.load() makes these
    cache = model.new_cache(max_len, batch=B)              # a RowsCache: a length per row
    logits, hidden = model(tokens, positions, mask, cache, last_only=False, layers=None, extra=None,
                           sizes=None)
    logits, hidden, fused = model(tokens, positions, mask, cache, features=(2, 15, 27))
    cache.keep(idx_0, ..., idx_B-1)         # each row's accepted entries

rows of different lengths (the batch engine: each row sees its own prefix, not the gap after it),
a prefill's logits at the last position only (`last_only`), a forward through some of the layers
(`layers`: self-speculative drafting) and embeddings of ids past the vocabulary (`extra`: PaSS's
[LA] tokens), rows whose trees are smaller than the largest (`sizes`: the padding after a
row's own tokens is computed where the fast path cannot skip it, never read), and the inputs of
some layers beside the output (`features`: EAGLE-3's fused features, the layers run in segments
split there). With one row, none of those, it computes what model.Transformer.forward computes
(tests/test_model.py). The fast paths (specdec.fast) are twins of this class's layers.
Shapes: B rows, T new tokens, S cache slots, D hidden, Hkv key/value heads, Dh head size."""

from dataclasses import replace

import torch

import model

# --- a KV cache of rows ---------------------------------------------------------------------------


class RowsCache(model.KVCache):
    """model.KVCache for B sequences side by side (rows), each of its own length.

    Invariant: row b's slots [0, lengths[b]) hold the keys/values of its accepted sequence, in
    order, for positions 0..lengths[b]-1; rows are right-padded. A forward of T new tokens writes
    them to slots [length, length+T) of every row, length = max(lengths) (one slice for the whole
    batch), and row b attends over its [0, lengths[b]) and those T (the forward hides the gap
    [lengths[b], length) from it); the lengths move only when keep() commits what was accepted.
    Everything at or beyond a row's length is garbage (rejected nodes, computed-only nodes:
    drafters.Draft.candidates, the gap): harmless, because no forward lets a row read a slot >= its
    length before overwriting it. With B = 1 there is no gap: length is the row's length."""

    def __init__(self, cfg: model.Config, batch: int, max_len: int, device, dtype):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = [0] * batch  # per row, on the host: no wait for the device to read them
        self.max_len = max_len

    @property
    def length(self):
        """Where the next forward writes its new tokens, in every row: the longest row's length."""
        return max(self.lengths)

    @length.setter
    def length(self, n):  # every row holds n (a drafter's cache, cut back or moved on by hand)
        self.lengths = [n] * len(self.lengths)

    def keep(self, *idx):
        """Commit row b's new entries idx[b] (indices into the last forward's T: list or 1-D
        tensor, ascending, e.g. its accepted tree path) to its slots from lengths[b] on, and grow
        lengths[b] by len(idx[b]): accepted nodes only, never one computed but not verified."""
        assert len(idx) == len(self.lengths), f"{len(self.lengths)} rows, {len(idx)} paths"
        start = self.length  # the slot of new entry 0, in every row
        moves = []  # (row, to slot, from slot) of every entry not in its place already
        for b, row in enumerate(idx):
            n, to = len(row), self.lengths[b]
            if isinstance(row, torch.Tensor):
                in_place = to == start and torch.equal(row, torch.arange(n, device=row.device))
                row = row.tolist() if not in_place else row
            else:  # known on the host: no wait for the device
                in_place = to == start and list(row) == list(range(n))
            if not in_place:  # a plain step of a row with no gap keeps 0..n-1 where they are
                moves += [(b, to + j, start + i) for j, i in enumerate(row)]
            self.lengths[b] += n
        if moves:  # every row's in one copy
            b, to, src = torch.tensor(moves, device=self.k.device).T  # (E,) each
            self.k[:, b, :, to] = self.k[:, b, :, src]
            self.v[:, b, :, to] = self.v[:, b, :, src]

    def put(self, rows, other):
        """Cache row rows[j] starts over as `other`'s row j: a new sequence takes a free row."""
        for j, b in enumerate(rows):
            n = other.lengths[j]
            self.k[:, b, :, :n] = other.k[:, j, :, :n]
            self.v[:, b, :, :n] = other.v[:, j, :, :n]
            self.lengths[b] = n

    def view(self, lo, hi):
        """Rows [lo, hi) as a RowsCache of their own: k, v are views (what a forward or keep()
        writes there lands here), the lengths a copy."""
        rows = RowsCache.__new__(RowsCache)
        rows.k, rows.v = self.k[:, lo:hi], self.v[:, lo:hi]
        rows.lengths = self.lengths[lo:hi]
        rows.max_len = self.max_len
        return rows

    def layers(self, lo, hi):
        """Layers [lo, hi) as a cache of their own (a forward through those layers alone reads and
        writes cache.k[i] for its i-th): k, v are views, the lengths the same list."""
        part = RowsCache.__new__(type(self))
        part.__dict__.update(self.__dict__)
        part.k, part.v = self.k[lo:hi], self.v[lo:hi]
        return part

    def select_rows(self, rows):
        """Keep only these rows (indices): a batch drops its ended sequences, which stop costing."""
        self.k = self.k[:, rows]
        self.v = self.v[:, rows]
        self.lengths = [self.lengths[b] for b in rows]

    def key_mask(self, T):
        """(B, length+T) bool: the slots each row may read in a forward of T new tokens (its own
        prefix and the new ones, not the gap); None when no row has a gap."""
        start = self.length
        if all(n == start for n in self.lengths):
            return None
        slots = torch.arange(start + T, device=self.k.device)  # (S,)
        lengths = torch.tensor(self.lengths, device=self.k.device)[:, None]  # (B, 1)
        return (slots < lengths) | (slots >= start)  # (B, S)


# --- the forward over rows ------------------------------------------------------------


def packed(sizes, T):
    """The tokens that matter of B rows of T: row b's first sizes[b], as flat indices b T + t, in
    order -> (M,) int32 (what kernels.c's `at` reads)."""
    return torch.tensor(
        [b * T + t for b, n in enumerate(sizes) for t in range(n)], dtype=torch.int32
    )


def attention_mask(T, start, mask, key_mask, device):
    """The (B|1, 1, T, start+T) bool mask: each new token sees the cached prefix (but the slots
    key_mask (B, start+T) hides) and, among the new tokens, what `mask` (T, T) or (B, T, T) allows
    (None: causal). None where that is plain causal (nothing cached or one new token, no gap)."""
    if mask is None:
        if (T == 1 or start == 0) and key_mask is None:
            return None
        mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    assert mask.shape[-2:] == (T, T), (
        f"tree mask must be (T, T) = ({T}, {T}), got {tuple(mask.shape)}"
    )
    mask = mask.view(-1, 1, T, T)
    prefix = torch.ones(mask.shape[0], 1, T, start, dtype=torch.bool, device=device)  # all seen
    full = torch.cat([prefix, mask], dim=-1)
    if key_mask is not None:  # hide the gaps, but let every token see itself (no NaN rows)
        full = full & key_mask[:, None, None, :]
        full[..., start:] |= torch.eye(T, dtype=torch.bool, device=device)
    return full  # (B|1, 1, T, start+T)


class Model(model.Transformer):
    """model.Transformer with rows of their own lengths, last_only, layers and extra (above)."""

    def new_cache(self, max_len=None, batch=1, num_layers=None) -> RowsCache:
        """num_layers: a cache for only that many layers (a forward running that many `layers`)."""
        cfg = self.cfg if num_layers is None else replace(self.cfg, n_layers=num_layers)
        return RowsCache(cfg, batch, max_len or self.cfg.max_seq_len, self.device, self.dtype)

    def embed(self, tokens, extra=None):
        """The token embeddings (..., D); ids from V on read the rows of `extra` (K, D): tokens the
        model was not trained with (PaSS's [LA] tokens), given by whoever owns them."""
        if extra is None:
            return self.embed_tokens(tokens)
        V = self.embed_tokens.num_embeddings
        added = extra[(tokens - V).clamp(0, len(extra) - 1)].to(self.dtype)  # (..., D)
        known = self.embed_tokens(tokens.clamp(max=V - 1))  # (..., D)
        return torch.where((tokens >= V)[..., None], added, known)

    def forward(
        self,
        tokens,
        positions,
        mask=None,
        cache=None,
        last_only=False,
        layers=None,
        extra=None,
        sizes=None,
        features=(),
    ):
        """tokens (B, T) long; positions (B, T) or (T,) long; mask (T, T) / (B, T, T) bool with
        mask[i, j] = new token i may see new token j (None: causal); the cached prefix is always
        visible. cache: a RowsCache (its invariant says where new entries go, what each row sees).
        Returns logits (B, T, V) and the final post-norm hidden states (B, T, D) that draft heads
        read; last_only: logits at the last position only (B, 1, V), for a long prompt's prefill.
        layers: run only these (indices in order: self-speculative drafting; see run_layers). extra:
        embeddings of ids past the vocabulary (embed()). sizes: row b's first sizes[b] tokens are
        its own, the rest padding whose logits and hidden states nobody reads (left out of the LM
        head; a fast path leaves them out of the layers: garbage there). features: layer indices,
        ascending, in [0, n_layers]: run_segments' fused inputs of those layers come back third,
        (B, T, len(features) * D); not with `layers`."""
        B, T = tokens.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.max_len:
            raise ValueError(f"KV cache full: {start} + {T} tokens > {cache.max_len} slots")
        cos, sin = self.rope(positions, self.dtype)
        key_mask = cache.key_mask(T) if cache is not None else None  # (B, S): the rows' gaps hidden
        attn_mask = attention_mask(T, start, mask, key_mask, tokens.device)
        x = self.embed(tokens, extra)  # (B, T, D)
        if features:
            assert layers is None, "features come from a forward through every layer"
            x, fused = self.run_segments(x, cos, sin, attn_mask, cache, start, features, sizes)
        else:
            x = self.run_layers(x, cos, sin, attn_mask, cache, start, layers, sizes)
        hidden = self.norm(x)  # (B, T, D)
        if sizes is not None and not last_only and sum(sizes) < B * T:  # the padding left out
            at = packed(sizes, T).to(tokens.device).long()  # (M,)
            own = self.lm_head(hidden.flatten(0, 1)[at])  # (M, V)
            logits = own.new_zeros(B * T, own.shape[-1])
            logits[at] = own
            logits = logits.view(B, T, -1)  # (B, T, V)
        else:
            logits = self.lm_head(hidden[:, -1:] if last_only else hidden)  # (B, T|1, V)
        return (logits, hidden, fused) if features else (logits, hidden)

    def run_layers(self, x, cos, sin, attn_mask, cache, start, layers=None, sizes=None):
        """x (B, T, D) through the decoder layers, all or forward's `layers`: the i-th layer run
        reads and extends cache.k[i], cache.v[i] from slot `start` (None: no cache). sizes: as
        forward's; every token is computed here."""
        run = self.layers if layers is None else [self.layers[i] for i in layers]
        for i, layer in enumerate(run):  # i: the layer's place in the cache
            kv = (cache.k[i], cache.v[i], start) if cache is not None else None
            x = layer(x, cos, sin, attn_mask, kv)
        return x  # (B, T, D)

    def run_segments(self, x, cos, sin, attn_mask, cache, start, features, sizes=None):
        """run_layers in segments split at the `features` layers -> the output (B, T, D) and those
        layers' inputs side by side (B, T, F*D): layer l's input is the residual stream after
        layers 0..l-1 (l = 0: the embeddings; l = n_layers: the last layer's output), what vLLM's
        EAGLE-3 collects as hidden_states + residual. Each segment is one run_layers call over a
        view of its layers' cache (one kernels.c call on the fast path: a hook would break it into
        layers), so the output is the unsegmented forward's, bit for bit."""
        L = len(self.layers)
        assert list(features) == sorted(set(features)) and 0 <= features[0] <= features[-1] <= L, (
            f"features: distinct layers in ascending order within [0, {L}], got {features}"
        )
        bounds = sorted({0, L, *features})
        inputs = {0: x}  # layer -> its input (B, T, D)
        for lo, hi in zip(bounds, bounds[1:]):
            part = None if cache is None else cache.layers(lo, hi)
            x = self.run_layers(x, cos, sin, attn_mask, part, start, tuple(range(lo, hi)), sizes)
            inputs[hi] = x
        return x, torch.cat([inputs[l] for l in features], dim=-1)  # (B, T, D), (B, T, F*D)
