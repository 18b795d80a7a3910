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
import math
import os
import re
import sys
import time

import torch
from tqdm import tqdm

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
    p.add_argument("--teacher-k", type=int, default=16, help="teacher targets: keep the base model's top-k probabilities per token")
    # heads and training
    p.add_argument("--heads", default="hydra++", choices=["medusa", "hydra", "hydra++"], help="which draft heads to train")
    p.add_argument("--num-heads", type=int, default=4, help="K, number of draft heads")
    p.add_argument("--num-layers", type=int, default=1, help="residual blocks per Medusa head / hidden layers per Hydra MLP")
    p.add_argument("--own-lm-head", action="store_true", help="a trainable LM head per head (Medusa-1) instead of the shared frozen one")
    p.add_argument("--kept-tokens", type=int, default=8192, help="heads predict over this many most frequent tokens (0 = whole vocabulary)")
    p.add_argument("--loss", default="teacher", choices=["teacher", "next-token"], help="teacher: the base model's distribution (Hydra); next-token: data tokens, weights 0.8^k (Medusa-1)")
    p.add_argument("--noise", type=float, default=0.0, help="NEFTune-style input noise alpha (0 = off)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, warm-up then cosine)")
    p.add_argument("--eval-every", type=int, default=200, help="held-out evaluation every this many steps")
    p.add_argument("--save-every", type=float, default=120, help="checkpoint every this many seconds")
    p.add_argument("--out", default=None, help="heads folder (default: <work>/heads-<kind>)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
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
def sample_batch(model, prompts, max_new, temperature, top_p, stop_ids, generator, top_k=0):
    """Batched decoding with a static KV cache: left-pad the prompts, hide the padding with a key
    mask, and step every row until it says a stop token. Returns the new ids of each row; with
    top_k > 0 also each row's features (see `features`): final hidden states at every position and
    the model's top-k next-token probabilities, recorded as the tokens are generated."""
    dev = model.device
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, L, dtype=torch.long, device=dev)
    key_mask = torch.zeros(B, L + max_new, dtype=torch.bool, device=dev)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        key_mask[b, L - len(p):] = True                          # the answer slots are all real
    positions = (key_mask[:, :L].long().cumsum(1) - 1).clamp(min=0)          # (B, L)
    cache = model.new_cache(L + max_new, batch=B)
    logits, hidden = model(ids, positions, None, cache, key_mask=key_mask[:, :L], last_only=True)
    cache.keep(range(L))
    out = [[] for _ in range(B)]
    hid = [[hidden[b, L - len(p):]] for b, p in enumerate(prompts)]          # per row: (T, D) pieces
    tops = [[] for _ in range(B)]
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    stop = torch.tensor(sorted(stop_ids), device=dev)
    pos = positions[:, -1:]                                                   # (B, 1)
    for step in range(max_new):
        logits = logits[:, -1].float()                                        # (B, V)
        probs = logits_to_probs(logits, temperature, top_p)
        nxt = sample(probs, generator) if temperature > 0 else probs.argmax(-1)  # (B,)
        top = logits.softmax(-1).topk(top_k, dim=-1) if top_k else None       # teacher: (B, k)
        rows = alive.nonzero()[:, 0].tolist()
        for b in rows:
            out[b].append(int(nxt[b]))
            if top_k:
                tops[b].append((top.indices[b], top.values[b]))
                if step > 0:
                    hid[b].append(hidden[b])
        alive &= ~torch.isin(nxt, stop)
        if not alive.any():
            break
        pos = pos + 1
        logits, hidden = model(nxt[:, None], pos, None, cache, key_mask=key_mask[:, :cache.length + 1])
        cache.keep([0])
    if not top_k:
        return out
    feats = [dict(hidden=torch.cat(hid[b])[:len(p) + len(out[b]) - 1],                  # (T-1, D)
                  top_ids=torch.stack([i for i, _ in tops[b]]), top_p=torch.stack([v for _, v in tops[b]]))
             for b, p in enumerate(prompts)]
    return out, feats


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


def self_distill(model, tokenizer, folder, args):
    """Grow the data set in `folder` to args.num_prompts conversations, one shard per batch."""
    os.makedirs(folder, exist_ok=True)
    shards = sorted(f for f in os.listdir(folder) if f.startswith("shard-") and f.endswith(".safetensors"))
    prompts_so_far = [p for f in shards for p in read_shard(os.path.join(folder, f), meta_only=True)]
    seen = []
    for p in prompts_so_far:
        keep_prompt(p, seen)
    have = len(prompts_so_far)
    stop = set(model.cfg.eos_ids) | {tokenizer.eos_token_id}
    prefix = user_turn_prefix(tokenizer)
    gen = torch.Generator(device=model.device).manual_seed(args.seed + have)
    t0, new_tokens, tried, kept = time.time(), 0, 0, 0
    bar = tqdm(total=args.num_prompts, initial=have, desc="data", unit="conv", disable=None)
    while have < args.num_prompts:
        written = sample_batch(model, [prefix] * args.gen_batch, 64, 1.0, 0.95, stop, gen)
        prompts = []
        for w in written:
            tried += 1
            if w and w[-1] in stop:
                text = tokenizer.decode(w[:-1], skip_special_tokens=True).strip()
                if keep_prompt(text, seen):
                    prompts.append(text)
        new_tokens += sum(map(len, written))
        prompts = prompts[:args.num_prompts - have]
        if not prompts:
            continue
        encoded = sorted((chat_ids(tokenizer, p), p) for p in prompts)          # similar lengths together
        answers, feats = sample_batch(model, [e for e, _ in encoded], args.max_answer_tokens,
                                      args.answer_temperature, 1.0, stop, gen, top_k=args.teacher_k)
        new_tokens += sum(map(len, answers))
        convs = [dict(prompt=p, ids=ids + a, loss=[False] * len(ids) + [True] * len(a), teacher_from=len(ids) - 1, **f)
                 for (ids, p), a, f in zip(encoded, answers, feats)]
        write_shard(os.path.join(folder, f"shard-{len(shards):05d}.safetensors"), convs)
        shards.append(None)
        have += len(convs)
        kept += len(convs)
        bar.update(len(convs))
        bar.set_postfix_str(f"{new_tokens / (time.time() - t0):.0f} new tok/s, kept {kept}/{tried} prompts")
    bar.close()


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


# --- user data: ShareGPT-style conversations -----------------------------------------------------

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def read_sharegpt(path, tokenizer):
    """[(ids, loss mask)] from a JSONL file of {"conversations": [{"from"|"role", "value"|"content"}]}.
    The loss mask marks the assistant's tokens. Errors name the line; nothing is dropped silently."""
    convs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                turns = json.loads(line)["conversations"]
                messages = [{"role": ROLES[t.get("from", t.get("role"))], "content": t.get("value", t.get("content"))}
                            for t in turns]
                assert messages and all(isinstance(m["content"], str) for m in messages)
            except (json.JSONDecodeError, KeyError, TypeError, AssertionError, AttributeError):
                raise ValueError(f"{path}, line {n}: expected {{\"conversations\": [{{\"from\": \"human\"|\"gpt\", "
                                 f"\"value\": \"...\"}}, ...]}} (or role/content)")
            ids, loss = [], []
            for i, m in enumerate(messages):   # render turn by turn, so each token knows its speaker
                text = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
                new = tokenizer(text, add_special_tokens=False).input_ids[len(ids):]
                ids += new
                loss += [m["role"] == "assistant"] * len(new)
            convs.append((ids, loss))
    if not convs:
        raise ValueError(f"{path}: no conversations in the file")
    return convs


@torch.inference_mode()
def features_of(model, convs, folder, top_k, batch_tokens=4096):
    """One pass of the base model over user conversations -> shards like self_distill's."""
    os.makedirs(folder, exist_ok=True)
    batch, size, n = [], 0, 0
    for i, (ids, loss) in enumerate(tqdm(convs, desc="features", disable=None)):
        ids = ids[:model.cfg.max_seq_len]
        logits, hidden = model(torch.tensor([ids], device=model.device), torch.arange(len(ids), device=model.device))
        top = logits[0, :-1].float().softmax(-1).topk(top_k, dim=-1)         # (T-1, k)
        batch.append(dict(ids=ids, loss=loss[:len(ids)], teacher_from=0, hidden=hidden[0, :-1].cpu(),
                          top_ids=top.indices.cpu(), top_p=top.values.cpu()))
        size += len(ids)
        if size >= batch_tokens or i == len(convs) - 1:
            write_shard(os.path.join(folder, f"shard-{n:05d}.safetensors"), batch)
            batch, size, n = [], 0, n + 1


def load_data(folder):
    """All shards of a folder, concatenated: ids, loss, hidden, top_ids, top_p (per token), offsets."""
    shards = sorted(f for f in os.listdir(folder) if f.startswith("shard-") and f.endswith(".safetensors"))
    if not shards:
        raise ValueError(f"no data shards in {folder}")
    parts = [read_shard(os.path.join(folder, f)) for f in shards]
    data = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "offsets"}
    lengths = torch.cat([p["offsets"].diff() for p in parts])
    data["offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return data


# --- losses ------------------------------------------------------------------------------------------
# Head j (1-based) at position t predicts token t+1+j. Its target is either the base model's own
# distribution at position t+j (teacher loss, the default) or the data token itself (next-token
# loss, Medusa-1, head weights 0.8^j). Only assistant tokens are predicted: at inference the heads
# only ever draft the assistant's reply, so prompt tokens would teach them nothing they use.

def teacher_loss(logits, top_ids, top_p):
    """Soft cross-entropy -sum_i p_i log q(i) over the teacher's top-k (ids in head vocabulary,
    -1 where the token is not kept). logits (M, V'), top_ids / top_p (M, k) -> (M,)"""
    logq = logits.float().log_softmax(-1)                                   # (M, V')
    kept = top_ids >= 0
    picked = logq.gather(1, top_ids.clamp(min=0))                           # (M, k)
    return -(top_p.float() * picked * kept).sum(-1)


def next_token_loss(logits, target):
    """Cross-entropy against the data token (head-vocabulary id, -1 if not kept). -> (M,)"""
    logq = logits.float().log_softmax(-1)
    return -logq.gather(1, target.clamp(min=0)[:, None])[:, 0] * (target >= 0)


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


def head_outputs(heads, batch, noise=0.0):
    """Run the heads on a batch: logits at the valid (b, t, j) and their teacher / data targets."""
    h = batch["hidden"].float()                                            # (B, T, D)
    B, T, D = h.shape
    if noise > 0:  # NEFTune-style input noise, U(-1, 1) * alpha / sqrt(T * D)
        h = h + (torch.rand_like(h) * 2 - 1) * noise / (T * D) ** 0.5
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
# heads in heads.safetensors + heads.json (heads.save), and the optimizer and progress in
# state.pt, each written to a temporary file and renamed, so a kill -9 never leaves half a file.

def save_checkpoint(folder, heads, opt, step, extra):
    import heads as heads_lib
    heads_lib.save(heads, folder)
    torch.save({"opt": opt.state_dict(), "step": step, **extra}, os.path.join(folder, "state.pt.tmp"))
    os.replace(os.path.join(folder, "state.pt.tmp"), os.path.join(folder, "state.pt"))


def main(args):
    import heads as heads_lib
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device)
    torch.manual_seed(args.seed)
    model, tokenizer = model_lib.load(args.model, device, torch.float32)
    work = args.work or os.path.join(model_lib.cache_root(), "train", re.sub(r"[^\w.-]", "_", model.cfg.name))
    if args.data == "self":
        folder = os.path.join(work, "self_distill")
        self_distill(model, tokenizer, folder, args)
    else:
        folder = os.path.join(work, "features-" + re.sub(r"[^\w.-]", "_", os.path.basename(args.data)))
        if not os.path.isdir(folder):
            features_of(model, read_sharegpt(args.data, tokenizer), folder, args.teacher_k)
    data = load_data(folder)
    n_conv = len(data["offsets"]) - 1
    print(f"[train] {n_conv} conversations, {len(data['ids'])} tokens, {int(data['loss'].sum())} assistant tokens", file=sys.stderr)

    # the kept vocabulary: the most frequent assistant tokens (and the teacher's top-1s)
    V = model.cfg.vocab_size
    counts = torch.bincount(data["ids"][data["loss"]].long(), minlength=V)
    counts += torch.bincount(data["top_ids"][:, 0][data["top_p"][:, 0] > 0].long(), minlength=V)
    kept = None
    if 0 < args.kept_tokens < V:
        kept = counts.topk(args.kept_tokens).indices.sort().values
        print(f"[train] kept {args.kept_tokens} tokens cover {counts[kept].sum() / counts.sum():.1%} of assistant tokens", file=sys.stderr)
    to_kept = torch.full((V,), -1, dtype=torch.long)
    to_kept[kept if kept is not None else torch.arange(V)] = torch.arange(len(kept) if kept is not None else V)

    out = args.out or os.path.join(work, "heads-" + args.heads)
    cfg = heads_lib.HeadsConfig(kind=args.heads, num_heads=args.num_heads, num_layers=args.num_layers, own_lm_head=args.own_lm_head)
    heads = heads_lib.build(cfg, model, kept).train()
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    held_out = torch.randperm(n_conv, generator=g)[:max(1, n_conv // 20)].tolist()
    train_convs = sorted(set(range(n_conv)) - set(held_out))
    lengths = data["offsets"].diff()
    per_epoch = len(make_batches(lengths, train_convs, args.batch_tokens, args.seed, 0))
    total = per_epoch * args.epochs
    step = 0
    if args.resume and os.path.exists(os.path.join(out, "state.pt")):
        heads = heads_lib.load(out, model).train()
        params = [p for p in heads.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        state = torch.load(os.path.join(out, "state.pt"), weights_only=True)
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"[train] resumed from step {step} in {out}", file=sys.stderr)
    lr_at = lambda s: args.lr * min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / max(total, 1)))
    weights = torch.tensor([0.8 ** j for j in range(1, args.num_heads + 1)], device=device)

    bar = tqdm(total=total, initial=step, desc=f"train {args.heads}", unit="step", disable=None)
    t0, seen, last_save = time.time(), 0, time.time()
    try:
        while step < total:
            epoch, i = divmod(step, per_epoch)
            convs = make_batches(lengths, train_convs, args.batch_tokens, args.seed, epoch)[i]
            batch = collate(data, convs, to_kept, args.num_heads, device)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
                logits, j, top_ids, top_p, target = head_outputs(heads, batch, args.noise)
            if args.loss == "teacher":
                loss = teacher_loss(logits, top_ids, top_p).mean()
            else:
                loss = (next_token_loss(logits, target) * weights[j]).mean()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {loss.item()} at step {step}; the last good checkpoint in {out} is kept")
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            seen += int(batch["valid"][..., 0].sum())
            bar.update(1)
            bar.set_postfix_str(f"loss {loss.item():.3f}, {seen / (time.time() - t0):.0f} tok/s")
            if step % args.eval_every == 0 or step == total:
                report = evaluate(heads.eval(), data, held_out, to_kept, args, device)
                heads.train()
                print(f"\n[eval step {step}] top1 " + " ".join(f"{a:.2f}" for a in report["top1"]) +
                      " | top5 " + " ".join(f"{a:.2f}" for a in report["top5"]) + f" | chain tau {report['chain_tau']:.2f}", file=sys.stderr)
            if time.time() - last_save > args.save_every or step == total:
                save_checkpoint(out, heads, opt, step, {})
                last_save = time.time()
    except KeyboardInterrupt:
        save_checkpoint(out, heads, opt, step, {})
        print(f"\n[train] interrupted at step {step}; checkpoint written to {out} (--resume continues)", file=sys.stderr)
        sys.exit(130)
    bar.close()
    report = evaluate(heads.eval(), data, held_out, to_kept, args, device)
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"[train] done: {step} steps, {time.time() - t0:.0f} s; heads in {out}; chain tau {report['chain_tau']:.2f}", file=sys.stderr)


if __name__ == "__main__":
    main(build_parser().parse_args())
