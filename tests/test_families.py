"""Every model family checkpoint.SUPPORTED names, against transformers' own implementation of it.

For each family a tiny random checkpoint is built with transformers' config class and saved with
save_pretrained at test time (the default model's tokenizer beside it), then loaded by
checkpoint.load: (a) its logits equal transformers' in fp32 for a prefill and for a tree step after
it, fast kernels and readable path alike; (b) `generate.py --model FOLDER` decodes greedily what
transformers' generate() does; (c) Qwen3 through `train.py --heads hydra++`: heads that draft, with
greedy speculative output identical to plain greedy. Also: what model.py does not compute is
refused in one line before weights load, and --help names every family.
Run: `python -m pytest -q tests/test_families.py`.
"""

import json

import pytest
import torch
import transformers

from specdec.benching import methods as catalogue
from specdec.loading import checkpoint
from specdec import drafters
from specdec.engines import decode
import generate as G
from specdec.fast import kernels
import tree as tree_lib
from test_cli import check_one_line_error, reply_ids, run_cli
from test_train_cli import TINY_RUN, conversations, run_train

SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)
FAMILIES = {  # model_type: (config class, what sets it apart, at sizes where it shows)
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 128}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),  # q is 4 x 16 = 64 wide, D 32
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "granite": (
        "GraniteConfig",
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.3,
            "logits_scaling": 2.5,
            "tie_word_embeddings": True,
        },
    ),
    "gemma": ("GemmaConfig", {"head_dim": 16}),  # tied, (1 + w) norms, GeGLU
}


def test_every_supported_family_is_tested():
    assert set(FAMILIES) == set(checkpoint.SUPPORTED)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """family -> the folder of a tiny random checkpoint of it (made once), and transformers'
    model."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint.resolve(checkpoint.DEFAULT))
    made = {}

    def make(family):
        if family not in made:
            name, extra = FAMILIES[family]
            torch.manual_seed(0)
            config = getattr(transformers, name)(vocab_size=len(tokenizer), **SMALL | extra)
            hf = transformers.AutoModelForCausalLM.from_config(config).eval()
            # norms at 1 (Gemma's at 0) and biases at 0 would hide a wrong fold
            with torch.no_grad():
                for p in hf.parameters():
                    p.add_(0.1 * torch.randn_like(p))
            folder = tmp_path_factory.mktemp(family)
            hf.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            # as Gemma's own config.json files have it: tied by the family's default
            if family == "gemma":
                config = json.loads((folder / "config.json").read_text())
                (folder / "config.json").write_text(
                    json.dumps({k: v for k, v in config.items() if k != "tie_word_embeddings"})
                )
            made[family] = str(folder), hf
        return made[family]

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_for_a_prefill_and_a_tree(family_dir, family):
    folder, hf = family_dir(family)
    model, _ = checkpoint.load(folder)
    tree = tree_lib.build([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    g = torch.Generator().manual_seed(1)
    prefix, nodes = (
        torch.randint(0, 49152, (1, 9), generator=g),
        torch.randint(0, 49152, (tree.num_nodes,), generator=g),
    )
    paths = [
        torch.cat([prefix[0], nodes[tree.mask[n].nonzero()[:, 0]]]) for n in range(tree.num_nodes)
    ]  # root..node
    with torch.no_grad():
        want_prefix = hf(prefix).logits[0]  # (9, V)
        want_tree = torch.stack([hf(path[None]).logits[0, -1] for path in paths])  # (N, V)
        for k in (kernels.in_use(model), kernels.Kernels()):  # fast, then readable
            kernels.use(model, k)
            cache = model.new_cache(32)
            got_prefix, _ = model(prefix, torch.arange(9), None, cache)
            cache.keep(range(9))
            got_tree, _ = model(nodes[None], 9 + tree.depth, tree.mask, cache)
            assert (got_prefix[0] - want_prefix).abs().max() <= 1e-4, (family, k)
            assert (got_tree[0] - want_tree).abs().max() <= 1e-4, (family, k)
    assert want_tree.std() > 0.5  # logits far from uniform: a wrong fold would show


def test_gemma_embeddings_in_bf16_are_transformers_to_the_bit(family_dir):
    """transformers rounds Gemma's sqrt(D) to the model's dtype before multiplying (in bf16,
    sqrt(32)
    = 5.65685 becomes 5.65625): the folded embedding rows are its products, bit for bit."""
    import copy

    folder, hf = family_dir("gemma")
    model, _ = checkpoint.load(folder, dtype=torch.bfloat16)
    ids = torch.arange(0, 49152, 97)
    with torch.no_grad():
        want = copy.deepcopy(hf.model.embed_tokens).to(torch.bfloat16)(ids)
    assert torch.equal(model.embed_tokens(ids), want)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_py_decodes_as_transformers_generate(family_dir, family, capsys, tmp_path):
    folder, hf = family_dir(family)
    ids, _ = reply_ids(
        capsys, tmp_path, "--model", folder, "--heads", "none", "--device", "cpu", "--dtype", "fp32"
    )
    model, tokenizer = checkpoint.load(folder)
    prompt, eos = (
        checkpoint.encode(tokenizer, "Name two rivers."),
        checkpoint.eos_ids(model, tokenizer),
    )
    want = catalogue.theirs(hf, catalogue.ForwardCounter(hf), eos)(prompt, 12, 0).tokens
    assert ids == want and len(ids) == 12


def test_qwen3_heads_trained_by_train_py_draft_and_keep_greedy_output(family_dir, capsys, tmp_path):
    folder, _ = family_dir("qwen3")
    chats, out = conversations(tmp_path / "small.jsonl", n=12), tmp_path / "heads"
    code, _, err = run_train(
        capsys,
        "--model",
        folder,
        "--data",
        chats,
        "--heads",
        "hydra++",
        "--work",
        tmp_path,
        "--out",
        out,
        "--device",
        "cpu",
        *TINY_RUN,
    )
    assert code == 0, err
    model, tokenizer = checkpoint.load(folder)
    heads = checkpoint.load_heads(out, model)
    assert heads.cfg.kind == "hydra++" and type(heads.prefix.block.self_attn.q_norm).__name__ in (
        "RMSNorm",
        "FastRMSNorm",
    )
    prompt = checkpoint.encode(tokenizer, "the cat sat on a mat")
    plain = decode.generate(model, prompt, 24)
    spec = decode.generate(
        model, prompt, 24, drafters.HeadsDrafter(heads, tree_lib.build(tree_lib.cartesian([3, 2])))
    )
    assert spec.tokens == plain.tokens and sum(spec.accepted) > 0


# --- what model.py does not compute: one line, before any weight is read --------------------------

REFUSED = [
    (
        "phi3",
        {
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0] * 4,
                "long_factor": [1.0] * 4,
            }
        },
        "rope scaling 'longrope' is not supported",
    ),
    ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75 is not supported"),
    (
        "qwen3",
        {"attention_bias": True},
        "field 'attention_bias' is true, which model.py does not compute",
    ),
    ("llama", {"hidden_act": "relu"}, "activation (hidden_act) 'relu' is not supported"),
    ("granite", {"logits_scaling": 0}, "field 'logits_scaling' must be a positive number"),
    (
        "gpt2",
        {},
        "architecture 'gpt2' is not supported; supported Llama-family types: "
        + ", ".join(checkpoint.SUPPORTED),
    ),
]


@pytest.mark.parametrize("family, fields, words", REFUSED, ids=[w[:30] for _, _, w in REFUSED])
def test_what_model_py_does_not_compute_is_refused_before_weights_load(
    capsys, tmp_path, family, fields, words
):
    """config.json alone: a refusal that needed the weights would name them missing instead."""
    (tmp_path / "config.json").write_text(
        json.dumps(dict(model_type=family, vocab_size=64, **SMALL) | fields)
    )
    check_one_line_error(
        *run_cli(capsys, "--prompt", "hi", "--heads", "none", "--model", tmp_path)[::2], words
    )


def test_a_sliding_window_caps_the_context_where_it_is_on():
    """Within its window a sliding-window model is the plain one: the context stops there."""
    base = dict(vocab_size=64, **SMALL)
    assert (
        checkpoint.config_from_hf(
            base | {"model_type": "mistral", "sliding_window": 100}, "m"
        ).max_seq_len
        == 100
    )
    assert (
        checkpoint.config_from_hf(
            base | {"model_type": "qwen2", "sliding_window": 100, "use_sliding_window": False}, "q"
        ).max_seq_len
        == 256
    )


def test_help_names_every_family(capsys):
    with pytest.raises(SystemExit):
        G.cli_main(["--help"])
    assert ", ".join(checkpoint.SUPPORTED) in " ".join(capsys.readouterr().out.split())
