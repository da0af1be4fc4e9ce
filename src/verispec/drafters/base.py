"""The one interface every drafter implements, and the registry that names them.

A drafter looks at the committed tokens of each running sequence and proposes draft tokens: a
chain, or a tree (each node with a parent that comes before it). It never calls the target model
or touches the target's KV cache; what it needs from the target (hidden states) it declares in
`target_taps` and receives through `on_commit`.

Adding a drafter is one file: a class with `propose` (and `on_commit` / `release` if it keeps
state), decorated with `@register("name", "usage", "what it is")`; the factory receives the text
after "name:" and a `DrafterContext`. docs/ARCHITECTURE.md walks through one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..sequence import Sequence


@dataclass
class Draft:
    tokens: list[int]  # d_1..d_n (n may be smaller than the budget, or 0); parents before children
    # q[i] [V]: the processed draft distribution node i was drawn from (for a tree, its parent's
    # distribution; siblings share it). None: a deterministic drafter (one-hot q at each token).
    q: torch.Tensor | list[torch.Tensor] | None = None
    parents: list[int] | None = None  # parent of each node (-1: the last committed token); None: a chain
    iid: bool = False  # siblings drawn i.i.d. from q (else without replacement, or distinct deterministic tokens)
    # features[i]: what the drafter knew about node i before drawing it (for model drafters the
    # logit of the largest probability of the distribution it was drawn from; for n-gram the log
    # of the evidence for it). The adaptive policy's estimator learns acceptance from them; a
    # sampled node's features never depend on its own token (docs/ARCHITECTURE.md).
    features: list[list[float]] | None = None

    @property
    def depth(self) -> int:
        """Tokens on the longest root path (a chain: its length)."""
        if self.parents is None:
            return len(self.tokens)
        d = []
        for par in self.parents:
            d.append(1 + (d[par] if par >= 0 else 0))
        return max(d, default=0)

    def depths(self) -> list[int]:
        """Depth of each node (1 = a child of the root)."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        d: list[int] = []
        for par in self.parents:
            d.append(1 + (d[par] if par >= 0 else 0))
        return d

    def truncate(self, budget: int) -> "Draft":
        """The first `budget` nodes (parents come first, so it is still a tree)."""
        if len(self.tokens) <= budget:
            return self
        return self.select(list(range(budget)))

    def select(self, keep: list[int]) -> "Draft":
        """The nodes `keep` (ascending; every kept node's parent is kept), renumbered."""
        if len(keep) == len(self.tokens):
            return self
        index = {-1: -1}
        for j, i in enumerate(keep):
            index[i] = j
        q = None if self.q is None else (self.q[keep] if isinstance(self.q, torch.Tensor) else [self.q[i] for i in keep])
        parents = None if self.parents is None else [index[self.parents[i]] for i in keep]
        feats = None if self.features is None else [self.features[i] for i in keep]
        return Draft([self.tokens[i] for i in keep], q, parents, self.iid, feats)


@dataclass(frozen=True)
class TreeShape:
    """How a drafter may branch. `branching[d]`: children per node at depth d (the last value
    repeats); `dynamic`: expand by cumulative draft probability (EAGLE-2) up to the node budget,
    with at most `branching[0]` children per node. A chain is branching (1,)."""

    branching: tuple[int, ...] = (1,)
    dynamic: bool = False

    @property
    def is_chain(self) -> bool:
        return not self.dynamic and all(b == 1 for b in self.branching)

    def children(self, depth: int) -> int:
        return self.branching[min(depth, len(self.branching) - 1)]

    @classmethod
    def parse(cls, spec: str | None) -> "TreeShape":
        """'chain' | 'dynamic[:W]' (W children per node at most, default 4) | 'static:B1,B2,..'."""
        spec = (spec or "chain").strip()
        kind, _, arg = spec.partition(":")
        try:
            if kind == "chain":
                return CHAIN
            if kind == "dynamic":
                w = int(arg) if arg else 4
                if w < 1:
                    raise ValueError
                return cls((w,), dynamic=True)
            if kind == "static":
                b = tuple(int(x) for x in arg.split(","))
                if not b or min(b) < 1:
                    raise ValueError
                return cls(b)
        except ValueError:
            pass
        raise ValueError(f"bad tree shape {spec!r}: use chain, dynamic[:W] or static:B1,B2,... (children per node "
                         f"at each depth, each >= 1)")


CHAIN = TreeShape()


class Drafter(Protocol):
    name: str
    # target layer outputs this drafter wants (layer i's output; -1: after the final norm)
    target_taps: tuple[int, ...]

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        """At most budgets[i] draft nodes for each sequence, in the shape seq.tree asks for (sampled
        with the sequence's params and generator)."""
        ...

    def on_commit(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor]) -> None:
        """Tokens seq.tokens[start : start + n] are now in the target's KV cache (a prompt chunk,
        or the last token plus the accepted path after a step); hidden[i] [n, H] holds the
        target's layer-i states of those tokens (only the taps asked for)."""
        ...

    def release(self, seq: Sequence) -> None:
        """The sequence has finished: free what the drafter kept for it."""
        ...


class DrafterBase:
    """Defaults for the optional parts of the interface."""

    name = "drafter"
    target_taps: tuple[int, ...] = ()

    def on_commit(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor]) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


@dataclass
class DrafterContext:
    """What a drafter factory may use: the target, the KV room per sequence, numerics."""

    target: object
    max_batch: int
    max_len: int
    dtype: torch.dtype
    device: object


@dataclass
class _Entry:
    name: str
    usage: str
    help: str
    factory: Callable[[str, DrafterContext], Drafter]
    detect: Callable[[str], bool] | None = None


REGISTRY: dict[str, _Entry] = {}


def register(name: str, usage: str, help: str, detect: Callable[[str], bool] | None = None):
    """Class or function decorator: `name[:ARG]` builds a drafter with factory(ARG, context).
    `detect(path)` lets a bare folder name select this kind (checkpoint drafters)."""

    def deco(factory):
        REGISTRY[name] = _Entry(name, usage, help, factory, detect)
        return factory

    return deco


def make_drafter(spec: str, target, max_batch: int, max_len: int, dtype: torch.dtype, device) -> Drafter:
    """Build a drafter from its command-line spec (`drafter_help()` lists them)."""
    ctx = DrafterContext(target, max_batch, max_len, dtype, device)
    kind, _, arg = spec.partition(":")
    if kind in REGISTRY:
        return REGISTRY[kind].factory(arg, ctx)
    for e in REGISTRY.values():
        if e.detect is not None and e.detect(spec):
            return e.factory(spec, ctx)
    raise ValueError(f"unknown drafter {spec!r}; use one of: " + ", ".join(e.usage for e in REGISTRY.values()))


def drafter_help() -> str:
    """One line per registered drafter, for --drafter help texts."""
    return "; ".join(f"{e.usage}: {e.help}" for e in REGISTRY.values()) + "; none: no speculation"

