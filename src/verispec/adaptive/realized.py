"""How much faster than plain decoding the verified plans really ran, against what they promised.

A plan is the best of many estimates, so its predicted gain over plain decoding is biased up,
and by how much depends on the load and on how well `StepCost` prices the plan's extra tokens
there. On the 2-core AVX2 EPYC at 64 streams (session 30, `benchmarks/inprocess_trace.py` over a
traced in-process sweep) the policy verified 42-128 nodes a step on plans predicted 1.15-1.6x
plain decoding; they ran at 0.55-1.0x of it, and the level at 0.92x plain decoding (every fixed k
lost there too: a node cost 5.2 ms, a request's plain step 6.3 ms, so only nodes accepted 83% of
the time broke even). A margin wide enough for that load would also refuse plans at light load,
where the policy beat every fixed k (session 29: 1.07-1.12x the best at 1-4 streams).

So the policy keeps, per batch-size bin (1, 2, 3-4, 5-8, ..., 33-64), the recent non-probe plan
steps: the step number, the predicted gain (the plan's expected tokens per second over plain
decoding's, as priced) and the realized gain (the tokens the step emitted per second of drafting
and verifying, over plain decoding's). Once MIN_PLANS of the last FORGET steps are on record, the
median overshoot (predicted minus realized) is what a plan's prediction must beat plain decoding
by, on top of the margin. A bin whose plans stop being verified keeps no fresh records, so its
overshoot lapses after FORGET steps and the policy tries again: at worst MIN_PLANS losing steps
every FORGET.

Plain decoding's speed, for the realized gain, is what this bin's own recent quiet steps that
verified nothing ran at (seconds per request, median), once MIN_PLAIN of them are on record;
before that, the step cost's price. Against the price alone the check let losing plans through
where that price was high (at 64 streams, 7.3 ms a request where such steps ran at 6.3-6.5):
the price inflates the predicted and the realized gain alike, and the overshoot, a difference,
then falls short of what the prediction exceeds by.

A gate that stopped a bin's plans (and its drafting but on probes) once the median realized
gain of its last 12 plans was under 1 + margin was tried in session 32: at 64 streams it brought
the policy to 0.986 of plain decoding in process and 0.991 through the server, but at one stream
a stretch of rejected plans closed it for up to 209 steps, across requests whose drafts would
have paid, and the level fell to 0.94-0.95 of fixed k = 7; reverted (`benchmarks/gate_replay.py`
replays traced sweeps under it).

Steps with prompt chunks riding in the forward are kept apart (their own bins): the plan's share
of such a step is the step less the riders' priced part, and how far that is off is its own
matter. At 64 streams the nodes of those steps cost 5.8 ms where they were priced 3.8 ms, were
accepted 79% of the time, and their steps were 43% of the level's time (session 30).
"""

from __future__ import annotations

import statistics
from collections import deque

from .costs import batch_bin


class RealizedGain:
    MIN_PLANS = 8  # records in a bin before its overshoot counts
    MIN_PLAIN = 4  # plain steps in a bin before their speed is the reference
    KEEP = 32  # records kept per bin
    FORGET = 256  # steps a record counts for

    def __init__(self):
        self._plans: dict[tuple[int, bool], deque[tuple[int, float, float]]] = {}  # (bin, riders) -> (step, predicted, realized)
        self._plain: dict[int, deque[tuple[int, float]]] = {}  # bin -> (step, seconds per request)

    def plain(self, step: int, num_reqs: int, seconds: float) -> None:
        """A quiet step (no prompt chunk riding along) that verified nothing took `seconds` after drafting."""
        self._plain.setdefault(batch_bin(num_reqs), deque(maxlen=self.KEEP)).append((step, seconds / num_reqs))

    def plain_seconds(self, step: int, num_reqs: int) -> float | None:
        """Seconds a plain step of num_reqs requests takes by this bin's recent plain steps; None
        with fewer than MIN_PLAIN of them in the last FORGET steps."""
        fresh = [s for at, s in self._plain.get(batch_bin(num_reqs), ()) if step - at < self.FORGET]
        return num_reqs * statistics.median(fresh) if len(fresh) >= self.MIN_PLAIN else None

    def record(self, step: int, num_reqs: int, predicted: float, realized: float, riders: bool = False) -> None:
        key = (batch_bin(num_reqs), riders)
        self._plans.setdefault(key, deque(maxlen=self.KEEP)).append((step, predicted, realized))

    def overshoot(self, step: int, num_reqs: int, riders: bool = False) -> float:
        """The median of predicted minus realized gain over this batch size's bin, quiet steps or
        those with riders (records from the last FORGET steps; 0 with fewer than MIN_PLANS of
        them, and never below 0)."""
        fresh = [p - r for at, p, r in self._plans.get((batch_bin(num_reqs), riders), ()) if step - at < self.FORGET]
        if len(fresh) < self.MIN_PLANS:
            return 0.0
        return max(0.0, statistics.median(fresh))
