"""A/B of `StepCost`'s line at one load level: the adaptive policy as it is (a count not seen twice
at this batch size costs a + b (T - N), fitted to this batch size's live steps) against the same
policy without the line (the rule before session 28: other batch sizes' counts and the profile's
shape), and plain decoding.

Session 27 ran this experiment before the line was the engine's rule: at 64 streams on an AVX2
EPYC the policy without it priced a verified node at 0.2-4.2 ms where it cost 5.2 (`node_cost.py`).

    python benchmarks/slope_ab.py 64 2 1,2,4,8,16,32     # level, rounds, levels seen before
"""

from verispec.memory import keep_freed_memory

keep_freed_memory()

from level_steps import ab_main  # noqa: E402
from verispec.adaptive.costs import StepCost  # noqa: E402
from verispec.adaptive.policy import AdaptiveDraftLength  # noqa: E402


class NoLine(StepCost):
    MIN_FIT = 1 << 62


class NoLinePolicy(AdaptiveDraftLength):
    @property
    def step_cost(self):
        if self._step_cost is None:
            self._step_cost = NoLine(self.profile)
        elif self._step_cost.profile is not self.profile:
            self._step_cost.profile = self.profile
        return self._step_cost


if __name__ == "__main__":
    ab_main({"no line": NoLinePolicy, "line": AdaptiveDraftLength})
