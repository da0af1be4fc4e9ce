"""Token-tree verification: recursive rejection sampling over siblings (SpecInfer, Miao et al.
2023; without replacement: Jeon et al. 2024, Recursive Speculative Decoding).

Walk from the root. At a node with target distribution p and children x_1..x_m (in draft order):
try x_i with probability min(1, p_i(x_i) / q_i(x_i)); on acceptance move to x_i (its own p comes
from its row of the same forward); on rejection update p_{i+1} = norm(max(0, p_i - q_i)) and try
the next sibling. If every child is rejected, emit a draw from the last residual; at a leaf,
a bonus draw from p. q_i is the distribution x_i was actually drawn from:
- i.i.d. siblings (`draft.iid`): q_i = q for every i;
- siblings drawn without replacement (the default, and every deterministic drafter, whose
  siblings are distinct tokens with one-hot q): q_i = q with x_1..x_{i-1} removed, renormalized.
Either way the emitted token is distributed exactly as the node's p (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, argmax, probs, sample
from . import Verdict


class TreeVerifier:
    def verify(self, logits: torch.Tensor, draft, params: SamplingParams, generator: torch.Generator) -> Verdict:
        """logits [n + 1, V]: row 0 at the root (last committed token), row i + 1 at draft node i.
        draft.parents[i] is node i's parent (-1: the root); draft.q[i] the distribution node i was
        drawn from (its parent's draft distribution; None: a deterministic drafter)."""
        if params.greedy:
            return self.greedy(argmax(logits[: len(draft.tokens) + 1]).tolist(), draft)
        return self.walk(lambda node: probs(logits[node : node + 1], params)[0], draft, generator)

    def walk(self, p_at, draft, generator: torch.Generator) -> Verdict:
        """The recursive rejection walk; p_at(node) [V] is the processed target distribution at a
        node (0: the root), computed only for the rows the walk visits."""
        children = _children(draft)
        node, path, tokens = 0, [], []
        while True:
            p = p_at(node)
            chosen = None
            removed: list[int] = []  # siblings already rejected (without replacement: out of q)
            for i in children[node]:
                x = draft.tokens[i]
                q = self._q(draft, i, removed, p)
                u = float(torch.rand((), generator=generator, device=p.device))
                if u * float(q[x]) < float(p[x]):
                    chosen = i
                    break
                residual = (p - q).clamp_min(0.0)
                total = residual.sum()
                p = residual / total if total > 0 else p  # total 0: p == q_i, the rejection had probability 0
                removed.append(x)
            if chosen is None:
                tokens.append(sample(p, generator))
                return Verdict(tokens, len(path), path)
            tokens.append(draft.tokens[chosen])
            path.append(chosen)
            node = chosen + 1

    @staticmethod
    def greedy(best: list[int], draft) -> Verdict:
        """The walk for a greedy request from its rows' argmax `best` [n + 1]: p at every node is a
        point mass on its row's argmax, so a child other than the argmax is rejected and leaves p
        as it was (the residual of a point mass at another token is the point mass), and the first
        child equal to the argmax is accepted. Tested against `walk`."""
        children, tokens = _children(draft), draft.tokens
        node, path, out = 0, [], []
        while True:
            chosen = next((i for i in children[node] if tokens[i] == best[node]), None)
            if chosen is None:
                return Verdict(out + [best[node]], len(path), path)
            out.append(tokens[chosen])
            path.append(chosen)
            node = chosen + 1

    @staticmethod
    def _q(draft, i: int, removed: list[int], like: torch.Tensor) -> torch.Tensor:
        """q_i [V]: the distribution sibling i was drawn from, given the siblings tried before it."""
        if draft.q is None:  # deterministic: a point mass on the token itself
            q = torch.zeros_like(like)
            q[draft.tokens[i]] = 1.0
            return q
        q = draft.q[i]
        if draft.iid or not removed:
            return q
        q = q.clone()
        q[removed] = 0.0
        total = q.sum()
        return q / total if total > 0 else q


def _children(draft) -> list[list[int]]:
    """children[node]: the draft nodes whose parent is node - 1 (node 0: the root), in draft order."""
    children: list[list[int]] = [[] for _ in range(len(draft.tokens) + 1)]
    for i, par in enumerate(draft.parents):
        children[par + 1].append(i)
    return children
