"""Verification: which drafted tokens the target accepts, losslessly (docs/ARCHITECTURE.md derives
both rules).

Glossary (per request, one step):
- draft          nodes d_1..d_n proposed by the drafter, each with the draft distribution q it
                 was drawn from (or none: a deterministic drafter, one-hot q); a chain has
                 parent(d_i) = d_{i-1}, a tree any parent that comes earlier (root: the last
                 committed token);
- target probs   p at every node from ONE target forward over [last token, d_1..d_n]: the
                 target's distribution for the token after that node;
- accepted       the nodes on the root path that pass the test (greedy: d == argmax p of its
                 parent; sampled: u < p(d) / q(d), u ~ U(0, 1); siblings are tried in order);
- recovered      at the first node where no child passes, a token drawn from the residual
                 norm(max(0, p - q)) left by the rejected children, so it is distributed as p;
- bonus          when the path reaches a leaf, one more token drawn from p at the leaf.
Each step emits accepted + 1 tokens. Greedy is the case where `probs` makes p one-hot; the
verifiers compute that case's outcome directly from the rows' argmax (`greedy`: the same verdicts,
tested against the general rule, without [n + 1, V] one-hot rows).

A verifier is one class with `verify(logits, draft, params, generator) -> Verdict`; `for_draft`
picks the chain verifier for chains and the tree verifier for trees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..sampling import SamplingParams


@dataclass
class Verdict:
    tokens: list[int]  # emitted this step: accepted drafts, then the recovered or bonus token
    accepted: int  # number of draft tokens accepted
    path: list[int] = field(default_factory=list)  # draft node index of each accepted token (a chain: 0..accepted-1)


class Verifier(Protocol):
    def verify(self, logits: torch.Tensor, draft, params: SamplingParams, generator: torch.Generator) -> Verdict:
        """logits [n + 1, V] fp32: row 0 at the last committed token, row i at draft node i - 1."""
        ...

    def greedy(self, best: list[int], draft) -> Verdict:
        """`verify` for a greedy request, from the argmax of each of those rows."""
        ...


from .chain import ChainVerifier  # noqa: E402  (they import Verdict from here)
from .tree import TreeVerifier  # noqa: E402

CHAIN, TREE = ChainVerifier(), TreeVerifier()


def for_draft(draft) -> Verifier:
    return CHAIN if draft.parents is None else TREE

__all__ = ["Verdict", "Verifier", "ChainVerifier", "TreeVerifier", "for_draft"]
