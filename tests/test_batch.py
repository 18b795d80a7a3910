"""engine.generate_batch's contracts: a row of a batch is the reply its prompt gets alone, token for
token (greedy, fp32; bf16 through kernels.c), for every drafter, prompts of different lengths and
rows that end at different steps; a sampled row depends on its own seed only."""

import pytest
import torch

from specdec.loading import catalog
from specdec.training import dataset
from specdec import drafters
from specdec.engines import decode
from specdec.engines import engine
from specdec.fast import kernels
from specdec import rows
import test_kernels
import tree as tree_lib
from conftest import tiny_config, draft_one
from test_generate import random_heads, small  # noqa: F401 (a fixture)
from test_kernels import native_path  # noqa: F401 (a fixture)

# prompts of 3 to 13 tokens; with EOS = 11 the rows end at different steps (after 40, 13, 3 (EOS),
# 1, 25 and 40 new tokens): each row's cache length drifts from its mates'
PROMPTS = [
    torch.randint(0, 12, (3 + 2 * s,), generator=torch.Generator().manual_seed(s)).tolist()
    for s in range(6)
]
LIMITS = [40, 13, 33, 1, 25, 40]
EOS = {11}


def make_drafter(name, model, matches=3):
    """The drafter `name` for `model`: heads are random, their tree cartesian 3, 2, 2; lookup
    proposes up to `matches` continuations."""
    tree = tree_lib.build(tree_lib.cartesian([3, 2, 2]))
    if name == "plain":
        return drafters.Plain("cpu")
    if name in ("medusa", "hydra", "hydra++"):
        return drafters.HeadsDrafter(random_heads(model, name), tree)
    if name == "lookup":
        return drafters.Lookup(4, 3, matches, "cpu")
    if name == "heads+lookup":
        heads = drafters.HeadsDrafter(random_heads(model, "hydra++"), tree)
        return catalog.heads_and_lookup(heads, 4, 3, 1, "cpu")
    if name == "hydra++-shared":  # 5 nodes past the roots shared by 2 to 4 rows
        return drafters.HeadsShared(random_heads(model, "hydra++"), tree, {1: 21, 2: 5})
    if name == "heads+lookup-shared":  # lookup's nodes beside 4 of the heads' shared by the rows
        heads = drafters.HeadsShared(random_heads(model, "hydra++"), tree, {1: 21, 2: 4})
        return catalog.heads_and_lookup(heads, 4, 3, 1, "cpu")
    if name == "layers":
        return drafters.ModelDrafter(model, 3, 0.0, 1.0, None, layers=[0])
    if name == "jacobi":
        return drafters.Jacobi(3, "cpu")
    assert name == "lookahead", name
    return drafters.Lookahead(3, 3, 2, "cpu")


BATCHING = ["plain", "medusa", "hydra", "hydra++", "lookup", "heads+lookup"]
EVERY = BATCHING + ["layers", "jacobi", "lookahead"]  # every drafter decodes rows side by side


@pytest.mark.parametrize("name", EVERY)
def test_every_row_of_a_greedy_batch_is_its_prompt_decoded_alone(small, name):
    alone = [
        decode.generate(small, p, n, make_drafter(name, small), eos_ids=EOS)
        for p, n in zip(PROMPTS, LIMITS)
    ]
    batch = engine.generate_batch(small, PROMPTS, LIMITS, make_drafter(name, small), eos_ids=EOS)
    for a, b in zip(alone, batch):
        assert b.tokens == a.tokens and b.stopped == a.stopped
        assert b.steps == a.steps and b.accepted == a.accepted and b.sources == a.sources
    stops = {(len(r.tokens), r.stopped) for r in batch}
    assert len(stops) > 2, "the rows should end at different steps, for different reasons"
    assert {r.stopped for r in batch} == {"eos", "length"}
    if name != "plain":
        assert sum(sum(r.accepted) for r in batch) > 0, "no draft accepted: no tree was exercised"


def test_a_row_finishing_leaves_the_batch_and_the_cache(small, monkeypatch):
    """Finished rows stop costing: each forward carries only the rows still decoding."""
    rows_seen, forward = [], small.forward
    monkeypatch.setattr(
        small,
        "forward",
        lambda tokens, *a, **k: rows_seen.append(len(tokens)) or forward(tokens, *a, **k),
    )
    engine.generate_batch(small, PROMPTS, LIMITS, None)
    assert rows_seen[0] == len(PROMPTS) and rows_seen[1] == len(PROMPTS) - 1  # LIMITS[3] == 1
    assert rows_seen == sorted(rows_seen, reverse=True) and rows_seen[-1] == 2  # two of 40
    assert len(rows_seen) == max(LIMITS)  # the prefill, then one plain step a token


@pytest.mark.parametrize("verify", ["sample", "typical"])
@pytest.mark.parametrize("name", ["plain", "hydra++", "heads+lookup"])
def test_a_sampled_row_depends_on_its_own_seed_only(small, name, verify):
    def seeded(s):
        return torch.Generator().manual_seed(s)

    alone = [
        decode.generate(small, p, n, make_drafter(name, small), verify, 0.9, 0.95, seeded(s)).tokens
        for s, (p, n) in enumerate(zip(PROMPTS, LIMITS))
    ]
    batch = engine.generate_batch(
        small,
        PROMPTS,
        LIMITS,
        make_drafter(name, small),
        verify,
        0.9,
        0.95,
        [seeded(s) for s in range(len(PROMPTS))],
    )
    assert [r.tokens for r in batch] == alone


@pytest.mark.parametrize("verify", ["sample", "typical"])
@pytest.mark.parametrize("size", [6, 4])
def test_sampled_drafts_of_a_row_come_from_its_own_generator(small, verify, size):
    """A drafter that samples its drafts (layers:N, skip, a draft model at a temperature) draws for
    row i from row i's generator, as it draws from the one generator of a sequence alone."""

    def sampled_layers(generator):
        return drafters.ModelDrafter(small, 3, 0.9, 0.95, generator, layers=[0])

    alone = []
    for s, (p, n) in enumerate(zip(PROMPTS, LIMITS)):
        g = torch.Generator().manual_seed(s)
        alone.append(decode.generate(small, p, n, sampled_layers(g), verify, 0.9, 0.95, g).tokens)
    seeded = [torch.Generator().manual_seed(s) for s in range(len(PROMPTS))]
    batch = engine.generate_batch(
        small, PROMPTS, LIMITS, sampled_layers(None), verify, 0.9, 0.95, seeded, batch_size=size
    )
    assert [r.tokens for r in batch] == alone


def test_the_cache_holds_each_rows_sequence_after_ragged_steps(small):
    """Row b's slots [0, lengths[b]) equal a fresh forward over its prompt and reply, whatever its
    batch mates accepted (the gap between rows' lengths is never kept)."""
    cache = small.new_cache(64, batch=3)
    seqs = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    width = max(map(len, seqs))
    padded = torch.tensor([s + [0] * (width - len(s)) for s in seqs])  # (3, 4)
    small(padded, torch.arange(width), None, cache)
    cache.keep(*[range(len(s)) for s in seqs])
    assert cache.lengths == [4, 2, 3] and cache.length == 4
    new = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])  # (3, 3) a chain in every row
    small(new, torch.tensor(cache.lengths)[:, None] + torch.arange(3), None, cache)
    paths = [[0, 1], [0, 1, 2], [0]]  # ragged acceptance: rows 1 and 2 copy across their gap
    cache.keep(*paths)
    for b, (s, path) in enumerate(zip(seqs, paths)):
        want = s + new[b, path].tolist()
        fresh = small.new_cache(16)
        small(torch.tensor([want]), torch.arange(len(want)), None, fresh)
        n = cache.lengths[b]
        assert n == len(want)
        assert torch.allclose(cache.k[:, b, :, :n], fresh.k[:, 0, :, :n], atol=1e-5)
        assert torch.allclose(cache.v[:, b, :, :n], fresh.v[:, 0, :, :n], atol=1e-5)


@pytest.mark.parametrize("name", ["plain", "hydra++", "heads+lookup"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_a_queue_of_prompts_through_fewer_rows_is_each_prompt_decoded_alone(small, name, size):
    """batch_size rows at most: the waiting prompts take the rows of those that end (continuous
    batching), and each reply is still the one its prompt gets alone."""
    alone = [
        decode.generate(small, p, n, make_drafter(name, small), eos_ids=EOS)
        for p, n in zip(PROMPTS, LIMITS)
    ]
    rows_seen, forward = [], small.forward

    def counted(tokens, *a, **k):
        rows_seen.append(len(tokens))
        return forward(tokens, *a, **k)

    drafter = make_drafter(name, small)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(small, "forward", counted)
        batch = engine.generate_batch(small, PROMPTS, LIMITS, drafter, eos_ids=EOS, batch_size=size)
    for a, b in zip(alone, batch):
        assert b.tokens == a.tokens and b.stopped == a.stopped and b.accepted == a.accepted
    assert max(rows_seen) == size
    if size > 1:  # refills: more than one prefill, and steps with every row busy after one
        assert rows_seen.count(size) > 2


@pytest.mark.parametrize("size", [2, None])
def test_the_data_stage_records_what_a_fresh_forward_over_prompt_and_reply_computes(small, size):
    """dataset.decode's features, recorded by its drafter (Recorder) from each step's Accepted:
    prompt i's hidden states at every position but the last of prompt + reply, and the top-k of
    the logits that chose each reply token."""
    out = dataset.decode(small, PROMPTS, 20, EOS, size, top_k=4)
    for prompt, (tokens, features) in zip(PROMPTS, out):
        seq = prompt + tokens[:-1]  # the last token is emitted, never forwarded
        logits, hidden = small(torch.tensor([seq]), torch.arange(len(seq)), None, None)
        top = logits[0, len(prompt) - 1 :].softmax(-1).topk(4)  # (len(tokens), 4)
        assert features["hidden"].shape[0] == len(seq)
        assert torch.allclose(features["hidden"].float(), hidden[0], atol=1e-2)  # stored in fp16
        assert torch.equal(features["top_ids"].long(), top.indices)
        assert torch.allclose(features["top_p"].float(), top.values, atol=1e-3)


def small_through_kernels_c():
    """The tests' small model in bf16, every layer through kernels.c's twins."""
    torch.manual_seed(0)
    bf16 = rows.Model(tiny_config(vocab_size=12)).eval().requires_grad_(False)
    return kernels.use(bf16.to(torch.bfloat16), test_kernels.C)


@pytest.mark.parametrize("name", ["plain", "hydra++", "hydra++-shared", "heads+lookup"])
def test_a_bf16_batch_through_kernels_c_is_each_prompt_decoded_alone(name, native_path):
    """kernels.c's layers take the rows of a batch in one call (each row's cache, positions and gap
    its own; a row's tree smaller than its mates' without their padding) and compute every row
    alone: in bf16 too, a row of a greedy batch is its prompt's reply alone, token for token."""
    bf16 = small_through_kernels_c()
    calls, packed = [], []
    real = kernels.stack_native

    def recorded(s, x, *a):
        calls.append(len(x))
        packed.append(len(a) > 5 and a[5] is not None)  # sizes: some rows' padding left out
        return real(s, x, *a)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "stack_native", recorded)
        alone = [
            decode.generate(bf16, p, n, make_drafter(name, bf16), eos_ids=EOS)
            for p, n in zip(PROMPTS, LIMITS)
        ]
        batch = engine.generate_batch(bf16, PROMPTS, LIMITS, make_drafter(name, bf16), eos_ids=EOS)
    assert [b.tokens for b in batch] == [a.tokens for a in alone]
    assert max(calls) > 1, "no batch of several rows went through kernels.c's layers"
    assert any(packed) == (name in ("hydra++-shared", "heads+lookup")), "ragged rows packed"


def rows_drafted_together_and_alone(base, kind):
    """HeadsDrafter.draft over 5 rows (each its own draft state and root), and each row's
    draft() alone; the heads random, their tree cartesian 3, 2, 2."""
    heads = kernels.use(random_heads(base, kind).to(base.dtype))
    drafter = drafters.HeadsDrafter(heads, tree_lib.build(tree_lib.cartesian([3, 2, 2])))
    rows = [drafter.row() for _ in range(5)]
    for i, row in enumerate(rows):
        seeded = torch.Generator().manual_seed(i)
        row.h = torch.randn(1, base.cfg.dim, generator=seeded).to(base.dtype)
    roots = [3, 7, 3, 0, 11]
    together = drafter.draft(rows, roots)
    return [d.tokens for d in together], [draft_one(row, r).tokens for row, r in zip(rows, roots)]


@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra++"])
def test_rows_drafted_in_one_call_of_each_head_are_each_row_drafted_alone(small, kind):
    together, alone = rows_drafted_together_and_alone(small, kind)
    assert len({tuple(t.tolist()) for t in alone}) > 1, "the rows should draft different trees"
    for t, a in zip(together, alone):
        assert torch.equal(t, a)


@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra++"])
def test_rows_drafted_together_in_bf16_through_kernels_c_are_each_row_alone(kind, native_path):
    """kernels.c computes each row of a product alone: a row's draft does not depend on its mates
    in bf16 either."""
    bf16 = small_through_kernels_c()
    together, alone = rows_drafted_together_and_alone(bf16, kind)
    for t, a in zip(together, alone):
        assert torch.equal(t, a)


class Repeat:
    """A test drafter: a chain of `gamma` copies of the root, its largest draft every step."""

    legend = ["base model", "repeat"]

    def __init__(self, gamma):
        self.shapes = drafters.Shapes("cpu")
        self.name, self.max_nodes, self.max_depth = f"repeat {gamma}", 1 + gamma, gamma

    def row(self, generator=None):
        return self

    def start(self, prompt, hidden, max_len, cached=0):
        pass

    def draft(self, rows, roots):
        chain = lambda root: drafters.chains([[root] * self.max_depth], 1)
        return [self.shapes.draft(root, chain(root)) for root in roots]

    def accept(self, accepted):
        pass


@pytest.fixture(scope="module")
def echo():
    """A tiny model whose LM head is zero: every logit is 0, so greedy decoding emits token 0
    forever (argmax takes the first of equal values) and Repeat's chains of 0 are accepted whole."""
    torch.manual_seed(0)
    model = rows.Model(tiny_config(vocab_size=12)).eval().requires_grad_(False)
    model.lm_head.weight.zero_()
    return model


@pytest.mark.parametrize("size", [1, 4, 8])
@pytest.mark.parametrize("name", BATCHING + ["repeat"])
def test_rows_that_end_past_their_limit_leave_room_for_the_rest(echo, name, size):
    """The cache is sized for the longest prompt + reply and one largest draft. A row that ends
    accepts drafts past its limit (kept, not emitted); while it waits to leave the batch its
    entries must not push the next forward's slots past the cache's end. Every drafter at batch 1,
    4 and 8 (where an ended row lingers a step), the longest row ending first; Repeat drafts its
    largest tree every step and has it accepted."""
    prompts = [[0] * 30] + [[0] * (3 + i) for i in range(7)]
    limits = [8] + [25] * 7  # row 0's prompt + reply is the longest
    drafter = Repeat(4) if name == "repeat" else make_drafter(name, echo)
    batch = engine.generate_batch(echo, prompts, limits, drafter, batch_size=size)
    assert [r.tokens for r in batch] == [[0] * n for n in limits]
    if name == "repeat":
        assert batch[0].accepted == [4, 2], "row 0 keeps 2 drafts past its limit"


# --- the tree follows the batch ----------------------------------------------------------------


def by_batch(model, kind="hydra++"):
    """Random heads whose tree shrinks with the live rows: a bushy tree alone, a chain of one at 2
    or 3 rows, the root alone (plain decoding) from 4."""
    trees = {1: tree_lib.cartesian([3, 2, 2]), 2: tree_lib.chain(1), 4: []}
    heads = random_heads(model, kind)
    return drafters.HeadsByBatch(heads, {B: tree_lib.build(p) for B, p in trees.items()})


def test_heads_by_batch_draft_the_tree_of_the_live_rows(small):
    d = by_batch(small)
    rows = [d.row() for _ in range(5)]
    hidden = torch.randn(1, 4, small.cfg.dim)
    for r in rows:
        r.start([1, 2, 3, 4], hidden, 64)
    sizes = [len(d.draft(rows[:n], [5] * n)[0].tokens) for n in range(1, 6)]
    assert sizes == [1 + 3 + 6 + 12, 2, 2, 1, 1]
    assert d.max_nodes == 22 and d.max_depth == 3 and "tree by batch size" in d.name


@pytest.mark.parametrize("kind", ["hydra", "hydra++"])
def test_a_greedy_batch_whose_tree_follows_it_is_each_prompt_decoded_alone(small, kind):
    """Six prompts through 4 rows: at first every row decodes plainly, then, as rows end, the rest
    draft again, a chain at 2 or 3 rows and the bushy tree alone; each row is still its prompt
    decoded alone."""
    alone = [decode.generate(small, p, n, eos_ids=EOS) for p, n in zip(PROMPTS, LIMITS)]
    d = by_batch(small, kind)
    sizes = []  # (live rows, nodes) of every step
    draft = d.draft

    def recorded(rows, roots):
        drafts = draft(rows, roots)
        sizes.append((len(rows), len(drafts[0].tokens)))
        return drafts

    d.draft = recorded
    batch = engine.generate_batch(small, PROMPTS, LIMITS, d, eos_ids=EOS, batch_size=4)
    assert [r.tokens for r in batch] == [r.tokens for r in alone]
    assert {(4, 1), (2, 2), (1, 22)} <= set(sizes) <= {(4, 1), (3, 2), (2, 2), (1, 22)}


def test_the_draft_state_follows_every_kept_token_while_the_batch_drafts_nothing(small):
    """Hydra++ decoding plainly (a batch of 4 drafts the root alone) still feeds every kept token
    through its prefix layer: its draft state is the one computed afresh over the whole text."""
    d = by_batch(small)
    rows = [d.row() for _ in range(4)]
    prompt = [1, 2, 3, 4, 5]
    _, hidden = small(torch.tensor([prompt]), torch.arange(5))
    for r in rows:
        r.start(prompt, hidden, 64)
    text = list(prompt)
    for _ in range(6):  # a plain step of every row: the root kept, its state moved on
        (draft, *_) = d.draft(rows, [7] * 4)
        assert len(draft.tokens) == 1
        _, h = small(torch.tensor([text + [7]]), torch.arange(len(text) + 1))
        for r in rows:
            r.accept(drafters.Accepted([7], h[:, -1:], torch.tensor([len(text)]), nodes=[0]))
        text.append(7)
    _, hidden = small(torch.tensor([text]), torch.arange(len(text)))
    fresh = d.heads.context(hidden, torch.arange(len(text)), d.heads.new_cache(64))[:, -1]
    torch.testing.assert_close(rows[0].h, fresh, atol=1e-5, rtol=1e-5)


# --- one budget shared by the batch --------------------------------------------------------------


def shared(model, kind="hydra++", budgets=None):
    """Random heads whose batch shares a budget: the whole bushy tree alone, 3 nodes past the roots
    at 2 or 3 rows, none (plain decoding) from 4."""
    tree = tree_lib.build(tree_lib.cartesian([3, 2, 2]))
    budgets = budgets or {1: 21, 2: 3, 4: 0}
    return drafters.HeadsShared(random_heads(model, kind), tree, budgets)


@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra++"])
def test_a_shared_budget_goes_to_the_surest_nodes_of_every_row(small, kind):
    """E nodes past the roots in all, each row's a tree of the candidates, and no node left out
    that the heads were surer of than one taken."""
    d = shared(small, kind, {1: 21, 2: 5})
    rows = [d.row() for _ in range(3)]
    for i, r in enumerate(rows):
        r.start([1, 2, 3, 4 + i], torch.randn(1, 4, small.cfg.dim), 64)
    h = torch.cat([r.h for r in rows])
    tokens, confidence = drafters.fill_scored(d.heads, h, torch.tensor([5, 6, 7]), d.plan, 22)
    drafts = d.draft(rows, [5, 6, 7])
    assert sum(len(x.tokens) - 1 for x in drafts) == 5
    taken = []
    for b, x in enumerate(drafts):
        index = [d.tree.paths.index(p) + 1 for p in x.tree.paths]
        assert torch.equal(x.tokens, tokens[b, [0] + index]), "a row's own candidates"
        assert all(p[:-1] == () or p[:-1] in x.tree.paths for p in x.tree.paths), "a tree"
        taken += [(b, i) for i in index]
    left = [(b, i) for b in range(3) for i in range(1, 22) if (b, i) not in taken]
    assert min(confidence[b, i] for b, i in taken) >= max(confidence[b, i] for b, i in left)


@pytest.mark.parametrize("kind", ["hydra", "hydra++"])
def test_a_greedy_batch_sharing_a_budget_is_each_prompt_decoded_alone(small, kind, monkeypatch):
    """Six prompts through 4 rows: at first every row decodes plainly (budget 0), then, as rows
    end, 3 nodes shared by the 2 or 3 left and the whole tree alone; each row is still its prompt
    decoded alone, and Hydra++'s rows catch up in one call of the prefix layer."""
    alone = [decode.generate(small, p, n, eos_ids=EOS) for p, n in zip(PROMPTS, LIMITS)]
    d = shared(small, kind)
    sizes, pages = [], []  # (live rows, nodes past the roots) of every step; rows a page call
    draft = d.draft

    def recorded(rows, roots):
        drafts = draft(rows, roots)
        sizes.append((len(rows), sum(len(x.tokens) - 1 for x in drafts)))
        return drafts

    d.draft = recorded
    forward = drafters.Page.forward
    monkeypatch.setattr(
        drafters.Page, "forward", lambda page, p, m: pages.append(len(m)) or forward(page, p, m)
    )
    batch = engine.generate_batch(small, PROMPTS, LIMITS, d, eos_ids=EOS, batch_size=4)
    assert [r.tokens for r in batch] == [r.tokens for r in alone]
    assert {(4, 0), (2, 3), (1, 21)} <= set(sizes) <= {(4, 0), (3, 3), (2, 3), (1, 21)}
    assert (max(pages, default=0) > 1) == (kind == "hydra++"), "rows caught up in one call"


def test_heads_sharing_a_budget_beside_lookup_keep_each_rows_tokens(small):
    """heads+lookup in a batch: lookup's nodes beside the heads' shared budget (catalog.for_batches
    builds it so); each row is still its prompt decoded alone, token for token."""
    alone = [decode.generate(small, p, n, eos_ids=EOS) for p, n in zip(PROMPTS, LIMITS)]
    d = make_drafter("heads+lookup-shared", small)
    batch = engine.generate_batch(small, PROMPTS, LIMITS, d, eos_ids=EOS, batch_size=4)
    assert [r.tokens for r in batch] == [r.tokens for r in alone]
    assert sum(sum(r.accepted) for r in batch) > 0 and type(d.heads) is drafters.HeadsShared


def test_after_a_stretch_at_budget_0_a_row_drafts_what_it_would_have_never_stopping(small):
    """Two rows keep the same tokens: one drafts every step (its state follows them one by one),
    the other drafts nothing for 6 steps (a batch at budget 0), then catches up in one call: both
    then draft the same tree, so the row accepts what it would have had speculation never
    stopped."""
    d = shared(small, budgets={1: 21, 4: 0})
    prompt = [1, 2, 3, 4, 5]
    _, hidden = small(torch.tensor([prompt]), torch.arange(5))
    going, stopped = d.row(), d.row()
    going.start(prompt, hidden, 64)
    stopped.start(prompt, hidden, 64)
    idle = [d.row() for _ in range(3)]  # the batch mates that hold the budget at 0
    for r in idle:
        r.start(prompt, hidden, 64)
    text = list(prompt)
    for t in range(6):
        kept = [(7 + t) % 12, 3]  # the root and a draft kept by each row
        assert all(len(x.tokens) == 1 for x in d.draft([stopped] + idle, [kept[0]] * 4))
        d.draft([going], [kept[0]])
        _, h = small(torch.tensor([text + kept]), torch.arange(len(text) + 2))
        positions = torch.arange(len(text), len(text) + 2)
        for r in (going, stopped, *idle):
            r.accept(drafters.Accepted(kept, h[:, -2:], positions, nodes=[0, 1]))
        text += kept
    (after,) = d.draft([stopped], [9])
    (never,) = d.draft([going], [9])
    assert torch.equal(after.tokens, never.tokens) and after.tree.paths == never.tree.paths
    torch.testing.assert_close(stopped.h, going.h, atol=1e-5, rtol=1e-5)


def test_a_page_computes_the_slots_from_its_first_member_to_its_last(small):
    """Six rows on a page of 16, two of them (slots 1 and 3) catching up: the prefix layer runs
    over slots 1..3 alone; each member's state is its row's run alone, and the live row between
    them (slot 2) keeps its cached entries."""
    d = shared(small)
    rows = [d.row() for _ in range(6)]
    for i, r in enumerate(rows):
        prompt = [1, 2, 3, 4 + i][: 2 + i % 3]
        _, hidden = small(torch.tensor([prompt]), torch.arange(len(prompt)))
        r.start(prompt, hidden, 64)
    page = rows[0].cache.page
    assert len(page.owners) == 16 and [r.cache.slot for r in rows] == list(range(6))
    L1, L3 = rows[1].cache.length, rows[3].cache.length  # 3 and 2: row 2's 4 is the longest
    lone = d.heads.new_cache(64)  # slot 3's row caught up alone, from the same start
    lone.k[:, 0, :, :L3] = page.cache.k[:, 3, :, :L3]
    lone.v[:, 0, :, :L3] = page.cache.v[:, 3, :, :L3]
    lone.length = L3
    before = page.cache.k[:, 2, :, :4].clone()
    seen = []
    block = d.heads.prefix.block
    block.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    new = [torch.randn(1, n, small.cfg.dim) for n in (2, 1)]
    for r, h, L in zip((rows[1], rows[3]), new, (L1, L3)):
        r.accept(drafters.Accepted([5] * h.shape[1], h, torch.arange(L, L + h.shape[1]), [0]))
    d.catch_up([rows[1], rows[3]])
    assert seen == [3], "slots 1, 2 and 3 only"
    assert (rows[1].cache.length, rows[3].cache.length) == (L1 + 2, L3 + 1)
    assert torch.equal(page.cache.k[:, 2, :, :4], before), "the row between them untouched"
    alone = d.heads.context(new[1], torch.arange(L3, L3 + 1), lone)[:, -1]
    torch.testing.assert_close(rows[3].h, alone, atol=1e-5, rtol=1e-5)
