"""joint.py (Medusa-2 with LoRA on the last layers): the adapter starts as the base model, its delta
merged into the weights computes what training computed, greedy speculative decoding with joint
heads is token-identical to plain greedy decoding of the adapted model, and the command line
refuses bad input in one line."""

import json
import os
import signal

import pytest
import torch
from safetensors.torch import save_file

from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec import drafters
from specdec.engines import decode
import heads as heads_lib
from specdec.training import joint
from specdec import rows
import tree as tree_lib
from conftest import save_tiny_model, tiny_config
from test_cli import check_one_line_error


def two_models(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=64, n_layers=3)
    a = rows.Model(cfg).eval()
    b = rows.Model(cfg).eval()
    b.load_state_dict(a.state_dict())
    return a, b


def random_convs(n=3, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(3, vocab, (12,), generator=g).tolist(), [False] * 4 + [True] * 8)
        for _ in range(n)
    ]


def trained_adapter(base, layers=2, seed=1):
    """An adapter whose B is not zero, as after training."""
    adapted = joint.Adapted(base, layers, rank=4, alpha=8.0)
    torch.manual_seed(seed)
    for lora in adapted.deltas().values():
        lora.B.data.normal_(0, 0.3)
    return adapted


def test_the_adapter_starts_as_the_base_model_and_its_merged_delta_computes_the_same(tmp_path):
    base, merged = two_models()
    convs = random_convs()
    data = joint.joint_data(base, convs, first=1, top_k=4)
    x = data["hidden"][:12].float()[None]  # the stream into layer 1, conversation 0
    _, want = base(torch.tensor([convs[0][0]]), torch.arange(12))
    fresh = joint.Adapted(base, 2, rank=4, alpha=8.0)
    # B = 0: the base model (x was stored in fp16)
    torch.testing.assert_close(fresh(x), want, atol=2e-3, rtol=0)
    adapted = trained_adapter(base)
    joint.save_delta(adapted, str(tmp_path), base)
    for lora in adapted.deltas().values():  # as saved: in half precision
        lora.A.data, lora.B.data = lora.A.data.half().float(), lora.B.data.half().float()
    assert "layers 1-2" in checkpoint.merge_delta(merged, str(tmp_path))
    caught = {}
    hook = base.layers[0].register_forward_hook(lambda m, a, out: caught.update(x=out))
    base(torch.tensor([convs[0][0]]), torch.arange(12))
    hook.remove()
    _, got = merged(torch.tensor([convs[0][0]]), torch.arange(12))
    torch.testing.assert_close(got, adapted(caught["x"]), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, want, atol=1e-2)  # the delta did change the model


def test_a_delta_refuses_another_base_model(tmp_path):
    base, _ = two_models()
    joint.save_delta(trained_adapter(base), str(tmp_path), base)
    other, _ = two_models(seed=5)
    with pytest.raises(heads_lib.HeadsError, match="another base model"):
        checkpoint.merge_delta(other, str(tmp_path))


@pytest.mark.parametrize("kind", ["medusa", "hydra++"])
def test_joint_heads_decode_losslessly_on_the_adapted_model(tmp_path, kind):
    base, model = two_models()
    heads = heads_lib.build(heads_lib.HeadsConfig(kind, num_heads=2), base)
    for p in heads.parameters():
        p.data.normal_(0, 0.2)
    checkpoint.save_heads(heads, str(tmp_path))
    joint.save_delta(trained_adapter(base), str(tmp_path), base)
    loaded, folder = catalog.load_heads(str(tmp_path), model)  # merges the delta into `model`
    plain = decode.generate(model, [5, 6, 7, 8], 24)
    for tree in (tree_lib.chain(2), tree_lib.cartesian([3, 2])):
        spec = decode.generate(
            model, [5, 6, 7, 8], 24, drafters.HeadsDrafter(loaded, tree_lib.build(tree))
        )
        assert spec.tokens == plain.tokens
    # --heads none: the original model
    assert decode.generate(base, [5, 6, 7, 8], 24).tokens != plain.tokens


def joint_inputs(tmp_path, n, **sizes):
    """A tiny 3-layer model, n random conversations (convs.safetensors) and Medusa heads to start
    from (init/), in tmp_path: joint.py's inputs. Returns the model's folder and the model."""
    model_dir = save_tiny_model(tmp_path / "model", num_hidden_layers=3, **sizes)
    base, _ = checkpoint.load(model_dir)
    convs = random_convs(n=n, vocab=200)
    ids = torch.cat([torch.tensor(c) for c, _ in convs]).int()
    loss = torch.cat([torch.tensor(m) for _, m in convs])
    offsets = torch.tensor([0] + [len(c) for c, _ in convs]).cumsum(0)
    save_file({"ids": ids, "loss": loss, "offsets": offsets}, str(tmp_path / "convs.safetensors"))
    heads = heads_lib.build(heads_lib.HeadsConfig("medusa", num_heads=2), base, torch.arange(256))
    checkpoint.save_heads(heads, str(tmp_path / "init"))
    return model_dir, base


def test_training_moves_the_adapter_and_the_heads_and_keeps_the_model_close(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # where the layers' input is kept
    model_dir, base = joint_inputs(tmp_path, 40, hidden_size=32, intermediate_size=64)
    out = tmp_path / "out"
    code = joint.cli_main(
        [
            "--model",
            model_dir,
            "--init",
            str(tmp_path / "init"),
            "--data",
            str(tmp_path / "convs.safetensors"),
            "--conversations",
            "30",
            "--eval-conversations",
            "5",
            "--batch-tokens",
            "64",
            "--epochs",
            "2",
            "--ramp",
            "2",
            "--eval-every",
            "100",
            "--dtype",
            "fp32",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    assert {"heads.safetensors", "heads.json", "lora.safetensors", "lora.json", "eval.json"} <= set(
        os.listdir(out)
    )
    delta = joint.load_file(str(out / "lora.safetensors"))
    # the adapter learned
    assert any(k.endswith(".B") and v.abs().sum() > 0 for k, v in delta.items())
    report = json.loads((out / "eval.json").read_text())
    assert report["curve"][0]["greedy_agreement"] == 1.0  # fp32 data: the start is the model itself
    assert report["greedy_agreement"] > 0.9
    # a second run reads it, not the model
    assert len(os.listdir(tmp_path / "cache" / "joint")) == 1


def joint_run(tmp_path, out, *more):
    """joint.py's flags for a short run on joint_inputs' files into `out`: 2 epochs of ~20 steps,
    a checkpoint after every step."""
    flags = ["--model", tmp_path / "model", "--init", tmp_path / "init"]
    flags += ["--data", tmp_path / "convs.safetensors", "--conversations", 30]
    flags += ["--eval-conversations", 5, "--batch-tokens", 64, "--epochs", 2, "--ramp", 2]
    flags += ["--eval-every", 7, "--dtype", "fp32", "--save-every", 0, "--out", out, *more]
    return joint.cli_main([str(f) for f in flags])


def test_a_run_says_what_it_does_and_resumes_after_ctrl_c_to_the_uninterrupted_weights(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    joint_inputs(tmp_path, 40, hidden_size=32, intermediate_size=64)
    assert joint_run(tmp_path, tmp_path / "whole") == 0
    err = capsys.readouterr().err
    for words in ("[joint] loading the model", "[joint] the teacher's pass over 32 conversations",
                  "[joint] the teacher's pass: 3/32 conversations", "[joint] step 1/"):  # fmt: skip
        assert words in err, err
    whole = torch.load(tmp_path / "whole" / "state.pt", weights_only=True)

    real, calls = joint.losses.collate, [0]

    def collate(*a, **k):  # Ctrl-C in the middle of the 9th step
        calls[0] += 1
        if calls[0] == 9:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(joint.losses, "collate", collate)
        assert joint_run(tmp_path, tmp_path / "out") == 130
    err = capsys.readouterr().err
    assert "[joint] stopped by signal 2 at step 9; checkpoint written to" in err, err
    assert "eval.json" not in os.listdir(tmp_path / "out")
    code = joint_run(tmp_path, tmp_path / "out")  # without --resume: refused, kept
    check_one_line_error(code, capsys.readouterr().err, "--resume continues it")
    assert joint_run(tmp_path, tmp_path / "out", "--resume") == 0
    assert "[joint] resumed from step 9 in" in capsys.readouterr().err
    resumed = torch.load(tmp_path / "out" / "state.pt", weights_only=True)
    assert resumed["step"] == whole["step"] > 9 and resumed["progress"] == whole["progress"]
    for part in ("heads", "modules"):
        flat = lambda d: {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}
        a = flat(whole[part] if part == "heads" else whole[part]["adapted"])
        b = flat(resumed[part] if part == "heads" else resumed[part]["adapted"])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    curves = [
        json.loads((tmp_path / f / "eval.json").read_text())["curve"] for f in ("whole", "out")
    ]
    assert curves[0] == curves[1]
    assert joint.load_file(str(tmp_path / "out" / "lora.safetensors")).keys()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--rank", "0"], "--rank 0: must be at least 1"),
        (["--lr-lora", "nan"], "--lr-lora nan: must be a number > 0"),
        (["--init", "eagle"], "--init eagle: not a heads folder"),
        (["--data", "chats.jsonl"], "give a conversations file"),
    ],
)
def test_bad_flags_are_one_line(no_model, capsys, tmp_path, argv, words):
    code = joint.cli_main(["--out", str(tmp_path / "out"), *argv])
    check_one_line_error(code, capsys.readouterr().err, words)


def test_an_out_folder_with_a_run_is_refused(no_model, capsys, tmp_path):
    (tmp_path / "heads.json").write_text("{}")
    check_one_line_error(
        joint.cli_main(["--out", str(tmp_path)]), capsys.readouterr().err, "is not empty"
    )


def test_init_none_is_refused_before_the_model_loads(no_model, capsys, tmp_path):
    code = joint.cli_main(["--init", "none", "--out", str(tmp_path / "out")])
    check_one_line_error(code, capsys.readouterr().err, "--init none", "trained heads")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [None, "not json"])
def test_an_init_folder_without_heads_names_the_flag_and_the_fix(
    no_model, capsys, tmp_path, content
):
    folder = tmp_path / "adir"
    folder.mkdir()
    words = ["--init", "heads.json missing"]
    if content is not None:  # a garbled heads.json
        (folder / "heads.json").write_text(content)
        (folder / "heads.safetensors").write_text("")
        words = ["--init", "not readable JSON"]
    code = joint.cli_main(["--init", str(folder), "--out", str(tmp_path / "out")])
    check_one_line_error(code, capsys.readouterr().err, *words, "pass a folder train.py wrote")
    assert not (tmp_path / "out").exists()


def test_a_teacher_k_beyond_the_vocabulary_is_one_line_and_leaves_no_out_folder(tmp_path, capsys):
    model_dir, base = joint_inputs(tmp_path, 4)
    argv = ["--model", model_dir, "--init", str(tmp_path / "init")]
    argv += ["--data", str(tmp_path / "convs.safetensors"), "--out", str(tmp_path / "out")]
    code = joint.cli_main([*argv, "--teacher-k", "999999"])
    vocab = str(base.cfg.vocab_size)
    said, error = capsys.readouterr().err.splitlines()  # what it was doing, then the one line
    assert said.startswith("[joint] loading the model")
    check_one_line_error(code, error, "--teacher-k 999999", f"at most {vocab}")
    assert not (tmp_path / "out").exists()
