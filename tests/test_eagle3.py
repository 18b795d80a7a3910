"""EAGLE-3 (specdec/eagle3.py, specdec/training/eagle3.py, export.py --heads eagle3): its contracts
on tiny random models (CPU, seeded).

- the segmented forward gives each named layer's input, as hooks on the readable forward see it,
  and the unsegmented forward's output and cache, bit for bit (fp32, and bf16 through kernels.c);
- greedy replies with an untrained and a briefly trained layer are plain decoding's, alone, in a
  batch and in a conversation (fp32), and through kernels.c in bf16;
- the training-time test sees what drafting sees: the unrolled steps' logits are the drafted
  nodes', on a chain and on every path of a tree;
- the loss falls over a few steps and held-out top-1 rises; train.py --heads eagle3 writes the
  heads' files and resumes a stopped run to the uninterrupted run's weights;
- the export holds every parameter vLLM 0.32's Eagle3LlamaForCausalLM creates (its names and
  shapes, read from vllm/model_executor/models/llama_eagle3.py and llama.py), and read back it
  drafts what the layer in memory drafts;
- bad input: one line, exit code 2.

Run: `python -m pytest -q tests/test_eagle3.py`. Shapes: T time, D hidden, V' draft vocabulary.
"""

import json
import os
import signal
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

import train
import tree as tree_lib
from conftest import save_tiny_model, tiny_config
from specdec import drafters, eagle3, export, rows
from specdec.engines import decode, engine
from specdec.fast import kernels
from specdec.loading import checkpoint
from specdec.training import eagle3 as training
from specdec.training.losses import to_kept_map

TREE = tree_lib.build(tree_lib.cartesian([2, 2, 1]))


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return rows.Model(tiny_config(**({"vocab_size": 24, "n_layers": 4} | kw))).eval()


def self_distilled(base, n=40, prompt=6, reply=26, seed=0):
    """n conversations: a random prompt, then the base model's own greedy reply (the assistant)."""
    g = torch.Generator().manual_seed(seed)
    convs = []
    for _ in range(n):
        p = torch.randint(0, base.cfg.vocab_size, (prompt,), generator=g).tolist()
        r = decode.generate(base, p, reply).tokens
        convs.append((p + r, [False] * prompt + [True] * len(r)))
    return convs


@pytest.fixture(scope="module")
def base():
    return tiny().requires_grad_(False)


@pytest.fixture(scope="module")
def data(base):
    return training.conversations_data(self_distilled(base))


def plan_for(base, data, module, **kw):
    args = dict(num_heads=3, teacher_k=8, batch_tokens=256, seed=0, noise=0.0, conversations=0)
    args = types.SimpleNamespace(**(args | {"epochs": 1} | kw))
    V = base.cfg.vocab_size
    return training.Plan(
        base, data, to_kept_map(module.kept_ids, V), module.cfg.layers, args, "cpu"
    )


def trained(base, data, steps=30, seed=0):
    """A layer trained `steps` steps on `data` (AdamW 3e-3), and its losses."""
    torch.manual_seed(seed)
    module = eagle3.build(base, torch.arange(20), depth=3).train()
    plan = plan_for(base, data, module)
    forward, opt = training.TrainForward(module), torch.optim.AdamW(module.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        loss = forward(plan.batch(step % plan.per_epoch), "teacher")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return module.eval().requires_grad_(False), losses


@pytest.fixture(scope="module")
def layer(base, data):
    return trained(base, data)


# --- features: the segmented forward --------------------------------------------------------------


def hooked(model, layers, tokens):
    """The inputs of `layers` (the last layer's output for L) as forward hooks see them on the
    readable forward, and its logits."""
    seen = {}
    L = len(model.layers)
    hooks = [
        model.layers[l].register_forward_pre_hook(lambda m, a, l=l: seen.__setitem__(l, a[0]))
        for l in layers
        if l < L
    ]
    hooks.append(model.layers[L - 1].register_forward_hook(lambda m, a, o: seen.__setitem__(L, o)))
    logits, _ = model(tokens, torch.arange(tokens.shape[1]), None, None)
    for h in hooks:
        h.remove()
    return [seen[l] for l in layers], logits


@pytest.mark.parametrize("layers", [(0, 2, 4), (1, 3), (2,)])
def test_the_segmented_forward_gives_the_hooks_inputs_and_the_same_output(base, layers):
    tokens = torch.randint(0, 24, (2, 9), generator=torch.Generator().manual_seed(1))
    inputs, _ = hooked(base, layers, tokens)
    mask = TREE.mask  # a step over a tree after a cached prefix, rows with a gap
    one, two = base.new_cache(32, batch=2), base.new_cache(32, batch=2)
    for cache in (one, two):
        base(tokens, torch.arange(9), None, cache)
        cache.keep(range(9), range(7))
    step = torch.randint(0, 24, (2, TREE.num_nodes), generator=torch.Generator().manual_seed(2))
    depth = torch.tensor([9, 7])[:, None] + TREE.depth
    want = base(step, depth, mask, one)
    got = base(step, depth, mask, two, features=layers)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(one.k, two.k) and torch.equal(one.v, two.v)
    _, _, fused = base(tokens, torch.arange(9), None, None, features=layers)
    assert torch.equal(fused, torch.cat(inputs, dim=-1))


def through_kernels_c(model):
    if kernels.native_library() is None:
        pytest.skip(f"kernels.c does not run here: {kernels.native_reason()}")
    C = kernels.Kernels(attention="cpu-bf16", packed=True, glue=True, native=True)
    return kernels.use(model.to(torch.bfloat16), C)


def test_in_bf16_through_kernels_c_each_segment_is_one_call_and_the_output_the_same():
    bf16 = through_kernels_c(tiny(vocab_size=24))
    calls, real = [], kernels.stack_native
    tokens = torch.randint(0, 24, (1, 12), generator=torch.Generator().manual_seed(3))
    outs = []
    with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
        mp.setattr(kernels, "stack_native", lambda s, *a: calls.append(len(s)) or real(s, *a))
        for features in ((), (0, 2, 4)):
            cache = bf16.new_cache(16)
            outs.append((bf16(tokens, torch.arange(12), None, cache, features=features), cache))
    (plain, c1), (segmented, c2) = outs
    assert calls == [4, 2, 2], "the whole forward in one call; with features, one a segment"
    assert torch.equal(plain[0], segmented[0]) and torch.equal(c1.k, c2.k)
    x0, x2, x4 = segmented[2].split(32, dim=-1)  # the inputs of layers 0, 2 and 4 (= L)
    with torch.inference_mode():
        _, first_two = bf16(
            tokens, torch.arange(12), None, bf16.new_cache(16, num_layers=2), layers=(0, 1)
        )
        assert torch.equal(x0, bf16.embed(tokens)) and torch.equal(bf16.norm(x2), first_two)
        assert torch.equal(bf16.norm(x4), segmented[1])


# --- greedy: token-identical to plain decoding ----------------------------------------------------


def prompts(n=4, vocab=24):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (5 + i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("which", ["untrained", "trained"])
def test_greedy_replies_are_plain_decodings_alone_in_a_batch_and_in_a_chat(base, layer, which):
    module = eagle3.build(base, torch.arange(20)) if which == "untrained" else layer[0]
    drafter = eagle3.Eagle3Drafter(module, TREE)
    assert isinstance(drafter, drafters.Drafter) and drafters.features_of(drafter) == (0, 2, 4)
    accepted = 0
    for p in prompts():
        plain = decode.generate(base, p, 40)
        r = decode.generate(base, p, 40, drafter)
        assert r.tokens == plain.tokens and r.steps <= plain.steps
        accepted += sum(r.accepted)
    batch = engine.generate_batch(base, prompts(), [40] * 4, drafter, batch_size=3)
    assert [b.tokens for b in batch] == [decode.generate(base, p, 40).tokens for p in prompts()]
    chat = decode.Conversation(base, drafter)
    first = chat.reply(prompts()[0], 12)
    turn = prompts()[0] + first.tokens[:-2] + [3, 4]  # the cut lands inside the last reply
    assert chat.reply(turn, 20).tokens == decode.generate(base, turn, 20).tokens
    if which == "trained":
        assert accepted >= 40, f"the trained layer drafted little that was kept ({accepted})"


class Checked(eagle3.Eagle3Drafter):
    """After every step, its cache holds the entries of the sequence so far but the last position
    (each with the token after it), as a fresh commit of them all computes them."""

    def __init__(self, base, module, tree):
        super().__init__(module, tree)
        self.base = base

    def start(self, prompt, hidden, max_len, cached=0):
        super().start(prompt, hidden, max_len, cached)
        self.seq, self.checked = list(prompt), 0

    def accept(self, accepted):
        super().accept(accepted)
        at = int(accepted.positions[0])  # the root's
        self.seq = self.seq[:at] + accepted.ids + [accepted.bonus]
        n = self.cache.length
        assert self.slots == list(range(n)) and n == len(self.seq) - 1
        seq = torch.tensor([self.seq])
        _, _, f = self.base(seq[:, :n], torch.arange(n), features=self.features)
        fresh = self.module.new_cache(n)
        self.module.commit(f, seq[:, 1:], torch.arange(n), fresh)
        assert torch.allclose(self.cache.k[..., :n, :], fresh.k, atol=1e-5)
        assert torch.allclose(self.cache.v[..., :n, :], fresh.v, atol=1e-5)
        self.checked += 1


def test_the_drafters_cache_holds_the_accepted_sequence(base, layer):
    d = Checked(base, layer[0], TREE)
    r = decode.generate(base, prompts()[1], 30, d)
    assert d.checked == r.steps - 1 and 0 < sum(r.accepted) < 3 * len(r.accepted)


def test_bf16_greedy_replies_through_kernels_c_are_plain_decodings(base, layer):
    bf16 = through_kernels_c(tiny())
    module = kernels.use(eagle3.build(bf16, torch.arange(20)))
    module.load_state_dict(layer[0].state_dict())
    kernels.use(module)  # packed again from these weights
    drafter = eagle3.Eagle3Drafter(module, TREE)
    accepted = 0
    for p in prompts():
        r = decode.generate(bf16, p, 40, drafter)
        assert r.tokens == decode.generate(bf16, p, 40).tokens
        accepted += sum(r.accepted)
    assert accepted > 0


# --- the training-time test sees what drafting sees -----------------------------------------------


def drafted(module, features, tokens, t, tree):
    """Drafting after the entries of positions 0..t (position i with token i+1): the tree's tokens
    and each depth's logits."""
    cache = module.new_cache(64)
    ids = tokens[:, 1 : t + 2]
    out = module.commit(features[:, : t + 1], ids, torch.arange(t + 1), cache)
    plan = drafters.draft_plan(tree)
    root = int(tokens[0, t + 1])
    return module.fill_tree(out[0, -1], root, plan, tree.num_nodes, cache, t)


def test_the_unrolled_steps_are_the_drafted_nodes_on_a_chain_and_on_every_path(base, layer):
    module = layer[0]
    seq = torch.randint(0, 24, (1, 20), generator=torch.Generator().manual_seed(4))
    t = 11
    _, _, f = base(seq, torch.arange(20), features=module.cfg.layers)
    tokens, by_depth = drafted(module, f, seq, t, tree_lib.build(tree_lib.chain(3)))
    seq[0, t + 2 : t + 4] = tokens[1:3]  # the sequence the drafts would make
    _, _, f = base(seq, torch.arange(20), features=module.cfg.layers)
    outs = module.unroll(f, seq, 3)
    for j in range(3):
        assert torch.allclose(module.logits(outs[j])[0, t], by_depth[j][0], atol=1e-5), j
    # a tree: each node's tokens are those a chain along its path drafts
    tree = tree_lib.build(tree_lib.cartesian([3, 2, 2]))
    tokens, _ = drafted(module, f, seq, t, tree)
    for node, path in enumerate(tree.paths, start=1):
        chain = tree_lib.build([path[:i] for i in range(1, len(path) + 1)])
        chain = drafted(module, f, seq, t, chain)[0]
        assert chain[-1] == tokens[node], path


def test_the_training_time_mask_is_causal_then_diagonal():
    assert eagle3.ttt_mask(3, 2).int().tolist() == [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]


# --- training -------------------------------------------------------------------------------------


def test_the_loss_falls_and_held_out_top1_rises(base, data, layer):
    module, losses = layer
    assert losses[-1] < losses[0] - 0.1, losses[::5]
    fresh = eagle3.build(base, torch.arange(20), depth=3)
    plan = plan_for(base, data, fresh)
    before = training.evaluate(fresh, plan, plan.held_out + plan.trained[:10])
    after = training.evaluate(module, plan, plan.held_out + plan.trained[:10])
    assert after["top1"][0] > before["top1"][0] and after["chain_tau"] > before["chain_tau"]
    assert len(after["rank_acceptance"]) == 3 and after["top5"][0] >= after["top1"][0]


def test_the_readable_loss_is_the_fused_one(base, data, layer):
    plan = plan_for(base, data, layer[0])
    batch = plan.batch(0)
    fused = training.TrainForward(layer[0])(batch, "teacher")
    readable = training.TrainForward(layer[0], train.batch_loss)(batch, "teacher")
    assert torch.allclose(fused, readable, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny transformers folder (3 layers) and 60 random conversations of it, in a folder."""
    d = tmp_path_factory.mktemp("eagle3-run")
    model = save_tiny_model(d / "model", num_hidden_layers=3, hidden_size=32, intermediate_size=64)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (60, 20), generator=g)
    loss = torch.tensor([False] * 5 + [True] * 15).repeat(60)
    offsets = torch.arange(61) * 20
    save_file(
        {"ids": ids.flatten().int(), "loss": loss, "offsets": offsets}, str(d / "c.safetensors")
    )
    return d, model


def run_train(d, model, out, *more):
    argv = ["--model", model, "--heads", "eagle3", "--data", str(d / "c.safetensors")]
    argv += ["--batch-tokens", "128", "--epochs", "2", "--eval-every", "1000", "--dtype", "fp32"]
    argv += ["--train-dtype", "fp32"]
    argv += ["--kept-tokens", "300", "--save-every", "1000", "--out", str(out), *more]
    return train.cli_main([str(a) for a in argv])


def test_train_py_writes_the_layer_and_resumes_to_the_uninterrupted_runs_weights(
    tiny_run, monkeypatch
):
    d, model = tiny_run
    assert run_train(d, model, d / "whole") in (0, None)
    assert {"heads.json", "heads.safetensors", "eval.json", "state.pt"} <= set(
        os.listdir(d / "whole")
    )
    report = json.load(open(d / "whole" / "eval.json"))
    assert len(report["top1"]) == 3 and report["curve"][-1]["step"] > 3
    real = training.Eagle3Session.after_step

    def stop_at_3(self, step, loss, batch):  # as a Ctrl-C after step 3 would
        if step == 3:
            self.stop.signum = signal.SIGINT
        return real(self, step, loss, batch)

    with monkeypatch.context() as mp:
        mp.setattr(training.Eagle3Session, "after_step", stop_at_3)
        with pytest.raises(SystemExit) as stopped:
            run_train(d, model, d / "stopped")
    assert stopped.value.code == 128 + signal.SIGINT
    assert run_train(d, model, d / "stopped", "--resume") in (0, None)
    one = torch.load(d / "whole" / "state.pt", weights_only=True)["heads"]
    two = torch.load(d / "stopped" / "state.pt", weights_only=True)["heads"]
    assert all(torch.equal(one[k], two[k]) for k in one)
    base, _ = checkpoint.load(model)
    loaded = eagle3.load(str(d / "whole"), base)
    assert loaded.cfg.layers == [0, 1, 3] and loaded.cfg.kept_tokens == 300


# --- export: vLLM's names, and the way back -------------------------------------------------------

STACKED = {  # vLLM's LlamaModel.hf_to_vllm_mapper (llama_eagle3.py): checkpoint part -> parameter
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}


def vllm_parameters(config):
    """{name: shape} of the parameters vLLM 0.32's Eagle3LlamaForCausalLM creates for this
    config.json (llama_eagle3.py: LlamaModel's embed_tokens, layers.0 = its LlamaDecoderLayer with
    qkv_proj over 2 * hidden_size and hidden_norm, fc over num_aux_hidden_states * target
    hidden_size, norm; lm_head over draft_vocab_size; draft_id_to_target_id where draft_vocab_size
    differs from the target's; no input_norm / fc_norm without norm_before_fc / fc_norm)."""
    D, H, Hkv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    Dh, I = config.get("head_dim") or D // H, config["intermediate_size"]
    V, Vd = config["vocab_size"], config.get("draft_vocab_size") or config["vocab_size"]
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    aux = len(ids) if ids else 3
    params = {
        "model.embed_tokens.weight": (V, D),  # the target's, shared, where the checkpoint has none
        "model.layers.0.self_attn.qkv_proj.weight": ((H + 2 * Hkv) * Dh, 2 * D),
        "model.layers.0.self_attn.o_proj.weight": (D, H * Dh),
        "model.layers.0.mlp.gate_up_proj.weight": (2 * I, D),
        "model.layers.0.mlp.down_proj.weight": (D, I),
        "model.layers.0.input_layernorm.weight": (D,),
        "model.layers.0.hidden_norm.weight": (D,),
        "model.layers.0.post_attention_layernorm.weight": (D,),
        "model.fc.weight": (D, aux * config.get("target_hidden_size", D)),
        "model.norm.weight": (D,),
        "lm_head.weight": (Vd, D),
    }
    if Vd != V:
        params["draft_id_to_target_id"] = (Vd,)
    assert (
        config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    )
    return params


def vllm_loads(tensors):
    """The checkpoint's tensors as Eagle3LlamaForCausalLM.load_weights routes them: {parameter:
    [(shard, shape)]} (t2d skipped; d2t renamed; all but lm_head under "model."; "midlayer." is
    "layers.0."; q/k/v and gate/up stacked)."""
    loads = {}
    for name, t in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name, shard = name.replace("midlayer.", "layers.0."), None
        for part, (stacked, which) in STACKED.items():
            if part in name:
                name, shard = name.replace(part, stacked), which
        loads.setdefault(name, []).append((shard, tuple(t.shape)))
    return loads


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_export_holds_every_vllm_parameter_and_drafts_as_the_layer_does(
    tiny_model_dir, tmp_path, dtype
):
    model, _ = checkpoint.load(tiny_model_dir)
    torch.manual_seed(0)
    module = eagle3.build(model, torch.arange(3, 300), depth=2)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    checkpoint.save_heads(module, str(tmp_path / "layer"), dtype=torch.float32)
    argv = ["--model", tiny_model_dir, "--heads", tmp_path / "layer", "--out", tmp_path / "out"]
    assert export.cli_main([str(a) for a in argv + ["--dtype", dtype]]) == 0
    config = json.load(open(tmp_path / "out" / "config.json"))
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    want, loads = vllm_parameters(config), vllm_loads(tensors)
    assert set(loads) == set(want) - {"model.embed_tokens.weight"}
    for name, parts in loads.items():
        rows = sum(shape[0] for _, shape in parts)
        assert (rows, *parts[0][1][1:]) == want[name], name
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]  # L = 1
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].sum() == 297
    assert tensors["fc.weight"].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    back = export.read_eagle3(str(tmp_path / "out"), model)
    if dtype == "bf16":
        module = eagle3.build(model, torch.arange(3, 300), depth=2)
        module.load_state_dict({k: v.float() for k, v in back.state_dict().items()})
    prompt = list(range(40, 52))
    for m in (module, back):
        m.eval()
    got = [record(model, m, prompt) for m in (module, back)]
    assert got[0] == got[1] and len(got[0]) > 3


def record(model, module, prompt):
    """The trees drafted over a greedy reply: [tokens of each step's draft]."""
    drafts = []

    class Recorded(eagle3.Eagle3Drafter):
        def draft(self, rows, roots):
            out = super().draft(rows, roots)
            drafts.append(out[0].tokens.tolist())
            return out

    decode.generate(model, prompt, 12, Recorded(module, TREE))
    return drafts


def test_the_default_models_layers_are_the_engines_default_and_left_to_them():
    assert eagle3.default_layers(30) == (2, 15, 27)
    layer = types.SimpleNamespace(cfg=eagle3.Eagle3Config(layers=[2, 15, 27], vocab_size=8))
    layer.draft_cfg = tiny_config()
    layer.state_dict = lambda: {"fc.weight": torch.zeros(1)}
    config, _ = export.vllm_eagle3(layer, 30)
    assert "eagle_config" not in config and config["draft_vocab_size"] == 8


# --- bad input: one line, exit code 2 -------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--heads", "eagle3"], "--heads eagle3 computes the base model's features as it trains"),
        (["--heads", "eagle3", "--data", "c.safetensors", "--loss", "next-token"], "--loss next"),
        (
            [
                "--heads",
                "eagle3",
                "--data",
                "c.safetensors",
                "--export-conversations",
                "x.safetensors",
            ],
            "--export-conversations writes the data set and stops",
        ),
    ],
)
def test_train_py_refuses_what_eagle3_cannot_train_on(
    argv, says, tiny_run, no_model, capsys, monkeypatch
):
    monkeypatch.chdir(tiny_run[0])
    assert train.cli_main(argv + ["--out", "o"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_generate_py_refuses_a_missing_or_mismatched_layer_in_one_line(
    tiny_model_dir, tmp_path, capsys
):
    import generate

    base, _ = checkpoint.load(tiny_model_dir)
    heads = tmp_path / "hydra"
    from heads import HeadsConfig, build as build_heads

    checkpoint.save_heads(build_heads(HeadsConfig("hydra", num_heads=2), base), str(heads))
    layer = tmp_path / "layer"
    checkpoint.save_heads(eagle3.build(base, torch.arange(300)), str(layer))
    cases = [
        (["--draft", "eagle3", "--heads", str(tmp_path / "none")], "not a heads folder"),
        (["--draft", "eagle3", "--heads", str(heads)], "does not describe an EAGLE-3 layer"),
        (["--heads", str(layer)], "holds an EAGLE-3 layer, which drafts with --draft eagle3"),
    ]
    for argv, says in cases:
        code = generate.cli_main(
            argv + ["--model", tiny_model_dir, "--prompt", "hi", "--dtype", "fp32"]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and says in err[-1], err
    out = generate.cli_main(
        [
            "--model",
            tiny_model_dir,
            "--draft",
            "eagle3",
            "--heads",
            str(layer),
            "--prompt",
            "hi",
            "--max-new-tokens",
            "8",
            "--dtype",
            "fp32",
        ]
    )
    text = capsys.readouterr()
    assert out == 0 and "eagle3, tree" in text.err
    generate.cli_main(
        [
            "--model",
            tiny_model_dir,
            "--heads",
            "none",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "8",
            "--dtype",
            "fp32",
        ]
    )
    assert capsys.readouterr().out == text.out


def test_a_layer_refuses_another_base_model(base):
    module = eagle3.build(base, None)
    other = tiny(seed=1)
    with pytest.raises(eagle3.HeadsError, match="trained for tiny, not tiny"):
        eagle3.build(other, None, cfg=module.cfg)
