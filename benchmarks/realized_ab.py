"""A/B of a check on the plans' realized gain, at one load level: the adaptive policy as it is
against the same policy that also vetoes plans at batch sizes where recent plans ran slower than
predicted, and plain decoding; every method's steps alternating (`level_steps.ab_level`).

Why: a plan is the best of many estimates, so its predicted gain over plain decoding is biased
up; `AdaptiveDraftLength.MARGIN` (3%) guesses that bias once for every load. Session 29's
sweep (alternating steps) measured the policy under plain decoding at 64 streams, 4.8% and 6.1%
in its two rounds, and 7.6% under it at 32 streams in one round, where no fixed k paid either. This variant measures the bias instead: after each quiet
step that verified a plan (no prompt chunk riding along, not a probe) it records predicted gain
(the plan's throughput over plain decoding's, as priced) and realized gain (tokens emitted per
second of drafting and verifying, over the batch size's own plain step: n tokens in what
`StepCost` says n tokens cost). Per batch-size bin (17-32, 33-64, ...), once 8 plans are on record,
a plan must beat plain decoding by MARGIN plus the median overshoot (predicted minus realized).
Records age out after FORGET steps, so a veto is checked again.

    python benchmarks/realized_ab.py 32 2 1,2,4,8,16     # level, rounds, levels seen before
"""

from verispec.memory import keep_freed_memory

keep_freed_memory()

import statistics  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402

from level_steps import ab_main  # noqa: E402
from verispec.adaptive.policy import AdaptiveDraftLength  # noqa: E402


class CheckedPolicy(AdaptiveDraftLength):
    MIN_PLANS = 8
    KEEP = 32  # plans on record per bin
    FORGET = 256  # steps a record counts

    def _choose(self, theta, exact):
        choice = super()._choose(theta, exact)
        self._plan_gain = None
        if choice and theta[0] > 0:
            over = self._overshoot(self._n_now)
            if theta[choice] < (1 + self.MARGIN + over) * theta[0]:
                return 0
            self._plan_gain = theta[choice] / theta[0]
        return choice

    def _overshoot(self, n: int) -> float:
        rec = [(p, r) for step, p, r in getattr(self, "_gains", {}).get((n - 1).bit_length(), ()) if self.steps - step <= self.FORGET]
        if len(rec) < self.MIN_PLANS:
            return 0.0
        return max(0.0, statistics.median(p - r for p, r in rec))

    def admit(self, seqs, drafts, draft_seconds):
        self._n_now, self._plan_gain, self._quiet = len(seqs), None, self._riding == (0, 0)
        self._draft_s = draft_seconds
        return super().admit(seqs, drafts, draft_seconds)

    def observe(self, seqs, drafts, verdicts):
        now, started = time.perf_counter(), self._verify_started
        super().observe(seqs, drafts, verdicts)
        gain = getattr(self, "_plan_gain", None)
        if started is None or gain is None or not self._quiet or self._probe:
            return
        n, tokens, rows, t0 = started
        seconds = now - t0 + self._draft_s
        plain = self.step_cost.costs(n, [n], [n])[0]
        if seconds <= 0 or plain <= 0:
            return
        emitted = sum(v.accepted + 1 for v in verdicts)
        realized = (emitted / seconds) / (n / plain)
        if not hasattr(self, "_gains"):
            self._gains = {}
        self._gains.setdefault((n - 1).bit_length(), deque(maxlen=self.KEEP)).append((self.steps, gain, realized))
        self._plan_gain = None


if __name__ == "__main__":
    ab_main({"as is": AdaptiveDraftLength, "checked": CheckedPolicy})
