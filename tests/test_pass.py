"""PaSS's [LA] tokens: every node of a step sees what its definition says (the chain its prefix, an
[LA] group the chain up to its node and its own [LA]s), and computes what a plain forward of that
sequence computes; greedy decoding with them is token-identical to plain greedy decoding; added
tokens leave the vocabulary's embeddings alone; pass_tokens.py trains them (the held-out chain tau
rises) and writes what `generate.py --draft pass:FOLDER` decodes with; bad input is one line."""

import json

import pytest
import torch
from safetensors.torch import save_file

from specdec.loading import catalog
from specdec.cli import plural
from specdec.loading import checkpoint
from specdec import drafters as D
from specdec.engines import decode
from specdec import rows
from specdec.training import pass_tokens
from conftest import save_tiny_model, tiny_config, draft_one
from test_bench_cli import run_bench, short_run
from test_cli import check_one_line_error, run_cli


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return rows.Model(tiny_config(**kw)).eval().requires_grad_(False)


def test_added_tokens_embed_the_vocabulary_as_before():
    """model.embed(ids, extra): ids below V as the vocabulary's embedding, ids V.. as extra's rows;
    the model itself is left as it was loaded (PaSS passes its rows with every forward)."""
    model = tiny()
    V = model.cfg.vocab_size
    ids = torch.arange(V)[None]
    before = model.embed_tokens(ids)
    extra = torch.randn(3, model.cfg.dim)
    assert torch.equal(model.embed(ids, extra), before)
    assert torch.equal(model.embed(torch.tensor([[V, V + 1, V + 2]]), extra)[0], extra)
    d = D.PaSS(model, extra, 2)
    assert d.la[:2] == [V, V + 1] and type(model.embed_tokens) is torch.nn.Embedding


@pytest.mark.parametrize("K, G", [(1, 1), (2, 1), (3, 1), (1, 3), (3, 2)])
def test_every_node_sees_its_definition_and_computes_a_plain_forward(K, G):
    model = tiny(vocab_size=32)
    d = D.PaSS(model, torch.randn(K, model.cfg.dim), K, G)
    t, n = d.tree, d.tree.num_nodes
    assert t.paths == [(r,) for r in range(G)] + [(0,) * k for k in range(2, K + 1)]
    # (g, 0): tree node g; (g, j): the j-th [LA] after it
    cell = lambda i: (i, 0) if i < n else ((i - n) // K, (i - n) % K + 1)
    for i in range(n * (K + 1)):  # brute force, from the definitions
        g, j = cell(i)
        for k in range(n * (K + 1)):
            h, m = cell(k)
            assert d.mask[i, k] == (
                (m == 0 and bool(t.mask[g, h])) or (j > 0 and h == g and 0 < m <= j)
            ), (i, k)
        assert d.depth[i] == t.depth[g] + j
    prompt, root = [3, 1, 4, 1, 5], 9
    cache = model.new_cache(64)
    model(torch.tensor([prompt]), torch.arange(5), None, cache)
    cache.keep(range(5))
    d.start(prompt, None, 64)
    d.first, d.rest = [7, 2, 6][:G], [11, 12][: K - 1]
    draft = draft_one(d, root)
    logits, _ = model(
        draft.tokens[None], cache.length + draft.depth, draft.mask, cache, extra=draft.extra
    )
    for g in range(n):
        seq = prompt + draft.tokens[t.mask[g].nonzero()[:, 0]].tolist()  # the root .. node g
        fresh, _ = model(torch.tensor([seq]), torch.arange(len(seq)))
        assert torch.allclose(logits[0, g], fresh[0, -1], atol=1e-5)
        for j in range(1, K + 1):
            fresh, _ = model(
                torch.tensor([seq + d.la[:j]]), torch.arange(len(seq) + j), extra=d.extra
            )
            assert torch.allclose(logits[0, n + g * K + j - 1], fresh[0, -1], atol=1e-5), (g, j)


@pytest.mark.parametrize("K, G", [(3, 1), (1, 3), (2, 2)])
def test_accept_reads_the_group_after_the_last_kept_node(K, G):
    model = tiny(vocab_size=32)
    d = D.PaSS(model, torch.randn(K, model.cfg.dim), K, G)
    d.start([1], None, 64)
    d.first, d.rest = [7, 2, 6][:G], [11, 12][: K - 1]
    draft = draft_one(d, 9)
    n = d.tree.num_nodes
    for path in [()] + d.tree.paths:
        node = ([()] + d.tree.paths).index(path)
        logits = torch.zeros(len(draft.tokens), 32)
        # its group says 20, 21, ...
        logits[n + node * K : n + node * K + K, 20 : 20 + K] = torch.eye(K) * 5
        logits[n + node * K, 25 : 25 + G] = torch.arange(
            G, 0, -1
        ).float()  # and 25, 26, ... next for the first
        nodes = d.tree.mask[node].nonzero()[:, 0].tolist()  # the root .. the node
        d.accept(D.Accepted(draft.tokens[nodes].tolist(), logits=logits, nodes=nodes))
        assert d.first == ([20] + list(range(25, 25 + G)))[:G] and d.rest == list(
            range(21, 20 + K)
        ), (path, d.first, d.rest)
        d.first, d.rest = [7, 2, 6][:G], [11, 12][: K - 1]
        draft_one(d, 9)


@pytest.mark.parametrize("K, guesses", [(1, 1), (2, 1), (4, 1), (1, 3), (2, 4)])
def test_greedy_equals_plain(K, guesses):
    """Random [LA] tokens: steps that accept nothing, some that accept (the tiny model repeats
    itself)."""
    model = tiny(vocab_size=12)
    prompts = [[s, 3, 5, 7, 1][: 3 + s] for s in range(4)]
    plain = [decode.generate(model, p, 40).tokens for p in prompts]
    torch.manual_seed(1)
    d = D.PaSS(model, torch.randn(K, model.cfg.dim), K, guesses)
    for p, want in zip(prompts, plain):
        r = decode.generate(model, p, 40, d)
        assert r.tokens == want and r.steps <= len(want)


def self_distilled(model, n, seed=0):
    """n conversations: 3 random tokens and 5, then the model's own greedy answer of 20 (a tiny
    random model with tied embeddings repeats its last token: 5 5 5 ..., what [LA] tokens can learn
    alone)."""
    g = torch.Generator().manual_seed(seed)
    convs = []
    for _ in range(n):
        prompt = torch.randint(6, model.cfg.vocab_size, (3,), generator=g).tolist() + [5]
        convs.append(
            (prompt + decode.generate(model, prompt, 20).tokens, [False] * 4 + [True] * 20)
        )
    return convs


def save_convs(convs, path):
    save_file(
        {
            "ids": torch.cat([torch.tensor(c) for c, _ in convs]).int(),
            "loss": torch.cat([torch.tensor(m) for _, m in convs]),
            "offsets": torch.tensor([0] + [len(c) for c, _ in convs]).cumsum(0),
        },
        str(path),
    )
    return str(path)


def test_training_raises_the_held_out_tau_and_the_tokens_get_accepted(tmp_path):
    folder = save_tiny_model(
        tmp_path / "model", num_hidden_layers=2, hidden_size=32, intermediate_size=64, vocab_size=64
    )
    base, _ = checkpoint.load(folder)
    convs = self_distilled(base, 40)
    out = tmp_path / "pass"
    code = pass_tokens.cli_main(
        [
            "--model",
            folder,
            "--data",
            save_convs(convs, tmp_path / "convs.safetensors"),
            "--conversations",
            "30",
            "--eval-conversations",
            "2",
            "--tokens",
            "2",
            "--batch",
            "2",
            "--epochs",
            "2",
            "--lr",
            "0.05",
            "--dtype",
            "fp32",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "tokens.json").read_text())
    assert (
        report["tokens"] == 2
        and report["curve"][-1]["chain_tau"] > report["curve"][0]["chain_tau"] + 0.5
    ), report["curve"]
    prompt = convs[0][0][:4]
    plain = decode.generate(base, prompt, 30)
    r = decode.generate(base, prompt, 30, catalog.pass_drafter(str(out), 2, 1, base))
    assert r.tokens == plain.tokens and r.steps < plain.steps / 2


BAD_FLAGS = {
    "--tokens 0": "--tokens 0: must be at least 1",
    "--stride -1": "--stride -1: must be at least 1",
    "--lr nan": "--lr nan: must be a number > 0",
    "--data chats.jsonl": "give a conversations file",
    "--seed -3": "--seed -3: out of range",
    "--tokens 17": "use 1 to 16",
}


@pytest.mark.parametrize("flags", BAD_FLAGS)
def test_bad_training_flags_are_one_line(no_model, capsys, tmp_path, flags):
    code = pass_tokens.cli_main(["--out", str(tmp_path / "out"), *flags.split()])
    check_one_line_error(code, capsys.readouterr().err, BAD_FLAGS[flags])


def test_an_out_folder_with_files_is_refused_and_kept(no_model, capsys, tmp_path):
    (tmp_path / "tokens.json").write_text("{}")
    check_one_line_error(
        pass_tokens.cli_main(["--out", str(tmp_path)]), capsys.readouterr().err, "is not empty"
    )
    assert (tmp_path / "tokens.json").read_text() == "{}"


def test_bad_draft_pass_input_is_one_line(capsys, tmp_path, tiny_model_dir):
    base = ["--model", tiny_model_dir, "--prompt", "hi", "--max-new-tokens", "4"]
    check_one_line_error(
        *run_cli(capsys, *base, "--draft", f"pass:{tmp_path / 'none'}")[::2], "no [LA] tokens in"
    )
    other = tmp_path / "other"
    other.mkdir()
    model = tiny(vocab_size=64)  # another base model: its fingerprint is not the tiny checkpoint's
    checkpoint.save_tokens(str(other), torch.randn(3, model.cfg.dim), model, {})
    check_one_line_error(
        *run_cli(capsys, *base, "--draft", f"pass:{other}")[::2], "trained for another base model"
    )
    mine = tmp_path / "mine"
    mine.mkdir()
    loaded, _ = checkpoint.load(tiny_model_dir)
    checkpoint.save_tokens(str(mine), torch.randn(3, loaded.cfg.dim), loaded, {})
    check_one_line_error(
        *run_cli(capsys, *base, "--draft", f"pass:{mine}", "--gamma", "4")[::2],
        "holds 3 [LA] tokens",
    )
    check_one_line_error(
        *run_cli(capsys, *base, "--draft", f"pass:{mine}", "--gamma", "40")[::2], "over MAX_NODES"
    )
    check_one_line_error(
        *run_cli(capsys, *base, "--draft", f"pass:{mine}", "--guesses", "0")[::2],
        "--guesses 0: must be at least 1",
    )
    check_one_line_error(
        *run_cli(capsys, *base, "--draft", f"pass:{mine}", "--guesses", "600")[::2],
        "over MAX_NODES",
    )
    check_one_line_error(
        *run_cli(capsys, *base, "--draft", f"pass:{mine}", "--window", "2")[::2],
        "--window does not apply to --draft pass",
    )
    (mine / "tokens.safetensors").write_bytes(b"garbage")
    check_one_line_error(
        *run_cli(capsys, *base, "--draft", f"pass:{mine}")[::2],
        "no [LA] tokens of pass_tokens.py there",
    )


def test_bench_tunes_pass_where_it_finds_tokens_for_the_model_and_then_uses_them(
    capsys, tmp_path, tiny_model_dir
):
    common = short_run(tmp_path, tiny_model_dir, limit=2, max_new_tokens=6, repeats=None)
    common += ["--heads-dir", tmp_path]
    check_one_line_error(
        *run_bench(capsys, *common, "--methods", "pass")[::2], "no [LA] tokens for this model"
    )
    loaded, _ = checkpoint.load(tiny_model_dir)
    (tmp_path / "pass").mkdir()
    checkpoint.save_tokens(str(tmp_path / "pass"), torch.randn(2, loaded.cfg.dim), loaded, {})
    code, out, err = run_bench(capsys, *common, "--tune-parallel", "--tune-repeats", 1)
    assert code == 0 and "| pass | gamma 2 guesses 2 |" in out and "| pass | gamma 3" not in out, (
        err
    )  # at most the 2 trained
    saved = json.loads(
        open(catalog.tuned_tree_file(tmp_path, "cpu", torch.float32, "parallel")).read()
    )
    code, out, err = run_bench(capsys, *common, "--methods", "pass", "--repeats", 1)
    assert (
        code == 0
        and f"[bench] pass: {plural(saved['pass']['gamma'], '[LA] token')}" in err
        and "(tuned for this machine)" in err
    ), err
    assert any(
        line.startswith("| pass |") and line.endswith("| yes |") for line in out.splitlines()
    ), out
