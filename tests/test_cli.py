"""generate.py's command line on bad input: every case ends with ONE line on stderr that starts
with "error:" and names the problem and the fix, exit code 2, and no traceback.

Most cases call generate.cli(argv) in-process: the checks that need no model run with model.load
replaced by a tripwire (they must fail before the model loads), the rest with model.load answering
from the session's default model (a real load per case would take minutes). A few cases run
`python generate.py` in a subprocess, to check the real entry point: exit code, stderr, stdout.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import generate as G
import heads as heads_lib
import model as model_lib
import tree as tree_lib
from conftest import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVIL = "__import__('os').system('echo hi')"


def check_one_line_error(code, err, *words):
    lines = err.strip().splitlines()
    assert code == 2, f"exit code {code}, stderr: {err}"
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), f"want one line 'error: ...', got {err!r}"
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
    return lines[0]


def run_cli(capsys, *argv):
    code = G.cli([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_script(*argv, timeout=180):
    """`python generate.py argv` in a subprocess: (exit code, stdout, stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    p = subprocess.run([sys.executable, "generate.py", *map(str, argv)], cwd=ROOT, env=env, capture_output=True,
                       text=True, encoding="utf-8", timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def no_model(monkeypatch):
    def tripwire(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(model_lib, "load", tripwire)


@pytest.fixture
def loaded(monkeypatch, default_model):
    """model.load("default") answers with the session's model; other names load for real."""
    real = model_lib.load
    monkeypatch.setattr(model_lib, "load", lambda name, device="cpu", dtype=None:
                        default_model if name == model_lib.DEFAULT else real(name, device, dtype))
    return default_model


@pytest.fixture(scope="module")
def heads_dir(default_model, tmp_path_factory):
    """Untrained Hydra heads (3) for the default model, saved by heads.save."""
    folder = tmp_path_factory.mktemp("heads")
    heads_lib.save(heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=3), default_model[0]), folder)
    return folder


def copy_heads(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in (heads_lib.WEIGHTS, heads_lib.CONFIG):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    return dst


# --- checks that need no model: they fail before it loads ----------------------------------------

FLAGS = [
    ([], "--prompt"),
    (["--prompt", "hi", "--prompts", "x.jsonl"], "not both"),
    (["--prompt", "   \n "], "empty"),
    (["--prompt", ""], "empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "at least 1"),
    (["--prompt", "hi", "--max-new-tokens", "-5"], "at least 1"),
    (["--prompt", "hi", "--max-new-tokens", "ten"], "invalid int"),
    (["--prompt", "hi", "--bogus-flag"], "unrecognized"),
    (["--prompt", "hi", "--temperature", "-0.1"], ">= 0"),
    (["--prompt", "hi", "--temperature", "nan"], ">= 0"),
    (["--prompt", "hi", "--top-p", "0"], "(0, 1]"),
    (["--prompt", "hi", "--top-p", "1.5"], "(0, 1]"),
    (["--prompt", "hi", "--verify", "greedy", "--temperature", "0.7"], "--verify sample"),
    (["--prompt", "hi", "--verify", "beam"], "invalid choice"),
    (["--prompt", "hi", "--seed", "-1"], "--seed"),
    (["--prompt", "hi", "--dtype", "fp8"], "unknown dtype; use auto, fp32, bf16, fp16"),
    (["--prompt", "hi", "--device", "tpu"], "unknown device"),
    (["--prompt", "hi", "--device", "cuda:x"], "unknown device"),
    (["--prompt", "hi", "--heads", "eagle"], "not a heads folder nor one of none, auto, medusa"),
    (["--prompt", "hi", "--heads", "none", "--tree", "chain:2"], "--tree needs draft heads"),
    (["--prompt", "hi", "--tree", EVIL], "is not a tree: expected 'chain:N'"),
    (["--prompt", "hi", "--tree", "cartesian:40,40"], "MAX_NODES"),
    (["--prompt", "hi", "--tree", "chain:5000"], "chain depth"),
    (["--prompt", "hi", "--out", "/no/such/folder/replies.jsonl"], "not a file in an existing folder"),
    (["--prompt", "hi", "--out", "."], "not a file in an existing folder"),
]


@pytest.mark.parametrize("argv, words", FLAGS, ids=[" ".join(a)[:40] for a, _ in FLAGS])
def test_bad_flags(no_model, capsys, argv, words):
    check_one_line_error(*run_cli(capsys, *argv)[::2], words)


def test_cuda_missing(no_model, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--device", "cuda")[::2], "CUDA is not available", "--device cpu")


def test_shipped_heads_missing(no_model, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(G, "SHIPPED", str(tmp_path))  # as in a checkout without weights/
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--heads", "medusa")[::2], "train.py --heads medusa")


@pytest.mark.parametrize("paths, words", [
    ([[0, 1]], "no parent: (0,) is missing (must be prefix-closed)"),
    ([[0], [-1]], "negative rank"),
    ([[r] for r in range(tree_lib.MAX_NODES)], "over MAX_NODES=1024"),
    ([[0], [2 ** 70]], "ranks index a head's top-k"),
    ([["__import__('os')"]], "not a tuple of ints"),
    ({"nodes": [[0]]}, 'expected a JSON object {"paths"'),
])
def test_bad_tree_files(no_model, capsys, tmp_path, paths, words):
    file = tmp_path / "tree.json"
    file.write_text(json.dumps(paths if isinstance(paths, dict) else {"paths": paths}))
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--tree", file)[::2], str(file), words)


@pytest.mark.parametrize("content, words", [
    ('{"prompt": "fine"}\nnot json\n', "line 2: not valid JSON"),
    ('{"prompt": "fine"}\n\n{"text": "no prompt field"}\n', 'line 3: needs a string field "prompt"'),
    ('{"prompt": 42}\n', 'line 1: needs a string field "prompt"'),
    ('["prompt"]\n', 'line 1: needs a string field "prompt"'),
    ('{"prompt": "  "}\n', "line 1: the prompt is empty"),
    ("", "no prompts in the file"),
    ("\n  \n", "no prompts in the file"),
    (b'{"prompt": "caf\xe9"}\n', "not valid UTF-8"),
    ("[" * 100000, "line 1: not valid JSON"),
])
def test_bad_prompts_file(no_model, capsys, tmp_path, content, words):
    file = tmp_path / "prompts.jsonl"
    file.write_bytes(content if isinstance(content, bytes) else content.encode())
    check_one_line_error(*run_cli(capsys, "--prompts", file)[::2], str(file), words)


def test_prompts_file_missing_or_a_folder(no_model, capsys, tmp_path):
    check_one_line_error(*run_cli(capsys, "--prompts", tmp_path / "nope.jsonl")[::2], "cannot read it")
    check_one_line_error(*run_cli(capsys, "--prompts", tmp_path)[::2], "cannot read it")


# --- the model ----------------------------------------------------------------------------------

def test_model_not_found(capsys, tmp_path):
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--model", tmp_path / "no" / "such" / "model")[::2],
                         "not a folder nor a hub id")
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--model", tmp_path)[::2], "no readable config.json")


def test_model_of_another_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--model", tmp_path)[::2],
                         "architecture 'gpt2' is not supported", "llama, mistral")


# --- prompts against the context ----------------------------------------------------------------

def test_prompt_longer_than_context(loaded, capsys):
    context = loaded[0].cfg.max_seq_len
    line = check_one_line_error(*run_cli(capsys, "--prompt", "hello world " * 4600)[::2],
                                f"the model's context holds {context}", "shorten it")
    assert int(line.split("the prompt has ")[1].split()[0]) > context


def test_max_new_tokens_beyond_context(loaded, capsys):
    """Asking for more tokens than the context leaves is an error up front (not a silent clamp)."""
    model, tok = loaded
    n = len(G.encode(tok, "hello " * 3000))
    room = model.cfg.max_seq_len - n
    check_one_line_error(*run_cli(capsys, "--prompt", "hello " * 3000, "--max-new-tokens", room + 1)[::2],
                         f"leaves room for {room}", f"ask for at most {room}")


def test_prompts_file_names_the_prompt_that_is_too_long(loaded, capsys, tmp_path):
    file = tmp_path / "p.jsonl"
    file.write_text(json.dumps({"prompt": "short", "id": "a"}) + "\n" + json.dumps({"prompt": "hi " * 9000, "id": "b"}) + "\n")
    check_one_line_error(*run_cli(capsys, "--prompts", file)[::2], "prompt b has")


def test_unusual_prompts_work(loaded, capsys):
    mixed = "Translate: 😀🎉 naïve café, 世界, مرحبا, Привет, שלום, नमस्ते 👩‍👩‍👧‍👦 \u200b\ufeff"
    code, out, err = run_cli(capsys, "--prompt", mixed, "--max-new-tokens", 3)
    assert code == 0, err
    long = "=" * 6000 + " " + mixed  # 6000+ characters, ~250 tokens
    code, out, err = run_cli(capsys, "--prompt", long, "--max-new-tokens", 2, "--raw")
    assert code == 0, err
    assert "[2 new tokens" in err


# --- heads and trees ----------------------------------------------------------------------------

def test_heads_folder_missing_files(loaded, capsys, tmp_path, heads_dir):
    folder = copy_heads(heads_dir, tmp_path / "h")
    os.remove(folder / heads_lib.WEIGHTS)
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--heads", folder)[::2], "has no heads.safetensors")
    copy_heads(heads_dir, folder)
    os.remove(folder / heads_lib.CONFIG)
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--heads", folder)[::2], "has no heads.json")


def test_heads_weights_damaged(loaded, capsys, tmp_path, heads_dir):
    folder = copy_heads(heads_dir, tmp_path / "h")
    data = (folder / heads_lib.WEIGHTS).read_bytes()
    for damaged in (data[: len(data) // 2], data[:5], b"\x00" * 64, b"hello" + data[5:]):
        (folder / heads_lib.WEIGHTS).write_bytes(damaged)
        check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--heads", folder)[::2], "unreadable or corrupted")


@pytest.mark.parametrize("change, words", [
    ({"dropout": 0.1}, "unknown field(s) ['dropout']"),
    ({"num_heads": "3"}, "field 'num_heads' must be int"),
    ({"own_lm_head": 1}, "field 'own_lm_head' must be bool"),
    ({"kind": "eagle"}, "unknown head kind 'eagle'"),
    ({"num_heads": 4}, "does not hold the weights"),
    ({"num_heads": 0}, "num_heads, num_layers >= 1"),
])
def test_heads_config_damaged(loaded, capsys, tmp_path, heads_dir, change, words):
    folder = copy_heads(heads_dir, tmp_path / "h")
    good = json.loads((folder / heads_lib.CONFIG).read_text())
    (folder / heads_lib.CONFIG).write_text(json.dumps(good | change))
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--heads", folder)[::2], f"--heads {folder}", words)


def test_heads_for_another_model(loaded, capsys, tmp_path):
    torch.manual_seed(0)
    tiny = model_lib.Transformer(tiny_config(name="tiny-llama")).eval()
    heads_lib.save(heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=2), tiny), tmp_path)
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--heads", tmp_path)[::2],
                         "heads were trained for tiny-llama, not SmolLM2", "train heads for this one")


def test_tree_that_does_not_fit_the_heads(loaded, capsys, tmp_path, heads_dir):
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--heads", heads_dir, "--tree", "chain:5")[::2],
                         "depth 5 needs 5 heads, the heads have 3")
    file = tmp_path / "wide.json"
    file.write_text(json.dumps({"paths": [[0], [60000]]}))
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--heads", heads_dir, "--tree", file)[::2],
                         "top-60001", f"the heads predict {loaded[0].cfg.vocab_size}")
    folder = copy_heads(heads_dir, tmp_path / "h")  # --tree auto reads the tree.json saved with the heads
    (folder / "tree.json").write_text('{"paths": [[0], [0, 0, 1]]}')
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--heads", folder)[::2], "tree.json", "no parent")


def test_heads_and_tree_that_fit_work(loaded, capsys, heads_dir):
    code, out, err = run_cli(capsys, "--prompt", "hi", "--heads", heads_dir, "--tree", "cartesian:2,2,1",
                             "--max-new-tokens", 4)
    assert code == 0, err
    assert "heads: hydra, tree: 11 nodes" in err


def test_sample_and_typical_at_temperature_0_are_greedy(loaded, capsys, tmp_path, heads_dir):
    """At --temperature 0 every verifier reduces to greedy: the same ids as plain greedy decoding."""
    ids = {}
    for name, extra in [("plain", ["--heads", "none"]), ("greedy", ["--heads", heads_dir, "--verify", "greedy"]),
                        ("sample", ["--heads", heads_dir, "--verify", "sample", "--temperature", "0"]),
                        ("typical", ["--heads", heads_dir, "--verify", "typical", "--temperature", "0"])]:
        out = tmp_path / f"{name}.jsonl"
        code, _, err = run_cli(capsys, "--prompt", "Name two rivers.", "--max-new-tokens", 12, "--quiet", "--out", out, *extra)
        assert code == 0, err
        ids[name] = json.loads(out.read_text())["token_ids"]
    assert len(ids["plain"]) == 12 or ids["plain"][-1] in loaded[0].cfg.eos_ids + (loaded[1].eos_token_id,)
    assert ids["greedy"] == ids["sample"] == ids["typical"] == ids["plain"]


# --- drafters: --draft, --draft-model, --gamma, --ngram, --matches --------------------------------

DRAFT_FLAGS = [
    (["--draft", "eagle"], "unknown drafter; use heads, lookup, heads+lookup, layers:N"),
    (["--draft", "layers:x"], "unknown drafter"),
    (["--draft", "layers:0"], "at least 1"),
    (["--draft", "layers:-3"], "at least 1"),
    (["--draft", "lookup", "--gamma", "0"], "--gamma 0: must be at least 1"),
    (["--draft", "layers:4", "--gamma", "-2"], "--gamma -2: must be at least 1"),
    (["--draft", "lookup", "--ngram", "0"], "--ngram 0: must be at least 1"),
    (["--draft", "lookup", "--matches", "0"], "--matches 0: must be at least 1"),
    (["--draft", "lookup", "--gamma", "600", "--matches", "2"], "MAX_NODES"),
    (["--draft", "model", "--draft-model", "x", "--gamma", "5000"], "MAX_NODES"),
    (["--gamma", "3"], "--gamma does not apply to --draft heads"),
    (["--draft", "layers:4", "--ngram", "2"], "--ngram does not apply to --draft layers:4"),
    (["--draft", "lookup", "--tree", "chain:2"], "--tree shapes the heads' tree"),
    (["--draft", "layers:4", "--heads", "medusa"], "drafts without heads"),
    (["--draft", "heads+lookup", "--heads", "none"], "needs heads"),
    (["--draft", "model"], "--draft model needs --draft-model"),
    (["--draft-model", "some/model"], "add --draft model or drop --draft-model"),
    (["--draft", "lookup", "--draft-model", "some/model"], "add --draft model"),
]


@pytest.mark.parametrize("argv, words", DRAFT_FLAGS, ids=[" ".join(a)[:40] for a, _ in DRAFT_FLAGS])
def test_bad_draft_flags(no_model, capsys, argv, words):
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", *argv)[::2], words)


def test_layers_beyond_the_model(loaded, capsys):
    n = loaded[0].cfg.n_layers
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--draft", f"layers:{n}")[::2],
                         f"the model has {n} layers, so N must be 1 to {n - 1}")


def test_heads_and_lookup_without_heads_for_this_model(loaded, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(G, "SHIPPED", str(tmp_path))  # --heads auto finds none
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--draft", "heads+lookup")[::2],
                         "no heads are shipped", "use --draft lookup")


def tiny_llama_folder(capsys, folder, tokenizer):
    """A 1-layer random Llama saved the transformers way, with `tokenizer` beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, max_position_embeddings=8192)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    capsys.readouterr()  # transformers' progress bars are not the command's output
    return folder


def test_draft_model_with_another_vocabulary(loaded, capsys, tmp_path):
    from transformers import AutoTokenizer
    other = AutoTokenizer.from_pretrained(model_lib.resolve(model_lib.DEFAULT))
    other.add_tokens(["<a-token-the-model-lacks>"])
    folder = tiny_llama_folder(capsys, tmp_path / "other", other)
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--draft", "model", "--draft-model", folder)[::2],
                         f"--draft-model {folder}: its vocabulary differs", "use a draft model with the same tokenizer")


def test_draft_model_not_llama_or_missing(loaded, capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--draft", "model", "--draft-model", tmp_path)[::2],
                         f"--draft-model {tmp_path}: architecture 'gpt2' is not supported")
    check_one_line_error(*run_cli(capsys, "--prompt", "hi", "--draft", "model", "--draft-model", tmp_path / "nope")[::2],
                         "--draft-model", "not a folder nor a hub id")


def reply_ids(capsys, tmp_path, *argv):
    out = tmp_path / "reply.jsonl"
    code, _, err = run_cli(capsys, "--prompt", "Name two rivers.", "--max-new-tokens", 12, "--quiet", "--out", out, *argv)
    assert code == 0, err
    return json.loads(out.read_text())["token_ids"], err


def test_every_drafter_through_the_cli_gives_plain_greedy_output(loaded, capsys, tmp_path, heads_dir):
    folder = tiny_llama_folder(capsys, tmp_path / "same", loaded[1])  # random weights, the model's tokenizer
    plain, _ = reply_ids(capsys, tmp_path, "--heads", "none")
    for argv, words in [(["--draft", "lookup", "--gamma", "4", "--matches", "2"], "lookup: n-grams 3..1, up to 4 tokens, 2 matches"),
                        (["--draft", "heads+lookup", "--heads", heads_dir, "--tree", "chain:2"], "heads: hydra, tree: 3 nodes + lookup"),
                        (["--draft", "layers:20"], "layers:20, 4 tokens a step"),
                        (["--draft", "model", "--draft-model", folder, "--gamma", "2"], "draft model, 2 tokens a step")]:
        ids, err = reply_ids(capsys, tmp_path, *argv)
        assert ids == plain, argv
        assert words in err.splitlines()[0]


def test_sampling_with_layers_runs(loaded, capsys, tmp_path):
    ids, err = reply_ids(capsys, tmp_path, "--draft", "layers:20", "--temperature", "0.8", "--seed", "1")
    assert "sampled" in err.splitlines()[0] and len(ids) > 0


def test_show_marks_the_lookup_tokens(loaded, capsys):
    code, out, err = run_cli(capsys, "--prompt", "Repeat exactly: the cat sat on the mat, the dog sat on the log.",
                             "--draft", "lookup", "--show", "--max-new-tokens", 20)
    assert code == 0, err
    assert f"{G.COLOURS[1]}lookup{G.COLOURS[0]} = proposed by it" in err
    assert G.COLOURS[1] in out  # some of the reply was copied by lookup


# --- the real entry point, in a subprocess -------------------------------------------------------

def test_script_rejects_a_tree_without_evaluating_it():
    t0 = time.time()
    code, out, err = run_script("--prompt", "hi", "--tree", EVIL)
    check_one_line_error(code, err, "is not a tree")
    assert "hi" not in out
    assert time.time() - t0 < 60  # it failed before loading the model
    check_one_line_error(*run_script("--prompt", "hi", "--max-new-tokens", "lots")[::2], "invalid int value: 'lots'")


def test_script_model_not_on_the_hub():
    t0 = time.time()
    code, out, err = run_script("--prompt", "hi", "--model", "nobody/nothing-123")
    check_one_line_error(code, err, "'nobody/nothing-123' could not be found or downloaded")
    assert time.time() - t0 < 90


def test_script_prompt_too_long_after_loading_the_model():
    """The model and tokenizer load before this check: nothing else may reach stderr."""
    code, out, err = run_script("--raw", "--prompt", "hello world " * 4600, "--heads", "none")
    check_one_line_error(code, err, "tokens, the model's context holds 8192")
    assert out == ""
