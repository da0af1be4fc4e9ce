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
    # target layer outputs this drafter wants to observe (layer i's output; -1: after the final norm)
    target_taps: tuple[int, ...] = ()

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Up to ks[i] draft tokens for each sequence (sampled with the sequence's params and generator)."""
        raise NotImplementedError

    def observe(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor]) -> None:
        """Target hidden states of newly committed tokens: hidden[i] is [n, H] for the tokens
        seq.tokens[start : start + n] (prompt chunks at prefill; the last token plus the accepted
        drafts after a step). Called only when `target_taps` is not empty."""

    def release(self, seq: Sequence) -> None:
        """The sequence has finished: free what the drafter kept for it."""
