"""EAGLE-3 (Li et al. 2025): one decoder layer drafts autoregressively over the base model's fused
low, middle and high features, laid out as vLLM 0.32 and SGLang load it.

    features   f_t = [x_2; x_15; x_27] at position t: the residual stream at the input of base
               layers (2, L//2, L-3) (vLLM's aux_hidden_state_layers), (3D,); the base forward
               gives them (rows.Model's `features`, drafters.ReadsFeatures)
    entry t    h = fc(f_t) (D,); x = [input_layernorm(E(x_{t+1})); hidden_norm(h)] (2D,);
               h' = h + attn(x) over the entries before; o_t = h' + mlp(post_norm(h')) (the
               midlayer, a Llama decoder layer whose q, k, v read 2D inputs), at rope position t;
               logits = lm_head(norm(o_t)) over the draft vocabulary V' guess x_{t+2}
    draft      depth 1 reads the last committed entry's o; depth d >= 2 reads the entries of its
               parents, each (h = the o its parent was drafted from, the parent's token) at
               position t_last + d - 1: the drafter's own output is the next step's h, as vLLM's
               proposer feeds it

The drafter's KV cache holds the entries of the accepted sequence; a step's tree entries go past
it, each seeing the cached prefix, its ancestors' entries and itself (a tree mask over the cache's
spare slots), and are garbage after the step. Training (specdec/training/eagle3.py) unrolls the
same layer K steps with its own outputs (`unroll`: EAGLE-3's training-time test), step j's query
at t seeing step 0's entries at <= t and its own diagonal entries of steps 1..j: exactly what a
node at depth j+1 sees here (tests/test_eagle3.py holds the two equal).

    module = build(base, kept_ids, depth=3)           # an untrained layer, initialised from base
    module = load(folder, base)                       # heads.json + heads.safetensors (train.py's)
    drafter = Eagle3Drafter(module, tree)             # a drafters.Drafter (and ReadsFeatures)
    outs = module.unroll(features, tokens, steps)     # training: [(B, T, D)] per step
    logits = module.logits(outs[j])                   # (B, T, V'); module.full_ids(ids): base ids

Export for vLLM / SGLang: specdec/export.py --heads eagle3. Test: `python -m pytest -q
tests/test_eagle3.py`. Shapes: B batch, T time, D hidden, F fused layers, V vocabulary, V' draft
vocabulary, N tree nodes, P parents at one depth, H query heads, Hkv key/value heads, Dh head size.
"""

import bisect
import copy
import json
import os
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

import model as model_lib
from heads import HeadsError
from specdec import drafters
from specdec.cli import plural
from specdec.fast import kernels
from specdec.loading import checkpoint

KIND = "eagle3"


def default_layers(n_layers):
    """The layers whose inputs are fused: vLLM's and SGLang's default for Llama models, (2, L // 2,
    L - 3), where those are distinct and in range; else 0, L // 2 and L (a model of a few
    layers, for which the engines need the ids written out: export.py writes them)."""
    layers = (2, n_layers // 2, n_layers - 3)
    if 2 < n_layers // 2 < n_layers - 3:  # 7 layers or more
        return layers
    return tuple(sorted({0, n_layers // 2, n_layers}))


@dataclass
class Eagle3Config:
    kind: str = KIND
    num_heads: int = 3  # the depth trained for (training-time test steps); trees at most as deep
    layers: list = field(default_factory=list)  # the base layers whose inputs are fused, ascending
    dim: int = 0  # D of the base model
    vocab_size: int = 0  # V of the base model
    kept_tokens: int = 0  # V', the draft vocabulary (kept_ids); 0: the whole vocabulary
    base_name: str = ""  # identity of the base model (model.cfg.name)
    base_fingerprint: str = ""  # model.lm_head_fingerprint(base): refuses another base model


def draft_config(base_cfg: model_lib.Config) -> model_lib.Config:
    """The midlayer's shapes: the base's dims and rope, as a Llama layer (vLLM builds a
    LlamaDecoderLayer: no biases, no q/k norms, SwiGLU), one layer."""
    return replace(base_cfg, n_layers=1, qkv_bias=False, qk_norm=False, activation="silu")


def ttt_mask(T, steps_before, device=None):
    """What step j = steps_before of the training-time test sees (T, (j+1) T): among step 0's
    entries those at positions <= t (causal), and of steps 1..j its own (the diagonal)."""
    blocks = [torch.ones(T, T, dtype=torch.bool, device=device).tril()]
    blocks += [torch.eye(T, dtype=torch.bool, device=device)] * steps_before
    return torch.cat(blocks, dim=-1)  # (T, (j+1) T)


# --- the layer ------------------------------------------------------------------------------------


class MidLayer(nn.Module):
    """EAGLE-3's decoder layer (vLLM's LlamaDecoderLayer with layer_idx 0): attention over
    [input_layernorm(E(token)); hidden_norm(h)] (2D wide), its output added to h, then the MLP."""

    def __init__(self, cfg: model_lib.Config):
        super().__init__()
        D, Dh = cfg.dim, cfg.head_dim
        self.input_layernorm = model_lib.RMSNorm(D, cfg.norm_eps)
        self.hidden_norm = model_lib.RMSNorm(D, cfg.norm_eps)
        self.self_attn = model_lib.Attention(cfg)
        self.self_attn.q_proj = nn.Linear(2 * D, cfg.n_heads * Dh, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * D, cfg.n_kv_heads * Dh, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * D, cfg.n_kv_heads * Dh, bias=False)
        self.post_attention_layernorm = model_lib.RMSNorm(D, cfg.norm_eps)
        self.mlp = model_lib.MLP(cfg)

    def inputs(self, e, h):
        return torch.cat([self.input_layernorm(e), self.hidden_norm(h)], dim=-1)  # (B, T, 2D)

    def forward(self, e, h, cos, sin, mask, kv):
        """e (B, T, D) the tokens' embeddings, h (B, T, D) the states; mask and kv as
        model.Attention's (the entries cached before) -> o (B, T, D), before the final norm."""
        h = h + self.self_attn(self.inputs(e, h), cos, sin, mask, kv)
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, T, D)

    def unrolled(self, e, h, cos, sin, past):
        """forward's twin for the training-time test, without a cache (autograd keeps no in-place
        write): past [(k, v)] the earlier steps' keys and values (B, Hkv, T, Dh) each, seen through
        ttt_mask -> (o (B, T, D), this step's (k, v))."""
        a, c = self.self_attn, self.self_attn.cfg
        B, T, _ = e.shape
        q, k, v = a.project(self.inputs(e, h))
        q = q.view(B, T, c.n_heads, c.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = k.view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        v = v.view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        q, k = model_lib.apply_rope(q, cos, sin), model_lib.apply_rope(k, cos, sin)
        keys = torch.cat([pk for pk, _ in past] + [k], dim=2)  # (B, Hkv, (j+1) T, Dh)
        values = torch.cat([pv for _, pv in past] + [v], dim=2)
        mask = ttt_mask(T, len(past), e.device)[None, None]  # (1, 1, T, (j+1) T)
        y = a.attend(q, keys, values, mask).transpose(1, 2).reshape(B, T, -1)  # (B, T, H*Dh)
        h = h + a.o_proj(y)
        return h + self.mlp(self.post_attention_layernorm(h)), (k, v)  # (B, T, D)


class Eagle3(nn.Module):
    """fc (D, F*D), the midlayer, norm and lm_head (V', D) over the draft vocabulary kept_ids (the
    base LM head's most frequent rows, as the heads'; None: all V). The token embedding is the
    base model's (a buffer, not saved: vLLM shares the target's too)."""

    def __init__(self, cfg: Eagle3Config, base, kept_ids):
        super().__init__()
        self.cfg = cfg
        self.draft_cfg = draft_config(base.cfg)
        D = cfg.dim
        self.fc = nn.Linear(len(cfg.layers) * D, D, bias=False)
        self.midlayer = MidLayer(self.draft_cfg)
        self.norm = model_lib.RMSNorm(D, base.cfg.norm_eps)
        self.lm_head = nn.Linear(
            D, len(kept_ids) if kept_ids is not None else cfg.vocab_size, False
        )
        self.register_buffer("embed", base.embed_tokens.weight.detach(), persistent=False)
        self.register_buffer("kept_ids", kept_ids)  # (V',) or None; saved
        self.rope = model_lib.Rope(self.draft_cfg)  # fp32 frequencies, as the base model's

    def new_cache(self, max_len):
        w = self.norm.weight
        return model_lib.KVCache(self.draft_cfg, max_len, w.device, w.dtype)

    def step(self, h, tokens, positions, mask=None, kv=None):
        """Entries (h, token) at `positions`: h (1, T, D), tokens (1, T) -> o (1, T, D)."""
        cos, sin = self.rope(positions, h.dtype)  # (1, 1, T, Dh)
        return self.midlayer(F.embedding(tokens, self.embed).to(h.dtype), h, cos, sin, mask, kv)

    def commit(self, features, tokens, positions, cache):
        """The entries of accepted positions, appended to `cache` and kept: features (1, T, F*D)
        of the base at those positions, tokens (1, T) each one's next token -> o (1, T, D)."""
        T, start = tokens.shape[1], cache.length
        if start + T > cache.max_len:
            raise ValueError(f"EAGLE-3 cache full: {start} + {T} entries > {cache.max_len} slots")
        h = self.fc(features.to(self.fc.weight.dtype))  # (1, T, D)
        mask = model_lib.attention_mask(T, start, None, h.device)  # causal, the cache visible
        out = self.step(h, tokens, positions, mask, (cache.k[0], cache.v[0], start))
        cache.length += T  # every entry is kept: its feature and token are the sequence's
        return out  # (1, T, D)

    def logits(self, o):
        return self.lm_head(self.norm(o))  # (..., V')

    def full_ids(self, ids):
        return ids if self.kept_ids is None else self.kept_ids[ids]

    def fill_tree(self, o, root, plan, num_nodes, cache, position):
        """The tokens (N,) of a tree (plan: drafters.draft_plan's) after `root`, drafted depth by
        depth from o (D,), the output of the last committed entry (at `position`). The P parents
        of depth d >= 2 get their entries in one call, written past cache.length (spare slots,
        never kept), each seeing the cache, its ancestors' entries and itself. -> (tokens, the
        logits (P, V') of each depth)."""
        dev, start, written = o.device, cache.length, 0
        tokens = torch.full((num_nodes,), root, device=dev)  # (N,)
        outs = o.new_zeros(num_nodes, o.shape[-1])  # node -> its entry's output: its children's h
        outs[0] = o  # the root's: the last committed entry's
        slot = torch.full((num_nodes,), -1, device=dev)  # node -> its entry's slot past start
        by_depth = []
        for d, at in enumerate(plan, start=1):
            parents = at.paths[:, -1]  # (P,)
            P = len(parents)
            z = outs[parents]  # (P, D) at depth 1: the root's
            if d > 1:  # the parents' entries: (their parent's output, their token)
                S = start + written + P
                mask = torch.zeros(P, S, dtype=torch.bool, device=dev)  # (P, S)
                mask[:, :start] = True
                rows = torch.arange(P, device=dev)
                if d > 2:  # ancestors at depths 1..d-2, written at earlier depths
                    mask[rows[:, None], start + slot[at.paths[:, 1:-1]]] = True
                mask[rows, start + written + rows] = True  # itself
                positions = torch.full((P,), position + d - 1, device=dev)  # (P,)
                h = outs[at.paths[:, -2]][None]  # (1, P, D)
                kv = (cache.k[0], cache.v[0], start + written)
                z = self.step(h, tokens[parents][None], positions, mask[None, None], kv)[0]
                outs[parents] = z
                slot[parents] = written + rows
                written += P
            logits = self.logits(z)  # (P, V')
            by_depth.append(logits)
            top = self.full_ids(logits.topk(at.k, dim=-1).indices)  # (P, k) base ids
            tokens[at.nodes] = top[at.row, at.rank]
        return tokens, by_depth

    def unroll(self, features, tokens, steps):
        """The training-time test: features (B, T, F*D), tokens (B, T) the sequence -> [o_j (B, T,
        D)] for j < steps, step j's at t reading token t+1+j (0 past the end) and o_{j-1} at t,
        at position t + j, and guessing token t+2+j."""
        B, T = tokens.shape
        h = self.fc(features.to(self.fc.weight.dtype))  # (B, T, D)
        later = F.pad(tokens, (0, steps))  # (B, T+steps)
        past, outs = [], []
        for j in range(steps):
            e = F.embedding(later[:, 1 + j : 1 + j + T], self.embed).to(h.dtype)  # (B, T, D)
            cos, sin = self.rope(torch.arange(j, T + j, device=h.device), h.dtype)
            h, kv = self.midlayer.unrolled(e, h, cos, sin, past)
            past.append(kv)
            outs.append(h)
        return outs


# --- building, initialising, saving and loading ---------------------------------------------------


def check_layers(layers, n_layers):
    if not (layers and list(layers) == sorted(set(layers)) and 0 <= layers[0] <= layers[-1]):
        raise HeadsError(f"EAGLE-3 layers must be distinct and ascending, got {list(layers)}")
    if layers[-1] > n_layers:
        raise HeadsError(f"EAGLE-3 layers {list(layers)}: the base model has {n_layers} layers")


def initialise(module, base):
    """A start a short run learns from: h = fc(f) is the last fused feature (fc's last block the
    identity, the others zero), the midlayer a copy of the base layer that reads that feature
    (q, k, v reading hidden_norm(h) alone: their token half zero; hidden_norm its input norm),
    norm and lm_head the base model's own (lm_head its kept rows). So at first the drafter's step
    0 is the base model's next-token guess from one layer further on (exactly so in fp32); a base
    whose layer is no Llama layer (biases, q/k norms, GeGLU) leaves the midlayer random, its
    o_proj and down_proj zero (it passes h through)."""
    cfg, D, L = module.cfg, module.cfg.dim, base.cfg.n_layers
    mid = module.midlayer
    with torch.no_grad():
        module.fc.weight.zero_()
        module.fc.weight[:, -D:] = torch.eye(D)
        module.norm.weight.copy_(base.norm.weight)
        rows = base.lm_head.weight
        module.lm_head.weight.copy_(rows if module.kept_ids is None else rows[module.kept_ids])
        c = base.cfg
        if c.qkv_bias or c.qk_norm or c.activation != "silu":
            nn.init.zeros_(mid.self_attn.o_proj.weight)
            nn.init.zeros_(mid.mlp.down_proj.weight)
            return
        src = base.layers[min(cfg.layers[-1], L - 1)]
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(mid.self_attn, name).weight
            w.zero_()
            w[:, D:] = getattr(src.self_attn, name).weight
        mid.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mid.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
        mid.hidden_norm.weight.copy_(src.input_layernorm.weight)
        mid.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)


def check_base(cfg: Eagle3Config, base):
    pairs = {  # name: (what the layer was trained for, what the base model has)
        "dim": (cfg.dim, base.cfg.dim),
        "vocab_size": (cfg.vocab_size, base.cfg.vocab_size),
        "LM head fingerprint": (cfg.base_fingerprint, model_lib.lm_head_fingerprint(base)),
    }
    diff = [f"{k} {have} != {want}" for k, (have, want) in pairs.items() if have != want]
    if diff:
        raise HeadsError(
            f"the EAGLE-3 layer was trained for {cfg.base_name}, not {base.cfg.name} "
            f"({', '.join(diff)}); use it with that model, or train one for this model with "
            "train.py --heads eagle3"
        )
    check_layers(cfg.layers, base.cfg.n_layers)


def build(base, kept_ids=None, depth=3, layers=None, cfg=None) -> Eagle3:
    """A fresh layer for `base` (model.Transformer), initialised from it (initialise()), on its
    device and in its dtype: kept_ids the draft vocabulary (None: all), depth the steps it is
    trained to draft, layers the fused ones (default_layers); or `cfg` as saved."""
    saved = cfg is not None
    if not saved:
        layers = list(layers or default_layers(base.cfg.n_layers))
        cfg = Eagle3Config(
            num_heads=depth,
            layers=layers,
            dim=base.cfg.dim,
            vocab_size=base.cfg.vocab_size,
            kept_tokens=0 if kept_ids is None else len(kept_ids),
            base_name=base.cfg.name,
            base_fingerprint=model_lib.lm_head_fingerprint(base),
        )
    if cfg.num_heads < 1:
        raise HeadsError(f"an EAGLE-3 layer drafts at least 1 token deep, got {cfg.num_heads}")
    check_base(cfg, base)
    if kept_ids is not None:
        kept_ids = torch.as_tensor(kept_ids).long().to(base.device)
        if len(kept_ids) != (cfg.kept_tokens or cfg.vocab_size):
            raise HeadsError(f"kept_tokens={cfg.kept_tokens} but {len(kept_ids)} kept_ids")
    fresh = Eagle3(cfg, base, kept_ids).to(device=base.device, dtype=torch.float32)
    if not saved:  # (a saved layer's weights are loaded over it)
        initialise(fresh, base)
    return fresh.to(dtype=base.dtype)


def read_config(path) -> Eagle3Config:
    """heads.json of an EAGLE-3 layer (train.py --heads eagle3's), checked field by field."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise HeadsError(f"{path} is not readable JSON ({e})") from None
    types = {f.name: f.type for f in fields(Eagle3Config)}
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise HeadsError(f"{path} does not describe an EAGLE-3 layer (kind {KIND!r})")
    if unknown := sorted(set(data) - set(types)):
        raise HeadsError(f"{path} has unknown field(s) {unknown}; known fields: {', '.join(types)}")
    if missing := sorted(set(types) - set(data)):
        raise HeadsError(f"{path} lacks field(s) {missing}; write it with train.py --heads eagle3")
    for name, value in data.items():
        if type(value) is not types[name] or (
            name == "layers" and not all(type(i) is int for i in value)
        ):
            raise HeadsError(
                f"{path}: field '{name}' must be {types[name].__name__}, got {value!r}"
            )
    return Eagle3Config(**data)


def is_eagle3(folder):
    """Whether `folder` holds an EAGLE-3 layer (its heads.json says so); reads heads.json only."""
    try:
        with open(os.path.join(folder, checkpoint.HEADS_CONFIG)) as f:
            return json.load(f).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def load(folder, base) -> Eagle3:
    """The layer train.py --heads eagle3 saved in `folder` (checkpoint.save_heads' files), for
    `base`, in its dtype, on the fast kernels for its device (kernels.use); raises HeadsError."""
    weights = os.path.join(folder, checkpoint.HEADS_WEIGHTS)
    config = os.path.join(folder, checkpoint.HEADS_CONFIG)
    for path in (config, weights):
        if not os.path.isfile(path):
            raise HeadsError(
                f"{folder} has no {os.path.basename(path)}; train.py --heads eagle3 writes both"
            )
    cfg = read_config(config)
    try:
        state = load_file(weights)
    except Exception as e:  # safetensors raises its own error on a truncated or garbled file
        raise HeadsError(f"{weights} is unreadable or corrupted ({e})") from None
    module = build(base, state.get("kept_ids"), cfg=cfg)
    try:
        module.load_state_dict(state)
    except RuntimeError as e:
        reason = str(e).splitlines()[-1].strip()
        raise HeadsError(f"{weights} does not hold the weights {config} describes ({reason})")
    return kernels.use(module.eval().requires_grad_(False))


# --- the drafter ----------------------------------------------------------------------------------


class Eagle3Drafter:
    """The layer as a drafters.Drafter filling a fixed tree (tree.py's) depth by depth, and a
    drafters.ReadsFeatures: the loop hands it the base's inputs of module.cfg.layers.

    State of a row: its KV cache, whose slots [0, length) hold the committed entries in order, at
    the positions `slots` lists (every position of the sequence but the last, which waits for the
    next token; after a conversation's cut, also but the one whose next token changed), and the
    last one's output `last`, which depth 1 reads. accept() commits the entries of the accepted
    nodes (each paired with the token after it, the last with the bonus) in one call; the prompt's
    last entry waits for the first root (`pending`). Rows of a batch each draft alone (a call a
    depth each); their trees are verified in one forward all the same."""

    def __init__(self, module, tree):
        self.module = module
        self.features = tuple(module.cfg.layers)
        self.tree = tree.to(module.lm_head.weight.device)
        self.plan = drafters.draft_plan(self.tree)
        self.mask = self.tree.mask if tree.num_nodes > 1 else None
        self.source = tree.depth.tolist()  # node i: step depth[i]'s guess, 0 the base model's
        self.name = f"eagle3, tree: {plural(tree.num_nodes, 'node')}"
        self.legend = ["base model"] + [f"eagle3 step {d}" for d in range(1, tree.max_depth + 1)]
        self.max_nodes = tree.num_nodes
        self.max_depth = tree.max_depth

    def row(self, generator=None):  # start() makes the state
        return copy.copy(self)

    def start(self, prompt, hidden, max_len, cached=0):
        """hidden: the base's fused features at positions cached.. (1, T, F*D)."""
        if not cached:
            self.cache = self.module.new_cache(max_len + self.tree.num_nodes)  # + the tree's
            self.slots = []
        else:  # entry t pairs position t with token t+1: those up to cached - 2 still hold
            kept = bisect.bisect_left(self.slots, cached - 1)
            self.cache.length = kept
            del self.slots[kept:]
        self.position = cached  # the next entry's
        self.pending = (hidden, list(prompt[cached + 1 :]))  # the last waits for the root
        self.last = None

    @torch.inference_mode()
    def commit(self, features, tokens):
        """The entries of the next positions: features (1, n, F*D), tokens (n,) the next ones."""
        n = features.shape[1]
        assert len(tokens) == n, f"{n} features, {len(tokens)} tokens after them"
        dev = self.tree.depth.device
        positions = torch.arange(self.position, self.position + n, device=dev)  # (n,)
        ids = torch.tensor([tokens], device=dev)  # (1, n)
        self.last = self.module.commit(features, ids, positions, self.cache)[0, -1]  # (D,)
        self.slots += positions.tolist()
        self.position += n

    def draft(self, rows, roots):
        return [row.fill(root) for row, root in zip(rows, roots)]

    @torch.inference_mode()
    def fill(self, root):
        if self.pending is not None:  # the prompt's: its last position's next token is the root
            features, tokens = self.pending
            self.commit(features, tokens + [root])
            self.pending = None
        tokens, _ = self.module.fill_tree(
            self.last, root, self.plan, self.tree.num_nodes, self.cache, self.position - 1
        )
        return drafters.Draft(tokens, self.tree, self.mask, self.tree.depth, self.source)

    def accept(self, accepted):
        self.commit(accepted.features, accepted.ids[1:] + [accepted.bonus])
