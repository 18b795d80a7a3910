"""The GPU's decode step: the base model's forward at static shapes, captured once per shape as a
CUDA graph and replayed (gpt-fast, SGLang's graph runner). model.py's forward is the lesson and
the reference; this is its tested twin (tests/test_graphs.py), used in its place by the loop.

    model = graphs.GraphedForward(model)        # then exactly as a model.Transformer:
    cache = model.new_cache(max_len, batch=B)   # a StaticCache: rows and slots of fixed buffers
    logits, hidden = model(tokens, positions, mask, cache)   # (B, N, V), (B, N, D); a replay
    cache.keep(*paths)                          # KVCache's, unchanged
    model.summary()   # 'cuda graphs: 3 shapes captured, 120 replays; eager: 5 (last_only 5)'
    model.prepare(B, N, max_len)                # optional: capture every length bucket now
    model.prepare_batches(B, N, max_len)        # ... and every key of a batch of up to B rows
    graphs.wanted("auto", device)               # a --cuda-graphs flag: on CUDA, True

Why: eager PyTorch launches hundreds of small kernels a step; a 135M model on an H100 waits for
the launches, not the arithmetic. A replayed graph launches them all at once, but only reads the
same addresses with the same shapes every time. So, for a shape key (B rows, N tree nodes rounded
up to a power of two, S slots attended: a length bucket, a power of two), every step:
  - tokens, positions and the tree mask are copied into that key's device buffers (padding nodes
    see only themselves, and no node sees them);
  - the rows' lengths and the write slot (max of them) come from the host in one copy, before;
  - each layer writes its N new keys/values at slots start..start+N-1 with index_copy_ (a slot
    given as a tensor, not a host int that changes), then attends over slots [0, S) of every row,
    a mask hiding what the row may not see: past its length (the gap of KVCache's invariant),
    past the new ones, and what the tree forbids;
  - the logits and hidden states land in that key's output buffers (valid until the next step of
    the same key: the loop reads them before then).
Nothing inside reads a value back to the host (tests/test_graphs.py counts: none). A forward the
static step cannot serve runs the readable model eagerly, counted by its reason in .fallbacks,
never silent: a prefill (last_only: T tokens, any T), `layers`, `extra`, `features` (EAGLE-3's
layer inputs), or a cache outside the buffers (made while another was in them, or not by
new_cache). On a CPU nothing is captured (.enabled is False): the same static step runs eagerly,
which is how the tests check it token for token against the readable model.

Garbage in the slots S hides (other rows' gaps, earlier sequences) is multiplied by a zero
weight, so it must be finite: it is, being keys and values some forward computed, or zeros.
Shapes: B rows, N tree nodes (new tokens), S slots attended, L layers, D hidden, V vocabulary,
Hkv key/value heads, Dh head size.
"""

import collections
import weakref

import torch

import model as model_lib
from specdec import rows

# --- the static step -------------------------------------------------------------------------
# model.Transformer.forward for a cached step, at the shapes of its inputs whatever the lengths.


def step_mask(tree, lengths, start, S):
    """(B, N, S) bool: new token i of row b sees slot s when s < lengths[b] (its own prefix), or
    when s = start + j is new token j and tree[b, i, j] (or j = i: every token sees itself).
    tree (B, N, N) bool, lengths (B,) long, start (1,) long; all on the device."""
    B, N, _ = tree.shape
    slots = torch.arange(S, device=tree.device)  # (S,)
    new = slots - start  # (S,) the slot's place among the new tokens
    is_new = (new >= 0) & (new < N)  # (S,)
    # tree[b, i, new[s]] where the slot is a new token's
    seen = tree.gather(2, new.clamp(0, N - 1).expand(B, N, S))  # (B, N, S)
    itself = new == torch.arange(N, device=tree.device)[:, None]  # (N, S)
    prefix = slots < lengths[:, None]  # (B, S)
    return prefix[:, None, :] | (is_new & seen) | itself  # (B, N, S)


def static_layer(layer, x, cos, sin, mask, k_cache, v_cache, slots):
    """One decoder layer (model.Block and its Attention.forward, the same modules) at static
    shapes: x (B, N, D); cos, sin (B|1, 1, N, Dh); mask (B, 1, N, S) bool; k_cache, v_cache
    (B, Hkv, S, Dh) this layer's, whose slots `slots` (N,) long get the new keys and values (a slot
    given as a tensor, not a host int that changes) -> (B, N, D)."""
    B, N, _ = x.shape
    attn = layer.self_attn
    c = attn.cfg
    q, k, v = attn.project(layer.input_layernorm(x))
    q = q.view(B, N, c.n_heads, c.head_dim).transpose(1, 2)  # (B, H, N, Dh)
    k = k.view(B, N, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, N, Dh)
    v = v.view(B, N, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, N, Dh)
    q = model_lib.apply_rope(attn.q_norm(q), cos, sin)
    k = model_lib.apply_rope(attn.k_norm(k), cos, sin)
    k_cache.index_copy_(2, slots, k)  # (B, Hkv, S, Dh), N slots written
    v_cache.index_copy_(2, slots, v)
    y = attn.attend(q, k_cache, v_cache, mask)  # (B, H, N, Dh)
    x = x + attn.o_proj(y.transpose(1, 2).reshape(B, N, c.n_heads * c.head_dim))  # (B, N, D)
    return x + layer.mlp(layer.post_attention_layernorm(x))  # (B, N, D)


def static_forward(model, k_cache, v_cache, tokens, positions, tree, lengths, start):
    """The readable forward's twin for one cached step (model.Transformer.forward, its layers
    through static_layer). k_cache, v_cache (L, B, Hkv, S, Dh): the cache's rows over S slots,
    written at slots start..start+N-1 of every row; tokens, positions (B, N) long; tree (B, N, N)
    bool; lengths (B,) long; start (1,) long -> logits (B, N, V), hidden (B, N, D).
    Every shape here depends on (B, N, S) only, and nothing is read back to the host."""
    B, N = tokens.shape
    S = k_cache.shape[3]
    slots = start + torch.arange(N, device=tokens.device)  # (N,) where the new entries go
    mask = step_mask(tree, lengths, start, S)[:, None]  # (B, 1, N, S)
    cos, sin = model.rope(positions, model.dtype)  # (B, 1, N, Dh)
    x = model.embed_tokens(tokens)  # (B, N, D): the lesson's model has no embed()
    for i, layer in enumerate(model.layers):
        x = static_layer(layer, x, cos, sin, mask, k_cache[i], v_cache[i], slots)
    hidden = model.norm(x)  # (B, N, D)
    return model.lm_head(hidden), hidden  # (B, N, V), (B, N, D)


# --- the cache the replays write into --------------------------------------------------------


class StaticCache(rows.RowsCache):
    """A KVCache whose keys and values are the first `batch` rows and `max_len` slots of
    GraphedForward's buffers (L, rows, Hkv, slots, Dh), so that they stay at one address: a
    captured graph reads and writes there. The invariant and every method are KVCache's, but
    select_rows, which moves the kept rows to the front of the same buffers instead of copying
    them elsewhere."""

    def __init__(self, k, v, batch, max_len):  # over given buffers: KVCache's allocates its own
        self.k = k[:, :batch, :, :max_len]  # (L, B, Hkv, max_len, Dh) views
        self.v = v[:, :batch, :, :max_len]
        self.lengths = [0] * batch
        self.max_len = max_len

    def select_rows(self, rows):
        n = len(rows)
        self.k[:, :n] = self.k[:, rows]  # the index makes a copy first: overlaps are safe
        self.v[:, :n] = self.v[:, rows]
        self.k = self.k[:, :n]
        self.v = self.v[:, :n]
        self.lengths = [self.lengths[b] for b in rows]


# --- one shape's buffers and graph -----------------------------------------------------------


class Shape:
    """The device buffers of one key (B, N, S), its host staging buffer and, on CUDA, its graph."""

    def __init__(self, B, N, S, device, pinned):
        self.key = (B, N, S)
        self.tokens = torch.zeros(B, N, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, N, dtype=torch.long, device=device)
        self.tree = torch.ones(B, N, N, dtype=torch.bool, device=device)
        self.scalars = torch.zeros(B + 1, dtype=torch.long, device=device)  # lengths, start
        self.host = torch.zeros(B + 1, dtype=torch.long, pin_memory=pinned)  # what fills it
        self.copied = torch.cuda.Event() if pinned else None  # host buffer free again
        self.graph = None  # torch.cuda.CUDAGraph once captured
        self.failed = None  # why its capture failed: it then runs eagerly, counted every step
        self.logits = self.hidden = None  # the outputs, (B, N, V) and (B, N, D)
        self.causal = torch.ones(N, N, dtype=torch.bool, device=device).tril()  # for mask None
        self.eye = torch.eye(N, dtype=torch.bool, device=device)  # what a padding node sees

    def load(self, tokens, positions, mask, lengths, start):
        """The step's inputs into the buffers: device copies, and one from the host. tokens (B, n)
        may have fewer nodes than the key's N: the last N - n are padding, that see only
        themselves and that no node sees (their tokens and positions: whatever was there)."""
        B, N, _ = self.key
        n = tokens.shape[1]
        self.tokens[:, :n].copy_(tokens)
        self.positions[:, :n].copy_(positions.expand(B, n))  # (n,) or (B, n)
        self.tree[:, :n, :n].copy_(self.causal[:n, :n] if mask is None else mask.expand(B, n, n))
        self.tree[:, :n, n:].fill_(False)
        self.tree[:, n:].copy_(self.eye[n:].expand(B, N - n, N))
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has read the host buffer
        self.host.numpy()[:] = list(lengths) + [start]
        self.scalars.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def inputs(self, k, v):
        B, N, S = self.key
        cache = (k[:, :B, :, :S], v[:, :B, :, :S])  # (L, B, Hkv, S, Dh) each
        return (*cache, self.tokens, self.positions, self.tree, self.scalars[:B], self.scalars[B:])


# --- the wrapper the loop takes as its model -------------------------------------------------


def node_slots(N):
    """The nodes a step of N is computed as: N rounded up to a power of two, so that drafters
    whose trees change size a step (lookup, heads+lookup, rows padded to the largest) need a
    handful of graphs, not one per size. The padding's keys and values land past every row's
    length: garbage by KVCache's invariant, overwritten before any row reads them."""
    return 1 << (N - 1).bit_length()


def wanted(flag, device):
    """A --cuda-graphs flag (auto | on | off) on `device`: whether the loop decodes through a
    GraphedForward. auto: where the device is CUDA (elsewhere nothing is captured)."""
    return flag == "on" or (flag == "auto" and torch.device(device).type == "cuda")


def buckets(smallest, slots):
    """The lengths a step attends over: powers of two from `smallest`, then all `slots`."""
    out = []
    while smallest < slots:
        out.append(smallest)
        smallest *= 2
    return out + [slots]


class GraphedForward:
    """model.Transformer's forward as the decode loop calls it, served by static_forward: replayed
    from a CUDA graph per shape key where `capture` (default: on a CUDA device), run eagerly
    otherwise. Everything else (cfg, device, dtype, lm_head, embed, ...) is the model's.

    slots: the buffers' length, fixed (a longer new_cache is a plain KVCache); None: they grow
    with what new_cache is asked, to a power of two (at most the model's context + 256), and
    every graph is captured again when they do. bucket: the smallest length attended. One
    StaticCache at a time lives in the buffers; a new_cache while it is alive (a prefill's own
    cache) is a plain KVCache."""

    def __init__(self, model, capture=None, slots=None, bucket=256, warmup=2):
        self.model = model
        self.enabled = model.device.type == "cuda" if capture is None else capture
        self.fixed = slots
        self.bucket = bucket
        self.buckets = []  # the lengths attended: buckets(), once the buffers are allocated
        self.warmup = warmup
        self.fallbacks = collections.Counter()  # reason -> eager forwards
        self.replays = 0  # static steps (replayed, or run eagerly when not enabled)
        self.shapes = {}  # (B, N, S) -> Shape
        self.k = self.v = None  # (L, rows, Hkv, slots, Dh): allocated by new_cache
        self.owner = lambda: None  # the StaticCache now in the buffers (a weak reference)
        self.memory = None  # the graphs' shared memory pool
        # register_forward_hook's: called after every forward, replayed or not (an OrderedDict:
        # torch's RemovableHandle holds it by a weak reference, which a plain dict refuses)
        self.hooks = collections.OrderedDict()

    def __getattr__(self, name):  # what the loop reads from the model: cfg, device, lm_head, ...
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def register_forward_hook(self, hook):
        """hook(self, (tokens, positions), (logits, hidden)) after every forward, as a module's
        forward hook (a replay never runs the model's own forward, so its hooks miss them)."""
        handle = torch.utils.hooks.RemovableHandle(self.hooks)
        self.hooks[handle.id] = hook
        return handle

    @property
    def slots(self):
        return 0 if self.k is None else self.k.shape[3]

    def room(self, max_len):
        """The buffers' length for a cache of max_len: a power of two (from bucket), so that a few
        lengths share buffers and graphs, never past max(max_len, the context + 256)."""
        grown = max(self.bucket, 1 << (max_len - 1).bit_length())
        return self.fixed or min(grown, max(max_len, self.model.cfg.max_seq_len + 256))

    def new_cache(self, max_len=None, batch=1, num_layers=None):
        max_len = max_len or self.model.cfg.max_seq_len
        too_long = self.fixed is not None and max_len > self.fixed
        if num_layers is not None or self.owner() is not None or too_long:
            return self.model.new_cache(max_len, batch, num_layers)  # eager forwards only
        rows = 0 if self.k is None else self.k.shape[1]
        if rows < batch or self.slots < max_len:  # new buffers: every graph read the old ones
            self.shapes.clear()
            cfg = self.model.cfg
            slots = max(self.slots, self.room(max_len))
            shape = (cfg.n_layers, max(rows, batch), cfg.n_kv_heads, slots, cfg.head_dim)
            self.k = torch.zeros(shape, device=self.model.device, dtype=self.model.dtype)
            self.v = torch.zeros(shape, device=self.model.device, dtype=self.model.dtype)
            self.buckets = buckets(min(self.bucket, slots), slots)
        cache = StaticCache(self.k, self.v, batch, max_len)
        self.owner = weakref.ref(cache)
        return cache

    def why_eager(self, cache, last_only, layers, extra, features=()):
        """Why the static step cannot serve this forward (None: it can)."""
        if features:
            return "features"  # EAGLE-3's layer inputs: the layers run in segments
        if last_only:
            return "last_only"  # a prefill: T tokens, any T
        if layers is not None:
            return "layers"
        if extra is not None:
            return "extra"
        if cache is None or cache is not self.owner():
            return "cache outside the buffers"  # not new_cache's, or made while one was in use
        return None

    def __call__(
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
        why = self.why_eager(cache, last_only, layers, extra, features)
        if why:
            self.fallbacks[why] += 1
            more = {"features": features} if features else {}  # (as a plain model is called)
            out = self.model(
                tokens, positions, mask, cache, last_only, layers, extra, sizes, **more
            )
        else:
            B, N = tokens.shape
            start = cache.length
            if start + N > cache.max_len:
                raise ValueError(f"KV cache full: {start} + {N} tokens > {cache.max_len} slots")
            P = node_slots(N) if start + node_slots(N) <= self.slots else N
            S = next(s for s in self.buckets if s >= start + P)
            logits, hidden = self.step(
                self.shape(B, P, S), tokens, positions, mask, cache.lengths, start
            )
            out = logits[:, :N], hidden[:, :N]  # (B, N, V), (B, N, D): the padding left out
        for hook in self.hooks.values():
            hook(self, (tokens, positions), out)
        return out

    def shape(self, B, N, S):
        if (B, N, S) not in self.shapes:
            device = self.model.device
            self.shapes[B, N, S] = Shape(B, N, S, device, device.type == "cuda")
        return self.shapes[B, N, S]

    @torch.inference_mode()
    def prepare(self, batch, nodes, max_len):
        """Capture (batch, nodes) at every length bucket of caches up to max_len now (a
        benchmark's warm-up, a server's start), not at the first step that reaches it. Only while
        no cache is in the buffers: the warm-up writes into them. A no-op where nothing is
        captured (.enabled False)."""
        if not self.enabled:
            return
        cache = self.new_cache(max_len, batch)
        assert isinstance(cache, StaticCache), "prepare() while a cache is in the buffers"
        nodes = node_slots(nodes)
        tokens = torch.zeros(batch, nodes, dtype=torch.long, device=self.model.device)
        for S in self.buckets:
            shape = self.shape(batch, nodes, S)
            if S < nodes or shape.graph is not None or shape.failed is not None:
                continue
            start = S - nodes  # the last slots of the bucket: any start <= S - N would do
            positions = start + torch.arange(nodes, device=tokens.device)  # (N,)
            shape.load(tokens, positions, None, [start] * batch, start)
            self.capture(shape)

    def prepare_batches(self, batch, nodes, max_len):
        """prepare() every key a batch engine of up to `batch` rows steps at, each row drafting up
        to `nodes` nodes: every row count (a batch drains to one row at its end), every power of
        two of nodes (a shared budget's rows change size every step), every length bucket up to
        max_len. A benchmark calls it before timing: no step of the run captures."""
        self.new_cache(max_len, batch)  # the buffers for all of them, allocated once
        for b in range(1, batch + 1):
            for n in sorted({node_slots(k) for k in range(1, nodes + 1)}):
                self.prepare(b, n, max_len)

    @torch.inference_mode()
    def step(self, shape, tokens, positions, mask, lengths, start):
        """Load the inputs, then replay (or capture first, or run the static step eagerly)."""
        shape.load(tokens, positions, mask, lengths, start)
        if self.enabled and shape.graph is None and shape.failed is None:
            self.capture(shape)
        self.replays += 1
        if shape.graph is not None:
            shape.graph.replay()
        else:
            if self.enabled:
                self.fallbacks[f"not captured: {shape.failed}"] += 1
            self.run(shape)
        return shape.logits, shape.hidden  # (B, N, V), (B, N, D)

    def run(self, shape):
        """The static step, eagerly, into the shape's output buffers (as a replay leaves them)."""
        logits, hidden = static_forward(self.model, *shape.inputs(self.k, self.v))
        if shape.logits is None:
            shape.logits, shape.hidden = logits, hidden
        else:
            shape.logits.copy_(logits)
            shape.hidden.copy_(hidden)

    @torch.inference_mode()
    def capture(self, shape):
        """Warm up on a side stream (what the step writes, it writes again: the same inputs), then
        capture one step into the shared pool. A failure is kept as the shape's reason to run
        eagerly."""
        step = lambda: static_forward(self.model, *shape.inputs(self.k, self.v))  # noqa: E731
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            self.memory = self.memory or torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.memory):
                shape.logits, shape.hidden = step()
            shape.graph = graph
        except Exception as e:  # named in .fallbacks at every step it costs
            shape.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            shape.logits = shape.hidden = None

    def summary(self):
        """One line for a banner or a footer: what was replayed, what ran eagerly and why."""
        eager = sum(self.fallbacks.values())
        why = ", ".join(f"{r} {n}" for r, n in self.fallbacks.most_common())
        if self.enabled:
            captured = sum(s.graph is not None for s in self.shapes.values())
            head = f"cuda graphs: {captured} shape{'s' * (captured != 1)} captured, "
            head += f"{self.replays} replay{'s' * (self.replays != 1)}"
        else:
            shapes = f"{len(self.shapes)} shape{'s' * (len(self.shapes) != 1)}"
            head = f"static steps (cuda graphs off): {shapes}, {self.replays} run"
        return f"{head}; eager: {eager}" + (f" ({why})" if why else "")
