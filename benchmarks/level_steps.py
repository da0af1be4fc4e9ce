"""Where one in-process load level's time goes, step by step: plain decoding beside the adaptive
policy (n-gram, k <= 7), each step split by kind (quiet, carrying prompt chunks: "rider", and
for the adaptive policy whether it verified a plan or a probe), with the median full-batch step,
the LM head, and the plan's predicted gain and priced seconds; then, for the adaptive policy,
steps that verified a plan against steps that verified nothing at the same batch size and
prompt tokens (tokens emitted per second of those steps).

Run with the step trace hook (it records every engine step; nothing in verispec changes):

    PYTHONPATH=benchmarks/step_trace VERISPEC_STEP_TRACE=/tmp/trace \\
        python benchmarks/level_steps.py 64 2 1,2,4,8,16,32    # level, rounds, levels seen before

The pool and context are the sweep's (`run_adaptive.sh`: prompts up to 140 tokens, a 204-token
context). Session 26: benchmarks/results/adaptive-s26/level_steps_64.txt.
"""

from verispec.memory import keep_freed_memory

keep_freed_memory()

import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from verispec import prompts as P  # noqa: E402
from verispec.bench.cli import sweep_pool  # noqa: E402
from verispec.bench.runner import (build_engine, busy_throughput, engine_config, measured_requests, run_batch,  # noqa: E402
                                    run_batches, sweep_requests)
from verispec.models import load_model, load_tokenizer  # noqa: E402

MAX_PROMPT, MAX_LEN = 140, 204


def kind(r: dict) -> str:
    if r["kind"] == "prefill":
        return "prefill"
    return ("rider" if r["prompt"] else "quiet") + ("+probe" if r.get("probe") else "+verify" if r.get("admitted") else "")


def rate(rs: list[dict]) -> str:
    if not rs:
        return "  -"
    return (f"{len(rs):3d} steps {sum(r['emitted'] for r in rs) / sum(r['s'] for r in rs):6.1f} tok/s "
            f"({statistics.mean(r['s'] for r in rs) * 1e3:4.0f} ms, n {statistics.mean(r['n'] for r in rs):4.1f}, "
            f"prompt {statistics.mean(r['prompt'] for r in rs):5.1f}, admitted {statistics.mean(r.get('admitted', 0) for r in rs):4.1f}, "
            f"accepted {statistics.mean(r.get('accepted', 0) for r in rs):4.1f})")


def report(name: str, recs: list[dict], n: int, line: str) -> None:
    print(line, flush=True)
    groups: dict[str, list[dict]] = {}
    for r in recs:
        groups.setdefault(kind(r), []).append(r)
    for k, rs in sorted(groups.items()):
        full = [r["s"] for r in rs if r["n"] >= n - 1]
        priced = [r for r in rs if r.get("cost_plan")]
        print(f"   {k:14s} {len(rs):4d} steps {sum(r['s'] for r in rs):6.2f} s  mean n {statistics.mean(r['n'] for r in rs):5.1f}"
              f"  prompt/step {statistics.mean(r['prompt'] for r in rs):6.1f}  admitted/step {statistics.mean(r.get('admitted', 0) for r in rs):5.1f}"
              f"  emitted {sum(r.get('emitted', 0) for r in rs):5d}  full-step med {statistics.median(full) * 1e3 if full else float('nan'):6.1f} ms"
              f"  head {statistics.median([r.get('head_s', 0) for r in rs]) * 1e3:5.1f} ms"
              + (f"  predicted {statistics.median(r['predicted'] for r in priced):.3f} priced {statistics.median(r['cost_plan'] for r in priced) * 1e3:.1f} ms"
                 if priced else ""), flush=True)
    if name == "adaptive":
        for lo, hi in ((n - n // 8, n + 1), (n // 2, n - n // 8), (0, n // 2)):
            for plo, phi in ((0, 1), (1, 150), (150, 10_000)):
                sel = [r for r in recs if r["kind"] == "decode" and lo <= r["n"] < hi and plo <= r["prompt"] < phi]
                print(f"   n {lo}-{hi - 1}, prompt {plo}-{phi - 1}: plan {rate([r for r in sel if r.get('admitted')])}"
                      f" | none {rate([r for r in sel if not r.get('admitted')])}", flush=True)


def level_setup(n: int, before: list[int]):
    """The sweep's requests at level n (pool and context as `run_adaptive.sh`'s), how many are
    measured, and a function that builds an engine at c streams (drafter None: plain decoding;
    policy_kind: the draft-length policy, "adaptive" or "fixed" at k = 7)."""
    torch.set_num_threads(2)
    tok, target = load_tokenizer("gemma3-270m"), load_model("gemma3-270m", torch.bfloat16)
    prompts = P.load(["mtbench", "humaneval"], 2)
    for p in prompts:
        p.ids = P.render(p, tok, target.config.model_type)
    pool = sweep_pool(prompts, ["mtbench", "humaneval"], 2 * max([n, *before]) + measured_requests(len(prompts), n) + len(prompts),
                      tok, target.config.model_type, MAX_PROMPT)

    def engine(c: int, drafter: str | None, policy=None, policy_kind: str = "adaptive"):
        cfg = engine_config("gemma3-270m", drafter, 7, "bfloat16", False, c, MAX_LEN, policy=policy_kind if drafter else "fixed")
        return build_engine(target, tok, cfg, None, policy)

    return (sweep_requests(prompts, n, pool), measured_requests(len(prompts), n),
            lambda c: sweep_requests(prompts, c, pool), engine)


def ab_level(n: int, rounds: int, before: list[int], variants: dict) -> None:
    """Plain decoding against adaptive policies of the given classes (name -> class) at level n,
    each policy having lived through the `before` levels first, as in the sweep; `rounds` rounds,
    every method's steps alternating as in the sweep (`run_batches`); busy throughput as the sweep
    measures it, each method's median and its ratio to plain's."""
    reqs, measured, level_requests, engine = level_setup(n, before)
    policies = {}
    for name, cls in variants.items():
        policy = None
        for c in before:  # the policy's history, as in the sweep
            eng = engine(c, "ngram", policy)
            if policy is None:
                eng.policy.__class__ = cls  # the engine built it; same state, this variant
            policy = eng.policy
            run_batch(eng, level_requests(c), 64)
        if policy is None:  # no levels before: a fresh policy of this variant
            policy = engine(n, "ngram").policy
            policy.__class__ = cls
        policies[name] = policy
    engines = {"plain": engine(n, None), **{name: engine(n, "ngram", p) for name, p in policies.items()}}
    assert all(type(engines[name].policy) is cls for name, cls in variants.items())
    results: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(rounds):
        names = list(engines)
        names = names[r % len(names):] + names[: r % len(names)]
        for name in names:
            run_batch(engines[name], reqs[:n], 4)  # warm-up
        for name, (seconds, rows, stats) in zip(names, run_batches([engines[x] for x in names], reqs, 64)):
            results[name].append(busy_throughput(rows, n, measured))
            print(f"r{r + 1} {name}: busy {results[name][-1]:.1f} tok/s, drain "
                  f"{sum(x['tokens'] for x in rows) / seconds:.1f}, tau {stats.tau:.2f}", flush=True)
    plain = statistics.median(results["plain"])
    for name, v in results.items():
        print(name, f"median {statistics.median(v):.1f}", [round(x) for x in v], f"/ plain {statistics.median(v) / plain:.3f}")


def ab_main(variants: dict) -> None:
    """`ab_level` from the command line: LEVEL ROUNDS [LEVELS,SEEN,BEFORE]."""
    before = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else []
    ab_level(int(sys.argv[1]), int(sys.argv[2]), before, variants)


def main() -> None:
    import sitecustomize as trace  # benchmarks/step_trace on PYTHONPATH

    n, rounds = int(sys.argv[1]), int(sys.argv[2])
    before = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else []
    reqs, measured, level_requests, engine = level_setup(n, before)
    policy = None
    for c in before:  # the adaptive policy's history, as in the sweep
        eng = engine(c, "ngram", policy)
        policy = eng.policy
        run_batch(eng, level_requests(c), 64)
    engines = {"plain": engine(n, None), "adaptive": engine(n, "ngram", policy)}
    for r in range(rounds):
        for name in (["plain", "adaptive"] if r % 2 == 0 else ["adaptive", "plain"]):
            eng = engines[name]
            run_batch(eng, reqs[:n], 4)  # warm-up
            first = len(trace.RECORDS)
            seconds, rows, stats = run_batch(eng, reqs, 64)
            recs = trace.RECORDS[first:]
            report(name, recs, n, f"round {r + 1} {name}: busy {busy_throughput(rows, n, measured):.1f} tok/s, drain "
                   f"{sum(x['tokens'] for x in rows) / seconds:.1f}, tau {stats.tau:.2f}, {len(recs)} steps "
                   f"{sum(x['s'] for x in recs):.2f} s of {seconds:.2f}")


if __name__ == "__main__":
    main()
