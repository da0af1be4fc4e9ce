"""EAGLE-3 training losses over the training-time-test unroll, on loss-masked positions only.

Alignment (see drafters/eagle3.py): step s, anchor row i predicts token x_{i+2+s}. Its target is the
target model's distribution after x_{i+1+s}: logits recomputed from the stored final post-norm state
`last[i+1+s]` through the target's LM head (rows of the draft vocabulary only, then the target's
final soft-cap), i.e. the target distribution restricted and renormalised to the draft vocabulary
(as speculators' `verifier_lm_head`). The position counts when x_{i+2+s} is a response token.
EAGLE-3 and MTP train on `response_anchors` only (x_{i+1} a response token too: the rows the engine
drafts from), so their logits come for those rows alone (drafters/head.py `forward(anchors=...)`).

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

import math

import torch


def target_logits(last: torch.Tensor, head_rows: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """last [B, T, H] post-norm target states -> fp32 logits over the draft vocabulary [B, T, Vd]."""
    z = (last.to(head_rows.dtype) @ head_rows.t()).float()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


def response_anchors(batch: dict) -> torch.Tensor:
    """The anchor rows the engine drafts from, per sample: i with x_{i+1} and x_{i+2} response tokens
    (i <= T - 3). Returns [B, R] sorted rows, right-padded with T - 1 (past every real row: no loss,
    no metric)."""
    ok = batch["mask"] & batch["valid"]
    B, T = ok.shape
    cand = ok[:, 1 : T - 1] & ok[:, 2:]  # [B, T-2] row i
    R = max(1, int(cand.sum(1).max()))
    rows = torch.arange(T - 2, device=ok.device).expand(B, -1)
    key = torch.where(cand, rows, rows + T).sort(1).values[:, :R]  # real rows first, in order
    return torch.where(key < T, key, T - 1)


def eagle3_loss(
    step_logits: list[torch.Tensor],  # per step [B, A_s, Vd]: the drafts of the step's anchor rows
    batch: dict,  # ids [B, T], mask [B, T], valid [B, T], last [B, T, H]
    head_rows: torch.Tensor,  # [Vd, H] the target's LM head rows of the draft vocabulary
    softcap: float | None,
    d2t_ids: torch.Tensor,  # [Vd] target id of each draft id
    t2d_ids: torch.Tensor,  # [V] draft id of each target id (-1: not in the draft vocabulary)
    decay: float = 1.0,
    kind: str = "kl",
    reduce=None,  # sums a tensor over data-parallel ranks (None: single process)
    rows: list[torch.Tensor] | None = None,  # per step the anchor rows its logits cover (P-EAGLE's COD)
    anchors: torch.Tensor | None = None,  # [B, R] the anchor rows of every step (`response_anchors`)
) -> tuple[torch.Tensor, dict]:
    """The step logits cover anchor rows 0, 1, .. (default), `rows[s]` (shared by the batch) or
    `anchors` (per sample). KL(p || q) = sum p log p - sum p z + logsumexp(z) for draft logits z,
    with p and sum p log p computed once per batch: no [.., Vd] log-softmax per step."""
    ids, mask, valid = batch["ids"], batch["mask"], batch["valid"]
    B, T = ids.shape
    ok = mask & valid
    p = neg_entropy = None
    if kind == "kl":
        with torch.no_grad():
            logp = target_logits(batch["last"], head_rows, softcap).log_softmax(-1)  # [B, T, Vd] after x_t
            p = logp.exp()
            neg_entropy = (p * logp).sum(-1)  # [B, T]
            del logp
    elif kind != "ce":
        raise ValueError(f"unknown loss {kind!r} (kl or ce)")
    at = lambda t, idx: t.gather(1, idx.clamp(0, T - 1))  # noqa: E731  [B, T] -> [B, A]
    total = torch.zeros((), device=ids.device)
    metrics = {}
    prev_ok = torch.ones(B, T, dtype=torch.bool, device=ids.device)  # [B, anchor row] (row T - 1: padding)
    for s, logits in enumerate(step_logits):
        if T - 2 - s <= 0:
            break
        if anchors is not None:
            r = anchors
        else:
            r = (torch.arange(logits.shape[1], device=ids.device) if rows is None else rows[s].to(ids.device))
            r = r[None].expand(B, -1)
        lg = logits.float()  # [B, A, Vd]
        tok_pos = 2 + s + r  # the token row r drafts at step s
        inside = tok_pos < T
        tgt_tok = at(ids, tok_pos)
        scored = at(ok, tok_pos) & inside  # a response token to draft
        m = scored
        lse = lg.logsumexp(-1)
        if kind == "kl":
            pr = p.gather(1, (tok_pos - 1).clamp(0, T - 1)[..., None].expand(-1, -1, p.shape[-1]))  # [B, A, Vd]
            per = at(neg_entropy, tok_pos - 1) - (pr * lg).sum(-1) + lse
            del pr
        else:
            d = t2d_ids[tgt_tok]
            m = m & (d >= 0)
            per = lse - lg.gather(-1, d.clamp_min(0)[..., None])[..., 0]
        cnt = m.sum().float()
        num = torch.where(m, per, torch.zeros_like(per)).sum()
        den = reduce(cnt.detach().clone()) if reduce else cnt
        total = total + (decay**s) * num / den.clamp_min(1.0)
        with torch.no_grad():
            # acceptance at the anchors the engine drafts from: x_{i+1} is a response token (the
            # first response token comes from the prefill, never from a draft); a data token
            # outside the draft vocabulary counts as a miss, as it does in the engine
            ma = scored & at(ok, r + 1)
            correct = (d2t_ids[lg.argmax(-1)] == tgt_tok) & ma
            all_ok = correct & prev_ok.gather(1, r.clamp(max=T - 1))  # with COD, r is a subset of the last step's anchors
            prev_ok = torch.zeros_like(prev_ok)
            prev_ok.scatter_(1, r.clamp(max=T - 1), all_ok)
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


def block_loss(
    logits: torch.Tensor,  # [B, A, S, Vd] a block drafter's logits (DFlash, DSpark)
    anchors: torch.Tensor,  # [B, A] anchor positions
    anchor_ok: torch.Tensor,  # [B, A] bool: a real anchor (padding anchors carry no loss)
    batch: dict,
    head_rows: torch.Tensor,
    softcap: float | None,
    d2t_ids: torch.Tensor,
    t2d_ids: torch.Tensor,
    gamma: float = 4.0,
    kind: str = "kl",
    reduce=None,
    first_slot: int = 1,  # the slot of the first draft: 1 for DFlash (slot 0 is the anchor), 0 for DSpark
    confidence: torch.Tensor | None = None,  # [B, A, S] DSpark's confidence logits
) -> tuple[torch.Tensor, dict]:
    """A block drafter's loss. Draft position s (0-based) is slot s + first_slot and drafts x_{a+1+s};
    it is weighted exp(-s/gamma) (DFlash's and DSpark's position decay). `kind`:
    - "kl": forward KL to the target's distribution after x_{a+s} (restricted to the draft vocabulary);
    - "ce": cross-entropy on the data token x_{a+1+s};
    - "tv": DSpark's draft loss, 0.1 CE + 0.9 TV, where TV = 1/2 ||p_d - p_t||_1 (DSpark eq. 8-10).
    With `confidence` (DSpark) every kind adds 1.0 BCE(confidence, 1 - TV): the confidence's soft
    label is the chance the draft survives verification (DSpark eq. 11). TV's gradient vanishes
    while the draft is far from the target (p_d of the target's tokens near 0): from scratch on Gemma
    3 270M's 8192-token draft vocabulary, "tv" left position-1 acceptance at 0.16 after 200 steps,
    so DSpark trains with "kl" by default too (`--loss tv` is the paper's mix).
    Metrics as `eagle3_loss`, over anchors whose token x_a is a response token (the engine drafts
    from those): `acc_s`, `acc_all_s`, and for DSpark `conf_s` (mean predicted confidence) and
    `accept_s` (mean soft label)."""
    ids, ok = batch["ids"], batch["mask"] & batch["valid"]
    B, T = ids.shape
    total = torch.zeros((), device=ids.device)
    metrics = {}
    prev_ok = None
    gather = lambda t, idx: t.gather(1, idx.clamp(0, T - 1))  # noqa: E731  [B, A] rows of t at idx
    for s in range(logits.shape[2] - first_slot):
        tok_pos = anchors + 1 + s  # [B, A]
        inside = tok_pos < T
        tgt_tok = gather(ids, tok_pos)
        m = anchor_ok & inside & gather(ok, tok_pos)
        lg = logits[:, :, s + first_slot].float()
        logq = lg.log_softmax(-1)
        lp = None
        if kind in ("kl", "tv") or confidence is not None:
            with torch.no_grad():
                H = batch["last"].shape[-1]
                last = batch["last"].gather(1, (tok_pos - 1).clamp(0, T - 1)[..., None].expand(-1, -1, H))
                lp = target_logits(last, head_rows, softcap).log_softmax(-1)
        d = t2d_ids[tgt_tok]
        ce = -logq.gather(-1, d.clamp_min(0)[..., None])[..., 0]
        tv = 0.5 * (logq.exp() - lp.exp()).abs().sum(-1) if kind == "tv" or confidence is not None else None  # [B, A]
        if kind == "kl":
            per = (lp.exp() * (lp - logq)).sum(-1)
        elif kind == "ce":
            m = m & (d >= 0)
            per = ce
        elif kind == "tv":
            per = 0.1 * torch.where(d >= 0, ce, torch.zeros_like(ce)) + 0.9 * tv
        else:
            raise ValueError(f"unknown loss {kind!r} (kl, ce or tv)")
        if confidence is not None:
            label = (1 - tv).detach().clamp(0, 1)
            per = per + torch.nn.functional.binary_cross_entropy_with_logits(
                confidence[:, :, s + first_slot].float(), label, reduction="none")
        cnt = m.sum().float()
        num = (per * m).sum()
        den = reduce(cnt.detach().clone()) if reduce else cnt
        total = total + math.exp(-s / gamma) * num / den.clamp_min(1.0)
        with torch.no_grad():
            ma = anchor_ok & inside & gather(ok, tok_pos) & gather(ok, anchors)
            correct = (d2t_ids[lg.argmax(-1)] == tgt_tok) & ma
            all_ok = correct if prev_ok is None else correct & prev_ok
            prev_ok = all_ok
            metrics[f"loss_{s}"] = (num.detach(), cnt)
            metrics[f"acc_{s}"] = (correct.sum().float(), ma.sum().float())
            metrics[f"acc_all_{s}"] = (all_ok.sum().float(), ma.sum().float())
            if confidence is not None:
                metrics[f"conf_{s}"] = ((torch.sigmoid(confidence[:, :, s + first_slot].float()) * ma).sum(), ma.sum().float())
                metrics[f"accept_{s}"] = ((label * ma).sum(), ma.sum().float())
    return total, metrics


def sample_anchors(batch: dict, count: int | None, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor positions for a block drafter: a >= 1 with x_a and x_{a+1} response tokens (the engine
    drafts from response tokens only). `count` random ones per sample (sorted), or all of them
    (count None, for evaluation). Returns (anchors [B, A], anchor_ok [B, A]); padding anchors are 1."""
    ok = batch["mask"] & batch["valid"]
    B, T = ok.shape
    cand = torch.zeros_like(ok)
    cand[:, 1 : T - 1] = ok[:, 1 : T - 1] & ok[:, 2:]
    rows = []
    for b in range(B):
        c = cand[b].nonzero()[:, 0]
        if count is not None and len(c) > count:
            c = c[torch.randperm(len(c), generator=generator)[:count].sort().values.to(c.device)]
        rows.append(c)
    A = max(1, max(len(r) for r in rows))
    anchors = torch.ones(B, A, dtype=torch.long, device=ok.device)
    anchor_ok = torch.zeros(B, A, dtype=torch.bool, device=ok.device)
    for b, r in enumerate(rows):
        anchors[b, : len(r)] = r
        anchor_ok[b, : len(r)] = True
    return anchors, anchor_ok
