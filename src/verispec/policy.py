"""Draft-length policies: how many draft nodes each request may propose this step.

The engine asks its policy twice per step: before drafting, how many nodes each running request
may draft (capped by the request's own `num_draft_tokens` and by the KV slack); after drafting,
which of the drafted nodes to verify. Then it reports the verdicts. Fixed k verifies every
drafted node; the adaptive policy (adaptive/) verifies those worth their cost. A policy may
look at anything committed, never at the draft tokens it is deciding on (that keeps verification
lossless: docs/ARCHITECTURE.md, "Why adaptive budgets stay lossless").
"""

from __future__ import annotations

from typing import Protocol

from .drafters.base import Draft
from .sequence import Sequence
from .verify import Verdict


class DraftLengthPolicy(Protocol):
    def budgets(self, seqs: list[Sequence], cap: int, holding: int = 0) -> list[int]:
        """Draft nodes each request may propose this step (0: no speculation), at most `cap`.
        `holding`: the requests holding a KV slot, `seqs` and those whose prompts are still being
        prefilled (0 where the caller does not say)."""
        ...

    def admit(self, seqs: list[Sequence], drafts: list[Draft], draft_seconds: float) -> list[Draft]:
        """The part of each draft to verify (a subtree holding the root's side: `Draft.select`).
        It may depend on the drafts' features and on anything committed, never on a node's own
        token when that token was sampled."""
        ...

    def riders(self, tokens: int, head_rows: int) -> None:
        """Prompt tokens that ride in this step's verify forward, and the LM head rows they add;
        called before `admit` (for policies that price their plans and time the steps)."""
        ...

    def observe(self, seqs: list[Sequence], drafts: list[Draft], verdicts: list[Verdict]) -> None:
        """The verifier's verdicts on the admitted drafts (for policies that learn)."""
        ...


class FixedDraftLength:
    """Every request drafts its own `num_draft_tokens` (the engine default or the request's),
    never more than the tokens it still may emit minus the bonus."""

    def budgets(self, seqs: list[Sequence], cap: int, holding: int = 0) -> list[int]:
        return [max(0, min(s.num_draft_tokens, cap, s.params.max_tokens - s.num_output - 1)) for s in seqs]

    def admit(self, seqs: list[Sequence], drafts: list[Draft], draft_seconds: float) -> list[Draft]:
        return drafts

    def observe(self, seqs: list[Sequence], drafts: list[Draft], verdicts: list[Verdict]) -> None:
        pass

    def riders(self, tokens: int, head_rows: int) -> None:
        pass
