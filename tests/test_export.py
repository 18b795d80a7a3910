"""export.py: Medusa heads written in vLLM's Medusa layout, read back the way vLLM reads them, give
our heads' logits; Hydra heads, joint heads and a non-empty --out are refused in one line.

The reader below follows vLLM's code (plain torch; vLLM is not imported),
github.com/vllm-project/vllm:
- vllm/transformers_utils/configs/medusa.py @ 4bb77b3239adff81001f12cd9c9a39b65800a373
(MedusaConfig):
  truncated_vocab_size None -> vocab_size; a key holding "num" and "heads" / "layers" becomes
  num_heads / num_hidden_layers.
- vllm/model_executor/models/medusa.py @ 09cddad8f0324594022359cd2b07e962a14b895f: ResidualBlock
  (per layer nn.Linear(D, D, bias=medusa_fc_bias), x = x + SiLU(layer(x))); Medusa.__init__ (one
  lm_head of truncated_vocab_size rows shared by every head if original_lm_head, else lm_heads.{k});
  compute_logits (logit_scale, then with a token_map the V' logits put at token_map in a (..., V)
  tensor of -inf); load_weights (a "medusa_heads." prefix dropped; token_map kept only if
  truncated_vocab_size < vocab_size; "lm_heads.0.weight" taken as lm_head with original_lm_head; an
  LM head with more rows than token_map cut to token_map's rows; names without a parameter ignored).
- vllm/model_executor/model_loader/default_loader.py @ 00b5ad0712629374e6352e2b31de0460be0fdf17
  (track_weights_loading): a parameter the checkpoint did not fill is an error.
vLLM feeds the heads the target model's final hidden state after its last norm, as model.forward.
Run: `python -m pytest -q tests/test_export.py`. Shapes: B batch, T time, K heads, V vocab.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdec.loading import checkpoint
from specdec import export
from heads import HeadsConfig, build
from test_cli import check_one_line_error

K, L = 3, 2  # heads, residual blocks a head


# --- vLLM's reader, in plain torch --------------------------------------------------------------


def vllm_load(folder):
    """(config, {parameter: tensor}, token_map or None, each head's LM head name) as vLLM loads
    them."""
    with open(folder / "config.json") as f:
        config = json.load(f)
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    for key in list(config):  # MedusaConfig.from_pretrained
        if "num" in key and ("heads" in key or "layers" in key):
            config["num_heads" if "heads" in key else "num_hidden_layers"] = config.pop(key)
    D, V = config["hidden_size"], config["vocab_size"]
    Vt = config.get("truncated_vocab_size") or V
    shapes = {}  # Medusa.__init__: its parameters
    for k in range(config["num_heads"]):
        for l in range(config["num_hidden_layers"]):
            shapes[f"blocks.{k}.layers.{l}.weight"] = (D, D)
            if config.get("medusa_fc_bias", False):
                shapes[f"blocks.{k}.layers.{l}.bias"] = (D,)
    shared = config.get("original_lm_head", False)
    lm_names = [
        "lm_head.weight" if shared else f"lm_heads.{k}.weight" for k in range(config["num_heads"])
    ]
    shapes |= {name: (Vt, D) for name in lm_names}
    token_map, weights = None, {}  # Medusa.load_weights
    for name, w in load_file(folder / "model.safetensors").items():
        name = name.replace("medusa_heads.", "")
        if name == "token_map":
            token_map = w if Vt < V else None
        elif name in shapes:
            weights[name] = w
        elif shared and name == "lm_heads.0.weight":
            weights["lm_head.weight"] = w
    for name, w in weights.items():
        if "lm_head" in name and token_map is not None and w.shape[0] > token_map.shape[0]:
            weights[name] = w = w[token_map]
        assert tuple(w.shape) == shapes[name], (
            f"{name}: {tuple(w.shape)}, vLLM's parameter is {shapes[name]}"
        )
    assert Vt == V or token_map is not None
    assert set(weights) == set(shapes), (
        f"not initialized from checkpoint: {set(shapes) - set(weights)}"
    )
    return config, {n: w.float() for n, w in weights.items()}, token_map, lm_names


def vllm_logits(loaded, h):
    """Medusa.forward + compute_logits on the base model's final hidden states h (..., D): (K, ...,
    V)."""
    config, w, token_map, lm_names = loaded
    out = []
    for k, lm_name in enumerate(lm_names):
        x = h
        for l in range(config["num_hidden_layers"]):
            x = x + F.silu(
                F.linear(
                    x, w[f"blocks.{k}.layers.{l}.weight"], w.get(f"blocks.{k}.layers.{l}.bias")
                )
            )
        logits = F.linear(x, w[lm_name]) * config.get("logit_scale", 1.0)  # (..., V')
        if token_map is not None:
            full = torch.full((*logits.shape[:-1], config["vocab_size"]), -torch.inf)  # (..., V)
            full[..., token_map] = logits
            logits = full
        out.append(logits)
    return torch.stack(out)  # (K, ..., V)


# --- export, read back, compare -----------------------------------------------------------------


def medusa_folder(model, folder, own=False, kept=None):
    torch.manual_seed(1)
    heads = build(HeadsConfig("medusa", num_heads=K, num_layers=L, own_lm_head=own), model, kept)
    with torch.no_grad():
        for p in heads.parameters():  # off the zero initialisation
            p.add_(0.1 * torch.randn_like(p))
    checkpoint.save_heads(heads, folder, dtype=torch.float32)
    return folder


@pytest.mark.parametrize(
    "own, kept", [(False, "some"), (True, "some"), (False, None), (False, "all")]
)
def test_vllm_reads_our_heads_logits(capsys, tmp_path, tiny_model_dir, own, kept):
    model, _ = checkpoint.load(tiny_model_dir, "cpu", torch.float32)
    V = model.cfg.vocab_size
    ids = {
        None: None,
        "some": torch.randperm(V, generator=torch.Generator().manual_seed(2))[:300],
        "all": torch.randperm(V, generator=torch.Generator().manual_seed(2)),
    }[kept]
    folder = medusa_folder(model, tmp_path / "heads", own, ids)
    code = export.cli_main(
        [
            "--model",
            tiny_model_dir,
            "--heads",
            str(folder),
            "--out",
            str(tmp_path / "vllm"),
            "--dtype",
            "fp32",
        ]
    )
    assert code == 0, capsys.readouterr().err
    # safetensors writes for the owner alone; the export takes the umask's mode, as config.json
    modes = {os.stat(tmp_path / "vllm" / n).st_mode for n in ("model.safetensors", "config.json")}
    assert len(modes) == 1
    heads = checkpoint.load_heads(folder, model)
    torch.manual_seed(3)
    tokens = torch.randint(0, V, (2, 5))  # (B, T)
    _, hidden = model(tokens, torch.arange(5))  # (B, T, D)
    z = heads(hidden, tokens).movedim(2, 0)  # (K, B, T, D)
    ours = heads.project(z.movedim(0, 2)).movedim(2, 0)  # (K, B, T, V')
    loaded = vllm_load(tmp_path / "vllm")
    assert loaded[2] is None and loaded[0]["truncated_vocab_size"] == V  # the full vocabulary
    theirs = vllm_logits(loaded, hidden)  # (K, B, T, V)
    kept_ids = torch.arange(V) if heads.kept_ids is None else heads.kept_ids
    expected = F.linear(z, model.lm_head.weight)  # (K, B, T, V): the base's rows but the kept
    expected[..., kept_ids] = ours
    assert torch.allclose(theirs, expected, rtol=1e-5, atol=1e-5), (theirs - expected).abs().max()
    if ids is None or len(ids) == V:  # every token kept: the same drafts as ours
        assert torch.equal(theirs.argmax(-1), heads.full_ids(ours.argmax(-1)))


def test_base_out_is_the_model_folder_with_its_architecture_named(capsys, tmp_path, tiny_model_dir):
    """--base-out: the base model's files as they are, config.json with `architectures` added
    (the tiny model's, like the GGUF conversion's, names none; vLLM refuses a config without)."""
    folder = medusa_folder(checkpoint.load(tiny_model_dir)[0], tmp_path / "heads")
    argv = ["--model", tiny_model_dir, "--heads", str(folder), "--out", str(tmp_path / "vllm")]
    assert export.cli_main([*argv, "--base-out", str(tmp_path / "base")]) == 0
    assert "wrote" in capsys.readouterr().out
    src = json.loads(open(os.path.join(tiny_model_dir, "config.json")).read())
    served = json.loads((tmp_path / "base" / "config.json").read_text())
    assert not src.get("architectures") and served == src | {"architectures": ["LlamaForCausalLM"]}
    assert sorted(os.listdir(tmp_path / "base")) == sorted(os.listdir(tiny_model_dir))
    for name in os.listdir(tiny_model_dir):
        if name != "config.json":
            assert (tmp_path / "base" / name).read_bytes() == open(
                os.path.join(tiny_model_dir, name), "rb"
            ).read()


@pytest.mark.parametrize("delay", [0.0, 0.1, 0.3])
def test_ctrl_c_right_after_the_files_are_written_is_one_line_or_none(
    tmp_path, tiny_model_dir, delay
):
    """A press `delay` seconds after the "wrote" line: the process has ended (exit 0: the work is
    done), or says one line and exits 130; never ended by the signal itself, with no line (Python's
    shutdown, a second or more after torch, used to take it)."""
    model, _ = checkpoint.load(tiny_model_dir, "cpu", torch.float32)
    heads = medusa_folder(model, tmp_path / "heads")
    argv = ["--model", tiny_model_dir, "--heads", heads, "--out", tmp_path / "vllm"]
    p = subprocess.Popen(
        [sys.executable, "-m", "specdec.export", *map(str, argv)],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert p.stdout.readline().startswith(f"wrote {tmp_path / 'vllm'}")
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode in (0, 130), (p.returncode, err)
    assert len(err.strip().splitlines()) == (p.returncode == 130), err
    assert load_file(tmp_path / "vllm" / "model.safetensors")
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["model_type"] == "medusa"


# --- refusals: one line, exit code 2, before the model loads, nothing overwritten -----------------


def test_hydra_heads_are_refused(no_model, capsys, tmp_path, tiny):
    for kind in ("hydra", "hydra++"):
        checkpoint.save_heads(build(HeadsConfig(kind, num_heads=2), tiny), tmp_path / kind)
        code = export.cli_main(["--heads", str(tmp_path / kind), "--out", str(tmp_path / "out")])
        check_one_line_error(
            code, capsys.readouterr().err, f"{kind} heads read the tokens drafted", "Medusa layout"
        )


def test_joint_heads_and_no_heads_are_refused(no_model, capsys, tmp_path, tiny):
    folder = tmp_path / "medusa-2"
    checkpoint.save_heads(build(HeadsConfig("medusa", num_heads=2), tiny), folder)
    (folder / checkpoint.DELTA_CONFIG).write_text("{}")
    check_one_line_error(
        export.cli_main(["--heads", str(folder), "--out", str(tmp_path / "out")]),
        capsys.readouterr().err,
        "LoRA delta",
    )
    check_one_line_error(
        export.cli_main(["--heads", "none", "--out", str(tmp_path / "out")]),
        capsys.readouterr().err,
        "no heads to export",
    )


@pytest.mark.parametrize("flag", ["--out", "--base-out"])
def test_non_empty_out_is_refused(no_model, capsys, tmp_path, tiny, flag):
    folder = tmp_path / "heads"
    checkpoint.save_heads(build(HeadsConfig("medusa", num_heads=2), tiny), folder)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("mine")
    argv = {
        "--out": ["--out", str(out)],
        "--base-out": ["--out", str(tmp_path / "new"), "--base-out", str(out)],
    }
    check_one_line_error(
        export.cli_main(["--heads", str(folder), *argv[flag]]),
        capsys.readouterr().err,
        f"{flag} {out}: not empty",
    )
    assert (
        sorted(p.name for p in out.iterdir()) == ["config.json"]
        and (out / "config.json").read_text() == "mine"
    )


def test_heads_of_another_model_name_the_one_in_their_heads_json(no_model, capsys, tmp_path, tiny):
    """Without --model (the default model) on heads trained for another model: refused before any
    model loads, naming the model heads.json records."""
    folder = tmp_path / "heads"
    checkpoint.save_heads(build(HeadsConfig("medusa", num_heads=2), tiny), folder)
    code = export.cli_main(["--heads", str(folder), "--out", str(tmp_path / "out")])
    line = check_one_line_error(
        code, capsys.readouterr().err, "trained for tiny", "pass --model tiny"
    )
    assert "use them with that model" not in line
    assert not (tmp_path / "out").exists()


def test_shipped_heads_on_another_model_ask_for_the_default_one(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "new" / "out"
    code = export.cli_main(["--model", tiny_model_dir, "--heads", "medusa", "--out", str(out)])
    check_one_line_error(
        code,
        capsys.readouterr().err,
        "--heads medusa: trained for SmolLM2-135M",
        f"not for --model {tiny_model_dir}",
        "pass --model default",
    )
    assert not (tmp_path / "new").exists()  # --out was made for nothing


@pytest.mark.parametrize("content", [None, "not json"])
def test_a_heads_folder_without_readable_heads_names_the_flag_and_the_fix(
    no_model, capsys, tmp_path, content
):
    """A folder without heads.json, or with a garbled one: one line naming --heads and the fix."""
    folder = tmp_path / "adir"
    folder.mkdir()
    words = ["--heads", "heads.json missing"]
    if content is not None:
        (folder / "heads.json").write_text(content)
        (folder / "heads.safetensors").write_text("")
        words = ["--heads", "not readable JSON"]
    code = export.cli_main(["--heads", str(folder), "--out", str(tmp_path / "out")])
    check_one_line_error(code, capsys.readouterr().err, *words, "pass a folder train.py wrote")
    assert not (tmp_path / "out").exists()
