"""One request's state as it moves through the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams


@dataclass
class SpecStats:
    """Counted in the acceptance step and nowhere else (docs/ARCHITECTURE.md, "Metrics")."""

    forwards: int = 0  # target forwards after prefill
    emitted: int = 0  # tokens emitted by those forwards
    drafts: int = 0  # steps that verified at least one draft token
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    drafted_at: list[int] = field(default_factory=list)  # per position: drafts at least that long
    accepted_at: list[int] = field(default_factory=list)  # per position: accepted there
    reached_at: list[int] = field(default_factory=list)  # per position: verified with all before it accepted

    def record(self, num_drafted: int, num_accepted: int, num_emitted: int, depth: int | None = None) -> None:
        """One verify step: `num_drafted` draft nodes (a tree's node count), of which `num_accepted`
        were accepted along one path, `num_emitted` tokens emitted. Per-position counts run over
        the `depth` positions of the draft (a chain: num_drafted)."""
        self.forwards += 1
        self.emitted += num_emitted
        if num_drafted:
            self.drafts += 1
            self.drafted += num_drafted
            self.accepted += num_accepted
            positions = num_drafted if depth is None else depth
            grow = positions - len(self.drafted_at)
            if grow > 0:
                self.drafted_at += [0] * grow
                self.accepted_at += [0] * grow
                self.reached_at += [0] * grow
            for i in range(positions):
                self.drafted_at[i] += 1
            for i in range(min(num_accepted + 1, positions)):
                self.reached_at[i] += 1
            for i in range(num_accepted):
                self.accepted_at[i] += 1

    def merge(self, other: "SpecStats") -> None:
        for name in ("forwards", "emitted", "drafts", "drafted", "accepted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        n = max(len(self.drafted_at), len(other.drafted_at))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        self.drafted_at = [a + b for a, b in zip(pad(self.drafted_at), pad(other.drafted_at))]
        self.accepted_at = [a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at))]
        self.reached_at = [a + b for a, b in zip(pad(self.reached_at), pad(other.reached_at))]

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward, bonus included (prefill excluded)."""
        return self.emitted / self.forwards if self.forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_unconditional(self) -> list[float]:
        """Per position k: accepted at k / all drafts."""
        return [a / self.drafts for a in self.accepted_at] if self.drafts else []

    @property
    def acceptance_conditional(self) -> list[float]:
        """Per position k: accepted at k / drafts that reached k (a token there, all before it accepted)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached_at)]

    def to_dict(self) -> dict:
        return {
            "target_forwards": self.forwards,
            "tau": round(self.tau, 4),
            "drafts": self.drafts,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_per_position_unconditional": [round(x, 4) for x in self.acceptance_unconditional],
            "acceptance_per_position_conditional": [round(x, 4) for x in self.acceptance_conditional],
        }


@dataclass
class Sequence:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # prompt + output; the last one is not in the KV cache yet
    slot: int = -1
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    drafter_state: object = None  # owned by the drafter
    num_draft_tokens: int = 0  # this request's draft budget in nodes (0: no speculation)
    tree: object = None  # this request's drafters.TreeShape (None: a chain)
    logprobs: list = field(default_factory=list)  # per output token: (token, logprob, {top token: logprob})

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
