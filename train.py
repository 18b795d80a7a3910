"""
Train draft heads (Medusa, Hydra, Hydra++) on a frozen base model, offline.

    python train.py --heads hydra++                      # self-distilled data, teacher loss
    python train.py --heads medusa --loss next-token     # Medusa-1's loss on the data tokens
    python train.py --heads hydra --data chats.jsonl     # your ShareGPT-style conversations
    python train.py --heads hydra++ --resume             # continue after Ctrl-C, a crash or kill -9
    torchrun --nproc_per_node 4 train.py --heads hydra++ # one process per GPU (DistributedDataParallel)

Pipeline, each stage cached on disk and reused:
1. data: the base model writes user prompts itself (Magpie-style: the chat template up to the
   start of a user turn, then sample), they are filtered for length and near-duplicates, and the
   model answers them (self-distillation). Or a user's ShareGPT-style JSONL.
2. features: one pass of the frozen base model stores, per token, its final hidden state and its
   top-k next-token probabilities (the teacher); later epochs never run the base model again.
3. heads: trained on those features over the most frequent tokens of the data (a kept-token map),
   with all heads' vocabulary projections in one matrix product. Checkpoints (state.pt) hold
   everything a resumed run needs to continue exactly as if it had never stopped. Ctrl-C finishes
   the current step, writes a checkpoint and exits with status 130. Under torchrun, rank 0 builds
   the data, every rank trains on its share of the batches, rank 0 evaluates, saves and prints.

The command line (tests/test_train_cli.py): bad input (a flag outside its range, given in --help; a
--data file that is missing; a folder that cannot be written; --resume with flags other than the
checkpoint's) ends with one line on stderr, "error: <what> ...; <fix>", and exit code 2, before the
model loads where it can. Cached features are keyed by what shapes them and rebuilt, with a notice,
when stale or damaged. Ctrl-C (or SIGTERM) while the data is built keeps the finished shards and
exits 130 (143).

Test: `python -m pytest -q tests/test_train.py tests/test_train_cli.py`. Shapes: B batch, T time,
D hidden, K heads, V' head vocabulary, M predictions (valid (b, t, head) triples), k teacher top-k.
"""
import argparse
import bisect
import hashlib
import json
import math
import os
import re
import signal
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn as nn
from tqdm import tqdm

import model as model_lib
from generate import Parser, UsageError, check_text, notice, pick_device, pick_dtype, writable_file, writable_folder
from verify import logits_to_probs, sample

HERE = os.path.dirname(os.path.abspath(__file__))


# Sane ranges of the numeric flags (inclusive), checked before anything loads and shown in --help.
# Once the model is loaded, --teacher-k and --kept-tokens must also fit its vocabulary and
# --max-answer-tokens its context.
RANGES = {
    "--num-prompts": (2, 10_000_000),     # one conversation is held out, at least one trains
    "--max-answer-tokens": (1, 32768),
    "--gen-batch": (1, 1024),
    "--answer-temperature": (0.0, 10.0),
    "--teacher-k": (1, 256),              # stored for every token: 6 bytes each
    "--num-heads": (1, 16),
    "--num-layers": (1, 16),
    "--kept-tokens": (0, 1_000_000),
    "--noise": (0.0, 100.0),
    "--epochs": (1, 1000),
    "--batch-tokens": (16, 1_048_576),
    "--lr": (1e-7, 1.0),
    "--eval-every": (1, 10 ** 9),
    "--save-every": (0.0, 1e9),
    "--seed": (0, 2 ** 32 - 1),           # combined as seed * 10**9 + step into a 64-bit seed
}


def span(flag):
    low, high = RANGES[flag]
    return f"; {low} to {high}"


def build_parser():
    p = Parser(description="Train draft heads on a frozen base model.",
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # base model
    p.add_argument("--model", default=model_lib.DEFAULT, help="'default', a local HF folder or a hub id")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    # data
    p.add_argument("--data", default="self", help="'self' (the model writes prompts and answers), a ShareGPT-style JSONL file, or a .safetensors file of conversations written by --export-conversations")
    p.add_argument("--export-conversations", default=None, metavar="FILE", help="write the data set's conversations (token ids and loss masks, no features: small enough to commit) to FILE.safetensors and stop; --data FILE rebuilds the features from it")
    p.add_argument("--continue-from", default=None, metavar="FILE", help="self-distillation: begin the data set with the conversations of FILE.safetensors (written by --export-conversations, e.g. the one in data/), their features computed in one pass, and write new ones from there up to --num-prompts")
    p.add_argument("--work", default=None, help="folder for cached data, features and checkpoints (default: cache folder per model)")
    p.add_argument("--num-prompts", type=int, default=2000, help="self-distillation: number of prompts (the data set grows to this size)" + span("--num-prompts"))
    p.add_argument("--max-answer-tokens", type=int, default=256, help="self-distillation: answer length limit" + span("--max-answer-tokens") + ", at most the model's context")
    p.add_argument("--gen-batch", type=int, default=128, help="self-distillation: generation batch size (rows decoded together; 128 measured fastest on 2 CPU cores)" + span("--gen-batch"))
    p.add_argument("--seeds", default=os.path.join(HERE, "data", "magpie.json"), help="self-distillation: JSON of tasks and topics that seed the prompts the model writes")
    p.add_argument("--dtype", default="auto", help="the base model's dtype while it writes data or computes features, auto (bf16 where that is fast, as in generate.py) | fp32 | bf16")
    p.add_argument("--answer-temperature", type=float, default=0.0, help="self-distillation: answer sampling temperature (0 = greedy, like decoding)" + span("--answer-temperature"))
    p.add_argument("--teacher-k", type=int, default=16, help="teacher targets: keep the base model's top-k probabilities per token" + span("--teacher-k") + ", at most the vocabulary")
    # heads and training
    p.add_argument("--heads", default="hydra++", choices=["medusa", "hydra", "hydra++"], help="which draft heads to train")
    p.add_argument("--num-heads", type=int, default=4, help="K, number of draft heads" + span("--num-heads"))
    p.add_argument("--num-layers", type=int, default=1, help="residual blocks per Medusa head / hidden layers per Hydra MLP" + span("--num-layers"))
    p.add_argument("--own-lm-head", action="store_true", help="a trainable LM head per head (Medusa-1) instead of the shared frozen one")
    p.add_argument("--kept-tokens", type=int, default=8192, help="heads predict over this many most frequent tokens (0 = whole vocabulary)" + span("--kept-tokens") + ", at most the vocabulary")
    p.add_argument("--loss", default="teacher", choices=["teacher", "next-token"], help="teacher: the base model's distribution (Hydra); next-token: data tokens, weights 0.8^k (Medusa-1)")
    p.add_argument("--noise", type=float, default=0.0, help="NEFTune-style input noise alpha (0 = off)" + span("--noise"))
    p.add_argument("--train-dtype", default="auto", choices=["auto", "fp32", "bf16"], help="the heads' matrix products in training: auto (bf16 where it is fast: CUDA, CPUs with native bf16; 1.9x on a 2-core AVX512-BF16 CPU) | fp32 | bf16; losses, gradients' sums and weights stay fp32")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data" + span("--epochs"))
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch" + span("--batch-tokens"))
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, warm-up then cosine)" + span("--lr"))
    p.add_argument("--eval-every", type=int, default=200, help="held-out evaluation every this many steps" + span("--eval-every"))
    p.add_argument("--save-every", type=float, default=120, help="checkpoint every this many seconds (0 = after every step)" + span("--save-every"))
    p.add_argument("--out", default=None, help="heads folder (default: <work>/heads-<kind>)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out, exactly where it stopped; "
                   "flags that shape the training must be the checkpoint's (refused otherwise), --eval-every and --save-every may change")
    p.add_argument("--seed", type=int, default=0, help="random seed (data, initialisation, batch order, noise)" + span("--seed"))
    return p


# --- data: self-distillation -------------------------------------------------------------------
# A conversation is token ids plus a per-token loss mask (True on the assistant's answer).

def chat_ids(tokenizer, prompt):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# --- batched decoding: the data stage's engine ----------------------------------------------------
# Rows of a batch share one KV cache and one slot counter: every step writes the same slot of
# every row. Prompts are left-padded so that they end at the same slot, and a key mask hides the
# padding. When a row finishes, a waiting prompt takes it over: it is prefilled into the slots just
# before the current one, so it too ends there, and its own key mask hides what the previous
# conversation left in that row. A row is refilled only while there is room for a whole answer
# after it; then finished rows are dropped (the batch is compacted), and when every row is done
# the next wave starts with a fresh cache. So no step computes rows that are done for nothing, and
# recording is one tensor write per step for all rows: tokens, hidden states and the teacher's
# top-k go into per-slot buffers, and a finished row's conversation is sliced out of them.

@torch.inference_mode()
def decode_batched(model, prompts, max_new, stop_ids, batch, temperature=0.0, top_p=1.0, generator=None, top_k=0):
    """Yield (i, new ids, features) for every prompt i (lists of ids), as rows finish. A row stops
    after a stop token (kept) or max_new tokens. Greedy at temperature 0. With top_k > 0 features
    are recorded (see `features`): hidden (T-1, D) at every position but the last of prompt + answer,
    top_ids / top_p (len(answer), top_k) the model's top-k next-token probabilities before each
    answer token. Else features is None."""
    dev, D = model.device, model.cfg.dim
    stop = torch.tensor(sorted(stop_ids), device=dev)
    waiting = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))   # longest first: pop() takes the shortest
    while waiting:
        rows = [waiting.pop() for _ in range(min(batch, len(waiting)))][::-1]
        L = max(len(prompts[i]) for i in rows)
        capacity = L + 2 * max_new                                   # refills happen in the first max_new steps
        B = len(rows)
        cache = model.new_cache(capacity, batch=B)
        key_mask = torch.zeros(B, capacity, dtype=torch.bool, device=dev)          # (B, S)
        conv = torch.tensor(rows, device=dev)                        # (B,) prompt index of each row, -1 = done
        start = torch.zeros(B, dtype=torch.long, device=dev)         # (B,) slot of the row's first prompt token
        plen = torch.zeros(B, dtype=torch.long, device=dev)          # (B,) prompt lengths
        tokens = torch.zeros(B, capacity, dtype=torch.long, device=dev)            # (B, S) every row's ids by slot
        hid = torch.zeros(B, capacity, D, dtype=torch.float16, device=dev) if top_k else None      # (B, S, D)
        teacher_ids = torch.zeros(B, capacity, top_k, dtype=torch.int32, device=dev) if top_k else None  # (B, S, k)
        teacher_p = torch.zeros(B, capacity, top_k, dtype=torch.float16, device=dev) if top_k else None

        def prefill(idx, ids_list, end):
            """Prompts ids_list into rows idx, left-padded to end at slot end - 1 -> last logits (r, V)."""
            Lr = max(map(len, ids_list))
            ids = torch.zeros(len(idx), Lr, dtype=torch.long, device=dev)
            km = torch.zeros(len(idx), Lr, dtype=torch.bool, device=dev)
            for r, p in enumerate(ids_list):
                ids[r, Lr - len(p):], km[r, Lr - len(p):] = torch.tensor(p, device=dev), True
            positions = (km.long().cumsum(1) - 1).clamp(min=0)                     # (r, Lr)
            sub = model.new_cache(Lr, batch=len(idx))
            logits, hidden = model(ids, positions, None, sub, key_mask=km, last_only=True)  # (r, 1, V), (r, Lr, D)
            cache.k[:, idx, :, end - Lr:end], cache.v[:, idx, :, end - Lr:end] = sub.k, sub.v
            key_mask[idx] = False
            key_mask[idx, end - Lr:end] = km
            tokens[idx, end - Lr:end] = ids
            if top_k:
                hid[idx, end - Lr:end] = hidden.half()
            lengths = torch.tensor([len(p) for p in ids_list], device=dev)
            start[idx], plen[idx] = end - lengths, lengths
            return logits[:, -1].float()                                            # (r, V)

        def take(idx, logits, slot):
            """Choose the next token of rows idx from their logits (r, V) at `slot`; record it at
            slot + 1; return the rows that finished."""
            # (r, V) passes are what a step costs beyond the model at a batch of 64: each one counts
            if temperature > 0:  # sampled among the 1,024 likeliest tokens (a top-p nucleus nearly always is)
                best = logits.topk(min(1024, logits.shape[-1]), dim=-1)                        # (r, 1024)
                nxt = best.indices.gather(1, sample(logits_to_probs(best.values, temperature, top_p), generator)[:, None])[:, 0]
            else:
                nxt = logits.argmax(-1)                                                         # (r,)
            tokens[idx, slot + 1] = nxt
            if top_k:  # the teacher: top-k probabilities, normalised over the whole vocabulary
                top = logits.topk(top_k, dim=-1)                                              # (r, k)
                teacher_ids[idx, slot] = top.indices.int()
                teacher_p[idx, slot] = (top.values - logits.logsumexp(-1, keepdim=True)).exp().half()
            n_new = slot + 2 - start[idx] - plen[idx]                                          # (r,)
            return idx[torch.isin(nxt, stop) | (n_new >= max_new)]

        def finish(done, slot):
            """Emit the rows `done` whose last token is at slot + 1; mark them free."""
            for b in done.tolist():
                s, p, i = int(start[b]), int(plen[b]), int(conv[b])
                answer = tokens[b, s + p:slot + 2].tolist()
                feats = None if not top_k else dict(hidden=hid[b, s:slot + 1].clone(),  # copies: the row is reused
                                                     top_ids=teacher_ids[b, s + p - 1:slot + 1].clone(),
                                                     top_p=teacher_p[b, s + p - 1:slot + 1].clone())
                yield i, answer, feats
            conv[done] = -1

        logits = prefill(torch.arange(B, device=dev), [prompts[i] for i in rows], L)            # (B, V)
        cache.length = L
        done = take(torch.arange(B, device=dev), logits, L - 1)
        while True:
            slot = cache.length                                       # the slot the next tokens go to
            yield from finish(done, slot - 1)
            free = (conv < 0).nonzero()[:, 0]
            if len(free) >= min(len(waiting), max(1, len(conv) // 8)) and waiting and slot + max_new <= capacity:
                # refill, once an eighth of the rows are free: each prefill reads every weight once, so they are grouped
                fits = [waiting.pop() for _ in range(len(free)) if waiting and len(prompts[waiting[-1]]) <= slot]
                if fits:
                    idx = free[:len(fits)]
                    conv[idx] = torch.tensor(fits, device=dev)
                    first = take(idx, prefill(idx, [prompts[i] for i in fits], slot), slot - 1)
                    yield from finish(first, slot - 1)
            alive = (conv >= 0).nonzero()[:, 0]
            if len(alive) == 0:
                break
            if len(alive) <= len(conv) * 3 // 4 and not (waiting and slot + max_new <= capacity):  # compact
                cache.select_rows(alive)
                key_mask, conv, start, plen, tokens = key_mask[alive], conv[alive], start[alive], plen[alive], tokens[alive]
                if top_k:
                    hid, teacher_ids, teacher_p = hid[alive], teacher_ids[alive], teacher_p[alive]
            nxt = tokens[:, slot]                                                               # (B,)
            positions = (slot - start)[:, None]                                                 # (B, 1)
            key_mask[:, slot] = True
            logits, hidden = model(nxt[:, None], positions, None, cache, key_mask=key_mask[:, :slot + 1])
            cache.keep([0])
            if top_k:
                hid[:, slot] = hidden[:, 0].half()
            rows_alive = (conv >= 0).nonzero()[:, 0]
            done = take(rows_alive, logits[rows_alive, -1].float(), slot)


def normalise(text):
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).split()


class PromptFilter:
    """Length and near-duplicate filter: 3-80 words, no chat-template markers, and no earlier
    prompt with the same first six words or sharing over half of its word trigrams (Jaccard).
    An index from trigram to prompts keeps each check proportional to the prompt, not the data."""

    def __init__(self):
        self.heads, self.grams, self.index = set(), [], {}
        self.tried = self.rejected_duplicate = 0

    def keep(self, text):
        from collections import Counter
        self.tried += 1
        words = normalise(text)
        if not 3 <= len(words) <= 80 or "im_start" in text or "im_end" in text:
            return False
        head = " ".join(words[:6])
        grams = {tuple(words[i:i + 3]) for i in range(len(words) - 2)}
        shared = Counter(j for g in grams for j in self.index.get(g, ()))
        if head in self.heads or any(n / len(grams | self.grams[j]) > 0.5 for j, n in shared.items()):
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
    grams = [tuple(w[i:i + 3]) for w in words for i in range(len(w) - 2)]
    n = max(len(words), 1)
    return dict(prompts=len(words), first_words=len({w[0] for w in words if w}) / n,
                openings=len({tuple(w[:3]) for w in words}) / n, distinct_trigrams=len(set(grams)) / max(len(grams), 1))


def diversity_line(prompts):
    d = prompt_diversity(prompts)
    return (f"{d['prompts']} prompts: {d['first_words']:.1%} distinct first words, {d['openings']:.1%} distinct "
            f"3-word openings, {d['distinct_trigrams']:.1%} of word trigrams distinct")


def read_seeds(path):
    """data/magpie.json: {"tasks": {category: [openers]}, "topics": [...]}, checked field by field."""
    try:
        with open(path, encoding="utf-8") as f:
            seeds = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--seeds {path}: not a readable JSON file ({e}); fix it or pass another") from None
    tasks, topics = seeds.get("tasks") if isinstance(seeds, dict) else None, seeds.get("topics") if isinstance(seeds, dict) else None
    if not (isinstance(tasks, dict) and tasks and all(isinstance(v, list) and v and all(isinstance(o, str) for o in v) for v in tasks.values())
            and isinstance(topics, list) and topics and all(isinstance(t, str) and t.strip() for t in topics)):
        raise UsageError(f"--seeds {path}: needs {{\"tasks\": {{category: [opener, ...]}}, \"topics\": [topic, ...]}}, "
                         "each list non-empty and of strings")
    return tasks, topics


def seeded_prefix(tokenizer, rng, tasks, topics):
    """Magpie with a seed: a system message naming a task and a topic drawn at random, then the
    chat template up to where the user's words begin, then an opener of that task. The model
    writes the rest of the user's message. Returns (prefix ids, opener)."""
    category = rng.choice(sorted(tasks))
    opener, topic = rng.choice(tasks[category]), rng.choice(topics)
    system = f"You are a helpful AI assistant. The user asks you for help with a {category} task about {topic}."
    marker = "\x00MARK\x00"
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text[:text.index(marker)] + opener, add_special_tokens=False).input_ids, opener


def self_distill(model, tokenizer, folder, args):
    """Grow the data set in `folder` to args.num_prompts conversations: the model writes prompts
    (Magpie, seeded from args.seeds), they are filtered, and it answers them greedily, its features
    recorded as it goes. One shard per args.gen_batch finished conversations, each written whole
    or not at all: a run that stops loses at most the conversations in flight, and the next run
    continues from the shards on disk (its random draws seeded by how many there are)."""
    import random
    os.makedirs(folder, exist_ok=True)
    shards = shards_in(folder)
    filt = PromptFilter()
    for p in folder_prompts(folder):
        filt.keep(p)
    have = len(filt.grams)
    if have >= args.num_prompts:
        return
    stop = set(model.cfg.eos_ids) | {tokenizer.eos_token_id}
    tasks, topics = read_seeds(args.seeds)
    rng = random.Random(args.seed * 1_000_003 + have)
    gen = torch.Generator(device=model.device).manual_seed(args.seed * 1_000_003 + have)
    t0, counts = time.time(), dict(new=0, answer=0, tried=0, kept=0)
    bar = tqdm(total=args.num_prompts, initial=have, desc="data", unit="conv", disable=None)
    pending = []

    def flush():  # the finished conversations -> one shard, written whole or not at all
        nonlocal have, pending
        write_shard(os.path.join(folder, f"shard-{len(shards):05d}.safetensors"), pending)
        shards.append(None)
        have, counts["kept"] = have + len(pending), counts["kept"] + len(pending)
        bar.update(len(pending))
        bar.set_postfix_str(f"{counts['new'] / (time.time() - t0):.0f} new tok/s, kept {counts['kept']}/{counts['tried']} prompts")
        pending = []

    try:
        while have < args.num_prompts:
            # 1. prompts for a round of 8 batches: the model writes twice that, the filter keeps new ones
            want = min(8 * args.gen_batch, args.num_prompts - have)
            seeded = [seeded_prefix(tokenizer, rng, tasks, topics) for _ in range(2 * want)]
            prompts = []
            for i, written, _ in decode_batched(model, [p for p, _ in seeded], 64, stop, args.gen_batch, 1.0, 0.95, gen):
                counts["new"], counts["tried"] = counts["new"] + len(written), counts["tried"] + 1
                text = (seeded[i][1] + tokenizer.decode(written[:-1], skip_special_tokens=True)).strip()
                if written[-1] in stop and filt.keep(text):
                    prompts.append(text)
                if len(prompts) == want:  # enough: the candidates not yet started are never written
                    break
            # 2. their answers, greedy, with features, in one stream (finished rows are refilled);
            # a shard whenever gen_batch of them are done
            encoded = [chat_ids(tokenizer, p) for p in prompts]
            for i, answer, feats in decode_batched(model, encoded, args.max_answer_tokens, stop, args.gen_batch,
                                                   args.answer_temperature, 1.0, gen, top_k=args.teacher_k):
                ids = encoded[i]
                pending.append(dict(prompt=prompts[i], ids=ids + answer, loss=[False] * len(ids) + [True] * len(answer),
                                    teacher_from=len(ids) - 1, **{k: v.cpu() for k, v in feats.items()}))
                counts["new"] += len(answer)
                counts["answer"] += len(answer)
                if len(pending) == args.gen_batch:
                    flush()
            if pending:
                flush()
    finally:
        bar.close()
        seconds = time.time() - t0
        print(f"[data] {counts['kept']} conversations, {counts['new']} new tokens ({counts['answer']} in answers) in "
              f"{seconds:.0f} s: {counts['new'] / max(seconds, 1e-9):.0f} new tokens/s; prompts kept {counts['kept']}/{counts['tried']}, "
              f"{filt.rejected_duplicate} near-duplicates rejected; {have} conversations in {folder}", file=sys.stderr, flush=True)


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
        hidden[:len(c["hidden"])] = c["hidden"].half()
        top_ids, top_p = torch.zeros(T, k, dtype=torch.int32), torch.zeros(T, k, dtype=torch.float16)
        n = len(c["top_ids"])
        top_ids[s:s + n], top_p[s:s + n] = c["top_ids"].int(), c["top_p"].half()
        for name, t in (("hidden", hidden), ("top_ids", top_ids), ("top_p", top_p)):
            cols[name].append(t)
    tensors = {name: torch.cat(v).contiguous() for name, v in cols.items()}
    tensors["offsets"] = torch.tensor([0] + [len(c["ids"]) for c in convs]).cumsum(0)
    save_file(tensors, path + ".tmp", metadata={"prompts": json.dumps([c.get("prompt", "") for c in convs])})
    os.replace(path + ".tmp", path)  # a shard is whole or absent


def read_shard(path, meta_only=False):
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        if meta_only:
            return json.loads(f.metadata()["prompts"])
        return {name: f.get_tensor(name) for name in f.keys()}


def folder_prompts(folder):
    """The prompts of every conversation in a data folder, in order (read from the shards' metadata)."""
    return [p for f in shards_in(folder) for p in read_shard(os.path.join(folder, f), meta_only=True)]


# --- user data: ShareGPT-style conversations -----------------------------------------------------

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def read_sharegpt(path, tokenizer):
    """[(ids, loss mask)] from a JSONL file of {"conversations": [{"from"|"role", "value"|"content"}]}.
    The loss mask marks the assistant's tokens. Errors name the line; nothing is dropped silently."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 text (bad byte at offset {e.start}); save it as UTF-8") from None
    convs = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            turns = json.loads(line)["conversations"]
            messages = [{"role": ROLES[t.get("from", t.get("role"))], "content": t.get("value", t.get("content"))}
                        for t in turns]
            assert messages and all(isinstance(m["content"], str) for m in messages)
        except (json.JSONDecodeError, KeyError, TypeError, AssertionError, AttributeError, RecursionError):
            raise ValueError(f"{path}, line {n}: expected {{\"conversations\": [{{\"from\": \"human\"|\"gpt\", "
                             f"\"value\": \"...\"}}, ...]}} (or role/content)")
        for m in messages:
            check_text(m["content"], f"{path}, line {n}")
        ids, loss = [], []
        for i, m in enumerate(messages):   # render turn by turn, so each token knows its speaker
            text = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
            new = tokenizer(text, add_special_tokens=False).input_ids[len(ids):]
            ids += new
            loss += [m["role"] == "assistant"] * len(new)
        convs.append((ids, loss))
    if not convs:
        raise ValueError(f"{path}: no conversations in the file")
    if not any(any(loss) for _, loss in convs):
        raise ValueError(f"{path}: no conversation has an assistant turn (\"from\": \"gpt\" or \"role\": \"assistant\"); "
                         "heads learn from the assistant's replies, so add them")
    return convs


def export_conversations(folder, path):
    """The conversations of a data folder (any shards: self-distilled or features_of's) as one small
    file: token ids (uint16 when every id fits, as for vocabularies up to 65,536; else int32),
    assistant-token mask, offsets, and the prompts in its metadata: 3 bytes a token. The features
    are left out (about 1 KB a token); --data path computes them again."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    parts = []
    for f in shards_in(folder):
        with safe_open(os.path.join(folder, f), "pt") as shard:  # these three only: features are ~1 KB a token
            parts.append({k: shard.get_tensor(k) for k in ("ids", "loss", "offsets")})
    prompts = folder_prompts(folder)
    lengths = torch.cat([p["offsets"].diff() for p in parts])
    ids = torch.cat([p["ids"] for p in parts]).int()
    tensors = {"ids": ids.to(torch.uint16) if ids.max() < 1 << 16 else ids, "loss": torch.cat([p["loss"] for p in parts]),
               "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])}
    save_file(tensors, path + ".tmp", metadata={"prompts": json.dumps(prompts)})
    os.replace(path + ".tmp", path)
    return len(lengths), len(tensors["ids"]), int(tensors["loss"].sum())


def read_conversations(path, flag="--data"):
    """[(ids, loss mask)] from a file written by export_conversations."""
    from safetensors.torch import load_file
    try:
        t = load_file(path)
        ids, loss, offsets = t["ids"].int(), t["loss"], t["offsets"].tolist()
    except Exception as e:  # safetensors' own error on a damaged file, or a missing tensor
        raise UsageError(f"{flag} {path}: not a conversations file written by --export-conversations ({e})") from None
    return [(ids[a:b].tolist(), loss[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]


def conversation_prompts(path):
    """The prompts stored with a file written by export_conversations (one per conversation)."""
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        return json.loads((f.metadata() or {}).get("prompts", "[]"))


def continue_from(model, folder, path, key):
    """--continue-from FILE: an empty self-distillation folder begins with FILE's conversations, their
    features computed in one pass (shards of ~128 conversations, as self_distill writes them), so a
    new machine continues the committed data instead of writing it again. A folder that already
    begins with them is left as it is (or completed, if a stop cut the seeding short); one that
    holds other data is refused."""
    prompts, have = conversation_prompts(path), folder_prompts(folder)
    if have[:len(prompts)] != prompts[:len(have)]:
        raise UsageError(f"--continue-from {path}: the self-distilled data in {folder} did not begin with these "
                         "conversations; use another --work, or leave --continue-from out to grow that data")
    if len(have) >= len(prompts):
        return
    convs = read_conversations(path, "--continue-from")
    if len(prompts) != len(convs):
        raise UsageError(f"--continue-from {path}: it holds {len(convs)} conversations but {len(prompts)} prompts; "
                         "give a file written by --export-conversations from self-distilled data")
    print(f"[train] self-distilled data begins with the {len(convs)} conversations of {path}: computing the features "
          f"of {len(convs) - len(have)}", file=sys.stderr, flush=True)
    seed, first = folder + ".seed", len(shards_in(folder))
    features_of(model, convs[len(have):], seed, key["teacher_k"], batch_tokens=128 * 256, key=key, prompts=prompts[len(have):])
    for i, name in enumerate(shards_in(seed)):  # whole shards, in order: a stop here keeps a prefix, continued next time
        os.replace(os.path.join(seed, name), os.path.join(folder, f"shard-{first + i:05d}.safetensors"))
    os.remove(os.path.join(seed, KEY_FILE))  # the folder's own key.json (check_self_data's) stays
    os.rmdir(seed)


@torch.inference_mode()
def features_of(model, convs, folder, top_k, batch_tokens=4096, key=None, prompts=None):
    """One pass of the base model over user conversations -> shards like self_distill's (with
    `prompts` in their metadata when given). They are written into folder.tmp with key.json last
    (see data_key), and renamed over folder at the end: an interrupted pass leaves the old folder
    or none, never a part."""
    import shutil
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    batch, size, n = [], 0, 0
    for i, (ids, loss) in enumerate(tqdm(convs, desc="features", disable=None)):
        ids = ids[:model.cfg.max_seq_len]
        logits, hidden = model(torch.tensor([ids], device=model.device), torch.arange(len(ids), device=model.device))
        top = logits[0, :-1].float().softmax(-1).topk(top_k, dim=-1)         # (T-1, k)
        batch.append(dict(ids=ids, loss=loss[:len(ids)], teacher_from=0, hidden=hidden[0, :-1].cpu(), prompt=prompts[i] if prompts else "",
                          top_ids=top.indices.cpu(), top_p=top.values.cpu()))
        size += len(ids)
        if size >= batch_tokens or i == len(convs) - 1:
            write_shard(os.path.join(tmp, f"shard-{n:05d}.safetensors"), batch)
            batch, size, n = [], 0, n + 1
    with open(os.path.join(tmp, KEY_FILE), "w") as f:
        json.dump({"key": key or {}, "shards": [f"shard-{i:05d}.safetensors" for i in range(n)]}, f, indent=1)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def map_shard(path):
    """A shard's tensors, memory-mapped: their bytes are read from disk when used, and the
    operating system keeps what fits in its page cache. A safetensors file is 8 bytes (n, little
    endian), n bytes of JSON naming each tensor's dtype, shape and byte range, then those bytes."""
    import numpy as np
    dtypes = {"F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_}
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    out = {}
    for name, info in header.items():
        if name != "__metadata__":
            (a, b), shape, dtype = info["data_offsets"], tuple(info["shape"]), dtypes[info["dtype"]]
            # mode "c": copy-on-write, i.e. writable for torch but never written back to the file;
            # an empty tensor has no bytes to map
            out[name] = torch.from_numpy(np.memmap(path, dtype, "c", 8 + n + a, shape) if b > a else np.zeros(shape, dtype))
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
        return self.parts[i][span.start - a:span.stop - a]


def load_data(folder):
    """All shards of a folder: ids, loss, teacher_top1 (the teacher's top-1 id per token, -1 where
    none was recorded) and offsets in memory, concatenated; hidden, top_ids and top_p as Columns,
    memory-mapped (5M tokens of them are ~6 GB)."""
    shards = shards_in(folder)
    if not shards:
        raise ValueError(f"no data shards in {folder}")
    parts = [map_shard(os.path.join(folder, f)) for f in shards]
    data = {k: torch.cat([p[k] for p in parts]) for k in ("ids", "loss")}
    data["teacher_top1"] = torch.cat([torch.where(p["top_p"][:, 0] > 0, p["top_ids"][:, 0], -1) for p in parts])
    data.update({k: Column([p[k] for p in parts]) for k in ("hidden", "top_ids", "top_p")})
    lengths = torch.cat([p["offsets"].diff() for p in parts])
    data["offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return data


# --- the data cache: keyed by what shapes it, checked before use ----------------------------------
# Next to its shards a data folder holds key.json: what the stored features depend on (data_key:
# the base model, its dtype and context, --teacher-k, and for --data FILE the sha256 of the file's
# bytes). Features of a user's file are reused only when that key is this run's and every shard
# is there and readable; otherwise they are computed again, with a notice saying why.
# Self-distilled data records its features while it is written (hours), so it is never thrown
# away: a run with other settings is refused, and an unreadable shard is set aside as *.broken.

KEY_FILE = "key.json"
SHARD_KEYS = {"ids", "loss", "hidden", "top_ids", "top_p", "offsets"}


def file_digest(path):
    """--data FILE: the sha256 of its bytes, or a UsageError saying what is wrong with the path."""
    fix = "give a ShareGPT-style JSONL file, or 'self' to let the model write its own data"
    if os.path.isdir(path):
        raise UsageError(f"--data {path}: is a folder; {fix}")
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    except OSError as e:
        raise UsageError(f"--data {path}: cannot read it ({e.strerror}); {fix}") from None
    return h.hexdigest()


def data_key(model, teacher_k, digest=None):
    """What stored features depend on; digest: the --data file's sha256 (None for self-distilled)."""
    key = {"model": model.cfg.name, "lm_head": model_lib.lm_head_fingerprint(model), "dim": model.cfg.dim,
           "max_seq_len": model.cfg.max_seq_len, "dtype": str(model.dtype).removeprefix("torch."), "teacher_k": teacher_k}
    return key | ({"data_sha256": digest} if digest else {})


def key_differences(saved, key):
    return ["the data file's content" if k == "data_sha256" else f"{k} {saved.get(k)!r}, now {v!r}"
            for k, v in key.items() if saved.get(k) != v]


def shard_shape(path):
    """(teacher k, hidden width) of a data shard, read from its header; ValueError if it is damaged."""
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
    return sorted(f for f in os.listdir(folder) if f.startswith("shard-") and f.endswith(".safetensors"))


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
    is set aside as *.broken and the rest renumbered: self_distill names a new shard by the count)."""
    os.makedirs(folder, exist_ok=True)
    fix = "use the same --model and --teacher-k, or another --work to make new data"
    try:
        with open(os.path.join(folder, KEY_FILE)) as f:
            saved = json.load(f)["key"]
    except (OSError, ValueError, KeyError, TypeError):
        saved = None  # none yet, or written by an older train.py: the shards' shapes are checked below
    if saved is not None and (differ := key_differences(saved, key)):
        raise UsageError(f"the self-distilled data in {folder} was made with other settings ({'; '.join(differ)}); "
                         f"its features were recorded as it was written and cannot be recomputed: {fix}")
    good = []
    for name in shards_in(folder):
        path = os.path.join(folder, name)
        try:
            k, dim = shard_shape(path)
        except ValueError as e:
            notice(f"{e}; set aside as {name}.broken, self-distillation writes as many conversations again")
            os.replace(path, path + ".broken")
            continue
        if (k, dim) != (key["teacher_k"], key["dim"]):
            raise UsageError(f"the self-distilled data in {folder} holds features of teacher-k {k} and width {dim}, this run "
                             f"needs {key['teacher_k']} and {key['dim']}: {fix}")
        good.append(name)
    for i, name in enumerate(good):  # no gaps; a target name is never a later shard's (numbers only go down)
        if name != f"shard-{i:05d}.safetensors":
            os.replace(os.path.join(folder, name), os.path.join(folder, f"shard-{i:05d}.safetensors"))
    with open(os.path.join(folder, KEY_FILE + ".tmp"), "w") as f:
        json.dump({"key": key}, f, indent=1)
    os.replace(os.path.join(folder, KEY_FILE + ".tmp"), os.path.join(folder, KEY_FILE))


def saved_so_far(folder, self_data):
    """What an interrupted data stage leaves: a sentence for the Ctrl-C notice."""
    if not self_data:
        return "the features pass keeps nothing partial; the same command computes them again"
    try:
        kept = f"{len(folder_prompts(folder))} conversations"
    except Exception:  # a damaged shard: the next run checks them all
        kept = "the conversations"
    return f"{kept} saved in {folder} are kept; the same command continues from them"


# --- losses ------------------------------------------------------------------------------------------
# Head j (1-based) at position t predicts token t+1+j. Its target is either the base model's own
# distribution at position t+j (teacher loss, the default) or the data token itself (next-token
# loss, Medusa-1, head weights 0.8^j). Only assistant tokens are predicted: at inference the heads
# only ever draft the assistant's reply, so prompt tokens would teach them nothing they use.

def teacher_loss(logits, top_ids, top_p):
    """Cross-entropy against the teacher's top-k probabilities and its residual mass.
    logits (M, V') of the heads; top_ids (M, k) the teacher's top-k in head-vocabulary ids (-1 where
    the token is not kept); top_p (M, k) their probabilities. -> (M,)

    Only the top k of the teacher's probabilities are stored; the rest, r = 1 - sum(top_p), is spread
    over the other tokens in a way nobody recorded. So "any other token" is one more outcome:

        L = - sum_i p_i log q_i  -  r log(1 - sum_i q_i)          (i over the teacher's top-k)

    This is the exact cross-entropy once the other tokens are lumped together, and it is smallest
    where the head gives each top-k token the teacher's probability and mass r to the rest. It is
    preferred to renormalising p over the top-k (target p_i / sum(p)), which claims the teacher is sure
    the next token is among its k when it is not: where the teacher hesitates (large r) the head would
    be pushed hardest to crush every other token, learning overconfidence exactly where drafts are
    rarely accepted, and its probabilities would stop meaning "chance the base model says this"
    (which a confidence-based tree, or speculative sampling with the heads as the draft, needs).
    Top-k tokens outside the heads' vocabulary (-1) are dropped from both sums: a head cannot say them.
    1 - sum q is clamped at 1e-6 (fp32 cancellation); it only matters if r < 1e-6, i.e. r = 0 in fp16.
    """
    logq = logits.float().log_softmax(-1)                                   # (M, V')
    kept = top_ids >= 0                                                     # (M, k)
    picked = logq.gather(1, top_ids.clamp(min=0)) * kept                    # (M, k) log q_i, 0 if not kept
    p = top_p.float() * kept                                                # (M, k)
    rest_p = (1 - top_p.float().sum(-1)).clamp(min=0)                       # (M,) teacher mass beyond its top-k
    rest_q = 1 - (picked.exp() * kept).sum(-1)                              # (M,) head mass beyond them
    return -(p * picked).sum(-1) - rest_p * torch.log(rest_q.clamp(min=1e-6))


def next_token_loss(logits, target):
    """Cross-entropy against the data token (head-vocabulary id, -1 if not kept). -> (M,)"""
    logq = logits.float().log_softmax(-1)
    return -logq.gather(1, target.clamp(min=0)[:, None])[:, 0] * (target >= 0)


class FusedTeacherLoss(torch.autograd.Function):
    """teacher_loss, the same numbers, with its gradient written out and computed block by block.

    Autograd through teacher_loss makes about ten passes over the (M, V') logits (M ~ 13k, V' = 8k:
    435 MB in fp32): the fp32 copy, log_softmax, the zeroed gradient of gather, log_softmax's backward
    and the bf16 copy back. On the 2-core CPU these took 1.9 s of a 3.5 s Hydra++ step (profile,
    bf16 autocast). Here each block of 64 rows is read once forward (its logsumexp) and once
    backward, in fp32 while it sits in cache. With q = softmax(logits), s = sum_i q_i over the
    teacher's top-k, P = sum_i p_i, r its residual mass and w = r / (1 - s), differentiating the
    formula of teacher_loss gives

        dL/dlogit_v = q_v (P - w s)  +  [v in top-k] (w q_v - p_v)

    a dense term (a scaled softmax) and k sparse ones. w = 0 where 1 - s is clamped at 1e-6, as
    autograd through the clamp has it. tests/test_train.py checks value and gradient against
    autograd through teacher_loss."""

    ROWS = 64

    @staticmethod
    def forward(ctx, logits, top_ids, top_p):
        lse = torch.empty(len(logits), device=logits.device)                 # (M,) fp32
        for a in range(0, len(logits), FusedTeacherLoss.ROWS):
            lse[a:a + FusedTeacherLoss.ROWS] = logits[a:a + FusedTeacherLoss.ROWS].float().logsumexp(-1)
        kept = top_ids >= 0                                                  # (M, k)
        ids = top_ids.clamp(min=0)
        picked = (logits.gather(1, ids).float() - lse[:, None]) * kept      # (M, k) log q_i, 0 if not kept
        q = picked.exp() * kept                                              # (M, k)
        p = top_p.float() * kept                                             # (M, k)
        rest_p = (1 - top_p.float().sum(-1)).clamp(min=0)                    # (M,)
        rest_q = 1 - q.sum(-1)                                               # (M,)
        loss = -(p * picked).sum(-1) - rest_p * rest_q.clamp(min=1e-6).log()
        w = torch.where(rest_q >= 1e-6, rest_p / rest_q.clamp(min=1e-6), torch.zeros_like(rest_q))
        ctx.save_for_backward(logits, lse, ids, p, q, w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, ids, p, q, w = ctx.saved_tensors
        dense = grad_loss * (p.sum(-1) - w * q.sum(-1))                      # (M,) coefficient of q_v
        sparse = grad_loss[:, None] * (w[:, None] * q - p)                   # (M, k)
        grad = torch.empty_like(logits)
        for a in range(0, len(logits), FusedTeacherLoss.ROWS):
            b = slice(a, a + FusedTeacherLoss.ROWS)
            g = (logits[b].float() - lse[b, None]).exp_().mul_(dense[b, None])
            grad[b] = g.scatter_add_(1, ids[b], sparse[b])
        return grad, None, None


def batch_loss(kind, logits, j, top_ids, top_p, target):
    """The mean loss of a batch's M predictions; j (M,) is head - 1. Teacher loss: every head alike;
    next-token loss: head j+1 weighted 0.8^(j+1) (Medusa-1), which is the teacher loss with the data
    token as a teacher sure of it (p = 1). A batch with no predictions gives 0. Both go through
    FusedTeacherLoss, the fast form of teacher_loss / next_token_loss (same values and gradients)."""
    if kind == "teacher":
        per = FusedTeacherLoss.apply(logits, top_ids, top_p)                # (M,)
    else:
        one = torch.ones(len(target), 1, device=logits.device)
        per = FusedTeacherLoss.apply(logits, target[:, None], one) * 0.8 ** (j + 1).float()  # (M,)
    return per.sum() / max(len(per), 1)


# --- batches ---------------------------------------------------------------------------------------

def make_batches(lengths, conv_ids, batch_tokens, seed, epoch):
    """Conversations grouped by similar length into batches of about batch_tokens padded tokens,
    in an order fixed by (seed, epoch) so that a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = sorted(conv_ids, key=lambda i: (int(lengths[i]), i))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * int(lengths[i]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def collate(data, convs, to_kept, K, device):
    """Right-padded (B, T) tensors for a list of conversation indices, plus per (b, t, j) targets."""
    off = data["offsets"]
    T = max(int(off[i + 1] - off[i]) for i in convs)
    B, D, k = len(convs), data["hidden"].shape[1], data["top_ids"].shape[1]
    ids = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.bool)
    hidden = torch.zeros(B, T, D, dtype=torch.float16)
    top_ids = torch.zeros(B, T, k, dtype=torch.long)
    top_p = torch.zeros(B, T, k, dtype=torch.float16)
    for b, i in enumerate(convs):
        a, e = int(off[i]), int(off[i + 1])
        ids[b, :e - a], loss[b, :e - a], hidden[b, :e - a] = data["ids"][a:e], data["loss"][a:e], data["hidden"][a:e]
        top_ids[b, :e - a], top_p[b, :e - a] = data["top_ids"][a:e], data["top_p"][a:e]
    # valid[b, t, j-1]: head j at position t predicts token t+1+j, an assistant token
    valid = torch.zeros(B, T, K, dtype=torch.bool)
    for j in range(1, K + 1):
        valid[:, :T - 1 - j, j - 1] = loss[:, 1 + j:]
    return dict(ids=ids.to(device), hidden=hidden.to(device), valid=valid.to(device),
                top_ids=to_kept[top_ids].to(device), top_p=top_p.to(device), targets=to_kept[ids].to(device))


def head_outputs(heads, batch, noise=0.0, generator=None):
    """Run the heads on a batch: logits at the valid (b, t, j) and their teacher / data targets.
    noise > 0 adds NEFTune-style noise drawn from `generator` (the caller seeds it per step)."""
    h = batch["hidden"].float()                                            # (B, T, D)
    B, T, D = h.shape
    if noise > 0:  # U(-1, 1) * alpha / sqrt(T * D)
        u = torch.rand(h.shape, generator=generator, device=h.device)      # (B, T, D)
        h = h + (u * 2 - 1) * noise / (T * D) ** 0.5
    positions = torch.arange(T, device=h.device).expand(B, T)
    z = heads(heads.context(h, positions), batch["ids"])                  # (B, T, K, D)
    valid = batch["valid"]                                                 # (B, T, K)
    b, t, j = valid.nonzero(as_tuple=True)                                 # j = head - 1
    if heads.cfg.own_lm_head:   # each head through its own matrix
        logits = torch.empty(len(b), heads.lm_head.weight.shape[1], device=h.device)
        for jj in range(heads.cfg.num_heads):
            sel = j == jj
            logits[sel] = heads.project(z[b[sel], t[sel], jj], jj + 1).float()
    else:                       # one matrix product for all heads
        logits = heads.project(z[b, t, j])                                 # (M, V')
    # head j+1 at t: the teacher's distribution sits at t+j+1, the data token at t+j+2
    return logits, j, batch["top_ids"][b, t + j + 1], batch["top_p"][b, t + j + 1], batch["targets"][b, t + j + 2]


class TrainForward(nn.Module):
    """head_outputs as one module's forward. DistributedDataParallel averages the gradients only of
    what runs inside the forward of the module it wraps, and training uses more of the heads than
    their forward (context, i.e. Hydra++'s PrefixMLP, and project, i.e. an own LM head)."""

    def __init__(self, heads):
        super().__init__()
        self.heads = heads

    def forward(self, batch, noise=0.0, generator=None):
        return head_outputs(self.heads, batch, noise, generator)


# --- evaluation ---------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(heads, data, convs, to_kept, args, device):
    """Per head: how often its top-1 / top-5 holds the base model's greedy token, the histogram of
    that token's rank (for sparse-tree search), and the expected tau of a chain draft: at each
    position, 1 + the number of leading heads whose top-1 is right (exact for greedy data)."""
    K = heads.cfg.num_heads
    top1, top5, count = torch.zeros(K), torch.zeros(K), torch.zeros(K)
    ranks = torch.zeros(K, 10)
    run_sum, run_n = 0.0, 0
    for convs_b in make_batches(data["offsets"].diff(), convs, args.batch_tokens, args.seed, 0):
        batch = collate(data, convs_b, to_kept, K, device)
        logits, j, top_ids, top_p, _ = head_outputs(heads, batch)
        greedy = top_ids[:, 0]                                             # the base model's own top-1
        order = logits.topk(10, dim=-1).indices                            # (M, 10)
        hit = order == greedy[:, None]                                     # (M, 10)
        for jj in range(K):
            sel = j == jj
            count[jj] += sel.sum()
            top1[jj] += hit[sel, 0].sum()
            top5[jj] += hit[sel, :5].any(-1).sum()
            ranks[jj] += hit[sel].sum(0).float().cpu()
        # chain acceptance: at positions where all K heads are valid, leading run of correct top-1s
        valid = batch["valid"]
        right = torch.zeros_like(valid)
        b, t, jv = valid.nonzero(as_tuple=True)
        right[b, t, jv] = hit[:, 0]
        full = valid.all(-1)
        run = right[full].long().cumprod(-1).sum(-1)                       # (positions,)
        run_sum, run_n = run_sum + run.sum().item(), run_n + len(run)
    count = count.clamp(min=1)
    return dict(top1=(top1 / count).tolist(), top5=(top5 / count).tolist(),
                rank_acceptance=(ranks / count[:, None]).tolist(), chain_tau=1 + run_sum / max(run_n, 1))


# --- checkpoints -------------------------------------------------------------------------------------
# Invariant: state.pt alone is the checkpoint. It holds the heads' weights, the optimizer state and
# the step they belong to, in one file written to state.pt.tmp (flushed to disk) and renamed over
# the old one, so after a kill -9 it is the old checkpoint or the new one, whole, never a mix.
# heads.safetensors + heads.json next to it (heads.save, what generate.py loads) are written after
# it: a crash between the two leaves them one checkpoint older than state.pt, and --resume never
# reads them. Nothing else needs saving: batches are fixed by (seed, epoch), the noise by (seed,
# step, rank), the learning rate by the step. `identity` (heads config, data size and digest, the
# flags) must match on resume, so that a checkpoint is never continued with other heads, other data
# or another recipe; only flags that never touch the weights may change, and a notice says so.

STATE = "state.pt"
RESUME_MAY_CHANGE = ("eval_every", "save_every")                # the new value is used
NOT_RECORDED = ("resume", "out", "work", "device", "model", "data", "export_conversations", "continue_from")  # places; model and data: by identity
SELF_DISTILL_FLAGS = ("num_prompts", "max_answer_tokens", "gen_batch", "answer_temperature", "seeds")


def recorded_flags(args):
    """The flags a checkpoint records (those shaping self-distilled data only with --data self)."""
    skip = NOT_RECORDED + (() if args.data == "self" else SELF_DISTILL_FLAGS)
    return {k: v for k, v in vars(args).items() if k not in skip}


def resume_differences(saved, now):
    """Flags recorded in both that differ, as '--flag new (checkpoint: old)': (refused, may change)."""
    differ = [k for k in saved if k in now and saved[k] != now[k]]
    say = lambda k: f"--{k.replace('_', '-')} {now[k]} (checkpoint: {saved[k]})"
    return [say(k) for k in differ if k not in RESUME_MAY_CHANGE], [say(k) for k in differ if k in RESUME_MAY_CHANGE]


def read_checkpoint(folder):
    path = os.path.join(folder, STATE)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or not a checkpoint: torch raises several kinds
        raise ValueError(f"{path} is unreadable ({type(e).__name__}); start afresh without --resume or with another --out") from None


def refuse_other_flags(folder, refused):
    if refused:
        raise ValueError(f"{folder}/{STATE} was written with other flags: {', '.join(refused)}; resume with the "
                         "checkpoint's values, or start afresh with another --out")


def data_digest(data):
    """A short digest of the training data's tokens, loss mask and conversation bounds."""
    h = hashlib.sha256()
    for name in ("offsets", "ids", "loss"):
        h.update(data[name].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def save_checkpoint(folder, heads, opt, step, identity, progress=None):
    import heads as heads_lib
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE)
    with open(path + ".tmp", "wb") as f:
        torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(), "step": step, "progress": progress, **identity}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    heads_lib.save(heads, folder)


def load_checkpoint(folder, heads, opt, identity):
    """Load state.pt into heads and opt (built as for a fresh run); returns the step to continue at
    and the progress so far (assistant tokens trained on, the learning curve)."""
    state = read_checkpoint(folder)
    if "heads" not in state:
        raise ValueError(f"{folder}/{STATE} was written by an older train.py (no heads inside); "
                         "start again without --resume, or with another --out")
    refused, changed = resume_differences(state.get("flags", {}), identity["flags"])
    refuse_other_flags(folder, refused)
    for flag in changed:
        notice(f"{flag}: the new value is used")
    saved, mine = state["heads"].get("kept_ids"), heads.kept_ids
    same_vocab = saved is None if mine is None else saved is not None and torch.equal(saved, mine.cpu())
    config, data = state.get("config") or {}, state.get("data") or []
    differ = [f"heads {k} {v} (checkpoint: {config.get(k)})" for k, v in identity["config"].items() if config.get(k) != v]
    if data != identity["data"][:len(data)]:  # older checkpoints record the size only, not the digest
        differ.append(f"data: {identity['data'][0]} conversations, {identity['data'][1]} tokens, digest "
                      f"{identity['data'][2]} (checkpoint: {', '.join(map(str, data))})")
    if differ or not same_vocab:
        raise ValueError(f"{folder}/{STATE} was written for other heads or data ({'; '.join(differ) or 'another kept vocabulary'}); "
                         "resume with the same flags and data, or use another --out")
    heads.load_state_dict(state["heads"])
    opt.load_state_dict(state["opt"])
    return state["step"], state.get("progress") or {"tokens": 0, "curve": []}


# --- training -----------------------------------------------------------------------------------------
# One step: forward on one batch, loss, backward, clip, AdamW. A non-finite loss or gradient stops
# training before the weights change. Ctrl-C (SIGINT) or SIGTERM (a scheduler's preemption, or
# torchrun passing a signal on) only raise a flag: the loop finishes its step, saves and exits with
# 128 + the signal number (130 for Ctrl-C). Stopping mid-step could save a half-updated optimizer.

class StopFlag:
    """Within `with StopFlag() as stop:`, SIGINT and SIGTERM set stop.signum instead of stopping."""

    def __enter__(self):
        self.signum = 0
        self.previous = {s: signal.signal(s, self.catch) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def catch(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def train_step(forward, opt, batch, lr, loss_kind, noise=0.0, generator=None, bf16=False):
    """One optimizer step on one collated batch; returns the loss. forward is TrainForward(heads),
    possibly wrapped in DistributedDataParallel; bf16: its matrix products in bf16 (autocast), the
    loss in fp32. Raises FloatingPointError, with the weights untouched, if the loss or the gradient
    norm is not finite (under DDP the gradients, hence the norm, are averaged over ranks: a NaN on
    one rank stops them all at the same step)."""
    with torch.autocast(device_type=batch["hidden"].device.type, dtype=torch.bfloat16, enabled=bf16):
        logits, j, top_ids, top_p, target = forward(batch, noise, generator)  # (M, V'), (M,), (M, k) x2, (M,)
    loss = batch_loss(loss_kind, logits, j, top_ids, top_p, target)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in opt.param_groups for p in group["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    if not (torch.isfinite(loss) and torch.isfinite(norm)):
        raise FloatingPointError(f"loss {loss.item()}, gradient norm {norm.item()}")
    opt.step()
    return loss.item()


def kept_vocabulary(data, vocab_size, n):
    """The heads' vocabulary: the n most frequent assistant tokens and teacher top-1s (sorted ids),
    or None for all. Returns (kept, to_kept: base id -> head id or -1, share of those tokens kept)."""
    counts = torch.bincount(data["ids"][data["loss"]].long(), minlength=vocab_size)
    top1 = data["teacher_top1"]
    counts += torch.bincount(top1[top1 >= 0].long(), minlength=vocab_size)
    kept = counts.topk(n).indices.sort().values if 0 < n < vocab_size else None
    ids = kept if kept is not None else torch.arange(vocab_size)
    to_kept = torch.full((vocab_size,), -1, dtype=torch.long)
    to_kept[ids] = torch.arange(len(ids))
    return kept, to_kept, float(counts[ids].sum() / counts.sum().clamp(min=1))


def curve_point(step, tokens, report):
    """One point of the learning curve that eval.json keeps (held-out tau against tokens trained on)."""
    return dict(step=step, tokens=tokens, chain_tau=round(report["chain_tau"], 4), top1=[round(a, 4) for a in report["top1"]])


def eval_line(step, report):
    return (f"[eval step {step}] top1 " + " ".join(f"{a:.2f}" for a in report["top1"]) + " | top5 " +
            " ".join(f"{a:.2f}" for a in report["top5"]) + f" | chain tau {report['chain_tau']:.2f}")


def train(model, data, out, args):
    """Train heads for the frozen `model` on `data` (load_data's dict) as `args` say, checkpointing
    to `out`; returns the heads. Under torch.distributed each rank trains on every world-th batch
    and rank 0 alone evaluates, saves and prints."""
    import heads as heads_lib
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda msg: None)
    device, K = model.device, args.num_heads
    kept, to_kept, coverage = kept_vocabulary(data, model.cfg.vocab_size, args.kept_tokens)
    if kept is not None:
        log(f"[train] kept {len(kept)} tokens cover {coverage:.1%} of assistant tokens")

    # heads and optimizer, the same on every rank (same seed), then the checkpoint if resuming
    torch.manual_seed(args.seed)
    cfg = heads_lib.HeadsConfig(kind=args.heads, num_heads=K, num_layers=args.num_layers, own_lm_head=args.own_lm_head)
    heads = heads_lib.build(cfg, model, kept).train()
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    n_conv = len(data["offsets"]) - 1
    identity = {"config": asdict(heads.cfg), "data": [n_conv, len(data["ids"]), data_digest(data)],
                "flags": recorded_flags(args)}
    step = saved_step = 0
    # assistant tokens trained on (head 1's targets, all ranks) and the held-out evaluations so far
    progress = {"tokens": 0, "curve": []}
    if args.resume and os.path.exists(os.path.join(out, STATE)):  # every rank reads it: --out must be shared
        step, progress = load_checkpoint(out, heads, opt, identity)
        saved_step = step
        log(f"[train] resumed from step {step} in {out}")
    elif args.resume:
        log(f"[train] no checkpoint in {out}; starting from step 0")
    forward = TrainForward(heads)
    bf16 = pick_dtype(args.train_dtype, device.type) == torch.bfloat16
    if world > 1:  # its backward averages gradients over ranks; the frozen shared buffers are never sent
        # (torch 2.13 calls broadcast_buffers deprecated; its replacement would still copy them once)
        forward = nn.parallel.DistributedDataParallel(forward, broadcast_buffers=False)

    # the data order: 5% held out for evaluation; batches fixed by (seed, epoch); rank r takes r, r + world, ...
    g = torch.Generator().manual_seed(args.seed)
    held_out = torch.randperm(n_conv, generator=g)[:max(1, n_conv // 20)].tolist()
    train_convs = sorted(set(range(n_conv)) - set(held_out))
    lengths = data["offsets"].diff()
    in_train = torch.zeros(n_conv, dtype=torch.bool)
    in_train[train_convs] = True
    position = torch.arange(len(data["ids"])) - data["offsets"][:-1].repeat_interleave(lengths)  # within its conversation
    if not (data["loss"] & (position >= 2) & in_train.repeat_interleave(lengths)).any():  # head 1 at t predicts t+2
        raise ValueError("nothing to learn from: no assistant token in the training data (no assistant turns, or only "
                         "in the 5% held out); heads learn the assistant's replies, so give data that has them")
    if args.epochs < 1:
        raise ValueError(f"--epochs {args.epochs} trains nothing; use 1 or more")
    n_batches = len(make_batches(lengths, train_convs, args.batch_tokens, args.seed, 0))
    per_epoch = n_batches // world                                   # steps per epoch
    if per_epoch == 0:
        raise ValueError(f"{n_batches} batch(es) of training data for {world} ranks: add data or lower --batch-tokens")
    total = per_epoch * args.epochs
    lr_at = lambda s: args.lr * min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / max(total, 1)))

    bar = tqdm(total=total, initial=step, desc=f"train {args.heads}", unit="step", disable=None if rank == 0 else True)
    t0, tokens0, last_save, batches_epoch = time.time(), progress["tokens"], time.time(), None
    with StopFlag() as stop:
        while step < total:
            epoch, i = divmod(step, per_epoch)
            if epoch != batches_epoch:
                batches, batches_epoch = make_batches(lengths, train_convs, args.batch_tokens, args.seed, epoch), epoch
            batch = collate(data, batches[i * world + rank], to_kept, K, device)
            noise_gen = torch.Generator(device=device).manual_seed(args.seed * 10**9 + step * world + rank) if args.noise > 0 else None
            try:
                loss = train_step(forward, opt, batch, lr_at(step), args.loss, args.noise, noise_gen, bf16)
            except FloatingPointError as e:
                kept_msg = f"the last checkpoint (step {saved_step}) in {out} is kept" if saved_step else "no checkpoint was written"
                raise FloatingPointError(f"step {step + 1}: {e}; training stopped, {kept_msg}") from None
            step += 1
            n_tokens = torch.tensor([int(batch["valid"][..., 0].sum())], device=device)
            if world > 1:
                dist.all_reduce(n_tokens)
            progress["tokens"] += int(n_tokens)
            rate = (progress["tokens"] - tokens0) / (time.time() - t0)   # assistant tokens/s, all ranks
            bar.update(1)
            bar.set_postfix_str(f"loss {loss:.3f}, {rate:.0f} tok/s")
            signum = torch.tensor([stop.signum], device=device)
            if world > 1:  # a signal on any rank stops every rank after this same step
                dist.all_reduce(signum, op=dist.ReduceOp.MAX)
            signum = int(signum)
            if rank == 0 and step % args.eval_every == 0 and step < total and not signum:
                report = evaluate(heads.eval(), data, held_out, to_kept, args, device)
                progress["curve"].append(curve_point(step, progress["tokens"], report))
                log("\n" + eval_line(step, report))
                heads.train()
            if rank == 0 and (signum or step == total or time.time() - last_save >= args.save_every):
                save_checkpoint(out, heads, opt, step, identity, progress)
                last_save, saved_step = time.time(), step
            if signum:
                if world > 1:
                    dist.barrier()  # nobody exits (and gets the others killed) before rank 0 has saved
                log(f"\n[train] stopped by signal {signum} at step {step}; checkpoint written to {out} (--resume continues)")
                sys.exit(128 + signum)
    bar.close()
    if rank == 0:
        report = evaluate(heads.eval(), data, held_out, to_kept, args, device)
        report["curve"] = progress["curve"] + [curve_point(step, progress["tokens"], report)]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "eval.json"), "w") as f:
            json.dump(report, f, indent=1)
        log(eval_line(step, report))
        log(f"[train] done: {step} steps, {time.time() - t0:.0f} s; heads in {out}; chain tau {report['chain_tau']:.2f}")
    return heads


# --- main ----------------------------------------------------------------------------------------------
# Plain `python train.py` is rank 0 of 1. Under torchrun (WORLD_SIZE > 1) every process joins a
# process group; rank 0 converts the model and builds the data while the others wait at a barrier,
# then they find both on disk.

def init_distributed(device):
    """Returns (rank, world size, torch.device). Under torchrun: NCCL and one GPU per rank
    (LOCAL_RANK) on CUDA, gloo on CPU."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device(device)
    import datetime
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    # a long timeout: the other ranks wait at the first barrier while rank 0 builds the data
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=datetime.timedelta(hours=12))
    return dist.get_rank(), world, torch.device(device)


def data_model(model, dtype):
    """The base model for generating data: `model` (fp32, what training reads) or a copy in bf16,
    where bf16 is fast (the data stage runs 3-4x faster in bf16 on a CPU with native bf16)."""
    import copy
    dtype = pick_dtype(dtype, model.device.type)
    return model if dtype == model.dtype else copy.deepcopy(model).to(dtype=dtype)


# Bad input is caught where it enters, each check as early as what it needs allows: the flags and
# paths before anything loads, what depends on the model right after it loads, a --resume
# checkpoint's flags before any data is built (which can take hours).

class Interrupted(Exception):
    """Ctrl-C or SIGTERM while the data is built; the message says what is kept."""

    def __init__(self, kept, signum):
        super().__init__(kept)
        self.signum = signum


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, a session that ends, `kill`) while the data is built: stops it as
    Ctrl-C does, so the finished shards are kept and the [data] summary is printed."""


def raise_terminated(signum, frame):
    raise Terminated


def check_args(args):
    """Every check that needs no model: ranges, the device, the folders, a --resume checkpoint."""
    for flag, (low, high) in RANGES.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if not low <= value <= high:  # NaN fails too
            raise UsageError(f"{flag} {value}: out of range; use {low} to {high}")
    pick_device(args.device)
    pick_dtype(args.dtype, "cpu")
    if args.data == "self":
        read_seeds(args.seeds)
    for flag in ("work", "out"):
        if getattr(args, flag) is not None:
            writable_folder(f"--{flag}", getattr(args, flag))
    if args.export_conversations is not None:
        if not args.export_conversations.endswith(".safetensors"):
            raise UsageError(f"--export-conversations {args.export_conversations}: name it FILE.safetensors")
        writable_file("--export-conversations", args.export_conversations, "conversations.safetensors")
    if args.continue_from is not None:
        if args.data != "self":
            raise UsageError(f"--continue-from {args.continue_from}: it seeds self-distilled data; use it with --data self, "
                             "or train on the file itself with --data FILE")
        read_conversations(args.continue_from, "--continue-from")  # a UsageError if it is not a conversations file
    if args.out is not None:
        check_resume(args.out, args)
    default = build_parser().get_default
    if args.data != "self":
        for name in SELF_DISTILL_FLAGS:
            if getattr(args, name) != default(name):
                notice(f"--{name.replace('_', '-')} has no effect with --data FILE (it shapes self-distilled data)")


def check_model_args(args, model):
    """The flags bounded by the loaded model."""
    vocab, context = model.cfg.vocab_size, model.cfg.max_seq_len
    if args.teacher_k > vocab:
        raise UsageError(f"--teacher-k {args.teacher_k}: the model's vocabulary has {vocab} tokens; use at most {vocab}")
    if args.kept_tokens > vocab:
        raise UsageError(f"--kept-tokens {args.kept_tokens}: the model's vocabulary has {vocab} tokens; "
                         f"use at most {vocab} (or 0 for all of them)")
    if args.data == "self" and args.max_answer_tokens > context:
        raise UsageError(f"--max-answer-tokens {args.max_answer_tokens}: the model's context holds {context} tokens; use less")


def check_resume(out, args):
    """--resume: refuse a checkpoint written with other flags now, before the data is built."""
    if args.resume and os.path.exists(os.path.join(out, STATE)):
        refuse_other_flags(out, resume_differences(read_checkpoint(out).get("flags", {}), recorded_flags(args))[0])


def main(args):
    check_args(args)
    digest = file_digest(args.data) if args.data != "self" else None
    rank, world, device = init_distributed(args.device)
    if rank > 0:
        dist.barrier()  # wait for rank 0 (below)
    model, tokenizer = model_lib.load(args.model, device, torch.float32)
    check_model_args(args, model)
    work = args.work or os.path.join(model_lib.cache_root(), "train", re.sub(r"[^\w.-]", "_", model.cfg.name))
    out = args.out or os.path.join(work, "heads-" + args.heads)
    if args.out is None:  # the default folders, known now that the model has a name
        writable_folder("--work", work)
        writable_folder("--out", out)
        check_resume(out, args)
    writer = data_model(model, args.dtype)  # the model that writes data and computes features
    key = data_key(writer, args.teacher_k, digest)
    if args.data == "self":
        folder = os.path.join(work, "self_distill")
    else:
        folder = os.path.join(work, "features-" + re.sub(r"[^\w.-]", "_", os.path.basename(args.data)))
    if rank == 0:
        on_sigterm = signal.signal(signal.SIGTERM, raise_terminated)
        try:
            if args.data == "self":
                check_self_data(folder, key)
                if args.continue_from:
                    continue_from(writer, folder, args.continue_from, key)
                print(f"[train] self-distilled data in {folder} (Ctrl-C keeps the shards written)", file=sys.stderr, flush=True)
                self_distill(writer, tokenizer, folder, args)
            elif problem := features_problem(folder, key):
                if os.path.isdir(folder):
                    notice(f"the features in {folder} cannot be used: {problem}; computing them again")
                convs = read_conversations(args.data) if args.data.endswith(".safetensors") else read_sharegpt(args.data, tokenizer)
                print(f"[train] computing the features of {args.data} into {folder}", file=sys.stderr, flush=True)
                features_of(writer, convs, folder, args.teacher_k, key=key)
        except KeyboardInterrupt as e:
            signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
            raise Interrupted(saved_so_far(folder, args.data == "self"), signum) from None
        finally:
            signal.signal(signal.SIGTERM, on_sigterm)
        if args.export_conversations:
            n, tokens, answers = export_conversations(folder, args.export_conversations)
            print(f"[train] {n} conversations, {tokens} tokens ({answers} assistant tokens) written to "
                  f"{args.export_conversations}; --data {args.export_conversations} rebuilds their features", file=sys.stderr)
            print(f"[train] diversity: {diversity_line(folder_prompts(folder))}", file=sys.stderr)
            return
        if world > 1:
            dist.barrier()  # the model cache and the data are on disk: let the others go
    data = load_data(folder)
    if rank == 0:
        print(f"[train] {len(data['offsets']) - 1} conversations, {len(data['ids'])} tokens, "
              f"{int(data['loss'].sum())} assistant tokens", file=sys.stderr)
    train(model, data, out, args)
    if world > 1:
        dist.destroy_process_group()


def cli(argv=None) -> int:
    """The command line. Bad input or data: one line on stderr naming it and the fix, exit code 2.
    A NaN loss: one line, exit code 1. Ctrl-C: what is kept, exit code 130 (during training the
    loop itself saves a checkpoint and exits 130). No traceback for any of them."""
    try:
        main(build_parser().parse_args(argv))
        return 0
    except (UsageError, ValueError, OSError, model_lib.LoadError) as e:
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    except FloatingPointError as e:  # training diverged: not a mistake in the input
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 1
    except Interrupted as e:
        how = "SIGTERM" if e.signum == signal.SIGTERM else "Ctrl-C"
        print(f"\n[train] interrupted by {how} while building the data: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("\n[train] interrupted by Ctrl-C", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(cli())
