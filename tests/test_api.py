"""The Python API (specdec/api.py): README.md's "From Python" example runs as written from a folder
outside the repository, set up as the README says; a string, a message list and a batch each come
back as text and ids without the EOS; a greedy batch is its prompts one at a time, sharing the
budget tuned for the machine where there is one, else catalog's default rule; a chat's second
turn forwards only what its cache lacks, and answers as the one-shot reply does; a bad argument is
one APIError (a ValueError) naming it; the keywords' defaults are generate.py's flags'.

Most tests run a tiny random Llama saved as a model folder (fp32); the README's example runs the
real default model. Test: `python -m pytest -q tests/test_api.py`.
"""

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

import generate
from specdec.commands import generate as command
from conftest import save_tiny_model
from specdec import api
from specdec import drafters
from specdec.loading import catalog
from specdec.loading import checkpoint
from specdec.engines import decode
from test_generate import random_heads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["Hi", "Tell me a story.", "What is the capital of France?"]


def varied_model(folder, **config):
    """save_tiny_model's tiny Llama with its matrices redrawn at a scale that makes its greedy
    replies vary from token to token (at its own scale it repeats one token)."""
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8)
    save_tiny_model(folder, num_attention_heads=4, num_key_value_heads=2, **sizes, **config)
    path = os.path.join(folder, "model.safetensors")
    g = torch.Generator().manual_seed(0)
    state = load_file(path)
    for name, weight in state.items():
        if weight.dim() == 2:  # the matrices; the norms' weights stay ones
            state[name] = torch.randn(weight.shape, generator=g) * 0.3
    save_file(state, path)
    return str(folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return varied_model(tmp_path_factory.mktemp("varied"))


@pytest.fixture(scope="module")
def heads_folder(folder, tmp_path_factory):
    """Random hydra heads for the varied model, as train.py saves them."""
    base, _ = checkpoint.load(folder, "cpu", torch.float32)
    out = str(tmp_path_factory.mktemp("heads"))
    checkpoint.save_heads(random_heads(base, "hydra"), out)
    return out


@pytest.fixture(scope="module", params=["lookup", "heads", "layers:1"])
def sd(request, folder, heads_folder):
    """The varied model, drafted by prompt lookup, by random hydra heads (a chain of 3) or by its
    own first layer (whose drafts are sampled at a sampled reply's temperature)."""
    if request.param == "heads":
        return api.load(folder, heads=heads_folder, dtype="fp32", threads=1)
    return api.load(folder, draft=request.param, dtype="fp32", threads=1)


# --- the README's example -------------------------------------------------------------------------


def readme_example():
    """(the PYTHONPATH the README sets, the script's name, the script) of "From Python"."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text[text.index("## From Python") :]
    section = section[: section.index("\n## ")]
    path, script = re.search(r"^PYTHONPATH=(\S+) python (\S+)$", section, re.M).groups()
    blocks = re.findall(r"^```\w*\n(.*?)^```", section, re.S | re.M)
    code = next(b for b in blocks if "from specdec.api import load" in b)
    return path, script, code


def test_the_readme_example_runs_from_outside_the_repository(tmp_path):
    """Written to a file in a folder outside the repository and run there with PYTHONPATH the
    repository's folder, where the README's names a placeholder; without it, specdec is not
    found (the folder is outside)."""
    path, script, code = readme_example()
    assert path == "/path/to/clone" and os.path.relpath(tmp_path, ROOT).startswith(".." + os.sep)
    (tmp_path / script).write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(**more):
        argv = [sys.executable, script]
        return subprocess.run(argv, cwd=tmp_path, env=env | more, capture_output=True, text=True)

    alone = run()
    assert alone.returncode != 0 and "No module named 'specdec'" in alone.stderr
    r = run(PYTHONPATH=ROOT)  # the placeholder, /path/to/clone, is this checkout
    assert r.returncode == 0, r.stderr
    assert "<|im_end|>" not in r.stdout and "Paris" in r.stdout
    assert " [stop]\n" in r.stdout  # the streamed reply, cut at its stop string
    forwarded = int(r.stdout.splitlines()[-1])
    assert 0 < forwarded < 40  # the second turn's: its prompt is the whole conversation, 61 tokens


def test_a_model_py_of_yours_beside_your_script_is_named_in_one_line(tmp_path):
    """Your folder comes first on Python's path: a model.py there would stand in for the
    repository's and fail later as an AttributeError; the import says so instead."""
    (tmp_path / "model.py").write_text("x = 1\n")
    (tmp_path / "hello.py").write_text("from specdec.api import load\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(
        [sys.executable, "hello.py"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "AttributeError" not in r.stderr, r.stderr
    assert last == (
        f"ImportError: {tmp_path / 'model.py'} stands in for the repository's model.py ({ROOT}), "
        "which specdec imports by that name: your script's folder comes first on Python's path; "
        "rename your model.py, or run the script from another folder"
    )


# --- replies: text and ids without EOS ------------------------------------------------------------


def test_a_string_a_message_list_and_a_batch_come_back_without_eos(folder, tmp_path):
    """A model whose EOS is a token its greedy reply makes: the reply stops there, and neither its
    ids nor its text holds it, whether the prompt is a string, the same as messages, or in a
    batch."""
    plain = api.load(folder, heads="none", dtype="fp32", threads=1)
    first = plain.generate(PROMPTS[1], max_new_tokens=12)
    k = max(i for i, t in enumerate(first.ids) if t not in first.ids[:i])
    eos = first.ids[k]  # its first appearance, k tokens in
    eos_model = varied_model(tmp_path / "eos", eos_token_id=eos)  # the same weights
    sd = api.load(eos_model, heads="none", dtype="fp32", threads=1)
    assert eos in sd.eos_ids
    messages = [{"role": "user", "content": PROMPTS[1]}]
    replies = [sd.generate(PROMPTS[1], max_new_tokens=16), sd.generate(messages, max_new_tokens=16)]
    replies += sd.generate_batch([PROMPTS[1], messages, PROMPTS[0]], max_new_tokens=16)
    for r in replies[:4]:
        assert r.stopped == "eos" and r.ids == first.ids[:k] and r.stats["new_tokens"] == k + 1
        assert r.text == sd.tokenizer.decode(first.ids[:k], skip_special_tokens=True)
    for r in replies:
        assert not set(r.ids) & sd.eos_ids and isinstance(r.text, str) and str(r) == r.text
        assert r.stopped in ("eos", "length")


def test_a_reply_carries_its_statistics(sd):
    r = sd.generate(PROMPTS[2], max_new_tokens=10)
    assert r.stopped == "length" and len(r.ids) == r.stats["new_tokens"] == 10
    assert r.stats["tau"] == 10 / r.stats["steps"] and r.stats["tokens_per_s"] > 0
    assert len(r.stats["accepted_by_depth"]) == sd.drafter.max_depth
    assert repr(sd).startswith("[tiny-random-llama on cpu, float32, ")


def test_a_greedy_batch_is_its_prompts_one_at_a_time(sd):
    alone = [sd.generate(p, max_new_tokens=16) for p in PROMPTS]
    for batch_size in (1, 2, 8):
        batch = sd.generate_batch(PROMPTS, batch_size=batch_size, max_new_tokens=16)
        assert [r.ids for r in batch] == [r.ids for r in alone]
        assert [r.text for r in batch] == [r.text for r in alone]


def test_a_stream_gives_generates_text_piece_by_piece_from_the_first_step(sd, monkeypatch):
    """Greedy: the pieces join into generate()'s text, and the first comes before the reply's
    second step ends (the decoding runs a piece ahead of the reader at most)."""
    alone = sd.generate(PROMPTS[1], max_new_tokens=24)
    steps = []
    real = decode.step
    monkeypatch.setattr(decode, "step", lambda *a, **k: steps.append(1) or real(*a, **k))
    stream = sd.stream(PROMPTS[1], max_new_tokens=24)
    pieces = []
    for piece in stream:
        pieces.append((piece, len(steps)))
    assert "".join(p for p, _ in pieces) == alone.text and len(pieces) > 1
    assert pieces[0][1] <= 2 < alone.stats["steps"] - 1, pieces
    assert stream.reply.ids == alone.ids and stream.reply.stopped == alone.stopped
    with pytest.raises(api.APIError, match="read already"):
        list(stream)


def test_a_stream_left_early_ends_its_decoding(sd, monkeypatch):
    steps = []
    real = decode.step
    monkeypatch.setattr(decode, "step", lambda *a, **k: steps.append(1) or real(*a, **k))
    stream = sd.stream(PROMPTS[1], max_new_tokens=200)
    for _ in stream:
        break
    assert len(steps) <= 3 and stream.reply.stopped == "stop"


def test_a_stop_string_ends_the_reply_before_it(sd):
    whole = sd.generate(PROMPTS[1], max_new_tokens=24)
    stop = whole.text[10:13]
    cut = whole.text[: whole.text.index(stop)]
    r = sd.generate(PROMPTS[1], max_new_tokens=24, stop=["never said", stop])
    assert r.text == cut and r.stopped == "stop" and r.ids == whole.ids[: len(r.ids)]
    assert stop in sd.tokenizer.decode(r.ids) and stop not in sd.tokenizer.decode(r.ids[:-1])
    assert r.stats["new_tokens"] < whole.stats["new_tokens"]
    assert "".join(sd.stream(PROMPTS[1], max_new_tokens=24, stop=stop)) == cut
    batch = sd.generate_batch([PROMPTS[1], PROMPTS[0]], max_new_tokens=24, stop=stop)
    assert batch[0].text == cut and batch[0].stopped == "stop" and batch[0].ids == r.ids
    never = sd.generate(PROMPTS[1], max_new_tokens=24, stop="never said")
    assert (never.text, never.ids, never.stopped) == (whole.text, whole.ids, whole.stopped)


def test_help_lists_every_argument_and_every_field():
    for function in (api.load, api.Decoder.generate, api.Decoder.generate_batch, api.Decoder.chat):
        said = inspect.getdoc(function)
        for name in inspect.signature(function).parameters:
            assert name == "self" or re.search(rf"\b{name}\b", said), (function.__name__, name)
    said = inspect.getdoc(api.Reply)
    assert all(field in said for field in ("text", "ids", "stopped", "stats", "tokens_per_s"))
    assert all(value in inspect.getdoc(api.Decoder.generate) for value in api.verify_lib.VERIFIERS)


def test_a_batch_rows_statistics_are_its_own(folder, tmp_path):
    """A row that ends early (at its EOS) reports its own time and rate, not the batch's."""
    plain = api.load(folder, heads="none", dtype="fp32", threads=1)
    first = plain.generate(PROMPTS[1], max_new_tokens=24)
    eos = first.ids[3]
    sd = api.load(varied_model(tmp_path / "eos", eos_token_id=eos), heads="none", dtype="fp32")
    rows = [PROMPTS[1], PROMPTS[2]]
    short, long = sd.generate_batch(rows, max_new_tokens=24)
    assert short.stopped == "eos" and short.stats["new_tokens"] < long.stats["new_tokens"]
    assert short.stats["seconds"] < long.stats["seconds"]
    for r in (short, long):
        assert r.stats["tokens_per_s"] == r.stats["new_tokens"] / r.stats["seconds"]


def test_a_seed_gives_the_same_sampled_reply(sd):
    runs = [sd.generate(PROMPTS[0], max_new_tokens=12, temperature=1.0, seed=s) for s in (3, 3, 4)]
    assert runs[0].ids == runs[1].ids != runs[2].ids


@pytest.mark.parametrize("draft, temperature", [("heads", 0.0), ("layers:1", 1.0), ("lookup", 0.7)])
def test_a_reply_is_generate_pys_for_the_same_flags(folder, draft, temperature, capsys):
    """The same text as `python generate.py` with the keywords as flags, sampled too (a model's own
    drafts sampled from the reply's generator, as generate.py's are)."""
    sd = api.load(folder, draft=draft, dtype="fp32", threads=1)
    r = sd.generate(PROMPTS[1], max_new_tokens=12, temperature=temperature, seed=3)
    flags = [
        "--model",
        folder,
        "--draft",
        draft,
        "--dtype",
        "fp32",
        "--threads",
        "1",
        "--seed",
        "3",
    ]
    flags += ["--prompt", PROMPTS[1], "--max-new-tokens", "12", "--temperature", str(temperature)]
    capsys.readouterr()
    assert generate.cli_main(flags) == 0
    assert capsys.readouterr().out == r.text + "\n"


# --- a chat ---------------------------------------------------------------------------------------


def test_a_chat_keeps_its_cache_and_answers_as_a_one_shot_reply(sd):
    chat = sd.chat(system="Be brief.", max_new_tokens=8)
    first = chat.send(PROMPTS[0])
    second = chat.send(PROMPTS[1])
    assert first.stats["forwarded"] == first.stats["prompt_tokens"]
    assert 0 < second.stats["forwarded"] < second.stats["prompt_tokens"]
    roles = ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in chat.messages] == roles
    again = sd.generate(chat.messages[:-1], max_new_tokens=8)  # the one-shot reply, new cache
    assert second.ids == again.ids
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "Be brief."}]


# --- bad arguments --------------------------------------------------------------------------------

BAD_LOADS = [
    ("heads", dict(heads="hydar")),
    ("heads", dict(heads=3)),
    ("tree", dict(draft="lookup", tree="chain:2")),
    ("draft", dict(draft="lookahed")),
    ("draft", dict(draft="heads+lookup", heads="none")),
    ("gamma", dict(draft="lookup", gamma=0)),
    ("gamma", dict(draft="lookup", gamma="3")),
    ("ngram", dict(draft="layers:2", ngram=2)),
    ("dtype", dict(dtype="fp8")),
    ("device", dict(device="tpu")),
    ("quantize", dict(quantize="int3")),
    ("threads", dict(threads=-1)),
    ("cuda_graphs", dict(cuda_graphs="yes")),
]


def assert_one_error(e, name):
    """One APIError, a ValueError, naming `name` in the keywords' words and nothing chained."""
    assert isinstance(e, api.APIError) and isinstance(e, ValueError)
    assert name in str(e) and "--" not in str(e) and "\n" not in str(e)
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)


@pytest.mark.parametrize("name, kw", BAD_LOADS, ids=[str(kw) for _, kw in BAD_LOADS])
def test_a_bad_load_argument_is_one_error_before_the_model_loads(name, kw, no_model):
    with pytest.raises(api.APIError) as e:
        api.load(**kw)
    assert_one_error(e.value, name)


def test_a_model_that_cannot_load_is_one_error():
    with pytest.raises(api.APIError) as e:
        api.load("/no/such/folder")
    assert_one_error(e.value, "model '/no/such/folder'")


BAD_CALLS = [
    ("temperature", dict(temperature=-1)),
    ("temperature", dict(temperature="hot")),
    ("top_p", dict(top_p=2)),
    ("verify", dict(verify="greedy", temperature=0.5)),
    ("verify", dict(verify="best")),
    ("seed", dict(seed=-1)),
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("max_new_tokens", dict(max_new_tokens=10**6)),
    ("prompt", dict(prompt=42)),
    ("prompt", dict(prompt="   ")),
    ("prompt", dict(prompt=[{"role": "bot", "content": "hi"}])),
    (
        "prompt",
        dict(prompt=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]),
    ),
    ("system", dict(system=3)),
]


@pytest.mark.parametrize("name, kw", BAD_CALLS, ids=[str(kw) for _, kw in BAD_CALLS])
def test_a_bad_generate_argument_is_one_error(sd, name, kw):
    kw = {"prompt": PROMPTS[0]} | kw
    with pytest.raises(api.APIError) as e:
        sd.generate(**kw)
    assert_one_error(e.value, name)


def test_bad_batch_and_chat_arguments_are_one_error(sd):
    for name, call in [
        ("prompts", lambda: sd.generate_batch("Hi")),
        ("prompts", lambda: sd.generate_batch([])),
        ("prompts[1]", lambda: sd.generate_batch(["Hi", 7])),
        ("prompts[1] is empty", lambda: sd.generate_batch(["Hi", " "])),
        ("prompts: a generator, not a list", lambda: sd.generate_batch(p for p in PROMPTS)),
        ("use generate_batch([...])", lambda: sd.generate(["Hi", "Ho"])),
        ("use generate_batch([...])", lambda: sd.stream(["Hi", "Ho"])),
        ("stop=['']: a string or a list of strings", lambda: sd.generate("Hi", stop=[""])),
        ("batch_size", lambda: sd.generate_batch(["Hi"], batch_size=0)),
        ("top_p", lambda: sd.chat(top_p=0)),
        ("message", lambda: sd.chat().send("")),
    ]:
        with pytest.raises(api.APIError) as e:
            call()
        assert_one_error(e.value, name)


def test_messages_are_put_in_the_keywords_words():
    values = {"draft": "heads", "heads": "hydra", "top_p": 1.5}
    said = api.in_keywords(
        "--heads hydra: no hydra heads are shipped; train them with train.py --heads hydra --out "
        "FOLDER, then pass --heads FOLDER; --draft heads+lookup; --top-p 1.5: must be in (0, 1]",
        values,
    )
    assert said == (
        "heads='hydra': no hydra heads are shipped; train them with train.py --heads hydra --out "
        "FOLDER, then pass heads FOLDER; draft heads+lookup; top_p=1.5: must be in (0, 1]"
    )


# --- the keywords are the flags -------------------------------------------------------------------


def test_the_keywords_defaults_are_generate_pys_flags():
    """Each keyword of load(), generate() and chat() that names a flag has the flag's default;
    generate_batch's batch_size is the API's own (8 rows: --batch-size 1 means one at a time)."""
    parser = command.build_parser()
    for function in (api.load, api.Decoder.generate, api.Decoder.chat, api.Decoder.generate_batch):
        for name, p in inspect.signature(function).parameters.items():
            if p.default is inspect.Parameter.empty or name == "batch_size":
                continue
            assert p.default == parser.get_default(name), f"{function.__name__}: {name}"
    assert api.MAX_NEW_TOKENS == command.MAX_NEW_TOKENS
    assert set(api.SIZES) == set(command.SIZES)


def test_importing_the_package_imports_nothing():
    """specdec.ctrl_c, an entry script's first import, loads neither torch nor the API: the
    package's __init__.py holds its table of contents and no code."""
    code = (
        "import sys, specdec.ctrl_c; assert 'torch' not in sys.modules; "
        "import specdec.cli; assert 'specdec.api' not in sys.modules"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_batch_shares_the_budget_tuned_for_the_machine(folder, heads_folder, tmp_path):
    """Heads with a budget the batch shares (bench.py --tune-tree's table): generate_batch drafts
    with it, as generate.py --batch-size does, and its replies are still the ones alone."""
    heads = shutil.copytree(heads_folder, tmp_path / "heads")
    base, _ = checkpoint.load(folder, "cpu", torch.float32)
    table = {"pool": [[0], [0, 0], [0, 0, 0]], "by_batch": {"1": {"extra": 3}, "2": {"extra": 2}}}
    file = catalog.tuned_tree_file(str(heads), "cpu", torch.float32, "budget")
    with open(file, "w") as f:
        json.dump({"by_batch": {"1": {"paths": [[0]]}}, "shared": table}, f)
    sd = api.load(folder, heads=str(heads), dtype="fp32", threads=1)
    assert type(sd.drafter) is drafters.HeadsDrafter
    assert type(sd.batch_drafter) is drafters.HeadsShared and sd.batch_drafter.budgets == {
        1: 3,
        2: 2,
    }
    alone = [sd.generate(p, max_new_tokens=16) for p in PROMPTS]
    batch = sd.generate_batch(PROMPTS, batch_size=3, max_new_tokens=16)
    assert [r.ids for r in batch] == [r.ids for r in alone]
    assert "tuned in budget-cpu-" in sd.batch_drafter.name


def test_a_batch_where_no_budget_was_tuned_shares_the_default_rule(folder, heads_folder, tmp_path):
    """Heads with no budget table for this machine (another kernels.c path, another dtype, a
    user's own heads: here the table removed): the rows share catalog.UNTUNED_BUDGETS, drafting
    from the heads' own tree and decoding plainly from 4 rows, never every row the whole tree; the
    banner says it is the default rule; the replies are still the ones alone."""
    from specdec import terminal

    heads = shutil.copytree(heads_folder, tmp_path / "heads")
    table = {"pool": [[0], [0, 0]], "by_batch": {"1": {"extra": 1}}}
    file = catalog.tuned_tree_file(str(heads), "cpu", torch.float32, "budget")
    with open(file, "w") as f:
        json.dump({"by_batch": {"1": {"paths": [[0]]}}, "shared": table}, f)
    tuned = api.load(folder, heads=str(heads), dtype="fp32", threads=1).batch_drafter
    assert tuned.budgets == {1: 1} and "tuned in " + os.path.basename(file) in tuned.name
    os.remove(file)  # the machine without a table
    sd = api.load(folder, heads=str(heads), dtype="fp32", threads=1)
    d = sd.batch_drafter
    assert type(d) is drafters.HeadsShared and d.budgets == catalog.UNTUNED_BUDGETS
    assert d.tree.paths == sd.drafter.tree.paths, "the candidates: the heads' own tree"
    assert [d.budget(rows)[0] for rows in (1, 2, 3, 4, 8, 16)] == [2, 2, 2, 0, 0, 0]
    batch_run = types.SimpleNamespace(model=sd.model, drafter=d)  # generate.py --batch-size 4
    banner = terminal.banner_line(batch_run, sd.draft, device="cpu", quantize="none", threads=1)
    assert f"the default rule, no {os.path.basename(file)} tuned: 1: 2, 2: 2, 4: 0)" in banner
    sizes = []  # (live rows, nodes past the roots) of every step
    draft = d.draft

    def recorded(rows, roots):
        drafts = draft(rows, roots)
        sizes.append((len(rows), sum(len(x.tokens) - 1 for x in drafts)))
        return drafts

    d.draft = recorded
    prompts = PROMPTS + ["Name two colours.", "Count to five."]
    alone = [sd.generate(p, max_new_tokens=16) for p in prompts]
    batch = sd.generate_batch(prompts, batch_size=4, max_new_tokens=16)
    assert [r.ids for r in batch] == [r.ids for r in alone]
    assert all(nodes == 0 for rows, nodes in sizes if rows >= 4), "plain decoding from 4 rows"
    assert all(nodes <= 2 for rows, nodes in sizes if rows < 4)
    assert any(nodes > 0 for _, nodes in sizes), "the rows drafted once fewer were left"
