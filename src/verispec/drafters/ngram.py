"""N-gram / prompt-lookup drafting: continue the longest suffix that occurred before.

For n from `max_n` down to `min_n`, take the last n tokens of the sequence (prompt and output) and
find their most recent earlier occurrence that is followed by k tokens; the tokens that followed it are the draft. Costs no
model call, so it pays off whenever the output copies from the prompt or from itself (code,
edits, summaries, repetitive text).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..sequence import Sequence
from .base import Draft, Drafter


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft(lookup(s.tokens, k, self.max_n, self.min_n) if k > 0 else []) for s, k in zip(seqs, ks)]


def lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
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
            return arr[start : start + k].tolist()
    return []
