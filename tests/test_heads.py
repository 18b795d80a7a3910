"""Tests for heads.py on a tiny random base model (CPU, seeded, each well under a second).

Shapes of every head kind; untrained heads equal the base LM head; the teacher-forced training pass
agrees with the drafting path; the Hydra++ PrefixMLP gives the same output in chunks with its cache
as in one call; checkpoint.save_heads / load_heads round trip and refuse other base models and
damaged files.
Run: `python -m pytest -q tests/test_heads.py`. Shapes: B batch, T time, D hidden, K heads, V vocab.
"""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import model  # noqa: E402
from specdec import rows
from specdec.loading.checkpoint import load_heads, save_heads  # noqa: E402
from heads import HeadsConfig, HeadsError, build  # noqa: E402

torch.set_num_threads(1)  # tiny tensors: threads only add overhead (and stall on a busy machine)
B, T, K, V, D = 2, 7, 3, 64, 32
KINDS = ["medusa", "hydra", "hydra++"]

# --- helpers ------------------------------------------------------------------------------------


def assert_close(a, b):  # torch.testing.assert_close imports torch.distributed: ~1 s the first time
    assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5), (
        f"max |a - b| = {(a - b).abs().max()}"
    )


def tiny_base(seed=0, dim=D):
    torch.manual_seed(seed)
    cfg = model.Config(
        vocab_size=V, dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64
    )
    return rows.Model(cfg).eval().requires_grad_(False)


def kept(n=16):
    return torch.randperm(V, generator=torch.Generator().manual_seed(1))[:n]


def perturb(heads, scale=0.1):
    """Move every trainable weight off its (partly zero) initial value, so that tests can fail."""
    torch.manual_seed(2)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(scale * torch.randn_like(p))
    return heads


def inputs(base, seed=3):
    torch.manual_seed(seed)
    tokens = torch.randint(0, V, (B, T))
    logits, hidden = base(tokens, torch.arange(T))
    return tokens, logits, hidden  # (B, T), (B, T, V), (B, T, D)


# --- shapes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("n_kept", [0, 16])
def test_shapes(kind, own, n_kept):
    base = tiny_base()
    heads = build(
        HeadsConfig(kind, num_heads=K, num_layers=2, own_lm_head=own),
        base,
        kept(n_kept) if n_kept else None,
    )
    Vh = n_kept or V
    assert (heads.cfg.dim, heads.cfg.vocab_size, heads.cfg.kept_tokens) == (D, V, n_kept)
    tokens, _, hidden = inputs(base)
    h = heads.context(hidden, torch.arange(T))
    assert h.shape == (B, T, D)
    z = heads(h, tokens)
    assert z.shape == (B, T, K, D)
    assert heads.project(z).shape == (B, T, K, Vh)
    for d in range(1, K + 1):
        zd = heads.head(d, h[:1, -1], torch.randint(0, V, (5, d)))
        assert zd.shape == ((1, D) if kind == "medusa" else (5, D))
        assert heads.project(zd, d).shape == (len(zd), Vh)
    ids = heads.full_ids(torch.arange(Vh))
    assert torch.equal(ids, kept(n_kept) if n_kept else torch.arange(V))
    assert (heads.new_cache(16) is None) == (kind != "hydra++")


# --- at initialisation --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("n_kept", [0, 16])
def test_untrained_heads_are_the_base_lm_head(kind, own, n_kept):
    base = tiny_base()
    ids = kept(n_kept) if n_kept else torch.arange(V)
    heads = build(
        HeadsConfig(kind, num_heads=K, num_layers=2, own_lm_head=own), base, ids if n_kept else None
    )
    tokens, logits, hidden = inputs(base)
    want = logits[..., ids]  # (B, T, V')
    got = heads.project(heads(heads.context(hidden, torch.arange(T)), tokens))  # (B, T, K, V')
    for k in range(K):
        assert_close(got[:, :, k], want)


def test_prefix_mlp_starts_as_a_norm():
    base = tiny_base()
    heads = build(HeadsConfig("hydra++", num_heads=K), base)
    _, _, hidden = inputs(base)
    want = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + base.cfg.norm_eps)
    assert_close(heads.context(hidden, torch.arange(T)), want)


# --- consistency --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_teacher_forcing_matches_drafting(kind):
    base = tiny_base()
    heads = perturb(build(HeadsConfig(kind, num_heads=K, num_layers=2), base))
    tokens, _, hidden = inputs(base)
    h = heads.context(hidden, torch.arange(T))
    z = heads(h, tokens)  # (B, T, K, D)
    padded = torch.cat([tokens, torch.zeros(B, K, dtype=torch.long)], dim=1)  # token 0 past the end
    for b in range(B):
        for t in range(T):
            for k in range(1, K + 1):
                path = padded[b, t + 1 : t + 1 + k][None]  # (1, k) root .. parent
                assert_close(z[b, t, k - 1], heads.head(k, h[b, t : t + 1], path)[0])
    # training runs the heads at chosen positions only: the same states there
    at = (torch.tensor([0, 1, 1, 0]), torch.tensor([T - 1, 0, 2, 3]))
    assert_close(heads(h, tokens, at), z[at])  # (N, K, D)


def test_teacher_forcing_sees_the_path():
    """Hydra heads must depend on the path tokens (else the test above proves little)."""
    heads = perturb(build(HeadsConfig("hydra", num_heads=K), tiny_base()))
    h = torch.randn(1, D)
    assert not torch.allclose(
        heads.head(2, h, torch.tensor([[1, 2]])), heads.head(2, h, torch.tensor([[1, 3]]))
    )


def test_prefix_mlp_cache_keeps_in_step():
    base = tiny_base()
    heads = perturb(build(HeadsConfig("hydra++", num_heads=K), base))
    _, _, hidden = inputs(base)
    hidden, positions = hidden[:1], torch.arange(T)
    whole = heads.context(hidden, positions)  # (1, T, D), no cache
    cache = heads.new_cache(16)
    parts = [
        heads.context(hidden[:, a:b], positions[a:b], cache) for a, b in [(0, 4), (4, 5), (5, T)]
    ]
    assert cache.length == T
    assert_close(torch.cat(parts, dim=1), whole)
    # it does attend
    assert not torch.allclose(whole[:, 1:], heads.context(hidden[:, 1:], positions[1:]))


def test_medusa_blocks_are_distinct_modules():
    heads = build(HeadsConfig("medusa", num_heads=K, num_layers=3), tiny_base())
    params = list(heads.parameters())
    assert len({id(p) for p in params}) == len(params) == K * 3 * 2
    assert sum(p.numel() for p in params) == K * 3 * (D * D + D)


# --- files --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,own,n_kept", [("medusa", False, 0), ("hydra", True, 16), ("hydra++", False, 16)]
)
def test_save_load_round_trip(tmp_path, kind, own, n_kept):
    base = tiny_base()
    heads = perturb(
        build(
            HeadsConfig(kind, num_heads=K, num_layers=2, own_lm_head=own),
            base,
            kept(n_kept) if n_kept else None,
        )
    )
    # exact round trip; the default half precision is tested below
    save_heads(heads, tmp_path, dtype=torch.float32)
    assert sorted(os.listdir(tmp_path)) == ["heads.json", "heads.safetensors"]
    saved = load_file(tmp_path / "heads.safetensors")
    trainable = {n for n, p in heads.named_parameters()}
    assert set(saved) == trainable | ({"kept_ids"} if n_kept else set())  # no frozen base tensor
    for name, buf in heads.named_buffers():
        if name != "kept_ids":
            assert not buf.requires_grad and name not in saved
    if kind != "medusa":
        assert heads.embed.data_ptr() == base.embed_tokens.weight.data_ptr()  # shared, not copied
    if not own and not n_kept:
        assert heads.lm_head.weight.data_ptr() == base.lm_head.weight.data_ptr()

    again = load_heads(tmp_path, base)
    assert again.cfg == heads.cfg
    tokens, _, hidden = inputs(base)
    h = heads.context(hidden, torch.arange(T))
    assert torch.equal(again.context(hidden, torch.arange(T)), h)
    assert torch.equal(again.project(again(h, tokens)), heads.project(heads(h, tokens)))
    assert torch.equal(again.full_ids(torch.arange(3)), heads.full_ids(torch.arange(3)))


def test_default_save_is_half_precision_and_close(tmp_path):
    base = tiny_base()
    heads = perturb(build(HeadsConfig("hydra++", num_heads=K), base))
    save_heads(heads, tmp_path)
    assert all(v.dtype == torch.float16 for v in load_file(tmp_path / "heads.safetensors").values())
    again = load_heads(tmp_path, base)
    tokens, _, hidden = inputs(base)
    h = heads.context(hidden, torch.arange(T))
    ref, got = (
        heads.project(heads(h, tokens)),
        again.project(again(again.context(hidden, torch.arange(T)), tokens)),
    )
    assert (got - ref).abs().max() < 1e-2 * ref.abs().max()


@pytest.mark.parametrize("other", [dict(seed=1), dict(dim=16)])
def test_load_refuses_another_base(tmp_path, other):
    save_heads(build(HeadsConfig("hydra", num_heads=K), tiny_base()), tmp_path)
    other_base = tiny_base(**other)
    other_base.cfg.name = "other-model"
    with pytest.raises(HeadsError, match="heads were trained for random, not other-model"):
        load_heads(tmp_path, other_base)


def test_load_refuses_damaged_files(tmp_path):
    base = tiny_base()
    with pytest.raises(HeadsError, match="does not exist"):
        load_heads(tmp_path / "nowhere", base)
    save_heads(build(HeadsConfig("medusa", num_heads=K), base), tmp_path)
    good = json.loads((tmp_path / "heads.json").read_text())

    def broken_config(text, match):
        (tmp_path / "heads.json").write_text(text)
        with pytest.raises(HeadsError, match=match):
            load_heads(tmp_path, base)

    broken_config("[1, 2]", "JSON object")
    broken_config("{not json", "not readable JSON")
    broken_config(json.dumps(good | {"dropout": 0.1}), "unknown field")
    broken_config(json.dumps(good | {"num_heads": "3"}), "'num_heads' must be int")
    broken_config(json.dumps(good | {"own_lm_head": 1}), "'own_lm_head' must be bool")
    broken_config(json.dumps(good | {"kind": "eagle"}), "unknown head kind 'eagle'")
    broken_config(json.dumps(good | {"num_heads": K + 1}), "does not hold the weights")
    (tmp_path / "heads.json").write_text(json.dumps(good))
    load_heads(tmp_path, base)  # restored: loads again

    data = (tmp_path / "heads.safetensors").read_bytes()
    (tmp_path / "heads.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HeadsError, match="unreadable or corrupted"):
        load_heads(tmp_path, base)
    os.remove(tmp_path / "heads.safetensors")
    with pytest.raises(HeadsError, match="has no heads.safetensors"):
        load_heads(tmp_path, base)
