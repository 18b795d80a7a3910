"""generate.py's contracts: greedy speculative output equals plain greedy output whatever the heads;
speculative sampling samples from the base model's own distribution; plain decoding matches
transformers' generate(); EOS and --max-new-tokens are respected."""

import collections
import itertools
import os

import pytest
import torch

from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import drafters
from specdec.engines import decode
import heads as heads_lib
from specdec.fast import kernels
from specdec import rows
import generate as G
import model as model_lib
import tree as tree_lib
from conftest import tiny_config

TREES = ["chain:3", "cartesian:3,2,2", "chain:1"]


def random_heads(base, kind, k=3, scale=0.5, seed=0):
    """Untrained heads with their zero-initialised weights perturbed, so that they draft junk."""
    torch.manual_seed(seed)
    h = heads_lib.build(heads_lib.HeadsConfig(kind=kind, num_heads=k), base)
    with torch.no_grad():
        for p in h.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * scale / p.shape[-1] ** 0.5)
    return h.eval()


@pytest.fixture(scope="module")
def small():
    """A tiny model with a 12-token vocabulary, so random drafts are often accepted."""
    torch.manual_seed(0)
    return rows.Model(tiny_config(vocab_size=12)).eval().requires_grad_(False)


def greedy_runs(model, drafter, seeds=4):
    """Greedy replies to `seeds` random prompts of 5 or more tokens, drafted by `drafter`, each
    checked token for token against plain decoding and in no more steps; their Results."""
    runs = []
    for seed in range(seeds):
        prompt = torch.randint(
            0, 12, (5 + seed,), generator=torch.Generator().manual_seed(seed)
        ).tolist()
        plain = decode.generate(model, prompt, 40)
        r = decode.generate(model, prompt, 40, drafter)
        assert r.tokens == plain.tokens
        assert r.steps <= plain.steps
        runs.append(r)
    return runs


@pytest.mark.parametrize("kind", heads_lib.KINDS)
@pytest.mark.parametrize("spec", TREES)
def test_greedy_speculative_equals_plain_tiny(small, kind, spec):
    heads = random_heads(small, kind)
    tree = tree_lib.build(tree_lib.parse(spec))
    runs = greedy_runs(small, drafters.HeadsDrafter(heads, tree))
    accepted = sum(sum(r.accepted) for r in runs)
    if spec.startswith("cartesian"):  # random heads on a chain may never be right; a bushy tree is
        assert accepted > 0, "no draft was ever accepted: the test would not exercise the tree path"


# --- the lesson's ladder (generate.py) against plain decoding and the engines' twin ---------------


def lesson_of(model):
    """model.py's Transformer (one sequence, model.KVCache) holding `model`'s weights."""
    lesson = model_lib.Transformer(model.cfg).eval().requires_grad_(False)
    lesson.load_state_dict(model.state_dict())
    return lesson


@pytest.mark.parametrize("kind", [None, *heads_lib.KINDS])
@pytest.mark.parametrize("spec", ["chain:3", "cartesian:3,2,2"])
def test_the_lessons_ladder_is_greedy_lossless_in_the_twins_steps(small, kind, spec):
    """generate.generate keeps plain greedy decoding's tokens, in as many forwards as the engines'
    decode.generate with the same heads and tree (its batch twin), EOS and the limit included."""
    lesson = lesson_of(small)
    heads = random_heads(small, kind) if kind else None
    tree = tree_lib.build(tree_lib.parse(spec))
    drafter = drafters.HeadsDrafter(heads, tree) if heads else None
    for seed, eos in itertools.product(range(3), [(), (3,)]):
        prompt = torch.randint(0, 12, (5 + seed,), generator=torch.Generator().manual_seed(seed))
        plain = decode.generate(small, prompt.tolist(), 40, eos_ids=eos)
        twin = decode.generate(small, prompt.tolist(), 40, drafter, eos_ids=eos)
        new, forwards = G.generate(lesson, prompt.tolist(), 40, heads, tree, eos_ids=eos)
        assert new == plain.tokens and forwards == twin.steps, (seed, eos)


@pytest.mark.parametrize("verify", ["sample", "typical"])
def test_the_lessons_ladder_samples_as_its_twin(small, verify):
    """At a temperature, the same seed draws the same reply in the lesson and in its twin."""
    heads = random_heads(small, "hydra")
    tree = tree_lib.build(tree_lib.parse("cartesian:3,2,2"))
    for seed in range(3):
        got = G.generate(
            lesson_of(small),
            [1, 2, 3, 4, 5],
            30,
            heads,
            tree,
            0.8,
            0.9,
            torch.Generator().manual_seed(seed),
            verify,
        )[0]
        twin = decode.generate(
            small,
            [1, 2, 3, 4, 5],
            30,
            drafters.HeadsDrafter(heads, tree),
            verify,
            0.8,
            0.9,
            torch.Generator().manual_seed(seed),
        )
        assert got == twin.tokens, seed


@pytest.mark.parametrize("kind", heads_lib.KINDS)
def test_greedy_speculative_equals_plain_default_model(default_model, kind):
    model, tok = default_model
    prompt = checkpoint.encode(tok, "List three fruits and say one thing about each.")
    plain = decode.generate(model, prompt, 24)
    heads = random_heads(model, kind, k=3, scale=0.05)
    for spec in ["chain:3", "cartesian:2,2,1"]:
        r = decode.generate(
            model, prompt, 24, drafters.HeadsDrafter(heads, tree_lib.build(tree_lib.parse(spec)))
        )
        assert r.tokens == plain.tokens, (kind, spec)


def test_plain_greedy_equals_transformers_generate(default_model):
    from transformers import LlamaForCausalLM

    model, tok = default_model
    hf = LlamaForCausalLM.from_pretrained(
        checkpoint.resolve(checkpoint.DEFAULT), dtype=torch.float32
    ).eval()
    for text in ["What is the capital of France?", "Write a short poem about rain."]:
        prompt = checkpoint.encode(tok, text)
        ours = decode.generate(model, prompt, 20, eos_ids={tok.eos_token_id})
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )
        assert ours.tokens == ref[0, len(prompt) :].tolist()


def test_max_new_tokens_and_eos_exact(small):
    heads = random_heads(small, "hydra")
    tree = tree_lib.build(tree_lib.cartesian([3, 2, 2]))
    prompt = [1, 2, 3, 4]
    for n in [1, 2, 5, 17]:
        r = decode.generate(small, prompt, n, drafters.HeadsDrafter(heads, tree))
        assert len(r.tokens) == n
        # every step emits its accepted drafts and a bonus token, the last one cut at the limit;
        # accepted counts only the drafts emitted, so acceptance by depth never counts past it
        assert len(r.tokens) - 1 - sum(r.accepted) in (r.steps - 1, r.steps - 2)
    full = decode.generate(small, prompt, 40).tokens
    eos = full[10]  # pretend the 11th token is EOS
    first = full.index(eos)
    r = decode.generate(small, prompt, 40, drafters.HeadsDrafter(heads, tree), eos_ids={eos})
    assert r.tokens == full[: first + 1] and r.stopped == "eos"


def test_computed_only_nodes_are_never_kept(small, monkeypatch):
    """Lookahead's window rides in every forward but is never verified: the KV cache still holds
    exactly the accepted sequence (its slots equal a fresh forward over prompt and reply)."""
    caches, new_cache = [], small.new_cache
    monkeypatch.setattr(
        small, "new_cache", lambda *a, **k: caches.append(new_cache(*a, **k)) or caches[-1]
    )
    prompt = [1, 2, 3, 4, 5]
    r = decode.generate(small, prompt, 40, drafters.Lookahead(3, 3, 3, "cpu"))
    assert r.tokens == decode.generate(small, prompt, 40).tokens and sum(r.accepted) > 0
    cache, seq = caches[0], prompt + r.tokens
    n = min(cache.length, len(seq))
    fresh = new_cache(n)
    small(torch.tensor([seq[:n]]), torch.arange(n), None, fresh)
    assert cache.length >= len(seq) - 1  # all but the last bonus
    assert torch.allclose(cache.k[..., :n, :], fresh.k, atol=1e-5) and torch.allclose(
        cache.v[..., :n, :], fresh.v, atol=1e-5
    )


def test_a_verifier_that_cannot_do_what_is_asked_is_refused(small):
    # greedy steps after a sampled first token: refused by the lesson and its twin alike
    for loop in (decode.generate, G.generate):
        with pytest.raises(ValueError, match="needs temperature 0"):
            loop(small, [1, 2, 3], 4, verify="greedy", temperature=0.7)
        with pytest.raises(ValueError, match="use one of"):
            loop(small, [1, 2, 3], 4, verify="tipical", temperature=0.7)


def test_a_tree_whose_ranks_skip_is_drafted_as_the_twin_drafts_it(small):
    """A hand-written tree may skip ranks ((0,), (2,): head 1's first and third guesses): each
    node gets its rank's token; the lesson's reply is plain decoding's, in the twin's steps."""
    heads = random_heads(small, "hydra")
    tree = tree_lib.build([(0,), (2,), (2, 1)])
    plain = decode.generate(small, [1, 2, 3, 4], 30)
    twin = decode.generate(small, [1, 2, 3, 4], 30, drafters.HeadsDrafter(heads, tree))
    new, forwards = G.generate(lesson_of(small), [1, 2, 3, 4], 30, heads, tree)
    assert new == plain.tokens and forwards == twin.steps


def test_heads_without_a_tree_draft_a_chain_as_deep_as_the_heads(small):
    heads = random_heads(small, "medusa", k=3)
    chain = tree_lib.build(tree_lib.chain(3))
    assert G.generate(lesson_of(small), [5, 6, 7], 20, heads) == G.generate(
        lesson_of(small), [5, 6, 7], 20, heads, chain
    )


def test_auto_dtype_is_fp16_on_a_gpu_without_native_bf16(monkeypatch):
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    # e.g. a T4 or V100: bf16 only emulated
    assert kernels.pick_dtype("auto", "cuda") == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert kernels.pick_dtype("auto", "cuda:0") == torch.bfloat16


def test_plain_decoding_has_tau_one(small):
    r = decode.generate(small, [1, 2, 3], 12)
    assert r.steps == len(r.tokens) == 12 and r.accepted == [0] * 11


# --- speculative sampling is lossless ------------------------------------------------------------


def exact_joint(model, prompt, n, temperature):
    """P(first n tokens) under plain sampling from the model, by enumeration."""
    V = model.cfg.vocab_size
    joint = {}
    for seq in itertools.product(range(V), repeat=n):
        p = 1.0
        for i in range(n):
            ids = torch.tensor([prompt + list(seq[:i])])
            logits, _ = model(ids, torch.arange(ids.shape[1]))
            p *= torch.softmax(logits[0, -1].double() / temperature, -1)[seq[i]].item()
        joint[seq] = p
    return joint


def chi_square(model, heads, tree, verify, n_samples, prompt, temperature=1.0):
    ref = exact_joint(model, prompt, 3, temperature)
    g = torch.Generator().manual_seed(0)
    counts = collections.Counter(
        tuple(
            decode.generate(
                model, prompt, 3, drafters.HeadsDrafter(heads, tree), verify, temperature, 1.0, g
            ).tokens
        )
        for _ in range(n_samples)
    )
    return sum(
        (counts[s] - n_samples * p) ** 2 / (n_samples * p)
        for s, p in ref.items()
        if n_samples * p > 0
    )


def four_token_setup():
    """A one-layer model over 4 tokens, random Hydra heads for it and a cartesian 2, 2 tree."""
    torch.manual_seed(0)
    model = rows.Model(
        tiny_config(vocab_size=4, dim=16, n_layers=1, n_heads=2, n_kv_heads=1)
    ).eval()
    model.requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)  # peakier distributions: drafts get accepted and rejected
    heads = random_heads(model, "hydra", k=2, scale=0.1)
    return model, heads, tree_lib.build(tree_lib.cartesian([2, 2]))


def test_speculative_sampling_matches_base_distribution():
    """The first three tokens of speculative sampling on a tree (Hydra heads that draft the
    likeliest tokens) follow the base model's own joint distribution: chi-square with 63 degrees of
    freedom stays below its 99.9% quantile (103); with the rejected token kept in the residual the
    same check fails by far."""
    model, heads, tree = four_token_setup()
    assert chi_square(model, heads, tree, "sample", 3000, [1, 2]) < 103


def test_broken_residual_rule_is_caught(monkeypatch):
    import verify

    def broken(logits, tokens, tree, temperature, top_p, generator):
        """The tree rule without its residual: rejected tokens are never removed."""
        q = verify.logits_to_probs(logits, temperature, top_p)
        node = 0
        while True:
            for c in tree.children[node]:
                if torch.rand((), generator=generator) < q[node, tokens[c]]:
                    node = c
                    break
            else:
                path = tree.mask[node].nonzero()[:, 0]
                return path, int(verify.sample(q[node], generator))

    model, heads, tree = four_token_setup()
    monkeypatch.setattr(decode.fast_verify, "speculative", broken)  # the twin decode runs
    assert chi_square(model, heads, tree, "sample", 3000, [1, 2]) > 103


def test_same_seed_same_output(small):
    heads = random_heads(small, "hydra++")
    tree = tree_lib.build(tree_lib.cartesian([2, 2]))
    runs = [
        decode.generate(
            small,
            [1, 2, 3],
            30,
            drafters.HeadsDrafter(heads, tree),
            "sample",
            0.8,
            0.9,
            torch.Generator().manual_seed(7),
        ).tokens
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    plain = [
        decode.generate(
            small, [1, 2, 3], 30, None, "sample", 0.8, 0.9, torch.Generator().manual_seed(7)
        ).tokens
        for _ in range(2)
    ]
    assert plain[0] == plain[1]


def test_a_tuned_tree_expected_to_lose_says_plain_decoding_is_faster(tiny, tmp_path, capsys):
    """bench.py --tune-tree records the tree's expected speedup; --tree auto on one below 1x says
    that --heads none is faster here (and says nothing for one that pays, or a file without it)."""
    from specdec import tuning

    heads = heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=2), tiny)
    file = catalog.tuned_tree_file(tmp_path, "cpu", torch.float32)
    for speedup, warned in ((0.74, True), (1.3, False), (None, False)):
        if speedup is None:
            tree_lib.save([[0]], file)
        else:
            tuning.save_tree([[0]], file, speedup)
        assert catalog.load_tree("auto", heads, str(tmp_path)).paths == [(0,)]
        err = capsys.readouterr().err
        assert (
            "0.74x plain decoding on this machine; --heads none (plain decoding) is faster" in err
        ) == warned


def test_tree_auto_prefers_the_tree_tuned_for_this_device_and_dtype(tiny, tmp_path, monkeypatch):
    """--tree auto: tree-cpu-PATH-float32.json (what bench.py --tune-tree writes on a CPU in fp32,
    PATH the kernels.c path it ran) wins over the shipped tree.json; heads in another dtype, on
    another CPU path, or no tuned file, read tree.json."""
    heads = heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=2), tiny)
    tree_lib.save([[0], [1]], tmp_path / "tree.json")
    path = kernels.native_path() or "generic"
    assert catalog.tuned_tree_file(tmp_path, "cpu", torch.float32) == str(
        tmp_path / f"tree-cpu-{path}-float32.json"
    )
    tree_lib.save([[0], [0, 0]], str(tmp_path / "tree-cpu-some-other-path-float32.json"))
    assert catalog.load_tree("auto", heads, str(tmp_path)).paths == [(0,), (1,)]
    tree_lib.save([[0], [0, 0]], catalog.tuned_tree_file(tmp_path, "cpu", torch.float32))
    assert catalog.load_tree("auto", heads, str(tmp_path)).paths == [(0,), (0, 0)]
    assert catalog.load_tree("auto", heads.to(torch.bfloat16), str(tmp_path)).paths == [(0,), (1,)]
    heads.float()  # --quantize fp16: its own tuned tree first, then the dtype's
    assert catalog.tuned_tree_file(tmp_path, "cpu", torch.float32, quant="fp16") == str(
        tmp_path / f"tree-cpu-{path}-float32-fp16.json"
    )
    assert catalog.load_tree("auto", heads, str(tmp_path), "fp16").paths == [(0,), (0, 0)]
    tree_lib.save(
        [[0], [1], [2]], catalog.tuned_tree_file(tmp_path, "cpu", torch.float32, quant="fp16")
    )
    assert catalog.load_tree("auto", heads, str(tmp_path), "fp16").paths == [(0,), (1,), (2,)]
    assert catalog.load_tree("auto", heads, str(tmp_path)).paths == [(0,), (0, 0)]
    os.remove(catalog.tuned_tree_file(tmp_path, "cpu", torch.float32))
    assert catalog.load_tree("auto", heads.float(), str(tmp_path)).paths == [(0,), (1,)]
