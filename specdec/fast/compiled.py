"""The decode step compiled the way GPU users make PyTorch fast (gpt-fast): torch.compile over a
static step whose KV cache is written at tensor positions, so that a whole generation, its accept
lengths changing every step, runs a handful of graphs compiled once. With mode "reduce-overhead"
on a GPU each graph replays as a CUDA graph; on a CPU inductor's C++ backend compiles the same
graph. model.py's forward stays the lesson and the reference; this wraps it from outside.

    model, heads = compiled.wrap(model, heads)     # then passed as the lesson's model and heads:
    new, forwards = generate.generate(model, prompt, n, heads, tree)   # its loop, unchanged
    compiled.prepare(model, heads, max_len, len(prompt), tree)   # optional: compile it all now
    model.summary()     # 'compiled (inductor, default): 4 graphs in 61.0 s; 62 steps, 40 keeps;
                        #  eager: 0'
    compiled.cache_dir()         # where inductor keeps what it compiled: ~/.cache/specdec/inductor

What is compiled (fullgraph=True: a graph break is an error, not a slow path; dynamic=False: one
graph per shape, never a dynamic-shape recompile):
  - verify: graphs.static_forward, the readable forward's tested twin at static shapes, for one
    sequence of N new tokens padded to a bucket of BUCKETS (padding nodes see only themselves, no
    node sees them), attending over every slot of fixed buffers; the cache's length reaches it as
    a device tensor (graphs.Shape.load: one host copy a step), never as a Python int;
  - a prompt (any length) goes through the same graphs in chunks of at most BUCKETS[-1];
  - keep: KVCache.keep's move of the accepted entries, the path padded to KEEP with moves of a
    slot onto itself;
  - heads: head(d, h, path) and project(z, d) for each depth d, and Hydra++'s PrefixMLP as
    graphs.static_layer over a static cache of its own, its T accepted positions padded to a bucket.
What stays eager: the lesson's loop (fill_tree's loop over parents, the verifier, the .tolist()
calls), the copies of a step's inputs into its bucket's buffers, full_ids.

The KV invariant is KVCache's (model.py): slots [0, length) are the accepted sequence. The buffers
have SLACK slots past the cache's max_len, because a padded step writes up to BUCKETS[-1] - 1 slots
past its real tokens and keep() moves up to KEEP slots: all past `length`, garbage by the
invariant, finite (keys and values some forward computed, or zeros) where a mask weighs them by 0.
One cache at a time lives in the buffers: a forward given an older one (or none) runs the readable
model eagerly, counted in .fallbacks by its reason, never silently. The engines' forward
(specdec/engines/decode.py: rows.Model's last_only and sizes) is served too, for one row; many
rows, `layers` and `extra` run eagerly, counted the same way.

The model's and heads' layers run their readable classes (kernels.use(.., Kernels())): dynamo
traces PyTorch, not kernels.c. Test: `python -m pytest -q tests/test_compiled.py`; on a GPU:
`python experiments/gpu_step.py`. Shapes: N tree nodes (new tokens), P a bucket, S slots, L layers,
D hidden, V vocabulary, Hkv key/value heads, Dh head size.
"""

import collections
import os
import time
import weakref

import torch
import torch.nn.functional as F

import model as model_lib
from specdec import rows
from specdec.fast import graphs
from specdec.fast import kernels

BUCKETS = (1, 4, 8, 16, 32, 64)  # the new tokens a compiled step is computed as
KEEP = 16  # the accepted path keep() moves, padded: a tree's depth + 1 is at most this
SLACK = BUCKETS[-1]  # slots past max_len that a padded step or a keep may write


# --- the compile cache ----------------------------------------------------------------------------


def cache_dir():
    """Where inductor keeps its compiled kernels: TORCHINDUCTOR_CACHE_DIR where the user set it,
    else ~/.cache/specdec/inductor (XDG_CACHE_HOME honoured), set before the first compile so that
    the next process reuses them. Importing torch._dynamo sets the variable to torch's default
    (a folder in /tmp, gone at a reboot): that value is taken as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not given or os.path.abspath(given) == os.path.abspath(default_cache_dir()):
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(home, "specdec", "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def bucket(n):
    """The smallest bucket that holds n new tokens (n <= BUCKETS[-1])."""
    return next(b for b in BUCKETS if b >= n)


# --- the compiled functions -----------------------------------------------------------------------
# Plain functions of tensors and modules: torch.compile traces each once per shape.


def keep_entries(k, v, idx, start):
    """KVCache.keep at static shapes: k, v (L, 1, Hkv, S, Dh); idx (KEEP,) long, the accepted path
    padded with j at its place j (a slot moved onto itself); start (1,) long the cache's length.
    New entry idx[j] moves from slot start + idx[j] to slot start + j, all read before any write."""
    dst = start + torch.arange(idx.shape[0], device=idx.device)  # (KEEP,)
    src = start + idx  # (KEEP,)
    k.index_copy_(3, dst, k.index_select(3, src))
    v.index_copy_(3, dst, v.index_select(3, src))


def prefix_step(prefix, k, v, x, positions, lengths, start):
    """heads.PrefixMLP.forward over its static cache: x (1, P, D) the base hidden states of P
    accepted positions (the last ones padding: causal, so no real one sees them); positions (1, P)
    long; k, v (1, 1, Hkv, S, Dh) written at slots start..start+P-1; lengths, start (1,) long, the
    cache's length -> (1, P, D)."""
    P = x.shape[1]
    causal = torch.ones(1, P, P, dtype=torch.bool, device=x.device).tril()  # (1, P, P)
    mask = graphs.step_mask(causal, lengths, start, k.shape[3])[:, None]  # (1, 1, P, S)
    slots = start + torch.arange(P, device=x.device)  # (P,)
    cos, sin = prefix.rope(positions, x.dtype)  # (1, 1, P, Dh)
    y = graphs.static_layer(prefix.block, x, cos, sin, mask, k[0], v[0], slots)  # (1, P, D)
    return prefix.norm(y)


class Compiler:
    """torch.compile's settings for every function here, and what they compiled."""

    def __init__(self, backend, mode, device):
        self.backend = backend
        self.mode = mode
        self.device = device
        self.seconds = {}  # (what, shapes) -> seconds of its first call: the compile, mostly

    def __call__(self, fn):
        kw = dict(fullgraph=True, dynamic=False, backend=self.backend)
        if self.backend == "inductor":  # the other backends take no mode
            kw["mode"] = self.mode
        return torch.compile(fn, **kw)

    def run(self, key, fn, *args):
        """fn(*args), the first call of each key (a graph compiled) timed apart."""
        if key in self.seconds:
            return fn(*args)
        t0 = time.perf_counter()
        out = fn(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds[key] = time.perf_counter() - t0
        return out


def fresh(t):
    """t with a layout of its own (contiguous strides): dynamo guards on strides, and a view's
    change with the step (h = hidden[:, -1] of n accepted nodes), which would compile again."""
    return t.clone(memory_format=torch.contiguous_format)


def own(t):
    """t, or on CUDA a copy of it: a CUDA graph's outputs live in its memory pool until its next
    replay, and the loop keeps some (the draft state) across steps."""
    return t.clone() if t.device.type == "cuda" else t


# --- the cache ------------------------------------------------------------------------------------


class CompiledCache(rows.RowsCache):
    """A cache of one row over the first max_len slots of the wrapper's buffers (a RowsCache, so
    that rows.Model's readable forward takes it too), whose keep() runs the compiled keep_entries
    (a path kept in place, as a prompt's, moves nothing). The invariant is KVCache's (model.py)."""

    def __init__(self, owner, max_len):  # over given buffers: RowsCache's allocates its own
        self.owner = owner
        self.k = owner.k[:, :, :, :max_len]  # (L, 1, Hkv, max_len, Dh) views
        self.v = owner.v[:, :, :, :max_len]
        self.lengths = [0]
        self.max_len = max_len

    def keep(self, *idx):
        assert len(idx) == 1, f"a compiled cache holds one row, got {len(idx)} paths"
        idx = idx[0].tolist() if isinstance(idx[0], torch.Tensor) else list(idx[0])
        if idx != list(range(len(idx))):  # a chain's accepted prefix is in place already
            self.owner.keep(idx, self.length)
        self.length += len(idx)


class Buffers:
    """Keys and values (layers, 1, Hkv, slots, Dh) at fixed addresses, allocated for the longest
    cache asked so far (grown: every graph compiles again, as its shapes changed)."""

    def __init__(self, device, dtype):
        self.device = device
        self.dtype = dtype
        self.k = self.v = None

    @property
    def slots(self):
        return 0 if self.k is None else self.k.shape[3]

    def fit(self, cfg, max_len):
        """Buffers for a cache of max_len: the next power of two from 256, plus SLACK."""
        if self.slots >= max_len + SLACK:
            return
        slots = max(256, 1 << (max_len - 1).bit_length()) + SLACK
        shape = (cfg.n_layers, 1, cfg.n_kv_heads, slots, cfg.head_dim)  # (L, 1, Hkv, S, Dh)
        self.k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        for t in (self.k, self.v):  # a CUDA graph reads and writes them where they are
            torch._dynamo.mark_static_address(t)


# --- the base model -------------------------------------------------------------------------------


class CompiledModel:
    """model.Transformer's forward as the lesson's loop calls it, model(tokens (1, T), positions
    (T,), mask (T, T) | None, cache) -> logits (1, T, V), hidden (1, T, D), served by the compiled
    static step; new_cache() -> a CompiledCache. Everything else (cfg, device, dtype, lm_head, ...)
    is the model's."""

    def __init__(self, model, compiler):
        self.model = model
        self.compiler = compiler
        self.verify = compiler(graphs.static_forward)
        self.keep_entries = compiler(keep_entries)
        self.buffers = Buffers(model.device, model.dtype)
        self.shapes = {}  # P -> graphs.Shape: the bucket's input buffers
        self.keep_host = torch.zeros(KEEP + 1, dtype=torch.long)  # a path and the length
        self.keep_device = torch.zeros(KEEP + 1, dtype=torch.long, device=model.device)
        self.owner = lambda: None  # the CompiledCache now in the buffers (a weak reference)
        self.fallbacks = collections.Counter()  # reason -> eager forwards
        self.steps = 0  # compiled forwards (a prompt's chunks each count)
        self.keeps = 0  # compiled keeps

    def __getattr__(self, name):  # what the loop reads from the model: cfg, device, dtype, ...
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    @property
    def k(self):
        return self.buffers.k

    @property
    def v(self):
        return self.buffers.v

    def new_cache(self, max_len=None, batch=1, num_layers=None):
        """A CompiledCache in the buffers; the engines' cache of many rows or of some layers, the
        model's own (its forwards run eagerly, counted)."""
        max_len = max_len or self.model.cfg.max_seq_len
        if batch != 1 or num_layers is not None:
            return self.model.new_cache(max_len, batch, num_layers)
        self.buffers.fit(self.model.cfg, max_len)
        cache = CompiledCache(self, max_len)
        self.owner = weakref.ref(cache)
        return cache

    def keep(self, idx, start):
        """CompiledCache.keep's move: the path idx of new entries after `start`; a path longer
        than KEEP (a tree deeper than any heads') moves eagerly, counted."""
        n = len(idx)
        if n > KEEP:
            self.fallbacks[f"a keep of more than {KEEP}"] += 1
            src = torch.tensor(idx, device=self.k.device) + start  # (n,)
            self.k[:, :, :, start : start + n] = self.k[:, :, :, src]
            self.v[:, :, :, start : start + n] = self.v[:, :, :, src]
            return
        self.keep_host.numpy()[:] = idx + list(range(n, KEEP)) + [start]
        self.keep_device.copy_(self.keep_host)  # the one host copy of a keep
        args = (self.k, self.v, self.keep_device[:KEEP], self.keep_device[KEEP:])
        self.compiler.run(("keep", KEEP), self.keep_entries, *args)
        self.keeps += 1

    def shape(self, P):
        S = self.buffers.slots
        if (P, S) not in self.shapes:
            device = self.model.device
            self.shapes[P, S] = graphs.Shape(1, P, S, device, device.type == "cuda")
        return self.shapes[P, S]

    def step(self, tokens, positions, mask, start):
        """One compiled forward of n <= BUCKETS[-1] new tokens after `start` accepted ones."""
        n = tokens.shape[1]
        shape = self.shape(bucket(n))
        shape.load(tokens, positions, mask, [start], start)
        args = (self.k, self.v, shape.tokens, shape.positions, shape.tree)
        args += (shape.scalars[:1], shape.scalars[1:])
        if self.model.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs are read
        logits, hidden = self.compiler.run(("verify", shape.key), self.verify, self.model, *args)
        self.steps += 1
        return own(logits[:, :n]), own(hidden[:, :n])  # (1, n, V), (1, n, D): no padding

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
    ):
        """The lesson's forward (tokens, positions, mask, cache), and the engines' (rows.Model's:
        last_only, a prefill's, computes every position and returns the last one's logits; sizes
        is not needed: padding nodes are computed and never read)."""
        why = self.why_eager(tokens, mask, cache, layers, extra)
        if why:
            self.fallbacks[why] += 1
            if last_only or layers is not None or extra is not None or sizes is not None:
                return self.model(tokens, positions, mask, cache, last_only, layers, extra, sizes)
            return self.model(tokens, positions, mask, cache)  # model.Transformer's four too
        T = tokens.shape[1]
        start = cache.length
        if start + T > cache.max_len:
            raise ValueError(f"KV cache full: {start} + {T} tokens > {cache.max_len} slots")
        positions = positions.reshape(T)  # (T,): the engines' one row is (1, T)
        mask = None if mask is None else mask.reshape(T, T)
        chunk = BUCKETS[-1]
        out = [  # a long prompt in chunks: each sees the ones before it as accepted
            self.step(tokens[:, i : i + chunk], positions[i : i + chunk], mask, start + i)
            for i in range(0, T, chunk)
        ]
        logits = torch.cat([o[0] for o in out], dim=1) if len(out) > 1 else out[0][0]
        hidden = torch.cat([o[1] for o in out], dim=1) if len(out) > 1 else out[0][1]
        return (logits[:, -1:] if last_only else logits), hidden  # (1, T|1, V), (1, T, D)

    def why_eager(self, tokens, mask, cache, layers=None, extra=None):
        """Why the compiled step cannot serve this forward (None: it can)."""
        if layers is not None:
            return "layers"
        if extra is not None:
            return "extra"
        if cache is None or cache is not self.owner():
            return "cache outside the buffers"  # none, not new_cache's, an older one, rows
        if mask is not None and tokens.shape[1] > BUCKETS[-1]:
            return f"a tree of more than {BUCKETS[-1]} nodes"
        return None

    @torch.inference_mode()
    def prepare(self, max_len, sizes=BUCKETS):
        """Compile now, in the loop's inference mode, the steps of caches up to max_len that
        forward these numbers of new tokens (a prompt's length, a tree's nodes: their buckets),
        and keep, so that no step of a generation compiles. Writes into the buffers: only while no
        cache is in use."""
        assert self.owner() is None, "prepare() while a cache is in the buffers"
        cache = self.new_cache(max_len)
        device = self.model.device
        chunks = {bucket(min(n, BUCKETS[-1])) for n in sizes}
        chunks |= {bucket(n % BUCKETS[-1]) for n in sizes if n > BUCKETS[-1] and n % BUCKETS[-1]}
        for P in sorted(chunks):
            tokens = torch.zeros(1, P, dtype=torch.long, device=device)
            self(tokens, torch.arange(P, device=device), None, cache)
        cache.keep([0, 2])  # a path not in place: the compiled move

    def summary(self):
        """One line for a banner or a footer: what was compiled and run, what ran eagerly."""
        c = self.compiler
        eager = sum(self.fallbacks.values())
        why = ", ".join(f"{r} {n}" for r, n in self.fallbacks.most_common())
        mode = f", {c.mode}" if c.backend == "inductor" else ""
        seconds = sum(c.seconds.values())
        return (
            f"compiled ({c.backend}{mode}): {len(c.seconds)} graphs in {seconds:.1f} s; "
            f"{self.steps} steps, {self.keeps} keeps; eager: {eager}" + (f" ({why})" if why else "")
        )


# --- the heads ------------------------------------------------------------------------------------


class PrefixCache(model_lib.KVCache):
    """Hydra++'s PrefixMLP cache over the compiled heads' buffers: KVCache's invariant (every
    position given is accepted: context() keeps them all)."""

    def __init__(self, owner, max_len):
        self.owner = owner
        self.k = owner.buffers.k[:, :, :, :max_len]  # (1, 1, Hkv, max_len, Dh) views
        self.v = owner.buffers.v[:, :, :, :max_len]
        self.length = 0
        self.max_len = max_len


class CompiledHeads:
    """heads.py's heads as the lesson's loop calls them: head(d, h, path) and project(z, d)
    compiled for each depth d, Hydra++'s context() through the compiled prefix_step; everything
    else (cfg, full_ids, forward for training, ...) is the heads'."""

    def __init__(self, heads, compiler, device):
        self.heads = heads
        self.compiler = compiler
        self.compiled_head = compiler(type(heads).head)
        self.compiled_project = compiler(type(heads).project)
        prefix = getattr(heads, "prefix", None)
        self.prefix = compiler(prefix_step) if prefix is not None else None
        dtype = next(heads.parameters()).dtype
        self.buffers = Buffers(device, dtype)
        self.scalars = torch.zeros(2, dtype=torch.long, device=device)  # lengths, start
        self.owner = lambda: None
        self.fallbacks = collections.Counter()

    def __getattr__(self, name):
        if name == "heads":
            raise AttributeError(name)
        return getattr(self.heads, name)

    def head(self, d, h, path):
        args = (self.heads, d, fresh(h), fresh(path))
        key = ("head", d, tuple(h.shape), tuple(path.shape))
        return own(self.compiler.run(key, self.compiled_head, *args))  # (R*P, D)

    def project(self, z, d=None):
        key = ("project", d, tuple(z.shape))
        return own(self.compiler.run(key, self.compiled_project, self.heads, fresh(z), d))

    def new_cache(self, max_len):
        if self.prefix is None:
            return None
        self.buffers.fit(self.heads.prefix.cfg, max_len)
        cache = PrefixCache(self, max_len)
        self.owner = weakref.ref(cache)
        return cache

    def context(self, hidden, positions, cache=None):
        """heads.context: hidden itself (Medusa, Hydra), or Hydra++'s PrefixMLP over it, in chunks
        of at most BUCKETS[-1] positions padded to a bucket, all kept."""
        if self.prefix is None:
            return hidden  # (1, T, D)
        if cache is None or cache is not self.owner() or hidden.shape[0] != 1:
            self.fallbacks["cache outside the buffers" if hidden.shape[0] == 1 else "rows"] += 1
            return self.heads.context(hidden, positions, cache)
        T = hidden.shape[1]
        if cache.length + T > cache.max_len:
            raise ValueError(
                f"PrefixMLP cache full: {cache.length} + {T} positions > {cache.max_len} slots"
            )
        out = []
        for i in range(0, T, BUCKETS[-1]):
            x = hidden[:, i : i + BUCKETS[-1]]  # (1, n, D)
            n = x.shape[1]
            pad = bucket(n) - n
            x = F.pad(x, (0, 0, 0, pad))  # (1, P, D)
            at = F.pad(positions[i : i + n], (0, pad), value=0)[None]  # (1, P)
            self.scalars.fill_(cache.length)  # no host copy: a fill with a scalar
            k, v = self.buffers.k, self.buffers.v
            args = (self.heads.prefix, k, v, x, at, self.scalars[:1], self.scalars[1:])
            y = self.compiler.run(("prefix", x.shape[1]), self.prefix, *args)  # (1, P, D)
            out.append(own(y[:, :n]))  # (1, n, D)
            cache.length += n
        return torch.cat(out, dim=1) if len(out) > 1 else out[0]  # (1, T, D)

    @torch.inference_mode()
    def prepare(self, max_len, sizes, tree):
        """Compile now what drafting `tree` compiles (generate.fill_tree's head and project at each
        depth, for all of its parents at once) and Hydra++'s context for these numbers of
        positions (a prompt's length) and for the 1 to depth + 1 accepted a step. Writes into the
        buffers: only while no cache is in use."""
        assert self.owner() is None, "prepare() while a cache is in the buffers"
        device = self.buffers.device
        h = torch.zeros(1, self.heads.cfg.dim, device=device, dtype=self.buffers.dtype)  # (1, D)
        depth = tree.max_depth
        for d, nodes in enumerate(tree.by_depth, start=1):
            P = len(tree.parent[nodes].unique())  # the parents drafted for at once
            path = torch.zeros(P, d, dtype=torch.long, device=device)  # (P, d)
            self.project(self.head(d, h, path), d)
        cache = self.new_cache(max_len)
        if cache is None:
            return
        for n in sorted({bucket(min(n, BUCKETS[-1])) for n in [*sizes, *range(1, depth + 2)]}):
            self.context(h.expand(1, n, -1), torch.arange(n, device=device), cache)
            cache.length = 0


def prepare(model, heads, max_len, prompt_len, tree):
    """Compile what a generation of a prompt of prompt_len tokens on `tree` (tree.py's) in caches
    up to max_len runs, model and heads as wrap() returned them (heads None: plain decoding)."""
    model.prepare(max_len, [prompt_len, tree.num_nodes])
    if heads is not None:
        heads.prepare(max_len, [prompt_len], tree)


# --- the entry point ------------------------------------------------------------------------------


def wrap(model, heads=None, mode="auto", backend="inductor"):
    """(model, heads) for the lesson's generate(): the model's forward and the heads' drafting
    compiled (above); heads None stays None. mode: torch.compile's ("default", "reduce-overhead":
    CUDA graphs, "max-autotune", ...); auto: reduce-overhead on CUDA, default elsewhere. backend:
    inductor, or a cheaper one to check the tracing ("aot_eager", "eager"). Puts the model's and
    heads' readable layers back (kernels.use(..., Kernels())): a quantized model is refused with
    a ValueError (its quantization would be dropped). Points inductor's cache at
    cache_dir() unless the user set it, and lets dynamo hold a graph per bucket of a few models."""
    quant = kernels.in_use(model).quant
    if quant != "none":
        raise ValueError(
            f"compiled.wrap runs the readable layers, and this model's are quantized to {quant}: "
            "compile the unquantized model, or run the quantized one without compiling"
        )
    if mode == "auto":
        mode = "reduce-overhead" if model.device.type == "cuda" else "default"
    cache_dir()
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, 64)  # buckets x models x head depths
    compiler = Compiler(backend, mode, model.device)
    kernels.use(model, kernels.Kernels())
    wrapped = CompiledModel(model, compiler)
    if heads is None:
        return wrapped, None
    kernels.use(heads, kernels.Kernels())
    return wrapped, CompiledHeads(heads, compiler, model.device)
