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

import statistics  # noqa: E402
import sys  # noqa: E402

from level_steps import level_setup  # noqa: E402
from verispec.adaptive.policy import AdaptiveDraftLength  # noqa: E402
from verispec.bench.runner import busy_throughput, run_batch  # noqa: E402


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


def main() -> None:
    n, rounds = int(sys.argv[1]), int(sys.argv[2])
    before = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else []
    reqs, measured, level_requests, engine = level_setup(n, before)

    policies = {}
    for name, cls in (("priced", AdaptiveDraftLength), ("unpriced", Unpriced)):
        policy = None
        for c in before:  # the policy's history, as in the sweep
            eng = engine(c, "ngram", policy)
            if policy is None:
                eng.policy.__class__ = cls  # the engine built it; same state, this rule
            policy = eng.policy
            run_batch(eng, level_requests(c), 64)
        policies[name] = policy
    engines = {"plain": engine(n, None), "priced": engine(n, "ngram", policies["priced"]),
               "unpriced": engine(n, "ngram", policies["unpriced"])}
    assert type(engines["unpriced"].policy) is Unpriced and type(engines["priced"].policy) is AdaptiveDraftLength
    results: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(rounds):
        names = list(engines)
        for name in names[r % 3:] + names[: r % 3]:
            eng = engines[name]
            run_batch(eng, reqs[:n], 4)  # warm-up
            seconds, rows, stats = run_batch(eng, reqs, 64)
            results[name].append(busy_throughput(rows, n, measured))
            print(f"r{r + 1} {name}: busy {results[name][-1]:.1f} tok/s, drain "
                  f"{sum(x['tokens'] for x in rows) / seconds:.1f}, tau {stats.tau:.2f}", flush=True)
    plain = statistics.median(results["plain"])
    for name, v in results.items():
        print(name, f"median {statistics.median(v):.1f}", [round(x) for x in v], f"/ plain {statistics.median(v) / plain:.3f}")


if __name__ == "__main__":
    main()
