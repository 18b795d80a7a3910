"""
The training data of draft heads: conversations (token ids, and a mask marking the assistant's
tokens) with the frozen base model's features of every token, on disk.

    python train.py --num-prompts 30000 --export-conversations convs.safetensors  # write, then
    export
    python train.py --data convs.safetensors                                      # features again

1. self-distillation (self_distill): the base model writes user prompts itself (Magpie-style: the
   chat template up to the start of a user turn, seeded with a task and a topic, then sample), they
   are filtered for length and near-duplicates (PromptFilter), and the model answers them greedily,
   as the heads will be used. Prompts and answers run through the decode loop (engine.py),
   many rows at once (decode). Or a user's ShareGPT-style JSONL (read_sharegpt).
2. features: per token, the base model's final hidden state and its top-k next-token probabilities
   (the teacher), recorded while answering or by one pass over given conversations (features_of).
   Training never runs the base model again. Shards hold whole conversations and are written whole
   or not at all; training reads them memory-mapped (load_data).
3. the cache: features are keyed by what shapes them (data_key) and checked before use; the
   conversations alone (3 bytes a token) are exported to a file small enough to commit
   (export_conversations), from which --data or --continue-from rebuilds the features.

train.py runs these stages and then trains on what load_data returns. Tests: tests/test_train.py,
tests/test_train_cli.py. Shapes: B batch, T time, D hidden, V vocabulary, k teacher top-k.
"""

import bisect
import copy
import hashlib
import json
import os
import re
import shutil
import sys
import time

import torch
from tqdm import tqdm

from specdec.loading import checkpoint
from specdec import drafters
from specdec.engines import engine
from specdec.fast import kernels
import model as model_lib
from specdec.loading.checkpoint import encode, eos_ids
from specdec.cli import UsageError, check_text, notice, plural, threads_flag

# the repository, two folders above this file
HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- decoding: the data stage's engine ----------------------------------------------------------
# engine.generate_batch, the one decode loop: `batch` rows at a time, each prompt taking the row of
# one that ends. The features are what the base model computed as it wrote the answer, recorded by
# a drafter that proposes nothing (plain decoding): the final hidden states over the prompt (its
# prefill, start()) and at every committed token (accept()), and the logits that chose each token.


class Recorder:
    """Plain decoding's drafter that records the features train.py learns from, a record per
    prompt in the order they start (the engine's queue: the prompts' order): hidden states over
    the prompt and at every committed token, and the top-k next-token probabilities before each
    answer token (the first from the prompt's last hidden state)."""

    name, legend, max_nodes, max_depth = "heads: none (plain decoding)", ["base model"], 1, 0

    def __init__(self, model, top_k):
        self.model = model
        self.top_k = top_k
        self.plain = drafters.Plain(model.device)
        self.records = []  # shared by every row()

    def row(self, generator=None):  # start() makes the state
        return copy.copy(self)

    def start(self, prompt, hidden, max_len, cached=0):
        self.record = {"hidden": [hidden[0].half()], "top_ids": [], "top_p": []}  # (T, D)
        self.records.append(self.record)
        self.teach(self.model.lm_head(hidden[0, -1:]))  # (1, V): the first answer token's teacher

    def draft(self, rows, roots):
        return self.plain.draft(rows, roots)

    def accept(self, accepted):  # plain decoding: a step keeps its root, then emits the bonus
        self.record["hidden"].append(accepted.hidden[0].half())  # (1, D)
        self.teach(accepted.logits)  # (1, V)

    def teach(self, logits):
        top = logits.float().topk(self.top_k, dim=-1)  # (1, k): normalised over the vocabulary
        p = (top.values - logits.float().logsumexp(-1, keepdim=True)).exp()
        self.record["top_ids"].append(top.indices.int())
        self.record["top_p"].append(p.half())


def decode(
    model, prompts, max_new, stop_ids, batch, temperature=0.0, top_p=1.0, seeds=None, top_k=0
):
    """[(new ids, features)] for the prompts (lists of ids), in their order. A reply stops after a
    stop token (kept) or max_new tokens. Greedy at temperature 0; else sampled, prompt i on its own
    generator seeded seeds[i]. With top_k > 0 features are recorded as features_of records them:
    hidden (T-1, D) at every position but the last of prompt + answer, top_ids / top_p
    (len(answer), k) the model's top-k next-token probabilities before each answer token; else
    features is None."""
    recorder = Recorder(model, top_k) if top_k else None
    generators = None
    if temperature > 0:
        generators = [torch.Generator(device=model.device).manual_seed(s) for s in seeds]
    replies = engine.generate_batch(
        model,
        prompts,
        [max_new] * len(prompts),
        recorder,
        temperature=temperature,
        top_p=top_p,
        generators=generators,
        eos_ids=stop_ids,
        batch_size=batch,
    )
    if not top_k:
        return [(reply.tokens, None) for reply in replies]
    assert len(recorder.records) == len(replies), "a record a prompt"
    features = [{k: torch.cat(v) for k, v in r.items()} for r in recorder.records]
    return [(reply.tokens, f) for reply, f in zip(replies, features)]


def normalise(text):
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).split()


class PromptFilter:
    """Length and near-duplicate filter: at least 3 words (--max-prompt-tokens bounds the rest), no
    chat-template markers, and no earlier prompt with the same first six words after its opener
    (the seed words it began with: comparing the openers themselves would let a six-word opener be
    used once) or sharing over half of its word trigrams (Jaccard). An index from trigram to
    prompts keeps each check proportional to the prompt, not the data."""

    def __init__(self, openers=()):
        # longest first
        self.openers = sorted({tuple(normalise(o)) for o in openers}, key=len, reverse=True)
        self.heads, self.grams, self.index = set(), [], {}
        self.tried = self.rejected_duplicate = 0

    def head(self, words):
        skip = next((len(o) for o in self.openers if tuple(words[: len(o)]) == o), 0)
        return " ".join(words[: skip + 6])

    def keep(self, text):
        from collections import Counter

        self.tried += 1
        words = normalise(text)
        if len(words) < 3 or "im_start" in text or "im_end" in text:
            return False
        head = self.head(words)
        grams = {tuple(words[i : i + 3]) for i in range(len(words) - 2)}
        shared = Counter(j for g in grams for j in self.index.get(g, ()))
        if head in self.heads or any(
            n / len(grams | self.grams[j]) > 0.5 for j, n in shared.items()
        ):
            self.rejected_duplicate += 1
            return False
        self.heads.add(head)
        for g in grams:
            self.index.setdefault(g, []).append(len(self.grams))
        self.grams.append(grams)
        return True


def prompt_diversity(prompts):
    """How varied a set of prompts is, in figures a reader can compare across data sets: how many
    distinct openings (first word, first three words) and how many of all word trigrams are
    distinct (1.0: no phrase ever repeats). PromptFilter has already rejected near-duplicates."""
    words = [normalise(p) for p in prompts]
    grams = [tuple(w[i : i + 3]) for w in words for i in range(len(w) - 2)]
    n = max(len(words), 1)
    return dict(
        prompts=len(words),
        first_words=len({w[0] for w in words if w}) / n,
        openings=len({tuple(w[:3]) for w in words}) / n,
        distinct_trigrams=len(set(grams)) / max(len(grams), 1),
    )


def diversity_line(prompts):
    d = prompt_diversity(prompts)
    return (
        f"{plural(d['prompts'], 'prompt')}: {d['first_words']:.1%} distinct first words, "
        f"{d['openings']:.1%} distinct "
        f"3-word openings, {d['distinct_trigrams']:.1%} of word trigrams distinct"
    )


def read_seeds(path):
    """data/magpie.json: {"tasks": {category: [openers]}, "topics": [...]}, checked field by
    field."""
    try:
        with open(path, encoding="utf-8") as f:
            seeds = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(
            f"--seeds {path}: not a readable JSON file ({e}); fix it or pass another"
        ) from None
    tasks, topics = (
        seeds.get("tasks") if isinstance(seeds, dict) else None,
        seeds.get("topics") if isinstance(seeds, dict) else None,
    )
    if not (
        isinstance(tasks, dict)
        and tasks
        and all(
            isinstance(v, list) and v and all(isinstance(o, str) for o in v) for v in tasks.values()
        )
        and isinstance(topics, list)
        and topics
        and all(isinstance(t, str) and t.strip() for t in topics)
    ):
        raise UsageError(
            f"--seeds {path}: needs "
            f'{{"tasks": {{category: [opener, ...]}}, "topics": [topic, ...]}}, '
            "each list non-empty and of strings"
        )
    return tasks, topics


def task_counts(prompts, tasks):
    """Conversations per task so far: a prompt belongs to the task of the longest seed opener it
    begins with (an opener two tasks share, to the first that lists it; a prompt written without
    a seed, to none)."""
    openers = sorted(
        ((o, task) for task, task_openers in tasks.items() for o in task_openers),
        key=lambda x: -len(x[0]),
    )
    counts = dict.fromkeys(tasks, 0)
    for p in prompts:
        task = next((task for o, task in openers if p.startswith(o)), None)
        if task is not None:
            counts[task] += 1
    return counts


def seeded_prefix(tokenizer, rng, tasks, topics, counts):
    """Magpie with a seed: a system message naming a task and a topic, then the chat template up
    to where the user's words begin, then an opener of that task. The model writes the rest of the
    user's message. Returns (prefix ids, opener). The task is drawn with weight 1 / (its
    conversations so far + 1): the tasks whose prompts are dropped most (too long to end within
    --max-prompt-tokens: summarisation, extraction) are drawn more, so that they catch up."""
    names = sorted(tasks)
    category = rng.choices(names, weights=[1 / (counts[t] + 1) for t in names])[0]
    opener, topic = rng.choice(tasks[category]), rng.choice(topics)
    system = (
        f"You are a helpful AI assistant. The user asks you for help with a {category} task about "
        f"{topic}."
    )
    marker = "\x00MARK\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": marker}], tokenize=False
    )
    return tokenizer(
        text[: text.index(marker)] + opener, add_special_tokens=False
    ).input_ids, opener


DRY_PROMPTS = 4096  # written in a row with none kept: the model cannot write prompts
# written with none ended: --max-prompt-tokens is too short for the model's prompts (or it never
# ends a turn); said at once rather than after DRY_PROMPTS
UNENDED_PROMPTS = 32


def self_distill(model, tokenizer, folder, args):
    """Grow the data set in `folder` to args.num_prompts conversations: the model writes prompts
    (Magpie, seeded from args.seeds), they are filtered, and it answers them greedily, its features
    recorded as it goes. One shard per batch (args.gen_batch rows; 0: kernels.sizes's for the
    device), each written whole or not at all: a run that stops loses at most the conversations in
    flight, and the next run continues from the shards on disk (its random draws seeded by how many
    there are)."""
    import random

    os.makedirs(folder, exist_ok=True)
    shards = shards_in(folder)
    tasks, topics = read_seeds(args.seeds)
    filt = PromptFilter(o for openers in tasks.values() for o in openers)
    written = folder_prompts(folder)
    for p in written:
        filt.keep(p)
    have, counts_by_task = len(written), task_counts(written, tasks)
    if have >= args.num_prompts:
        return
    stop = eos_ids(model, tokenizer)
    rng = random.Random(args.seed * 1_000_003 + have)
    # each reply samples on its own generator (the engine's rows), seeded from this one
    seeder = torch.Generator().manual_seed(args.seed * 1_000_003 + have)
    batch = args.gen_batch or kernels.sizes(model.device, kernels.in_use(model).native).gen_batch
    t0, counts = time.time(), dict(new=0, answer=0, tried=0, ended=0, kept=0)
    bar = tqdm(total=args.num_prompts, initial=have, desc="data", unit="conv", disable=None)
    pending, dry = [], 0  # dry: prompts written since the last one kept

    def flush():  # the finished conversations -> one shard, written whole or not at all
        nonlocal have, pending
        write_shard(os.path.join(folder, f"shard-{len(shards):05d}.safetensors"), pending)
        shards.append(None)
        have, counts["kept"] = have + len(pending), counts["kept"] + len(pending)
        bar.update(len(pending))
        bar.set_postfix_str(
            f"{counts['new'] / (time.time() - t0):.0f} new tok/s, kept "
            f"{counts['kept']}/{counts['tried']} prompts"
        )
        pending = []

    try:
        while have < args.num_prompts:
            # 1. prompts for a round of 8 batches: the model writes twice that, and every candidate
            # runs
            # to its end (stopping at the first `want` done would keep the quickest, i.e. the
            # shortest
            # prompts); then the filter keeps new ones, in the order they were drawn
            want = min(8 * batch, args.num_prompts - have)
            seeded = [
                seeded_prefix(tokenizer, rng, tasks, topics, counts_by_task)
                for _ in range(2 * want)
            ]
            ended = {}
            seeds = torch.randint(1 << 62, (len(seeded),), generator=seeder).tolist()
            written_all = decode(
                model, [p for p, _ in seeded], args.max_prompt_tokens, stop, batch, 1.0, 0.95, seeds
            )
            for i, (written, _) in enumerate(written_all):
                counts["new"], counts["tried"] = counts["new"] + len(written), counts["tried"] + 1
                if written[-1] in stop:
                    counts["ended"] += 1
                    ended[i] = (
                        seeded[i][1] + tokenizer.decode(written[:-1], skip_special_tokens=True)
                    ).strip()
            prompts = []
            for i in sorted(ended):
                if have + len(prompts) < args.num_prompts and filt.keep(ended[i]):
                    prompts.append(ended[i])
            for task, n in task_counts(prompts, tasks).items():
                counts_by_task[task] += n
            if not counts["ended"] and counts["tried"] >= UNENDED_PROMPTS:
                raise UsageError(
                    f"--max-prompt-tokens {args.max_prompt_tokens}: none of the "
                    f"{counts['tried']} user prompts the model wrote ended within it (with one "
                    f"of the stop tokens {sorted(stop)}), so no prompt fit; give a larger "
                    "--max-prompt-tokens, or your own data with --data"
                )
            dry = dry + 2 * want if not prompts else 0
            if dry >= DRY_PROMPTS:  # else this loop would never end
                raise UsageError(
                    f"the model wrote {dry} user prompts in a row and none was kept (each must end "
                    f"with one of the stop tokens {sorted(stop)} within {args.max_prompt_tokens} "
                    "tokens and be new); use a chat model whose end-of-turn token is among its EOS "
                    "ids, or give your own data with --data"
                )
            if not prompts:  # none kept this round: write more
                continue
            # 2. their answers, greedy, with features, in one stream (finished rows are refilled);
            # a shard whenever a batch of them are done
            encoded = [encode(tokenizer, p) for p in prompts]
            seeds = torch.randint(1 << 62, (len(encoded),), generator=seeder).tolist()
            answers = decode(
                model,
                encoded,
                args.max_answer_tokens,
                stop,
                batch,
                args.answer_temperature,
                1.0,
                seeds,
                top_k=args.teacher_k,
            )
            for ids, prompt, (answer, feats) in zip(encoded, prompts, answers):
                pending.append(
                    dict(
                        prompt=prompt,
                        ids=ids + answer,
                        loss=[False] * len(ids) + [True] * len(answer),
                        teacher_from=len(ids) - 1,
                        **{k: v.cpu() for k, v in feats.items()},
                    )
                )
                counts["new"] += len(answer)
                counts["answer"] += len(answer)
                if len(pending) == batch:
                    flush()
            if pending:
                flush()
    finally:
        bar.close()
        seconds = time.time() - t0
        print(
            f"[data] {plural(counts['kept'], 'conversation')}, "
            f"{plural(counts['new'], 'new token')} "
            f"({counts['answer']} in answers) in "
            f"{seconds:.0f} s: {counts['new'] / max(seconds, 1e-9):.0f} new tokens/s; prompts "
            f"kept {counts['kept']}/{counts['tried']}, "
            f"{plural(filt.rejected_duplicate, 'near-duplicate')} rejected; "
            f"{plural(have, 'conversation')} in {folder}",
            file=sys.stderr,
            flush=True,
        )


# --- features on disk ----------------------------------------------------------------------------
# A shard holds whole conversations, concatenated: per token its id, whether it is an assistant
# token (loss), the base model's final hidden state (fp16) and its top-k next-token probabilities
# (zero where not needed). `offsets` marks where each conversation begins.


def write_shard(path, convs):
    from safetensors.torch import save_file

    D, k = convs[0]["hidden"].shape[1], convs[0]["top_ids"].shape[1]
    cols = {"ids": [], "loss": [], "hidden": [], "top_ids": [], "top_p": []}
    for c in convs:
        T, s = len(c["ids"]), c["teacher_from"]
        cols["ids"].append(torch.tensor(c["ids"], dtype=torch.int32))
        cols["loss"].append(torch.tensor(c["loss"], dtype=torch.bool))
        hidden = torch.zeros(T, D, dtype=torch.float16)
        hidden[: len(c["hidden"])] = c["hidden"].half()
        top_ids, top_p = (
            torch.zeros(T, k, dtype=torch.int32),
            torch.zeros(T, k, dtype=torch.float16),
        )
        n = len(c["top_ids"])
        top_ids[s : s + n], top_p[s : s + n] = c["top_ids"].int(), c["top_p"].half()
        for name, t in (("hidden", hidden), ("top_ids", top_ids), ("top_p", top_p)):
            cols[name].append(t)
    tensors = {name: torch.cat(v).contiguous() for name, v in cols.items()}
    tensors["offsets"] = torch.tensor([0] + [len(c["ids"]) for c in convs]).cumsum(0)
    save_file(
        tensors,
        path + ".tmp",
        metadata={"prompts": json.dumps([c.get("prompt", "") for c in convs])},
    )
    replace_durably(path + ".tmp", path)  # a shard is whole or absent


def replace_durably(tmp, path):
    """os.replace(tmp, path) once tmp's bytes are on disk: after a crash of the machine, not only of
    the process, path is the old file or the new one, never a new name over unwritten pages."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path, meta_only=False):
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        if meta_only:
            return json.loads(f.metadata()["prompts"])
        return {name: f.get_tensor(name) for name in f.keys()}


def folder_prompts(folder):
    """The prompts of every conversation in a data folder, in order (read from the shards'
    metadata)."""
    return [
        p for f in shards_in(folder) for p in read_shard(os.path.join(folder, f), meta_only=True)
    ]


# --- user data: ShareGPT-style conversations -----------------------------------------------------

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def records(path):
    """[(where, record)] of a data file: JSON Lines (one object a line) or one JSON array of
    objects;
    `where` names the line or the array index for messages."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not valid UTF-8 text (bad byte at offset {e.start}); save it as UTF-8"
        ) from None
    if text.lstrip().startswith("["):  # the usual ShareGPT .json: one array
        try:
            return [(f"{path}, record {i}", r) for i, r in enumerate(json.loads(text))]
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(
                f"{path}: not valid JSON at line {e.lineno}, column {e.colno} ({e.msg}); fix the "
                "file"
            ) from None
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append((f"{path}, line {n}", json.loads(line)))
            except (json.JSONDecodeError, RecursionError) as e:
                out.append(
                    (
                        f"{path}, line {n}",
                        ValueError(f"{path}, line {n}: not valid JSON ({getattr(e, 'msg', e)})"),
                    )
                )
    return out


def messages_of(record, where):
    """[{"role", "content"}] of a ShareGPT record ({"conversations": [{"from", "value"}]}) or an
    OpenAI-style one ({"messages": [{"role", "content"}]})."""
    if isinstance(record, Exception):
        raise record
    try:
        turns = record["conversations"] if "conversations" in record else record["messages"]
        fields = ["from" if "from" in t else "role" for t in turns]  # ShareGPT's or OpenAI's
        speakers = [t[field] for t, field in zip(turns, fields)]
        messages = [
            {
                "role": ROLES.get(who) if isinstance(who, str) else None,
                "content": t.get("value", t.get("content")),
            }
            for t, who in zip(turns, speakers)
        ]
        assert messages and all(isinstance(m["content"], str) for m in messages)
    except (KeyError, TypeError, AssertionError, AttributeError):
        raise ValueError(
            f"{where}: expected "
            f'{{"conversations": [{{"from": "human"|"gpt", "value": "..."}}, ...]}} '
            f'or {{"messages": [{{"role": "user"|"assistant", "content": "..."}}, ...]}}'
        ) from None
    for i, m in enumerate(messages):  # the format is right but a speaker is unknown: say which
        if m["role"] is None:
            said = f'"{fields[i]}": {json.dumps(speakers[i])}'
            raise ValueError(
                f"{where}: turn {i + 1} has {said}, which is not a role here; "
                f"use one of {', '.join(ROLES)}"
            )
    for m in messages:
        check_text(m["content"], where)
    return messages


def cut_replies(record, messages, where):
    """The indices of the replies a record marks as cut short ("cut": [...], written by chat's
    /save for replies stopped by --max-new-tokens or Ctrl-C), checked: each an assistant turn."""
    cut = record.get("cut", [])
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not isinstance(cut, list) or not all(type(i) is int and i in replies for i in cut):
        raise ValueError(
            f'{where}: "cut": {json.dumps(cut)} should list indices of assistant turns '
            f"({', '.join(map(str, replies)) or 'there are none'}); fix it or leave it out"
        )
    return set(cut)


def conversation_tokens(messages, tokenizer, where, cut=()):
    """(ids, loss mask) of a conversation in the chat template; the mask marks the assistant's
    tokens. cut: the indices of replies cut short (chat's /save marks them): the template closes
    every reply with its end-of-turn tokens, but the model never said them there, so they are
    left out of a cut reply's mask (all of the reply, where its text cannot be told from them)."""
    ids, loss = [], []

    def extend(upto, speaker_is_assistant, generation_prompt=False):
        """Append the tokens that rendering messages[:upto] adds after `ids`."""
        try:
            text = tokenizer.apply_chat_template(
                messages[:upto], tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # the template's own refusal (jinja), e.g. roles that must alternate
            raise ValueError(
                f"{where}: the model's chat template refuses this conversation "
                f"({' '.join(str(e).split())}); fix the turns or leave the line out"
            ) from None
        full = tokenizer(text, add_special_tokens=False).input_ids
        if full[: len(ids)] != ids:
            raise ValueError(
                f"{where}: the chat template renders the earlier turns differently once turn "
                f"{upto} follows, so its tokens cannot be given to their speakers; leave the line "
                "out"
            )
        new = full[len(ids) :]
        ids.extend(new)
        loss.extend([speaker_is_assistant] * len(new))

    for i, m in enumerate(messages):  # render turn by turn, so each token knows its speaker
        if m["role"] == "assistant" and i > 0:
            # the assistant's header is the prompt's, as in decoding
            extend(i, False, generation_prompt=True)
        start = len(ids)
        extend(i + 1, m["role"] == "assistant")
        if i in cut:
            said = start  # where the reply's own text ends: none of it, unless it is found
            if i > 0:
                text = tokenizer.apply_chat_template(
                    messages[:i], tokenize=False, add_generation_prompt=True
                )
                own = tokenizer(text + m["content"], add_special_tokens=False).input_ids
                if ids[: len(own)] == own and len(own) >= start:
                    said = len(own)
            loss[said : len(ids)] = [False] * (len(ids) - said)
    return ids, loss


SKIP_BAD = "fix it, or add --skip-bad to leave out the conversations that cannot be read"


def check_data(path, skip_bad):
    """--data FILE, before the model loads: a conversations file that --export-conversations
    wrote, or a ShareGPT-style file whose records all read as conversations (as read_sharegpt
    reads them, but for the chat template, which needs the model's tokenizer): one with an
    assistant's turn, none that cannot be read unless skip_bad. A UsageError names the first
    problem and, where it is a record's, --skip-bad."""
    if path.endswith(".safetensors"):
        conversation_tensors(path)
        return
    if os.path.isdir(path):
        raise UsageError(f"--data {path}: is a folder; {DATA_FIX}")
    try:
        found = records(path)
    except OSError as e:
        raise UsageError(f"--data {path}: cannot read it ({e.strerror}); {DATA_FIX}") from None
    except ValueError as e:  # not UTF-8, a JSON array that does not parse
        raise UsageError(f"--data {e}") from None
    readable, bad = [], []
    for where, record in found:
        try:
            readable.append(messages_of(record, where))
            cut_replies(record, readable[-1], where)
        except ValueError as e:
            bad.append(str(e))
    if bad and (not skip_bad or len(bad) == len(found)):
        held = f"{len(bad)} of {plural(len(found), 'conversation')} cannot be read"
        fix = SKIP_BAD if len(bad) < len(found) else "fix the file"
        raise UsageError(f"--data {path}: {held}, the first: {bad[0]}; {fix}")
    if not found:
        raise UsageError(f"--data {path}: no conversations in the file; give one a line")
    if not any(m["role"] == "assistant" for messages in readable for m in messages):
        raise UsageError(
            f'--data {path}: no conversation has an assistant turn ("from": "gpt" or "role": '
            '"assistant"); heads learn from the assistant\'s replies, so add them'
        )


def read_sharegpt(path, tokenizer, skip_bad=False):
    """[(ids, loss mask)] from a ShareGPT-style or OpenAI-style data file (JSONL or a JSON array).
    The loss mask marks the assistant's tokens, but not the end-of-turn of a reply the record
    marks as cut short ("cut", as chat's /save writes it). Errors name the line; skip_bad leaves
    bad records out and says how many, else the first one stops the run. Nothing is dropped
    silently."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{path}: the model's tokenizer has no chat template, so conversations cannot be laid "
            "out "
            "as the model reads them; use a chat model (tokenizer_config.json with a chat_template)"
        )
    convs, bad = [], []
    for where, record in records(path):
        try:
            messages = messages_of(record, where)
            cut = cut_replies(record, messages, where)
            convs.append(conversation_tokens(messages, tokenizer, where, cut))
        except ValueError as e:
            if not skip_bad:
                raise ValueError(f"{e}; {SKIP_BAD}") from None
            bad.append(str(e))
    if bad:
        notice(
            f"{len(bad)} of {plural(len(bad) + len(convs), 'conversation')} left out "
            f"(--skip-bad); the first: {bad[0]}"
        )
    if not convs:
        raise ValueError(f"{path}: no conversations in the file")
    if not any(any(loss) for _, loss in convs):
        raise ValueError(
            f'{path}: no conversation has an assistant turn ("from": "gpt" or "role": '
            '"assistant"); '
            "heads learn from the assistant's replies, so add them"
        )
    return convs


def exported_already(path):
    """(ids, offsets) of the conversations file at `path`, which --export-conversations may replace
    only with more of the same conversations; a UsageError if it is something else."""
    from safetensors.torch import load_file

    try:
        t = load_file(path)
        return t["ids"].int(), t["offsets"]
    except Exception:  # safetensors' own error on a file of another kind, or a missing tensor
        raise UsageError(
            f"--export-conversations {path}: that file is not a conversations file; give a new "
            "file name (it is left as it is)"
        ) from None


def export_conversations(folder, path):
    """The conversations of a data folder (any shards: self-distilled or features_of's) as one small
    file: token ids (uint16 when every id fits, as for vocabularies up to 65,536; else int32),
    assistant-token mask, offsets, and the prompts in its metadata: 3 bytes a token. The features
    are left out (about 1 KB a token); --data path computes them again. A file already at `path`
    is replaced only when these conversations begin with its own (the data grew), else refused."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    parts = []
    for f in shards_in(folder):
        with safe_open(
            os.path.join(folder, f), "pt"
        ) as shard:  # these three only: features are ~1 KB a token
            parts.append({k: shard.get_tensor(k) for k in ("ids", "loss", "offsets")})
    prompts = folder_prompts(folder)
    lengths = torch.cat([p["offsets"].diff() for p in parts])
    ids = torch.cat([p["ids"] for p in parts]).int()
    tensors = {
        "ids": ids.to(torch.uint16) if ids.max() < 1 << 16 else ids,
        "loss": torch.cat([p["loss"] for p in parts]),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
    }
    if os.path.exists(path):
        old_ids, old_offsets = exported_already(path)
        n = len(old_offsets) - 1
        if (
            n > len(lengths)
            or not torch.equal(tensors["offsets"][: n + 1], old_offsets)
            or not torch.equal(ids[: len(old_ids)], old_ids)
        ):
            raise UsageError(
                f"--export-conversations {path}: it holds {plural(n, 'conversation')} that "
                f"the data in {folder} does not begin with; give a new file name (it is left "
                "as it is)"
            )
    save_file(tensors, path + ".tmp", metadata={"prompts": json.dumps(prompts)})
    replace_durably(path + ".tmp", path)
    return len(lengths), len(tensors["ids"]), int(tensors["loss"].sum())


def conversation_flags(p, data_help, eval_conversations):
    """--model, --data, --conversations, --eval-conversations of the scripts that train on the
    conversations train.py exported and on its split of them (joint.py, pass_tokens.py)."""
    p.add_argument("--model", default=checkpoint.DEFAULT, help=checkpoint.MODEL_HELP)
    p.add_argument(
        "--data",
        default=os.path.join(HERE, "data", "smollm2-135m-instruct-conversations.safetensors"),
        help=f"a conversations file written by train.py --export-conversations ({data_help})",
    )
    p.add_argument(
        "--conversations",
        type=int,
        default=2000,
        help="train on the first this many of train.py's training split",
    )
    p.add_argument(
        "--eval-conversations",
        type=int,
        default=eval_conversations,
        help="evaluate on the first this many of its held-out split",
    )


def run_flags(p, seed_help, out_help):
    """--device, --threads, --seed and --out (required), the last flags of the same scripts."""
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    threads_flag(p)
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--out", required=True, help=out_help)


def check_conversations_file(path, flag="--data"):
    if not path.endswith(".safetensors"):
        raise UsageError(
            f"{flag} {path}: give a conversations file (.safetensors) written by train.py "
            "--export-conversations"
        )
    conversation_tensors(path, flag)


def conversation_tensors(path, flag="--data"):
    """(ids, loss mask, offsets) of a file written by export_conversations; a UsageError naming
    `flag` if it is not one."""
    from safetensors.torch import load_file

    try:
        t = load_file(path)
        return t["ids"].int(), t["loss"], t["offsets"].tolist()
    except Exception as e:  # safetensors' own error on a damaged file, or a missing tensor
        raise UsageError(
            f"{flag} {path}: not a conversations file written by --export-conversations ({e})"
        ) from None


def largest_id(path, flag="--data"):
    """The largest token id in a conversations file (checked against the model's vocabulary)."""
    ids = conversation_tensors(path, flag)[0]
    return int(ids.max()) if len(ids) else -1


def read_conversations(path, flag="--data"):
    """[(ids, loss mask)] from a file written by export_conversations."""
    ids, loss, offsets = conversation_tensors(path, flag)
    return [(ids[a:b].tolist(), loss[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]


def conversation_prompts(path):
    """The prompts stored with a file written by export_conversations (one per conversation)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return json.loads((f.metadata() or {}).get("prompts", "[]"))


def continue_from(model, folder, path, key, per_shard=128):
    """--continue-from FILE: an empty self-distillation folder begins with FILE's conversations,
    their features computed in one pass (shards of 128 conversations, as self_distill writes them,
    each moved into the folder when it is written), so a new machine continues the committed data
    instead of writing it again. A folder that already begins with them is left as it is (or
    completed, if a stop cut the seeding short); one that holds other data is refused."""
    prompts, have = conversation_prompts(path), folder_prompts(folder)
    if "" in prompts:
        raise UsageError(
            f"--continue-from {path}: its conversations have no prompts recorded (it was exported "
            "from "
            "a --data file, not from self-distilled data); train on it with --data instead"
        )
    if have[: len(prompts)] != prompts[: len(have)]:
        raise UsageError(
            f"--continue-from {path}: the self-distilled data in {folder} did not begin with these "
            "conversations; use another --work, or leave --continue-from out to grow that data"
        )
    if len(have) >= len(prompts):
        return
    convs = read_conversations(path, "--continue-from")
    if len(prompts) != len(convs):
        raise UsageError(
            f"--continue-from {path}: it holds {plural(len(convs), 'conversation')} but "
            f"{plural(len(prompts), 'prompt')}; "
            "give a file written by --export-conversations from self-distilled data"
        )
    print(
        f"[train] self-distilled data begins with the {plural(len(convs), 'conversation')} of "
        f"{path}: "
        "computing the features "
        f"of {len(convs) - len(have)}",
        file=sys.stderr,
        flush=True,
    )
    seed = folder + ".seed"
    # a shard at a time: a stop loses at most the one in flight
    for at in range(len(have), len(convs), per_shard):
        features_of(
            model,
            convs[at : at + per_shard],
            seed,
            key["teacher_k"],
            batch_tokens=float("inf"),
            key=key,
            prompts=prompts[at : at + per_shard],
        )
        os.replace(
            os.path.join(seed, "shard-00000.safetensors"),
            os.path.join(folder, f"shard-{len(shards_in(folder)):05d}.safetensors"),
        )
    shutil.rmtree(seed, ignore_errors=True)  # the folder's own key.json (check_self_data's) stays


@torch.inference_mode()
def features_of(model, convs, folder, top_k, batch_tokens=1 << 16, key=None, prompts=None):
    """One pass of the base model over user conversations -> shards like self_distill's (with
    `prompts` in their metadata when given), a shard every `batch_tokens` tokens (~75 MB: few files
    open while training reads them). They are written into folder.tmp with key.json last
    (see data_key), and renamed over folder at the end: an interrupted pass (Ctrl-C, a full disk)
    leaves the old folder or none, never a part, and no folder.tmp."""
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        write_features(model, convs, tmp, top_k, batch_tokens, key, prompts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def write_features(model, convs, tmp, top_k, batch_tokens, key, prompts):
    """features_of's pass, into the folder `tmp`: the shards, then key.json."""
    batch, size, n = [], 0, 0
    bar, t0 = tqdm(convs, desc="features", disable=None), time.time()
    for i, (ids, loss) in enumerate(bar):
        # no bar (a log file): a line every tenth
        if bar.disable and i and i % max(1, len(convs) // 10) == 0:
            print(
                f"[features] {i}/{len(convs)} conversations, {time.time() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        ids = ids[: model.cfg.max_seq_len]
        logits, hidden = model(
            torch.tensor([ids], device=model.device), torch.arange(len(ids), device=model.device)
        )
        top = logits[0, :-1].float().softmax(-1).topk(top_k, dim=-1)  # (T-1, k)
        batch.append(
            dict(
                ids=ids,
                loss=loss[: len(ids)],
                teacher_from=0,
                hidden=hidden[0, :-1].cpu(),
                prompt=prompts[i] if prompts else "",
                top_ids=top.indices.cpu(),
                top_p=top.values.cpu(),
            )
        )
        size += len(ids)
        if size >= batch_tokens or i == len(convs) - 1:
            write_shard(os.path.join(tmp, f"shard-{n:05d}.safetensors"), batch)
            batch, size, n = [], 0, n + 1
    with open(os.path.join(tmp, KEY_FILE), "w") as f:
        json.dump(
            {"key": key or {}, "shards": [f"shard-{i:05d}.safetensors" for i in range(n)]},
            f,
            indent=1,
        )


def map_shard(path):
    """A shard's tensors, memory-mapped: their bytes are read from disk when used, and the
    operating system keeps what fits in its page cache. A safetensors file is 8 bytes (n, little
    endian), n bytes of JSON naming each tensor's dtype, shape and byte range, then those bytes."""
    import numpy as np

    dtypes = {
        "F16": np.float16,
        "F32": np.float32,
        "I32": np.int32,
        "I64": np.int64,
        "BOOL": np.bool_,
    }
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    # one mapping of the whole file (one open file descriptor a shard, however many tensors), mode
    # "c": copy-on-write, i.e. writable for torch but never written back to the file
    raw = np.memmap(path, np.uint8, "c")
    out = {}
    for name, info in header.items():
        if name != "__metadata__":
            (a, b), shape, dtype = info["data_offsets"], tuple(info["shape"]), dtypes[info["dtype"]]
            out[name] = torch.from_numpy(raw[8 + n + a : 8 + n + b].view(dtype).reshape(shape))
    return out


class Column:
    """One per-token feature (hidden, top_ids, top_p) of all of a folder's shards, end to end,
    left memory-mapped: column[a:e] is tokens a..e-1, a range within one shard (a conversation
    never spans two), read from disk when asked for."""

    def __init__(self, parts):
        self.parts = parts
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + len(p))
        self.shape = (self.starts[-1],) + tuple(parts[0].shape[1:])

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, span):
        i = bisect.bisect_right(self.starts, span.start) - 1
        a = self.starts[i]
        assert span.stop <= self.starts[i + 1], f"tokens {span.start}..{span.stop} span two shards"
        return self.parts[i][span.start - a : span.stop - a]


def load_data(folder):
    """All shards of a folder: ids, loss, teacher_top1 (the teacher's top-1 id per token, -1 where
    none was recorded) and offsets in memory, concatenated; hidden, top_ids and top_p as Columns,
    memory-mapped (5M tokens of them are ~6 GB)."""
    shards = shards_in(folder)
    if not shards:
        raise ValueError(f"no data shards in {folder}")
    parts = [map_shard(os.path.join(folder, f)) for f in shards]
    data = {k: torch.cat([p[k] for p in parts]) for k in ("ids", "loss")}
    data["teacher_top1"] = torch.cat(
        [torch.where(p["top_p"][:, 0] > 0, p["top_ids"][:, 0], -1) for p in parts]
    )
    data.update({k: Column([p[k] for p in parts]) for k in ("hidden", "top_ids", "top_p")})
    lengths = torch.cat([p["offsets"].diff() for p in parts])
    data["offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return data


# --- the data cache: keyed by what shapes it, checked before use ----------------------------------
# Next to its shards a data folder holds key.json: what the stored features depend on (data_key:
# the base model (by its weights, not its name), its dtype and context, --teacher-k, and for
# --data FILE the sha256 of the file's bytes). Features of a user's file are reused only when that
# key is this run's and every shard is there and readable; otherwise they are computed again, with
# a notice saying why.
# Self-distilled data records its features while it is written (hours), so it is never thrown
# away: a run with other settings is refused, and an unreadable shard is set aside as *.broken.

KEY_FILE = "key.json"
SHARD_KEYS = {"ids", "loss", "hidden", "top_ids", "top_p", "offsets"}


DATA_FIX = "give a ShareGPT-style JSONL file, or 'self' to let the model write its own data"


def file_digest(path):
    """--data FILE: the sha256 of its bytes, or a UsageError saying what is wrong with the path."""
    if os.path.isdir(path):
        raise UsageError(f"--data {path}: is a folder; {DATA_FIX}")
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    except OSError as e:
        raise UsageError(f"--data {path}: cannot read it ({e.strerror}); {DATA_FIX}") from None
    return h.hexdigest()


def weights_digest(model):
    """A short digest of a model's weights: 256 values spread over each tensor, rounded to bf16 so
    that the fp32 model and its bf16 copy (prepare.data_model) agree. It names the model by what it
    computes, not by how --model was typed or where its folder is."""
    h = hashlib.sha256()
    for name, w in model.named_parameters():
        flat = w.detach().reshape(-1)
        sample = flat[:: max(1, len(flat) // 256)][:256].to(torch.bfloat16)
        h.update(name.encode() + sample.view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def data_key(model, teacher_k, digest=None):
    """What stored features depend on; digest: the --data file's sha256 (None for
    self-distilled)."""
    key = {
        "weights": weights_digest(model),
        "lm_head": model_lib.lm_head_fingerprint(model),
        "dim": model.cfg.dim,
        "max_seq_len": model.cfg.max_seq_len,
        "dtype": str(model.dtype).removeprefix("torch."),
        "teacher_k": teacher_k,
    }
    return key | ({"data_sha256": digest} if digest else {})


# Fields that a key.json written by an older train.py lacks (it named the model instead, as --model
# was typed): not compared there, so that its data stays usable.
LATER_FIELDS = ("weights",)


def key_differences(saved, key):
    say = {"data_sha256": "the data file's content", "weights": "the base model's weights"}
    return [
        say[k] if k in say else f"{k} {saved.get(k)!r}, now {v!r}"
        for k, v in key.items()
        if saved.get(k) != v and (k in saved or k not in LATER_FIELDS)
    ]


def shard_shape(path):
    """(teacher k, hidden width) of a data shard, read from its header; ValueError if it is
    damaged."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            if set(f.keys()) == SHARD_KEYS:
                return f.get_slice("top_ids").get_shape()[1], f.get_slice("hidden").get_shape()[1]
            problem = f"it holds {sorted(f.keys())}"
    except Exception as e:  # safetensors raises its own error type on a truncated or damaged file
        problem = str(e)
    raise ValueError(f"{os.path.basename(path)} is unreadable ({problem})")


def shards_in(folder):
    return sorted(
        f for f in os.listdir(folder) if f.startswith("shard-") and f.endswith(".safetensors")
    )


def features_problem(folder, key):
    """Why the features in `folder` cannot be used for `key`, or None when they can."""
    try:
        with open(os.path.join(folder, KEY_FILE)) as f:
            saved = json.load(f)
        saved_key, shards = saved["key"], saved["shards"]
        assert isinstance(saved_key, dict) and isinstance(shards, list)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return f"no valid {KEY_FILE} (an interrupted pass, or an older train.py)"
    if differ := key_differences(saved_key, key):
        return "made from other data or settings: " + "; ".join(differ)
    if shards_in(folder) != shards or not shards:
        return f"its shards are not the {len(shards)} listed in {KEY_FILE}"
    for name in shards:
        try:
            if shard_shape(os.path.join(folder, name)) != (key["teacher_k"], key["dim"]):
                return f"{name} holds features of another shape"
        except ValueError as e:
            return str(e)
    return None


def check_self_data(folder, key):
    """Before self-distillation grows the data in `folder`: its features must have been made with
    this run's key (else a UsageError; the data is kept), and each shard must be readable (else it
    is set aside as *.broken and the rest renumbered: self_distill names a new shard by the
    count)."""
    os.makedirs(folder, exist_ok=True)
    fix = "use the same --model and --teacher-k, or another --work to make new data"
    try:
        with open(os.path.join(folder, KEY_FILE)) as f:
            saved = json.load(f)["key"]
    except (OSError, ValueError, KeyError, TypeError):
        # none yet, or written by an older train.py: the shards' shapes are checked below
        saved = None
    if saved is not None and (differ := key_differences(saved, key)):
        raise UsageError(
            f"the self-distilled data in {folder} was made with other settings "
            f"({'; '.join(differ)}); "
            f"its features were recorded as it was written and cannot be recomputed: {fix}"
        )
    good = []
    for name in shards_in(folder):
        path = os.path.join(folder, name)
        try:
            k, dim = shard_shape(path)
        except ValueError as e:
            notice(
                f"{e}; set aside as {name}.broken, self-distillation writes as many conversations "
                "again"
            )
            os.replace(path, path + ".broken")
            continue
        if (k, dim) != (key["teacher_k"], key["dim"]):
            raise UsageError(
                f"the self-distilled data in {folder} holds features of teacher-k {k} and width "
                f"{dim}, this run "
                f"needs {key['teacher_k']} and {key['dim']}: {fix}"
            )
        good.append(name)
    # no gaps; a target name is never a later shard's (numbers only go down)
    for i, name in enumerate(good):
        if name != f"shard-{i:05d}.safetensors":
            os.replace(
                os.path.join(folder, name), os.path.join(folder, f"shard-{i:05d}.safetensors")
            )
    with open(os.path.join(folder, KEY_FILE + ".tmp"), "w") as f:
        json.dump({"key": key}, f, indent=1)
    os.replace(os.path.join(folder, KEY_FILE + ".tmp"), os.path.join(folder, KEY_FILE))


def saved_so_far(folder, self_data):
    """What an interrupted data stage leaves: a sentence for the Ctrl-C notice."""
    if not self_data:
        return "the features pass keeps nothing partial; the same command computes them again"
    try:
        kept = plural(len(folder_prompts(folder)), "conversation")
    except Exception:  # a damaged shard: the next run checks them all
        kept = "the conversations"
    return f"{kept} saved in {folder} are kept; the same command continues from them"
