"""A/B of the adaptive policy's cost profile when one policy is carried up the load levels, in
process at one level: plain decoding, the policy as it is ("reaching": each engine it is handed to
makes its profile reach that engine's largest forward, `AdaptiveDraftLength.reach`) and as it was
before session 27 ("short": the profile it was born with at one stream, 64 tokens, extrapolated
along its last segment to forwards of up to 700 tokens). Each policy first lives through the given
lower levels, as in the sweep; busy throughput as the sweep measures it.

    python benchmarks/reach_ab.py 64 4 1,2,4,8,16,32     # level, rounds, levels seen before
"""

from verispec.memory import keep_freed_memory

keep_freed_memory()

from level_steps import ab_main  # noqa: E402
from verispec.adaptive.policy import AdaptiveDraftLength  # noqa: E402


class Short(AdaptiveDraftLength):
    """Before session 27: a carried policy kept the profile it was born with."""

    def reach(self, max_tokens, load) -> None:
        pass


if __name__ == "__main__":
    ab_main({"reaching": AdaptiveDraftLength, "short": Short})
