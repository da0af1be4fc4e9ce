"""How much faster than plain decoding the verified plans really ran, against what they promised.

A plan is the best of many estimates, so its predicted gain over plain decoding is biased up,
and by how much depends on the load and on how well `StepCost` prices the plan's extra tokens
there. On the 2-core AVX2 EPYC at 64 streams (session 30, `benchmarks/inprocess_trace.py` over a
traced in-process sweep) the policy verified 42-128 nodes a step on plans predicted 1.15-1.6x
plain decoding; they ran at 0.55-1.0x of it, and the level at 0.92x plain decoding (every fixed k
lost there too: a node cost 5.2 ms, a request's plain step 6.3 ms, so only nodes accepted 83% of
the time broke even). A margin wide enough for that load would also refuse plans at light load,
where the policy beat every fixed k (session 29: 1.07-1.12x the best at 1-4 streams).

So the policy keeps, per batch-size bin (1, 2, 3-4, 5-8, ..., 33-64), the recent quiet plan steps
(no prompt chunk riding along, not a probe): the step number, the predicted gain (the plan's
expected tokens per second over plain decoding's, as priced) and the realized gain (the tokens
the step emitted per second of drafting and verifying, over plain decoding's as priced). Once
MIN_PLANS of the last FORGET steps are on record, the median overshoot (predicted minus realized)
is what a plan's prediction must beat plain decoding by, on top of the margin. A bin whose plans
stop being verified keeps no fresh records, so its overshoot lapses after FORGET steps and the
policy tries again: at worst MIN_PLANS losing steps every FORGET.
"""

from __future__ import annotations

import statistics
from collections import deque


class RealizedGain:
    MIN_PLANS = 8  # records in a bin before its overshoot counts
    KEEP = 32  # records kept per bin
    FORGET = 256  # steps a record counts for

    def __init__(self):
        self._bins: dict[int, deque[tuple[int, float, float]]] = {}  # bin -> (step, predicted, realized)

    @staticmethod
    def bin(num_reqs: int) -> int:
        return (num_reqs - 1).bit_length()

    def record(self, step: int, num_reqs: int, predicted: float, realized: float) -> None:
        self._bins.setdefault(self.bin(num_reqs), deque(maxlen=self.KEEP)).append((step, predicted, realized))

    def overshoot(self, step: int, num_reqs: int) -> float:
        """The median of predicted minus realized gain over this batch size's bin (records from the
        last FORGET steps; 0 with fewer than MIN_PLANS of them, and never below 0)."""
        fresh = [p - r for at, p, r in self._bins.get(self.bin(num_reqs), ()) if step - at < self.FORGET]
        if len(fresh) < self.MIN_PLANS:
            return 0.0
        return max(0.0, statistics.median(fresh))
