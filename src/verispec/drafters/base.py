"""The one interface every drafter implements.

A drafter looks at the committed tokens of each running sequence and proposes up to k next
tokens. It never calls the target model or touches the target's KV cache; what it needs from the
target (hidden states) it declares in `target_taps` and receives through `observe`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sequence import Sequence


@dataclass
class Draft:
    tokens: list[int]  # d_1..d_k (k may be smaller than asked, or 0)
    q: torch.Tensor | None = None  # [k, V] processed draft probabilities; None = deterministic (one-hot)


class Drafter:
    name = "drafter"
    target_taps: tuple[int, ...] = ()  # target layer outputs this drafter wants to observe

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Up to ks[i] draft tokens for each sequence (sampled with the sequence's params and generator)."""
        raise NotImplementedError

    def observe(self, seqs: list[Sequence], hidden: dict[int, torch.Tensor]) -> None:
        """Called after each target forward with the requested target hidden states."""

    def release(self, seq: Sequence) -> None:
        """The sequence has finished: free what the drafter kept for it."""
