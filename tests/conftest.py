"""Shared fixtures: a tiny random Llama (fast, most tests) and the real default model (a few)."""
import pytest
import torch

import model as model_lib

torch.set_num_threads(1)  # tests use tiny tensors: one thread avoids contention overhead


def tiny_config(**kw):
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64,
                max_seq_len=256, name="tiny")
    base.update(kw)
    return model_lib.Config(**base)


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return model_lib.Transformer(tiny_config()).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32 on CPU."""
    return model_lib.load(model_lib.DEFAULT, "cpu", torch.float32)
