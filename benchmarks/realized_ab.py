"""A/B of the check on the plans' realized gain (`adaptive/realized.py`), at one load level: the
adaptive policy as it is against the same policy with the check switched off, and plain decoding;
every method's steps alternating (`level_steps.ab_level`), each policy having lived through the
levels given before.

    python benchmarks/realized_ab.py 64 2 1,2,4,8,16,32     # level, rounds, levels seen before
"""

from verispec.memory import keep_freed_memory

keep_freed_memory()

from level_steps import ab_main  # noqa: E402
from verispec.adaptive.policy import AdaptiveDraftLength  # noqa: E402


class Unchecked(AdaptiveDraftLength):
    """The policy before session 30: a plan must beat plain decoding by MARGIN only."""

    def _choose(self, theta, exact, num_reqs):
        self.realized.MIN_PLANS = float("inf")  # no bin ever has enough records
        return super()._choose(theta, exact, num_reqs)


if __name__ == "__main__":
    ab_main({"checked": AdaptiveDraftLength, "unchecked": Unchecked})
