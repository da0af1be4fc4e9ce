"""N-gram / prompt-lookup drafting: continue the longest suffix that occurred before.

Chain: for n from `max_n` down to `min_n`, take the last n tokens of the sequence (prompt and
output), find their most recent earlier occurrence that is followed by k tokens, and draft the
tokens that followed it.

Tree: the continuations of several earlier occurrences, merged into a trie. Every occurrence of
the last n tokens (n = max_n..min_n, the most recent `max_matches` of each length) votes for each
node on its continuation with the length of the context it shares with the sequence's end (up
to 16 tokens: a longer shared context predicts a surer continuation); the budget keeps the highest-voted nodes (a child
never outvotes its parent, so the kept nodes form a tree), siblings ordered by votes, then by
recency. Costs no model call, so it pays off whenever the output copies from the prompt or from
itself (code, edits, summaries, repetitive text).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..sequence import Sequence
from .base import CHAIN, Draft, DrafterBase, register


@register("ngram", "ngram[:N]", "prompt lookup over prompt + output, suffixes of N..1 tokens (default 3)")
def _make(arg: str, ctx) -> "NgramDrafter":
    try:
        n = int(arg) if arg else 3
    except ValueError:
        raise ValueError(f"ngram takes a suffix length, e.g. ngram:3, got {arg!r}") from None
    return NgramDrafter(max_n=n)


class NgramDrafter(DrafterBase):
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1, max_matches: int = 16):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n, self.max_matches = max_n, min_n, max_matches

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        out = []
        for s, k in zip(seqs, budgets):
            shape = s.tree or CHAIN
            if k <= 0:
                out.append(Draft([]))
            elif shape.is_chain:
                tokens, shared = lookup(s.tokens, k, self.max_n, self.min_n)
                out.append(Draft(tokens, features=[[math.log1p(shared)]] * len(tokens)))
            else:
                out.append(self._trie(s.tokens, k, shape))
        return out

    def _trie(self, tokens: list[int], budget: int, shape) -> Draft:
        arr = np.asarray(tokens, dtype=np.int64)
        L = len(arr)
        # trie: node -> {token: child}; votes and recency per node
        kids: list[dict[int, int]] = [{}]
        votes, recent, depth, parent, token = [0.0], [0], [0], [-1], [-1]
        seen: set[int] = set()
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = sliding_window_view(arr[: L - 1], n)  # [L - n, n]
            hits = np.flatnonzero((windows == arr[L - n:]).all(axis=1))[-self.max_matches:]
            for h in hits[::-1]:  # most recent first
                if h + n in seen:  # the same continuation, already voted for by a longer suffix
                    continue
                seen.add(int(h + n))
                w = _match_length(arr, int(h) + n, L, n)  # a longer shared context: a surer continuation
                node = 0
                for t in arr[h + n : min(L, h + n + budget)].tolist():
                    child = kids[node].get(t)
                    if child is None:
                        child = len(votes)
                        kids[node][t] = child
                        kids.append({})
                        votes.append(0.0)
                        recent.append(int(h))
                        depth.append(depth[node] + 1)
                        parent.append(node)
                        token.append(t)
                    votes[child] += w
                    node = child
        # best-first over the trie: a node can be taken once its parent is, at most
        # shape.children(depth) children per node
        chosen: list[int] = []
        index = {0: -1}
        taken = [0] * len(votes)
        frontier = list(kids[0].values())
        while frontier and len(chosen) < budget:
            frontier.sort(key=lambda c: (-votes[c], depth[c], -recent[c]))
            c = frontier.pop(0)
            par = parent[c]
            if taken[par] >= shape.children(depth[par]):
                continue
            taken[par] += 1
            index[c] = len(chosen)
            chosen.append(c)
            frontier += list(kids[c].values())
        # parents before children: chosen order already has that (a child enters the frontier after its parent)
        return Draft([token[c] for c in chosen], None, [index[parent[c]] for c in chosen],
                      features=[[math.log1p(votes[c])] for c in chosen])  # evidence: summed match lengths


def _match_length(arr: np.ndarray, end: int, L: int, n: int, cap: int = 16) -> int:
    """How many tokens before `end` equal the tokens before the sequence's end (at least n)."""
    m = n
    while m < cap and end - m - 1 >= 0 and arr[end - m - 1] == arr[L - m - 1]:
        m += 1
    return m


def lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> tuple[list[int], int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching
    suffix, and how many tokens of context that occurrence shares with the sequence's end."""
    arr = np.asarray(tokens, dtype=np.int64)
    L = len(arr)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # candidate windows start at 0..L-n-1 (the suffix itself starts at L-n and is excluded)
        windows = sliding_window_view(arr[: L - 1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == arr[L - n:]).all(axis=1))
        if len(hits):
            # the most recent match that has k tokens after it, else the one with the most
            full = hits[hits + n + k <= L]
            start = int(full[-1] if len(full) else hits[0]) + n
            return arr[start : start + k].tolist(), _match_length(arr, start, L, n)
    return [], 0
