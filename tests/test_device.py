"""The CUDA path, guarded on a CPU: tensors that would live on an accelerator never mix with host
tensors where CUDA would refuse ("Expected all tensors to be on the same device").

No GPU runs in CI, so SimulatedDevice replays CUDA's rule on CPU tensors: a tensor is "on the
device" when it was made with an explicit device (device=..., .to(device)), or computed from one
that is (the model's and the heads' weights are); every other tensor is host memory. CUDA then
refuses an op that mixes a device tensor with a host tensor of one or more dimensions (a 0-d host
tensor is a scalar, which CUDA accepts), an in-place op that writes device values into host memory,
and indexing host memory with device indices. The same code run with device="cpu" cannot tell
the two apart; this mode can.

Also what would make a first GPU run slow, counted on the CPU: host syncs a decode step, tree
tensors copied to the device a step, an attention mask where SDPA's flash kernels need none; and
the settings tuned per device (the 'layers' file, with a notice when a GPU falls back to a CPU's).
"""

import os

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from specdec.loading import catalog
from specdec import drafters
from specdec.engines import decode
from specdec import rows
import heads as heads_lib
from specdec.training import losses
from specdec.training import batches
from specdec.training.evaluate import evaluate
import tree as tree_lib
from conftest import tiny_config
from specdec.training import dataset as D
from test_train import args_for, features  # noqa: F401 (a fixture)

FACTORIES = {
    "zeros",
    "ones",
    "full",
    "empty",
    "arange",
    "tensor",
    "as_tensor",
    "rand",
    "randn",
    "randint",
    "randperm",
    "eye",
    "linspace",
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_like",
    "rand_like",
}
INDEXING = {"__getitem__", "__setitem__", "index_select", "gather", "take"}


def on_device(t):
    return getattr(t, "_on_device", False)


def place(t, device):
    t._on_device = device
    return t


class SimulatedDevice(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        dev = [x for x in inputs if on_device(x)]
        host = [x for x in inputs if not on_device(x)]
        if dev and host and name not in FACTORIES | {"to", "copy_"}:
            self_ = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if name in INDEXING and self_ is not None and on_device(self_):
                pass  # device memory indexed by host indices: CUDA copies them over
            elif (
                name in INDEXING
                or (name.endswith("_") and not name.startswith("__"))
                or name.startswith("__i")
            ):
                # writes or reads host memory with device data
                if self_ is not None and not on_device(self_):
                    raise RuntimeError(
                        f"{name}: host tensor {tuple(self_.shape)} with a device tensor"
                    )
            elif any(x.dim() > 0 for x in host):
                raise RuntimeError(
                    f"{name}: device and host tensors mixed: "
                    f"{[tuple(x.shape) for x in host if x.dim()]}"
                )
        out = func(*args, **kwargs)
        if name in FACTORIES:
            where = kwargs.get("device") is not None or (name.endswith("_like") and bool(dev))
        elif name in ("to", "cuda"):
            moved = kwargs.get("device") is not None or any(
                isinstance(a, (str, torch.device)) for a in args[1:]
            )
            where = moved or bool(dev)
            # .to() of what is already there returns it: a device copy is another tensor
            if moved and out is args[0]:
                out = out.view_as(out)
        elif name in ("cpu", "numpy"):
            where = False
        else:
            where = bool(dev)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                place(t, where)
        return out


def placed(module):
    for t in list(module.parameters()) + list(module.buffers()):
        place(t, True)
    return module


def test_the_simulation_catches_what_cuda_refuses():
    """The pattern of the crash in evaluate.evaluate: host counters that device scalars are added
    to."""
    with SimulatedDevice():
        x = torch.ones(3, device="cpu")  # on the device
        counts = torch.zeros(3)  # host
        with pytest.raises(RuntimeError, match="host tensor"):
            counts[0] += x.sum()
        with pytest.raises(RuntimeError, match="mixed"):
            x + torch.ones(3)
        x + torch.ones(())  # a host scalar is fine
        x[torch.tensor([0, 1])]  # device memory, host indices: fine
        with pytest.raises(RuntimeError, match="host tensor"):
            torch.ones(3)[x.long()]
        (x.sum().cpu() + counts).tolist()  # explicit transfers are fine


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)

    return placed(rows.Model(tiny_config(vocab_size=64)).eval())


@pytest.mark.parametrize("kind", heads_lib.KINDS)
def test_generate_keeps_to_the_device(small, kind):
    heads = placed(heads_lib.build(heads_lib.HeadsConfig(kind, num_heads=2), small).eval())
    tree = tree_lib.build(tree_lib.cartesian([2, 2]))
    with SimulatedDevice():  # drafters move their trees to the device when they are built
        for drafter in (None, drafters.HeadsDrafter(heads, tree), drafters.Lookup(3, 2, 1, "cpu")):
            assert len(decode.generate(small, [1, 2, 3, 1, 2], 12, drafter).tokens) == 12
        g = torch.Generator().manual_seed(0)
        decode.generate(
            small, [1, 2, 3], 8, drafters.HeadsDrafter(heads, tree), "sample", 0.8, 1.0, g
        )


def test_training_step_and_evaluation_keep_to_the_device(features, tmp_path):
    """evaluate.evaluate added device counts into host counters: a crash at the first evaluation on
    CUDA."""
    base, folder = features
    data, args = D.load_data(folder), args_for(tmp_path)
    kept, to_kept, _ = batches.kept_vocabulary(data, base.cfg.vocab_size, args.kept_tokens)
    heads = placed(
        heads_lib.build(heads_lib.HeadsConfig("hydra++", num_heads=2), placed(base), kept).train()
    )
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-3)
    held_out, train_convs = batches.split(len(data["offsets"]) - 1, 0)
    with SimulatedDevice():
        batch = losses.collate(data, train_convs[:4], to_kept, 2, base.device)
        losses.train_step(losses.TrainForward(heads), opt, batch, 1e-3, "teacher")
        report = evaluate(heads.eval(), data, held_out, to_kept, args, base.device)
    assert report["chain_tau"] >= 1


def test_a_generator_on_another_device_is_named_before_decoding():

    # a device that is not the generator's
    on_meta = rows.Model(tiny_config(vocab_size=64)).to("meta")
    with pytest.raises(ValueError, match="generator is on cpu, the model on meta"):
        decode.generate(on_meta, [1, 2], 4, temperature=0.8, generator=torch.Generator())


# --- host-device synchronisations ----------------------------------------------------------------
# On CUDA these calls wait for the device (a value comes back) or copy from the host: counted on
# the CPU by name. The decode loop should make few of them a step, whatever the drafter.

SYNCS = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "equal",
    "nonzero",
    "tensor",
    "as_tensor",
}


class SyncCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += getattr(func, "__name__", "") in SYNCS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", [None, *heads_lib.KINDS])
@pytest.mark.parametrize("verify", ["greedy", "typical", "sample"])
def test_a_decode_step_makes_at_most_four_host_syncs(small, kind, verify):
    """Plain decoding and each head kind under each verifier: the verifier brings back what the step
    needs in one transfer, the loop takes the kept tokens and their nodes in one more, and the KV
    cache learns from the host whether they are already in place."""
    heads = (
        heads_lib.build(heads_lib.HeadsConfig(kind, num_heads=2), small).eval() if kind else None
    )
    tree = tree_lib.build(tree_lib.cartesian([2, 2]))
    drafter = drafters.HeadsDrafter(heads, tree) if heads else None
    temperature, g = (0.0 if verify == "greedy" else 0.8), torch.Generator().manual_seed(0)
    # warm-up: trees built once
    decode.generate(small, [1, 2, 3], 4, drafter, verify, temperature, 1.0, g)
    with SyncCounter() as count:
        r = decode.generate(small, [1, 2, 3, 1, 2], 40, drafter, verify, temperature, 1.0, g)
    assert count.n / r.steps <= 4, f"{count.n / r.steps:.1f} syncs a step"


# --- index tensors: on the device once per tree --------------------------------------------------
# A tree's parents, paths and ranks are host data until moved; moved every step, each is a copy
# from the host and a wait on CUDA. The drafters move each tree once, when they first build it.


class HostToDevice(SimulatedDevice):
    """SimulatedDevice that counts host tensors copied to the device (.to / .cuda, copy_ into
    it)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        host = bool(args) and isinstance(args[0], torch.Tensor) and not on_device(args[0])
        if name == "copy_":
            self.n += on_device(args[0]) and not on_device(args[1])
        out = super().__torch_function__(func, types, args, kwargs)
        self.n += name in ("to", "cuda") and host and on_device(out)
        return out


@pytest.mark.parametrize("verify", ["greedy", "typical", "sample"])
def test_no_tree_tensor_is_copied_to_the_device_in_a_step(small, verify):
    heads = placed(heads_lib.build(heads_lib.HeadsConfig("hydra", num_heads=2), small).eval())
    tree = tree_lib.build(tree_lib.cartesian([2, 2]))
    temperature, g = (0.0 if verify == "greedy" else 0.8), torch.Generator().manual_seed(0)
    with HostToDevice() as copies:
        for drafter in (drafters.HeadsDrafter(heads, tree), drafters.Plain("cpu")):
            # Plain builds its tree here
            decode.generate(small, [1, 2, 3], 4, drafter, verify, temperature, 1.0, g)
            before = copies.n
            r = decode.generate(small, [1, 2, 3, 1, 2], 24, drafter, verify, temperature, 1.0, g)
            assert copies.n == before, (
                f"{(copies.n - before) / r.steps:.1f} host-to-device copies a step ({drafter.name})"
            )


# --- attention: SDPA's fast kernels --------------------------------------------------------------


def test_a_prefill_with_nothing_cached_is_causal_without_a_mask(monkeypatch):
    """An explicit mask rules out SDPA's flash kernels on CUDA: a plain prefill passes is_causal and
    no mask (readable attention and its GPU twin), and gives what the masked form gives; a step
    after a cached prefix (a tree) passes its mask."""
    from specdec.fast import kernels

    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    m = rows.Model(tiny_config(vocab_size=64)).eval()
    tokens, T, tree = (
        torch.tensor([[5, 6, 7, 8, 9, 10]]),
        6,
        tree_lib.build(tree_lib.cartesian([2])),
    )
    for fast in (kernels.Kernels(), kernels.Kernels(attention="expanded-kv")):
        kernels.use(m, fast)
        with torch.inference_mode():
            calls.clear()
            cache = m.new_cache(16)
            causal, _ = m(tokens, torch.arange(T), None, cache)
            assert calls == [(True, True)] * m.cfg.n_layers
            masked, _ = m(
                tokens, torch.arange(T), torch.ones(T, T, dtype=torch.bool).tril(), m.new_cache(16)
            )
            torch.testing.assert_close(causal, masked)
            cache.keep(range(T))
            calls.clear()
            m(tokens[:, :3], T + tree.depth, tree.mask, cache)
            assert calls == [(False, False)] * m.cfg.n_layers


# --- settings tuned per device and dtype ---------------------------------------------------------


def test_the_layers_setting_is_read_for_the_device_and_dtype_and_a_gpu_is_told_of_a_cpu_one(
    tmp_path, capsys
):
    import json
    from types import SimpleNamespace
    from specdec.benching import methods as catalogue

    def tuned(file, layers):
        (tmp_path / file).write_text(
            json.dumps(
                {
                    "model": "m",
                    "layers": layers,
                    "gamma": 2,
                    "machine": {"hardware": "h", "dtype": "d"},
                }
            )
        )

    model = lambda device, dtype: SimpleNamespace(
        cfg=SimpleNamespace(name="m", n_layers=8), device=torch.device(device), dtype=dtype
    )
    args = SimpleNamespace(heads_dir=str(tmp_path))
    tuned(os.path.basename(catalog.tuned_tree_file("", "cpu", torch.bfloat16, "layers")), 3)
    tuned(os.path.basename(catalog.tuned_tree_file("", "cpu", torch.float32, "layers")), 5)
    assert catalogue.layers_setting(args, model("cpu", torch.float32))[0] == 5
    assert catalogue.layers_setting(args, model("cpu", torch.bfloat16))[0] == 3
    assert capsys.readouterr().err == ""
    assert catalogue.layers_setting(args, model("cuda", torch.bfloat16))[0] == 3
    assert "notice: no 'layers' setting tuned for cuda" in capsys.readouterr().err
    tuned("layers-cuda-bfloat16.json", 6)
    assert catalogue.layers_setting(args, model("cuda", torch.bfloat16))[0] == 6
    assert capsys.readouterr().err == ""
