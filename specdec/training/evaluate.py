"""How well heads guess the base model on held-out conversations: per head its top-1 and top-5
hit rates and the rank histogram (for sparse-tree search), and the expected tau of a chain draft.
train.py evaluates every --eval-every steps and at the end (eval.json, with the learning curve);
joint.py and the experiments measure heads the same way.

    report = evaluate(heads, data, held_out, to_kept, args, device, bf16)
    line = eval_line(step, report)

Tests: tests/test_train.py, tests/test_device.py. Shapes: M predictions, V' head vocabulary,
K heads.
"""

import torch

from specdec.training.batches import make_batches
from specdec.training.losses import collate, head_states, logits_of


@torch.no_grad()
def evaluate(heads, data, convs, to_kept, args, device, bf16=False):
    """Per head: how often its top-1 / top-5 holds the base model's greedy token, the histogram of
    that token's rank (for sparse-tree search), and the expected tau of a chain draft: at each
    position, 1 + the number of leading heads whose top-1 is right (exact for greedy data).
    args: batch_tokens and seed (the batches). bf16: the products in bf16, as training's. The
    counts stay on the device until the end."""
    K = heads.cfg.num_heads
    # on the device: one transfer at the end
    top1, top5, count = (torch.zeros(K, device=device) for _ in range(3))
    ranks = torch.zeros(K, 10, device=device)
    run_sum, run_n = torch.zeros((), device=device), 0
    for convs_b in make_batches(data["offsets"].diff(), convs, args.batch_tokens, args.seed, 0):
        batch = collate(data, convs_b, to_kept, K, device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            z, j, top_ids, top_p, _, (b, t) = head_states(heads, batch)
            logits = logits_of(heads, z, j)  # (M, V')
        greedy = top_ids[:, 0]  # the base model's own top-1
        # (M, 10), fewer with fewer kept tokens
        order = logits.topk(min(10, logits.shape[-1]), dim=-1).indices
        hit = order == greedy[:, None]  # (M, 10)
        for jj in range(K):
            sel = j == jj
            count[jj] += sel.sum()
            top1[jj] += hit[sel, 0].sum()
            top5[jj] += hit[sel, :5].any(-1).sum()
            ranks[jj, : hit.shape[1]] += hit[sel].sum(0).float()
        # chain acceptance: at positions where all K heads are valid, leading run of correct top-1s
        valid = batch["valid"]
        right = torch.zeros_like(valid)
        right[b, t, j] = hit[:, 0]
        full = valid.all(-1)
        run = right[full].long().cumprod(-1).sum(-1)  # (positions,)
        run_sum, run_n = run_sum + run.sum(), run_n + len(run)
    return report(top1, top5, ranks, count, run_sum, run_n)


def report(top1, top5, ranks, count, run_sum, run_n):
    """eval.json's numbers from the counts: hits at top-1 and top-5 (K,), by rank (K, R), over
    count (K,) predictions a head; run_sum accepted drafts over run_n chains."""
    count = count.clamp(min=1)
    return dict(
        top1=(top1 / count).tolist(),
        top5=(top5 / count).tolist(),
        rank_acceptance=(ranks / count[:, None]).tolist(),
        chain_tau=1 + run_sum.item() / max(run_n, 1),
    )


def curve_point(step, tokens, report):
    """One point of the learning curve that eval.json keeps (held-out tau against tokens trained
    on)."""
    return dict(
        step=step,
        tokens=tokens,
        chain_tau=round(report["chain_tau"], 4),
        top1=[round(a, 4) for a in report["top1"]],
    )


def eval_line(step, r):
    return (
        f"[eval step {step}] top1 {' '.join(f'{a:.2f}' for a in r['top1'])} | top5 "
        f"{' '.join(f'{a:.2f}' for a in r['top5'])} | chain tau {r['chain_tau']:.2f}"
    )
