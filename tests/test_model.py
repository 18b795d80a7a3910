"""model.py against transformers' LlamaForCausalLM, tree forward, and the KV cache's keep();
checkpoint.py's loading of a model (the default one's conversion, bad folders, the script)."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.loading import checkpoint
from specdec.fast import kernels
import model as model_lib
from specdec import rows
import tree as tree_lib
from conftest import TINY_LLAMA, tiny_config


def hf_twin(cfg, rope_scaling=None, tie=False, cls=model_lib.Transformer):
    """A random HF Llama and our Transformer holding the same weights."""
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.hidden_dim,
        rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie,
    )
    hf = LlamaForCausalLM(hf_cfg).eval()
    ours_cfg = checkpoint.config_from_hf(json.loads(hf_cfg.to_json_string()), name="twin")
    ours = cls(ours_cfg).eval()
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    ours.load_state_dict(state, strict=not tie)
    return hf, ours


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("cls", [model_lib.Transformer, rows.Model], ids=["lesson", "rows"])
def test_parity_tiny(rope_scaling, tie, cls):
    """model.py's forward, and the engines' (specdec/rows.py), match transformers."""
    hf, ours = hf_twin(
        tiny_config(rope_theta=500000.0 if rope_scaling else 10000.0), rope_scaling, tie, cls
    )
    tokens = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        ref = hf(tokens).logits
        logits, hidden = ours(tokens, torch.arange(40))
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert hidden.shape == (2, 40, 32)


def test_parity_default_model(default_model):
    """The readable path and the kernels chosen for this CPU in fp32 (prepacked linears where
    oneDNN is there) both match transformers."""
    model, tok = default_model
    hf = LlamaForCausalLM.from_pretrained(
        checkpoint.resolve(checkpoint.DEFAULT), dtype=torch.float32
    ).eval()
    tokens = torch.tensor(
        [tok.encode("The capital of France is Paris, and the capital of Germany is")]
    )
    chosen = kernels.in_use(model)
    assert chosen == kernels.Kernels.choose("cpu", torch.float32, 0)
    try:
        with torch.no_grad():
            ref = hf(tokens).logits
            for k in (kernels.Kernels(), chosen):
                kernels.use(model, k)
                logits, _ = model(tokens, torch.arange(tokens.shape[1]))
                torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)
    finally:
        kernels.use(model, chosen)


@pytest.fixture(params=["lesson", "rows"])
def either(request, tiny):
    """The tiny model as model.py's Transformer (one sequence) and as the engines' rows.Model."""
    if request.param == "rows":
        return tiny
    lesson = model_lib.Transformer(tiny.cfg).eval().requires_grad_(False)
    lesson.load_state_dict(tiny.state_dict())
    return lesson


def test_tree_forward_equals_sequential(either):
    """Logits at every tree node equal those of running its root-to-node path after the prefix."""
    tiny = either
    torch.manual_seed(1)
    tree = tree_lib.build([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)])
    prefix = torch.randint(0, 64, (1, 7))
    tokens = torch.randint(0, 64, (tree.num_nodes,))
    cache = tiny.new_cache(64)
    tiny(prefix, torch.arange(7), None, cache)
    cache.keep(range(7))
    logits, _ = tiny(tokens[None], 7 + tree.depth, tree.mask, cache)
    for node in range(tree.num_nodes):
        path = tree.mask[node].nonzero()[:, 0]  # ancestors root..node
        seq = torch.cat([prefix[0], tokens[path]])[None]
        ref, _ = tiny(seq, torch.arange(seq.shape[1]))
        torch.testing.assert_close(logits[0, node], ref[0, -1], atol=1e-5, rtol=1e-5)


def test_keep_accepted_path(either):
    """After keeping a tree path, the next forward equals one over a cache built from scratch."""
    tiny = either
    tree = tree_lib.build(tree_lib.cartesian([2, 2]))
    torch.manual_seed(2)
    prefix = torch.randint(0, 64, (1, 5))
    tokens = torch.randint(0, 64, (tree.num_nodes,))
    cache = tiny.new_cache(64)
    tiny(prefix, torch.arange(5), None, cache)
    cache.keep(range(5))
    tiny(tokens[None], 5 + tree.depth, tree.mask, cache)
    path = torch.tensor([0, 2, 5])  # root -> (1,) -> (1, 0)
    assert tree.parent[5] == 2 and tree.parent[2] == 0
    cache.keep(path.tolist())
    nxt = torch.tensor([[7, 9]])
    logits, _ = tiny(nxt, torch.arange(8, 10), None, cache)
    seq = torch.cat([prefix[0], tokens[path], nxt[0]])[None]
    fresh = tiny.new_cache(64)
    ref, _ = tiny(seq, torch.arange(seq.shape[1]), None, fresh)
    torch.testing.assert_close(logits[0], ref[0, -2:], atol=1e-5, rtol=1e-5)
    assert cache.length == 8


def test_first_layers_only(tiny):
    """layers=[0] is a one-layer model with the same weights (final norm and LM head included),
    with and without a cache of one layer."""
    torch.manual_seed(4)
    seq = torch.randint(0, 64, (1, 9))
    one = rows.Model(tiny_config(n_layers=1)).eval()
    one.load_state_dict(
        {k: v for k, v in tiny.state_dict().items() if not k.startswith("layers.1.")}
    )
    ref, ref_hidden = one(seq, torch.arange(9))
    logits, hidden = tiny(seq, torch.arange(9), layers=[0])
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)
    # the second layer matters
    assert not torch.allclose(logits, tiny(seq, torch.arange(9))[0], atol=1e-3)
    cache = tiny.new_cache(16, num_layers=1)
    assert cache.k.shape[0] == 1
    tiny(seq[:, :5], torch.arange(5), None, cache, layers=[0])
    cache.keep(range(5))
    logits, _ = tiny(seq[:, 5:], torch.arange(5, 9), None, cache, layers=[0])
    torch.testing.assert_close(logits, ref[:, 5:], atol=1e-5, rtol=1e-5)


def test_a_row_shorter_than_its_batch_mates_reads_only_its_own_prefix(tiny):
    """Right-padded rows of one cache: its per-row lengths hide a shorter row's gap, so the row's
    next logits are the ones it gets alone."""
    torch.manual_seed(3)
    long, short = torch.randint(0, 64, (9,)), torch.randint(0, 64, (4,))
    cache = tiny.new_cache(16, batch=2)
    padded = torch.stack([long[:8], torch.cat([short[:3], torch.zeros(5, dtype=torch.long)])])
    tiny(padded, torch.arange(8), None, cache)
    cache.keep(range(8), range(3))
    logits, _ = tiny(torch.stack([long[8:], short[3:]]), torch.tensor([[8], [3]]), None, cache)
    assert torch.isfinite(logits).all()
    for row, seq in enumerate((long, short)):
        ref, _ = tiny(seq[None], torch.arange(len(seq)))
        torch.testing.assert_close(logits[row, -1], ref[0, -1], atol=1e-5, rtol=1e-5)


def test_corrupted_cache_is_rebuilt(tmp_path, monkeypatch):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"hello")
    digest = checkpoint._sha256(folder / "a.bin")
    (folder / "manifest.json").write_text(json.dumps({"a.bin": [5, digest]}))
    assert checkpoint.cache_is_valid(str(folder))
    (folder / "a.bin").write_bytes(b"hellO")  # same size, other bytes
    assert not checkpoint.cache_is_valid(str(folder))
    (folder / "a.bin").write_bytes(b"hell")  # truncated
    assert not checkpoint.cache_is_valid(str(folder))
    (folder / "manifest.json").unlink()  # conversion died before the manifest
    assert not checkpoint.cache_is_valid(str(folder))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(checkpoint.LoadError, match="not supported.*llama"):
        checkpoint.load(str(tmp_path))


def test_missing_model():
    with pytest.raises(checkpoint.LoadError, match="no such folder"):
        checkpoint.load("/no/such/folder")


# --- reduced precision
# -----------------------------------------------------------------------------


def test_rope_frequencies_stay_fp32():
    """Casting the model to bf16 must not round the rotary frequencies: rounded (8 mantissa bits,
    up to 0.33% off) they turn a position of 4,000 into angles up to 5.6 rad wrong. The model's
    bf16 cos/sin at long positions stay within bf16's own rounding of the exact values."""
    # 32 frequencies, as SmolLM2
    cfg = tiny_config(rope_theta=10000.0, max_seq_len=8192, head_dim=64)
    m = rows.Model(cfg).to(dtype=torch.bfloat16)
    assert m.rope.inv_freq.dtype == torch.float32
    torch.testing.assert_close(m.rope.inv_freq, model_lib.rope_frequencies(cfg), atol=0, rtol=0)
    positions = torch.arange(2000, 4001, 250)
    exact = positions[:, None].double() * model_lib.rope_frequencies(cfg).double()  # (P, Dh/2)
    cos, sin = m.rope(positions, torch.bfloat16)  # (1, 1, P, Dh)
    half = cfg.head_dim // 2
    assert (cos[0, 0, :, :half].double() - exact.cos()).abs().max() < 0.01
    assert (sin[0, 0, :, :half].double() - exact.sin()).abs().max() < 0.01
    # what .to(bf16) did
    rounded = positions[:, None].double() * model_lib.rope_frequencies(cfg).bfloat16().double()
    assert (rounded.cos() - exact.cos()).abs().max() > 0.5  # the check can fail


def test_script_takes_model_and_refuses_bad_arguments(capsys, tiny_model_dir):
    """`python -m specdec.loading.checkpoint` runs main(): --help, --model, one line and exit code 2
    on bad input."""

    def one_line_error(words):
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and words in err, (
            err
        )

    with pytest.raises(SystemExit) as e:
        checkpoint.main(["--help"])
    assert e.value.code == 0 and "--model" in capsys.readouterr().out
    assert checkpoint.main(["--model", tiny_model_dir, "--prompt", "Hello"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("loaded tiny-random-llama in ") and err == ""
    assert checkpoint.main(["--model", "/no/such/model"]) == 2
    one_line_error("no such folder")
    assert checkpoint.main(["--bogus"]) == 2
    one_line_error("unrecognized arguments: --bogus")


def test_conversion_notice_goes_to_stderr(capsys, monkeypatch, tmp_path, tiny_model_dir):
    """The one-time conversion of the default model says so on stderr: stdout holds only what the
    scripts generate. (transformers' GGUF reading is replaced by the tiny model: the same calls.)"""
    import transformers

    real = transformers.AutoTokenizer.from_pretrained
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda src, gguf_file: real(tiny_model_dir)
    )
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda src, gguf_file, dtype: hf
    )
    checkpoint.convert_gguf(str(tmp_path / "model.gguf"), str(tmp_path / "converted"))
    out, err = capsys.readouterr()
    assert out == "" and "[model] converting model.gguf" in err
    assert checkpoint.cache_is_valid(str(tmp_path / "converted"))


def test_a_model_folder_without_tokenizer_files_is_named(tmp_path, tiny_model_dir):
    import shutil

    folder = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir, folder)
    for f in folder.iterdir():
        if f.name.startswith("tokenizer"):
            f.unlink()
    with pytest.raises(
        checkpoint.LoadError, match=r"no-tokenizer has no tokenizer \(tokenizer.json"
    ):
        checkpoint.load(str(folder))
