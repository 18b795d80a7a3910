"""
Train draft heads (Medusa, Hydra, Hydra++) on a frozen base model, offline.

    python train.py --heads hydra++                      # self-distilled data, teacher loss
    python train.py --heads medusa --loss next-token     # Medusa-1's loss on the data tokens
    python train.py --heads hydra --data chats.jsonl     # your ShareGPT-style conversations

Pipeline, each stage cached on disk and reused:
1. data: the base model writes user prompts itself (Magpie-style: the chat template up to the
   start of a user turn, then sample), they are filtered for length and near-duplicates, and the
   model answers them (self-distillation). Or a user's ShareGPT-style JSONL.
2. features: one pass of the frozen base model stores, per token, its final hidden state and its
   top-k next-token probabilities (the teacher); later epochs never run the base model again.
3. heads: trained on those features over the most frequent tokens of the data (a kept-token map),
   with all heads' vocabulary projections in one matrix product.
"""
import argparse
import json
import os
import re
import sys
import time

import torch

import model as model_lib
from verify import logits_to_probs, sample

HERE = os.path.dirname(os.path.abspath(__file__))


def build_parser():
    p = argparse.ArgumentParser(description="Train draft heads on a frozen base model.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # base model
    p.add_argument("--model", default=model_lib.DEFAULT, help="'default', a local HF folder or a hub id")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    # data
    p.add_argument("--data", default="self", help="'self' (the model writes prompts and answers) or a ShareGPT-style JSONL file")
    p.add_argument("--work", default=None, help="folder for cached data, features and checkpoints (default: cache folder per model)")
    p.add_argument("--num-prompts", type=int, default=2000, help="self-distillation: number of prompts (the data set grows to this size)")
    p.add_argument("--max-answer-tokens", type=int, default=256, help="self-distillation: answer length limit")
    p.add_argument("--gen-batch", type=int, default=32, help="self-distillation: generation batch size")
    p.add_argument("--answer-temperature", type=float, default=0.0, help="self-distillation: answer sampling temperature (0 = greedy, like decoding)")
    p.add_argument("--seed", type=int, default=0, help="random seed (data, initialisation, order)")
    return p


# --- data: self-distillation -------------------------------------------------------------------
# A conversation is stored as token ids plus the index where the assistant's answer starts.

def user_turn_prefix(tokenizer):
    """The chat template rendered up to where the user's words begin (Magpie-style prompting)."""
    marker = "\x00MARK\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text[:text.index(marker)], add_special_tokens=False).input_ids


def chat_ids(tokenizer, prompt):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.inference_mode()
def sample_batch(model, prompts, max_new, temperature, top_p, stop_ids, generator):
    """Batched decoding with a static KV cache: left-pad the prompts, hide the padding with a key
    mask, and step every row until it says a stop token. Returns the new ids of each row."""
    dev = model.device
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, L, dtype=torch.long, device=dev)
    key_mask = torch.zeros(B, L + max_new, dtype=torch.bool, device=dev)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        key_mask[b, L - len(p):] = True                          # the answer slots are all real
    positions = (key_mask[:, :L].long().cumsum(1) - 1).clamp(min=0)          # (B, L)
    cache = model.new_cache(L + max_new, batch=B)
    logits, _ = model(ids, positions, None, cache, key_mask=key_mask[:, :L], last_only=True)
    cache.keep(range(L))
    out = [[] for _ in range(B)]
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    stop = torch.tensor(sorted(stop_ids), device=dev)
    pos = positions[:, -1:]                                                   # (B, 1)
    for _ in range(max_new):
        probs = logits_to_probs(logits[:, -1].float(), temperature, top_p)    # (B, V)
        nxt = sample(probs, generator) if temperature > 0 else probs.argmax(-1)  # (B,)
        for b in alive.nonzero()[:, 0].tolist():
            out[b].append(int(nxt[b]))
        alive &= ~torch.isin(nxt, stop)
        if not alive.any():
            break
        pos = pos + 1
        logits, _ = model(nxt[:, None], pos, None, cache, key_mask=key_mask[:, :cache.length + 1])
        cache.keep([0])
    return out


def normalise(text):
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).split()


def keep_prompt(text, seen):
    """Length and near-duplicate filter: 3-80 words, and no earlier prompt sharing the same first
    six words or most of its word trigrams."""
    words = normalise(text)
    if not 3 <= len(words) <= 80 or "im_start" in text or "im_end" in text:
        return False
    head = " ".join(words[:6])
    grams = {tuple(words[i:i + 3]) for i in range(len(words) - 2)}
    for other_head, other in seen:
        if head == other_head or (grams and len(grams & other) / len(grams | other) > 0.5):
            return False
    seen.append((head, grams))
    return True


def self_distill(model, tokenizer, path, args):
    """Grow the data file at `path` to args.num_prompts conversations, appending in batches."""
    rows = read_jsonl_ids(path) if os.path.exists(path) else []
    seen = []
    for r in rows:
        keep_prompt(r["prompt"], seen)
    stop = set(model.cfg.eos_ids) | {tokenizer.eos_token_id}
    prefix = user_turn_prefix(tokenizer)
    gen = torch.Generator(device=model.device).manual_seed(args.seed + len(rows))
    t0, new_tokens, tried = time.time(), 0, 0
    with open(path, "a", encoding="utf-8") as f:
        while len(rows) < args.num_prompts:
            written = sample_batch(model, [prefix] * args.gen_batch, 64, 1.0, 0.95, stop, gen)
            prompts = []
            for w in written:
                tried += 1
                if w and w[-1] in stop:
                    text = tokenizer.decode(w[:-1], skip_special_tokens=True).strip()
                    if keep_prompt(text, seen):
                        prompts.append(text)
            prompts = prompts[:args.num_prompts - len(rows)]
            if not prompts:
                continue
            new_tokens += sum(map(len, written))
            encoded = sorted((chat_ids(tokenizer, p), p) for p in prompts)          # similar lengths together
            answers = sample_batch(model, [e for e, _ in encoded], args.max_answer_tokens,
                                   args.answer_temperature, 1.0, stop, gen)
            new_tokens += sum(map(len, answers))
            for (ids, p), a in zip(encoded, answers):
                row = {"prompt": p, "ids": ids + a, "start": len(ids)}
                rows.append(row)
                f.write(json.dumps(row) + "\n")
            f.flush()
            rate = new_tokens / (time.time() - t0)
            print(f"[data] {len(rows)}/{args.num_prompts} conversations, kept {len(rows)}/{tried} written prompts, "
                  f"{rate:.0f} new tokens/s", file=sys.stderr, flush=True)
    return rows


def read_jsonl_ids(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if n == sum(1 for _ in open(path, encoding="utf-8")):   # a half-written last line: drop it
                    break
                raise ValueError(f"{path}, line {n}: not valid JSON")
    return rows


def main(args):
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device)
    torch.manual_seed(args.seed)
    model, tokenizer = model_lib.load(args.model, device, torch.float32)
    work = args.work or os.path.join(model_lib.cache_root(), "train", re.sub(r"[^\w.-]", "_", model.cfg.name))
    os.makedirs(work, exist_ok=True)
    if args.data == "self":
        rows = self_distill(model, tokenizer, os.path.join(work, "self_distill.jsonl"), args)
    print(f"{len(rows)} conversations, {sum(len(r['ids']) for r in rows)} tokens")


if __name__ == "__main__":
    main(build_parser().parse_args())
