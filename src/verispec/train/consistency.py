"""Train <-> serve consistency: the acceptance the engine measures on the trainer's own held-out data.

The trainer estimates acceptance at every anchor of a held-out response: anchor i (the drafter has
the target's states up to token i and the token x_{i+1}) counts as s + 1 accepted drafts when its
greedy drafts of x_{i+2} .. x_{i+2+s} all equal the data (the target's greedy tokens). The engine
measures acceptance only at the anchors its steps happen to start from, and that is a biased
sample: a step that fails advances one token and starts the next step right after a hard token,
while a step that succeeds skips the easy tokens it accepted. So the engine's per-position
acceptance in normal generation is below the trainer's even when the drafter behaves the same.

`engine_acceptance_at_every_anchor` runs the engine at each anchor of the trainer's data instead
(prompt = the sample up to x_{i}, whose prefill yields x_{i+1}, then one speculative step), which
is the trainer's metric measured by the serving code path: the two must agree (tested), so a gap
that remains on real data is the domain or the anchor sampling, not a train/serve mismatch.
"""

from __future__ import annotations

import torch


@torch.inference_mode()
def engine_acceptance_at_every_anchor(target, drafter, samples, num_draft_tokens: int, max_batch: int = 16,
                                      max_model_len: int = 2048) -> dict:
    """samples: (ids [T], mask [T]) pairs with greedy-regenerated responses (mask: response tokens).
    Returns {"acceptance_unconditional": [per position], "acceptance_conditional": [...],
    "anchors": n}, counted over the anchors the trainer's evaluation counts."""
    from ..engine import Engine, EngineConfig
    from ..sampling import SamplingParams

    K = num_draft_tokens
    cfg = EngineConfig(model="unused", drafter=None, num_draft_tokens=K, draft_policy="fixed",
                       dtype=str(target.dtype).removeprefix("torch."), max_batch_size=max_batch,
                       max_model_len=max_model_len, exact=True)  # batch-invariant: each anchor as if alone
    eng = Engine(target, None, cfg, drafter)
    hits = [0] * K  # anchors with at least s + 1 accepted drafts, among those that count at position s
    counts = [0] * K
    jobs = []
    for ids, mask in samples:
        ids, mask = ids.tolist(), mask.tolist()
        T = len(ids)
        for i in range(T - 2):
            if mask[i + 1] and mask[i + 2]:  # x_{i+1} is a response token: the engine drafts from here
                jobs.append((ids[: i + 1], [ids[i + 2 + s] if i + 2 + s < T and mask[i + 2 + s] else None
                                            for s in range(K)]))
    for a in range(0, len(jobs), max_batch):
        batch = jobs[a : a + max_batch]
        seqs = [eng.add_request(p, SamplingParams(max_tokens=K + 2, ignore_eos=True)) for p, _ in batch]
        first: dict[int, int] = {}  # request -> drafts accepted in its first speculative step
        while len(first) < len(seqs):
            eng.step()
            for s in seqs:
                if s.id not in first and (s.stats.drafts or s.finished):
                    first[s.id] = s.stats.accepted if s.stats.drafts else 0
                    eng.abort(s)  # one step per anchor: later steps start from other anchors
        for s, (_, truth) in zip(seqs, batch):
            accepted = first[s.id]
            for pos in range(K):
                if truth[pos] is None:
                    break
                counts[pos] += 1
                hits[pos] += accepted >= pos + 1
    unc = [h / c if c else 0.0 for h, c in zip(hits, counts)]
    cond = [unc[0]] + [unc[s] / unc[s - 1] if unc[s - 1] else 0.0 for s in range(1, K)]
    return {"acceptance_unconditional": unc, "acceptance_conditional": cond, "anchors": counts[0] if K else 0}
