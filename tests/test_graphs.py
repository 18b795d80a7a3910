"""graphs.py's contracts: the static step is the readable forward's twin (greedy output token for
token in fp32: plain, heads, heads+lookup, batch rows); every step of one shape key runs the same
operations on the same shapes; nothing inside the step that a graph replays reads a value back to
the host or mixes in a host tensor; what cannot be served statically runs eagerly and is counted.
Real capture and replay run only where CUDA is (skipped elsewhere)."""

import collections

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from specdec.loading import catalog
from specdec import drafters
from specdec.engines import decode
from specdec.engines import engine
from specdec.fast import graphs
from specdec import rows
import tree as tree_lib
from conftest import tiny_config
from test_batch import EOS, LIMITS, PROMPTS
from test_device import SimulatedDevice, SyncCounter, placed
from test_generate import random_heads, small  # noqa: F401 (a fixture)

DRAFTERS = ["plain", "hydra++", "heads+lookup"]
# drafters that decode one sequence: the loop calls the wrapper the same way
ALONE = {
    "jacobi": lambda model: drafters.Jacobi(3, "cpu"),
    "lookahead": lambda model: drafters.Lookahead(3, 3, 2, "cpu"),
    "layers": lambda model: drafters.ModelDrafter(model, 3, 0.0, 1.0, None, layers=[0]),
}


def make_drafter(name, model, device="cpu", heads=None):
    """Plain decoding, random Hydra++ heads (or `heads`) on a tree cartesian 3, 2, 2, or those
    heads and prompt lookup in one tree."""
    if name == "plain":
        return drafters.Plain(device)
    heads = heads if heads is not None else random_heads(model, "hydra++").to(device)
    d = drafters.HeadsDrafter(heads, tree_lib.build(tree_lib.cartesian([3, 2, 2])))
    return d if name == "hydra++" else catalog.heads_and_lookup(d, 4, 3, 1, device)


def wrapped(model, **kw):
    """A GraphedForward with small length buckets, so that a generation crosses some."""
    return graphs.GraphedForward(model, bucket=kw.pop("bucket", 16), **kw)


# --- the twin: token for token -------------------------------------------------------------------


@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_output_through_the_static_step_is_the_readable_models(small, name):
    fast = wrapped(small)
    for p, n in zip(PROMPTS, LIMITS):
        eager = decode.generate(small, p, n, make_drafter(name, small), eos_ids=EOS)
        static = decode.generate(fast, p, n, make_drafter(name, small), eos_ids=EOS)
        assert static.tokens == eager.tokens and static.steps == eager.steps
    assert not fast.enabled and fast.replays > 0
    assert set(fast.fallbacks) == {"last_only"}  # the prefills, and nothing else


@pytest.mark.parametrize("name", ALONE)
def test_one_sequence_drafters_through_the_static_step_give_the_readable_models_output(small, name):
    """The drafters that keep what the model computed a step (Jacobi's outputs, the layers'
    own cache on the inner model): the step's buffers are reused, their output is not."""
    fast = wrapped(small)
    for p, n in zip(PROMPTS, LIMITS):
        eager = decode.generate(small, p, n, ALONE[name](small), eos_ids=EOS)
        static = decode.generate(fast, p, n, ALONE[name](small), eos_ids=EOS)
        assert static.tokens == eager.tokens and static.steps == eager.steps
    assert set(fast.fallbacks) == {"last_only"}


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_row_of_a_batch_through_the_static_step_is_the_readable_models(small, name):
    """Rows of different lengths (gaps), rows that end and leave (select_rows), waiting prompts
    that take free rows (a prefill cache of their own, then put)."""
    eager = engine.generate_batch(small, PROMPTS, LIMITS, make_drafter(name, small), eos_ids=EOS)
    for size in (None, 2):
        fast = wrapped(small)
        static = engine.generate_batch(
            fast, PROMPTS, LIMITS, make_drafter(name, small), eos_ids=EOS, batch_size=size
        )
        for a, b in zip(eager, static):
            assert b.tokens == a.tokens and b.stopped == a.stopped
        assert set(fast.fallbacks) == {"last_only"}


@pytest.mark.parametrize("N", [3, 4])  # 3: computed as 4 nodes, one of them padding
@pytest.mark.parametrize("bucket", [8, 64])
def test_a_step_equals_the_readable_forward_with_gaps_and_a_tree(N, bucket):
    """One forward of a tree over rows of different lengths: the same logits, hidden states and
    cache entries as the readable one, whatever bucket it attends over, padded or not."""
    torch.manual_seed(0)
    m = rows.Model(tiny_config()).eval()
    B = 3
    tree = torch.ones(4, 4, dtype=torch.bool).tril()
    tree[2, 1] = tree[3, 2] = False  # branches 0-1-3 and 0-2: a tree, not a chain
    tree = tree[:N, :N].expand(B, N, N)
    tokens = torch.randint(0, 64, (B, N))
    positions = torch.tensor([5, 9, 2])[:, None] + torch.arange(N)  # (B, N)
    with torch.inference_mode():
        fast = graphs.GraphedForward(m, bucket=bucket)
        caches = [m.new_cache(40, batch=B), fast.new_cache(40, batch=B)]
        caches[0].k.normal_()  # prefixes, and garbage in the gaps
        caches[0].v.normal_()
        caches[1].k.copy_(caches[0].k)
        caches[1].v.copy_(caches[0].v)
        for c in caches:
            c.lengths = [5, 9, 2]
        eager = m(tokens, positions, tree, caches[0])
        fast.k[:, :, :, 9:] = 1e4  # past the lengths, garbage of any size: hidden
        static = fast(tokens, positions, tree, caches[1])
        assert static[0].shape == (B, N, 64) and static[1].shape == (B, N, 32)
        torch.testing.assert_close(static, eager)
        new = slice(9, 9 + N)  # the slots of the new entries, in every row
        torch.testing.assert_close(caches[1].k[:, :, :, new], caches[0].k[:, :, :, new])
        torch.testing.assert_close(caches[1].v[:, :, :, new], caches[0].v[:, :, :, new])
    assert list(fast.shapes) == [(B, 4, 16 if bucket == 8 else 64)]


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_conversation_through_the_static_step_replies_as_the_readable_model(small, name):
    """Conversation keeps one cache across replies (a StaticCache here) and cuts it back: each
    reply is the one-shot reply of the readable model."""
    chat = decode.Conversation(wrapped(small), make_drafter(name, small))
    assert isinstance(chat.cache, graphs.StaticCache)
    prompt = PROMPTS[1]
    for limit in (12, 5, 20):
        r = chat.reply(prompt, limit, eos_ids=EOS)
        alone = decode.generate(small, prompt, limit, make_drafter(name, small), eos_ids=EOS)
        assert r.tokens == alone.tokens
        prompt = prompt + r.tokens + [3, 4, 5]  # the next user turn
    assert set(chat.model.fallbacks) == {"last_only"}


# --- static shapes -------------------------------------------------------------------------------


class OpShapes(TorchFunctionMode):
    """Every torch call: its name and the shapes of its tensor arguments and results."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = [
            tuple(x.shape)
            for x in tree_flatten((args, kwargs, out))[0]
            if isinstance(x, torch.Tensor)
        ]
        self.ops.append((getattr(func, "__name__", str(func)), tuple(shapes)))
        return out


@pytest.mark.parametrize("name", ["plain", "heads+lookup"])
def test_every_step_of_a_shape_key_runs_the_same_ops_on_the_same_shapes(small, name, monkeypatch):
    """What a graph captures for (B, N, S) is what every later step of that key runs: recorded op by
    op inside static_forward, step after step, rows of any lengths."""
    traces = collections.defaultdict(list)  # key -> one trace per step
    inner = graphs.static_forward

    def recorded(model, k, v, tokens, *rest):
        with OpShapes() as ops:
            out = inner(model, k, v, tokens, *rest)
        traces[(*tokens.shape, k.shape[3])].append(ops.ops)
        return out

    monkeypatch.setattr(graphs, "static_forward", recorded)
    fast = wrapped(small)
    engine.generate_batch(
        fast, PROMPTS, LIMITS, make_drafter(name, small), eos_ids=EOS, batch_size=3
    )
    decode.generate(fast, PROMPTS[0], 40, make_drafter(name, small))
    assert len(traces) >= 3 and sum(map(len, traces.values())) > 20
    for key, steps in traces.items():
        assert all(ops == steps[0] for ops in steps), f"{key}: the shapes changed between steps"
    assert set(fast.shapes) == set(traces)
    assert all(N & (N - 1) == 0 for _, N, _ in fast.shapes), "nodes padded to a power of two"


# --- nothing comes back to the host inside the step ----------------------------------------------


@pytest.mark.parametrize("name", DRAFTERS)
def test_the_replayed_part_makes_no_host_sync_and_keeps_to_the_device(small, name, monkeypatch):
    """Inside static_forward (what a graph captures): no host sync counted by test_device's
    SyncCounter, and no host tensor mixed in (SimulatedDevice: the model, the cache and the step's
    buffers are on the device). The generation around it is unchanged."""
    syncs = []
    inner = graphs.static_forward

    def counted(*args):
        with SyncCounter() as count:
            out = inner(*args)
        syncs.append(count.n)
        return out

    monkeypatch.setattr(graphs, "static_forward", counted)
    torch.manual_seed(0)
    dev_model = placed(rows.Model(tiny_config(vocab_size=12)).eval())
    dev_model.load_state_dict(small.state_dict())
    fast = wrapped(dev_model)
    heads = placed(random_heads(dev_model, "hydra++"))
    with SimulatedDevice():  # drafters move their trees to the device when they are built
        drafter = make_drafter(name, dev_model, heads=heads)
        out = decode.generate(fast, PROMPTS[5], 30, drafter, eos_ids=EOS)
    assert (
        out.tokens
        == decode.generate(small, PROMPTS[5], 30, make_drafter(name, small), eos_ids=EOS).tokens
    )
    assert syncs and set(syncs) == {0}, f"host syncs inside the step: {syncs}"


# --- what runs eagerly is counted and named ------------------------------------------------------


def test_what_the_static_step_cannot_serve_runs_eagerly_and_is_counted(small):
    fast = wrapped(small)
    with torch.inference_mode():
        cache = fast.new_cache(64)
        other = fast.new_cache(64)  # the buffers are taken: a plain KVCache
        assert isinstance(cache, graphs.StaticCache) and type(other) is rows.RowsCache
        fast(torch.tensor([[1, 2, 3]]), torch.arange(3), None, cache, last_only=True)
        cache.keep(range(3))
        fast(torch.tensor([[4]]), torch.tensor([3]), None, other)
        fast(torch.tensor([[4]]), torch.tensor([3]), None, cache, layers=[0])
        cache.keep([0])
        fast(torch.tensor([[5]]), torch.tensor([4]), None, cache)
    assert fast.fallbacks == {"last_only": 1, "cache outside the buffers": 1, "layers": 1}
    assert fast.replays == 1
    fast.prepare(1, 4, 64)  # nothing to capture on a CPU
    assert fast.replays == 1 and fast.shapes.keys() == {(1, 1, 16)}
    line = fast.summary()
    assert "eager: 3" in line and "layers 1" in line and "cuda graphs off" in line
    del cache
    assert isinstance(fast.new_cache(64), graphs.StaticCache)  # free again once the cache is gone
    with pytest.raises(ValueError, match="KV cache full"):
        with torch.inference_mode():
            c = fast.new_cache(4)
            fast(torch.tensor([[1, 2, 3, 4, 5]]), torch.arange(5), None, c)


def test_the_buffers_grow_to_a_power_of_two_and_their_shapes_start_over(small):
    fast = wrapped(small)  # bucket 16; the model's context 256
    assert fast.new_cache(20).k.shape[3] == 20 and fast.slots == 32
    decode.generate(fast, PROMPTS[0], 5)  # a cache of 3 + 5 + 1 slots: in the buffers as they are
    assert fast.slots == 32 and fast.shapes
    decode.generate(fast, PROMPTS[0], 40)  # 44 slots: new buffers, and the shapes read the old ones
    assert fast.slots == 64 and all(S <= 64 for _, _, S in fast.shapes)
    assert fast.new_cache(700, batch=3).k.shape[1:4:2] == (3, 700) and fast.slots == 700
    assert graphs.GraphedForward(small, slots=64).new_cache(65).__class__ is rows.RowsCache


def test_the_flag_is_on_where_cuda_is_unless_it_says_otherwise():
    assert graphs.wanted("auto", "cuda:0") and graphs.wanted("on", "cpu")
    assert not graphs.wanted("auto", "cpu") and not graphs.wanted("off", "cuda")


def test_the_wrapper_reads_as_the_model(small):
    fast = wrapped(small)
    assert fast.cfg is small.cfg and fast.lm_head is small.lm_head
    assert fast.device == small.device and fast.dtype == small.dtype
    assert fast.new_cache(32, num_layers=1).k.shape[0] == 1  # a drafter's cache: the model's
    calls = []  # a forward hook sees every forward, replayed or eager (bench counts them so)
    handle = fast.register_forward_hook(lambda m, args, out: calls.append(out[0].shape))
    r = decode.generate(fast, PROMPTS[2], 6)
    handle.remove()
    decode.generate(fast, PROMPTS[2], 6)
    assert len(calls) == r.steps and calls[0] == (1, 1, 12)  # the prefill's last_only logits


class FakeGraph:
    """A captured step as the wrapper sees one: replay() recomputes into the shape's buffers."""

    def __init__(self, fast, shape):
        self.replay = lambda: fast.run(shape)


def test_each_key_is_captured_once_then_replayed_and_a_failed_capture_is_counted(small):
    """The GPU's control flow, on a CPU: capture stands in (FakeGraph) and may fail."""
    fast = wrapped(small, capture=True)
    captured = []

    def capture(shape):
        captured.append(shape.key)
        if shape.key[1] == 1:  # the plain step's capture fails
            shape.failed = "RuntimeError: no"
        else:
            fast.run(shape)  # what the warm-up and capture leave in the outputs
            shape.graph = FakeGraph(fast, shape)

    fast.capture = capture
    fast.prepare(1, 4, 300)  # every bucket of (1, 4) up to 300 tokens, before any step
    assert captured == [(1, 4, S) for S in (16, 32, 64, 128, 256, 512)]  # 300 -> 512 slots
    for p, n in zip(PROMPTS, LIMITS):
        eager = decode.generate(small, p, n, make_drafter("hydra++", small), eos_ids=EOS)
        static = decode.generate(fast, p, n, make_drafter("hydra++", small), eos_ids=EOS)
        assert static.tokens == eager.tokens
    assert len(captured) == len(set(captured)), "a key captured twice"
    decode.generate(fast, PROMPTS[0], 5)  # plain: (1, 1, 16), whose capture fails
    assert fast.fallbacks["not captured: RuntimeError: no"] == 4  # every step it ran eagerly
    assert "not captured: RuntimeError: no 4" in fast.summary()


def test_a_batch_sharing_a_budget_steps_only_at_keys_prepared_before_it(small):
    """prepare_batches before a run (a benchmark's, before timing): a batch of 4 rows sharing a
    budget that moves as rows end (its rows' trees change size every step) captures nothing while
    it decodes, and gives the readable model's replies."""
    fast = wrapped(small, capture=True)
    captured = []

    def capture(shape):
        captured.append(shape.key)
        fast.run(shape)
        shape.graph = FakeGraph(fast, shape)

    fast.capture = capture
    heads = random_heads(small, "hydra++")
    tree = tree_lib.build(tree_lib.cartesian([3, 2, 2]))
    budgets = {1: 21, 2: 5, 4: 2}  # nodes past the roots by live rows: they move as rows end
    longest = max(len(p) + n for p, n in zip(PROMPTS, LIMITS)) + tree.num_nodes  # the engine's
    fast.prepare_batches(4, tree.num_nodes, longest)
    prepared = len(captured)
    nodes = (1, 2, 4, 8, 16, 32)  # up to the tree's 22 nodes, as steps round them
    keys = {(b, n, S) for b in range(1, 5) for n in nodes for S in fast.buckets}
    assert captured == sorted(captured) and set(captured) == {k for k in keys if k[2] >= k[1]}

    def replies(model):  # the prompts through 4 rows sharing the budget
        d = drafters.HeadsShared(heads, tree, budgets)
        batch = engine.generate_batch(model, PROMPTS, LIMITS, d, eos_ids=EOS, batch_size=4)
        return [r.tokens for r in batch]

    assert replies(fast) == replies(small)
    assert len(captured) == prepared, f"captured while decoding: {captured[prepared:]}"
    assert fast.replays > 0 and not fast.fallbacks.get("cache outside the buffers")


# --- real CUDA graphs, where there is a GPU ------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("name", DRAFTERS)
def test_captured_graphs_replay_the_readable_models_greedy_output(small, name):
    """fp32 on the GPU: one sequence at a time, then batches of 4 rows (gaps, rows that end and
    are refilled), every shape captured and replayed."""
    gpu = rows.Model(small.cfg).eval()
    gpu.load_state_dict(small.state_dict())
    gpu = gpu.cuda()
    fast = wrapped(gpu)
    assert fast.enabled
    for p, n in zip(PROMPTS, LIMITS):
        eager = decode.generate(gpu, p, n, make_drafter(name, gpu, "cuda"), eos_ids=EOS)
        static = decode.generate(fast, p, n, make_drafter(name, gpu, "cuda"), eos_ids=EOS)
        assert static.tokens == eager.tokens
    eager, static = [
        engine.generate_batch(
            m, PROMPTS, LIMITS, make_drafter(name, gpu, "cuda"), eos_ids=EOS, batch_size=4
        )
        for m in (gpu, fast)
    ]
    assert [r.tokens for r in static] == [r.tokens for r in eager]
    assert set(fast.fallbacks) == {"last_only"}, fast.summary()
    assert all(s.graph is not None for s in fast.shapes.values()), fast.summary()
