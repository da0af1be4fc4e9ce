"""Experiment (not the engine's policy): price a step by a line fitted to the live steps at this
batch size, against the adaptive policy as it is and plain decoding, at one load level.

`StepCost` prices a forward of T tokens by the median of live steps of exactly T tokens (twice
seen), else by interpolating between seen counts or the profile's shape; plans of varying size
seldom fill one count, and at 64 streams on an AVX2 EPYC the policy priced a verified node at
0.2-4.2 ms where it cost 5.2 (`node_cost.py`). Here a count not seen at this batch size is priced
by body = a + b (T - N), least squares over this batch size's live steps of the last 256 (at
least 8 of them over two counts or more), and the measured path otherwise.

    python benchmarks/slope_ab.py 64 2 1,2,4,8,16,32     # level, rounds, levels seen before
"""

from verispec.memory import keep_freed_memory

keep_freed_memory()

import numpy as np  # noqa: E402

from level_steps import ab_main  # noqa: E402
from verispec.adaptive.costs import StepCost  # noqa: E402
from verispec.adaptive.policy import AdaptiveDraftLength  # noqa: E402


class SlopeCost(StepCost):
    MIN_FIT = 8

    def costs(self, num_reqs, tokens, head_rows=None):
        pts = [(T, t) for (n, T), q in self.seen_at.items() if n == num_reqs
               for at, t in q if self.steps - at < self.FORGET_AFTER]
        if len(pts) < self.MIN_FIT or len({T for T, _ in pts}) < 2:
            return super().costs(num_reqs, tokens, head_rows)
        x = np.array([T - num_reqs for T, _ in pts], float)
        a, b = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), np.array([t for _, t in pts]), rcond=None)[0]
        b = max(b, 0.0)
        here = {T: m for (n, T), q in self.seen_at.items() if n == num_reqs and (m := self._median(q)) is not None}
        out = []
        for i, T in enumerate(tokens):
            body = here.get(T, a + b * (T - num_reqs))
            cost = max(body, 0.0) + self.profile.head_cost(T if head_rows is None else head_rows[i])
            out.append(max(cost, out[-1] if out else 0.0))
        return out


class SlopePriced(AdaptiveDraftLength):
    @property
    def step_cost(self):
        if self._step_cost is None:
            self._step_cost = SlopeCost(self.profile)
        elif self._step_cost.profile is not self.profile:
            self._step_cost.profile = self.profile
        return self._step_cost


if __name__ == "__main__":
    ab_main({"as is": AdaptiveDraftLength, "slope": SlopePriced})
