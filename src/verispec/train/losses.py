"""EAGLE-3 training losses over the training-time-test unroll, on loss-masked positions only.

Alignment (see drafters/eagle3.py): step s, anchor row i predicts token x_{i+2+s}. Its target is the
target model's distribution after x_{i+1+s}: logits recomputed from the stored final post-norm state
`last[i+1+s]` through the target's LM head (rows of the draft vocabulary only, then the target's
final soft-cap), i.e. the target distribution restricted and renormalised to the draft vocabulary
(as speculators' `verifier_lm_head`). The position counts when x_{i+2+s} is a response token.

Losses: forward KL(p_target || q_draft) (default), or cross-entropy on the data token (`ce`; tokens
outside the draft vocabulary are skipped). Step s is weighted by decay^s; each step is a mean over
its positions, the denominators summed over data-parallel ranks first (`reduce`) so that N ranks
compute exactly the loss one process would on the same global batch.

Metrics per step: `acc_s` = draft argmax == data token (with greedy-regenerated data, the target's
argmax: an acceptance estimate), and `acc_all_s` = steps 0..s all correct at that anchor (the chance
a chain drafts s + 1 accepted tokens), over the anchors the engine can draft from (x_{i+1} a
response token); train/consistency.py measures the same numbers through the engine.
"""

from __future__ import annotations

import torch


def target_logits(last: torch.Tensor, head_rows: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """last [B, T, H] post-norm target states -> fp32 logits over the draft vocabulary [B, T, Vd]."""
    z = (last.to(head_rows.dtype) @ head_rows.t()).float()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


def eagle3_loss(
    step_logits: list[torch.Tensor],  # per step [B, T-1, Vd] (row i = anchor i)
    batch: dict,  # ids [B, T], mask [B, T], valid [B, T], last [B, T, H]
    head_rows: torch.Tensor,  # [Vd, H] the target's LM head rows of the draft vocabulary
    softcap: float | None,
    d2t_ids: torch.Tensor,  # [Vd] target id of each draft id
    t2d_ids: torch.Tensor,  # [V] draft id of each target id (-1: not in the draft vocabulary)
    decay: float = 1.0,
    kind: str = "kl",
    reduce=None,  # sums a tensor over data-parallel ranks (None: single process)
    rows: list[torch.Tensor] | None = None,  # per step the anchor rows its logits cover (P-EAGLE's COD)
) -> tuple[torch.Tensor, dict]:
    ids, mask, valid = batch["ids"], batch["mask"], batch["valid"]
    T = ids.shape[1]
    ok = mask & valid
    tl = None
    if kind == "kl":
        with torch.no_grad():
            tl = target_logits(batch["last"][:, 1 : T - 1], head_rows, softcap)  # position i+1 for i in 0..T-3
            logp = tl.log_softmax(-1)
    total = torch.zeros((), device=ids.device)
    metrics = {}
    prev_ok = torch.ones(ids.shape[0], max(T - 1, 0), dtype=torch.bool, device=ids.device)  # [B, anchors]
    for s, logits in enumerate(step_logits):
        n = T - 2 - s
        if n <= 0:
            break
        r = torch.arange(n, device=ids.device) if rows is None else rows[s].to(ids.device)
        sel = r < n  # anchors whose token x_{i+2+s} exists
        r, lg = r[sel], logits[:, : len(sel)][:, sel].float()  # [A], [B, A, Vd]
        tgt_tok = ids[:, 2 + s + r]
        m = ok[:, 2 + s + r]
        logq = lg.log_softmax(-1)
        if kind == "kl":
            lp = logp[:, s + r]
            per = (lp.exp() * (lp - logq)).sum(-1)
        elif kind == "ce":
            d = t2d_ids[tgt_tok]
            m = m & (d >= 0)
            per = -logq.gather(-1, d.clamp_min(0)[..., None])[..., 0]
        else:
            raise ValueError(f"unknown loss {kind!r} (kl or ce)")
        cnt = m.sum().float()
        num = (per * m).sum()
        den = reduce(cnt.detach().clone()) if reduce else cnt
        total = total + (decay**s) * num / den.clamp_min(1.0)
        with torch.no_grad():
            # acceptance at the anchors the engine drafts from: x_{i+1} is a response token (the
            # first response token comes from the prefill, never from a draft); a data token
            # outside the draft vocabulary counts as a miss, as it does in the engine
            ma = ok[:, 2 + s + r] & ok[:, 1 + r]
            pred = d2t_ids[lg.argmax(-1)]
            correct = (pred == tgt_tok) & ma
            all_ok = correct & prev_ok[:, r]  # with COD, r is a subset of the last step's anchors
            prev_ok = torch.zeros_like(prev_ok)
            prev_ok[:, r] = all_ok
            metrics[f"loss_{s}"] = (num.detach(), cnt)
            metrics[f"acc_{s}"] = (correct.sum().float(), ma.sum().float())
            metrics[f"acc_all_{s}"] = (all_ok.sum().float(), ma.sum().float())
    return total, metrics


def summarize(metrics: dict, reduce=None) -> dict:
    """{name: (sum, count)} -> {name: ratio}, summed over ranks first."""
    out = {}
    for k, (a, b) in metrics.items():
        t = torch.stack([a.float(), b.float()])
        if reduce:
            t = reduce(t)
        out[k] = float(t[0] / t[1]) if t[1] > 0 else 0.0
    return out
