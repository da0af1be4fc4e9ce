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
decoding's, as priced) and the realized gain (the tokens the step emitted per second of drafting,
planning and verifying, over plain decoding's). Where nodes are dear (below), once MIN_PLANS of
the last FORGET steps are on record, the median overshoot (predicted minus realized) is what a
plan's prediction must beat plain decoding by, on top of the margin. A bin whose plans stop being
verified keeps no fresh records, so its overshoot lapses after FORGET steps and the policy tries
again: at worst MIN_PLANS losing steps every FORGET.

Plain decoding's speed, for the realized gain, is what this bin's own recent quiet steps that
verified nothing ran at (seconds per request, median), once MIN_PLAIN of them are on record;
before that, the step cost's price. Against the price alone the check let losing plans through
where that price was high (at 64 streams, 7.3 ms a request where such steps ran at 6.3-6.5):
the price inflates the predicted and the realized gain alike, and the overshoot, a difference,
then falls short of what the prediction exceeds by.

Nodes are dear where verifying one node per request costs at least the policy's DEAR_SHARE
(0.6) of a plain step, by the step cost's price or at the slope of plain steps from one request
(the policy's `_nodes`; 0.69 at 32 streams and 0.81 at 64 on the 2-core AVX2 EPYC by session
31's plain steps, 0.5 at 16, 0.06 at one). There a bin whose plans lately did not beat plain
decoding by the margin (the median realized gain of MIN_LOSING fresh records below 1 + margin:
`losing`) takes no plan at all, whatever it promises, and a cheap drafter does not draft there
except on probes, until those records lapse (`closed`). There a node must be accepted nearly as
often as it costs a plain token's share to pay, so plans live on a thin margin that the price's error eats: at 64
streams plans accepted 83-94% of the time realized a median 0.92-0.99x plain decoding while
predicting 1.04-1.21x, and the overshoot, a median difference, let the plans predicted above it
through (session 31: 0.943x plain decoding, 9-62 plans a round). With this gate the policy ran
0.986x in process and 0.991x through the server (session 32). Where nodes are cheap, a rejected
plan costs little and a losing record says only that recent text was novel: the gate applied at
one stream too (session 32) closed for up to 209 steps after 12 rejected plans, across requests
whose drafts would have paid, and the level fell to 0.94-0.95 of fixed k = 7; the estimator,
not the gate, answers for acceptance. The overshoot likewise: at one stream, where the n-gram
lookup's drafts are accepted whole or not at all, a few rejected plans among accepted ones set a
median overshoot of 0.5, and no plan was verified for the rest of a 256-token bench (1.09x plain
decoding where fixed k = 7 ran 1.70x; session 33, `adaptive-s33/levels-1-2b`).

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
    MIN_LOSING = 12  # records before a bin's realized gain can stop its plans (`losing`): one noisy
    # record counts less; replayed on session 31's traces (benchmarks/gate_replay.py), 8 closed the 16-stream level in one round
    # on plans that paid (2.9% of its time), 12 nowhere below 32 streams
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
        fresh = self._fresh(step, num_reqs, riders)
        return max(0.0, statistics.median(p - r for p, r in fresh)) if len(fresh) >= self.MIN_PLANS else 0.0

    def losing(self, step: int, num_reqs: int, riders: bool, margin: float) -> bool:
        """Whether this bin's plans, on steps with riders or without as asked, lately realized a
        median gain below 1 + margin (False with fewer than MIN_LOSING fresh records)."""
        fresh = self._fresh(step, num_reqs, riders)
        return len(fresh) >= self.MIN_LOSING and statistics.median(r for _, r in fresh) < 1 + margin

    def closed(self, step: int, num_reqs: int, margin: float) -> bool:
        """Whether nothing is worth drafting for at this batch size: the bin has MIN_LOSING fresh
        records, on steps with riders or without, and every such set is `losing`."""
        sets = [r for r in (False, True) if len(self._fresh(step, num_reqs, r)) >= self.MIN_LOSING]
        return bool(sets) and all(self.losing(step, num_reqs, r, margin) for r in sets)

    def _fresh(self, step: int, num_reqs: int, riders: bool) -> list[tuple[float, float]]:
        """(predicted, realized) of the bin's records from the last FORGET steps."""
        return [(p, r) for at, p, r in self._plans.get((batch_bin(num_reqs), riders), ()) if step - at < self.FORGET]
