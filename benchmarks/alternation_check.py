"""Does alternating engines' steps (`run_batches`, the in-process sweep) change what a step costs?

Plain decoding at one load level, the sweep's requests (pool, context, 64 tokens), run three ways
in turn, `rounds` times: one engine alone, two plain engines alternating (A and B), alone again.
Each run reports its seconds per step (the engine's clock over its steps). If alternation is free,
A's and B's step times equal the alone runs' around them, within the machine's noise.

    python benchmarks/alternation_check.py 1,16,64 3      # levels, rounds
"""

from verispec.memory import keep_freed_memory

keep_freed_memory()

import statistics  # noqa: E402
import sys  # noqa: E402

from level_steps import level_setup  # noqa: E402
from verispec.bench.runner import run_batch, run_batches  # noqa: E402


def main() -> None:
    levels = [int(x) for x in sys.argv[1].split(",")]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    for n in levels:
        reqs, _, _, engine = level_setup(n, [])
        alone, a, b = engine(n, None), engine(n, None), engine(n, None)
        steps = {}
        for e in (alone, a, b):
            run_batch(e, reqs[:n], 4)  # warm-up
            steps[e] = 0

            def counted(step=e.step, e=e):
                steps[e] += 1
                return step()
            e.step = counted
        per_step = {"alone": [], "A": [], "B": []}
        for r in range(rounds):
            for e, names in ((alone, ["alone"]), ((a, b), ["A", "B"]), (alone, ["alone"])):
                engines = list(e) if isinstance(e, tuple) else [e]
                before = [steps[x] for x in engines]
                for name, eng, b0, (seconds, _, _) in zip(names, engines, before, run_batches(engines, reqs, 64)):
                    per_step[name].append(seconds / (steps[eng] - b0))
        med = {k: statistics.median(v) for k, v in per_step.items()}
        print(f"{n} streams: ms/step alone {med['alone'] * 1e3:.1f} {[round(x * 1e3, 1) for x in per_step['alone']]}, "
              f"alternating A {med['A'] * 1e3:.1f} B {med['B'] * 1e3:.1f}; "
              f"alternating / alone {(med['A'] + med['B']) / 2 / med['alone']:.3f}", flush=True)


if __name__ == "__main__":
    main()
