"""Does a step cost more right after another engine's big step? The in-process sweep alternates
every method's steps in one fixed cycle (`run_batches`; rotating the methods' order per round and
level keeps who follows whom), and in it the adaptive policy's steps always came right after fixed
k = 7's, the largest forwards (at 64 streams 512 tokens and more, their LM head's logits alone
268 MB), while plain decoding's came after the adaptive policy's.

Three engines at one load level, the sweep's requests, steps in the cycle A, K, B: two plain
engines (A and B) and the n-gram drafter at fixed k = 7 (K). B's steps follow K's, A's follow
B's; both do the same work. If a neighbour's step is free, B's ms per step equals A's within the
noise; the ratio B / A is the cost of following a big step.

    python benchmarks/neighbour_check.py 64 2      # level, rounds
"""

from verispec.memory import keep_freed_memory

keep_freed_memory()

import statistics  # noqa: E402
import sys  # noqa: E402

from level_steps import level_setup  # noqa: E402
from verispec.bench.runner import run_batch, run_batches  # noqa: E402


def main() -> None:
    n, rounds = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2
    reqs, _, _, engine = level_setup(n, [])
    engines = {"A": engine(n, None), "K": engine(n, "ngram", policy_kind="fixed"), "B": engine(n, None)}
    steps = dict.fromkeys(engines, 0)
    for name, e in engines.items():
        run_batch(e, reqs[:n], 4)  # warm-up

        def counted(step=e.step, name=name):
            steps[name] += 1
            return step()
        e.step = counted
    ratios = []
    for r in range(rounds):
        before = dict(steps)
        out = dict(zip(engines, run_batches(list(engines.values()), reqs, 64)))
        ms = {k: out[k][0] / (steps[k] - before[k]) * 1e3 for k in engines}
        ratios.append(ms["B"] / ms["A"])
        print(f"round {r + 1}: ms/step A (after B) {ms['A']:.1f}, K {ms['K']:.1f}, B (after K) {ms['B']:.1f}; "
              f"B / A {ratios[-1]:.3f}", flush=True)
    print(f"{n} streams: B / A median {statistics.median(ratios):.3f} over {rounds} rounds", flush=True)


if __name__ == "__main__":
    main()
