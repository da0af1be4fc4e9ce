"""A/B of the adaptive policy's pricing of prompt chunks that ride in a verify forward, in process
at one load level: plain decoding, the adaptive policy as it is ("priced": engine._decode_step
calls `policy.riders` before `policy.admit`, and a plan is priced by what it adds to the forward
the riders are in) and the session-25 rule ("unpriced": riders reported after the plan, only to
time the step). Each adaptive policy first lives through the given lower levels, as in the
sweep; then rounds at the level, the methods' order rotated; busy throughput as the sweep
measures it (`runner.busy_throughput`).

    python benchmarks/riders_ab.py 64 3 8,32     # level, rounds, levels seen before

Session 26's results file (benchmarks/results/adaptive-s26/riders_ab.txt) was measured with the
first version of the priced rule, which counted the riders' own cost in the plan's step
(BENCHMARKS.md, session 26).
"""

from verispec.memory import keep_freed_memory

keep_freed_memory()

from level_steps import ab_main  # noqa: E402
from verispec.adaptive.policy import AdaptiveDraftLength  # noqa: E402


class Unpriced(AdaptiveDraftLength):
    """The session-25 rule: the riders are added to the step's timing after the plan."""

    def riders(self, tokens: int, head_rows: int) -> None:
        self._late = (tokens, head_rows)

    def admit(self, seqs, drafts, draft_seconds):
        out = super().admit(seqs, drafts, draft_seconds)
        tokens, rows = getattr(self, "_late", (0, 0))
        self._late = (0, 0)
        if self._verify_started is not None:
            n, t, r, t0 = self._verify_started
            self._verify_started = (n, t + tokens, r + rows, t0)
        return out


if __name__ == "__main__":
    ab_main({"priced": AdaptiveDraftLength, "unpriced": Unpriced})
