# Run as: python benchmarks/results/adaptive-s29/alternation_faults.py (from the repository root, session 29).
# Output:
#   alone [25.88] wall 25.88 minflt 8194
#   A+B [25.73, 25.67] wall 51.41 minflt 8
#   alone [23.94] wall 23.94 minflt 0
#   alone [22.63] wall 22.63 minflt 0
#   A+B [25.28, 25.8] wall 51.08 minflt 3
#   alone [25.52] wall 25.52 minflt 0
from verispec.memory import keep_freed_memory
keep_freed_memory()
import resource, sys, time
sys.path.insert(0, "benchmarks")
from level_steps import level_setup
from verispec.bench.runner import run_batch, run_batches
n = 64
reqs, _, _, engine = level_setup(n, [])
alone, a, b = engine(n, None), engine(n, None), engine(n, None)
for e in (alone, a, b):
    run_batch(e, reqs[:n], 4)
def flt():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_minflt, r.ru_majflt
for rep in range(2):
    for engines, name in (([alone], "alone"), ([a, b], "A+B"), ([alone], "alone")):
        f0 = flt(); t = time.perf_counter()
        out = run_batches(engines, reqs[:n], 24)
        f1 = flt()
        print(name, [round(s, 2) for s, _, _ in out], "wall", round(time.perf_counter() - t, 2), "minflt", f1[0] - f0[0], flush=True)
