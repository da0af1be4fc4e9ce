"""Chain verification (Leviathan et al. 2023, Algorithm 1): accept d_i while u_i < p_{i-1}(d_i) /
q_i(d_i); at the first rejection draw from norm(max(0, p - q)); after k acceptances, a bonus from
p_k. All k ratios come from one vectorized pass."""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, argmax, probs, sample
from . import Verdict


class ChainVerifier:
    def verify(self, logits: torch.Tensor, draft, params: SamplingParams, generator: torch.Generator) -> Verdict:
        """logits [k + 1, V]; draft.tokens d_1..d_k; draft.q [k, V] (None: one-hot at d_i)."""
        if params.greedy:
            return self.greedy(argmax(logits[: len(draft.tokens) + 1]).tolist(), draft)
        return self.accept(probs(logits[: len(draft.tokens) + 1], params), draft, generator)

    @staticmethod
    def greedy(best: list[int], draft) -> Verdict:
        """`accept` for a greedy request from its rows' argmax `best` [k + 1]: p is a point mass on
        each row's argmax, so d_i passes iff it is the argmax of row i - 1 (u * q < 1 always holds),
        and the residual after a rejection, or the bonus, is that row's argmax whatever q was. No
        [k + 1, V] one-hot, scatter and count per row (262,144-entry rows: at 16 requests they cost
        more than the attention), and the engine takes every request's argmax in one call. Tested
        against `accept`."""
        tokens, k = draft.tokens, len(draft.tokens)
        n = 0
        while n < k and tokens[n] == best[n]:
            n += 1
        return Verdict(tokens[:n] + [best[n]], n, list(range(n)))

    def accept(self, p: torch.Tensor, draft, generator: torch.Generator) -> Verdict:
        """p [k + 1, V] processed target probabilities (one-hot rows for greedy)."""
        draft_tokens = draft.tokens
        k = len(draft_tokens)
        q = draft.q
        if isinstance(q, list):
            q = torch.stack(q) if q else None
        if k:
            idx = torch.arange(k, device=p.device)
            d = torch.tensor(draft_tokens, device=p.device)
            p_d = p[idx, d]  # [k]
            q_d = q[idx, d] if q is not None else torch.ones_like(p_d)
            u = torch.rand(k, generator=generator, device=p.device)
            ok = (u * q_d < p_d).tolist()  # u < p/q without dividing by zero
            n = ok.index(False) if False in ok else k
        else:
            n = 0
        path = list(range(n))
        if n == k:
            return Verdict(draft_tokens + [sample(p[k], generator)], k, path)
        if q is None:
            residual = p[n].clone()
            residual[draft_tokens[n]] = 0.0
        else:
            residual = (p[n] - q[n]).clamp_min(0.0)
        if residual.sum() <= 0:  # p == q on the support: the rejection had probability 0; fall back to p
            residual = p[n]
        return Verdict(draft_tokens[:n] + [sample(residual, generator)], n, path)


