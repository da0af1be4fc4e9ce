"""Draft-length policies: how many draft nodes each request may propose this step.

The engine asks its policy once per step for every running request; the answer is capped by
the request's own `num_draft_tokens` and by the KV slack. Fixed k is the first policy; an
adaptive one (cost- and confidence-aware) is another class with the same method. A policy may
look at anything committed, never at the draft tokens it is deciding on (that keeps verification
lossless: docs/ARCHITECTURE.md, "Why adaptive budgets stay lossless").
"""

from __future__ import annotations

from typing import Protocol

from .sequence import Sequence


class DraftLengthPolicy(Protocol):
    def budgets(self, seqs: list[Sequence], cap: int) -> list[int]:
        """Draft nodes each request may propose this step (0: no speculation), at most `cap`."""
        ...


class FixedDraftLength:
    """Every request drafts its own `num_draft_tokens` (the engine default or the request's),
    never more than the tokens it still may emit minus the bonus."""

    def budgets(self, seqs: list[Sequence], cap: int) -> list[int]:
        return [max(0, min(s.num_draft_tokens, cap, s.params.max_tokens - s.num_output - 1)) for s in seqs]
