"""Where a load-sweep level's time goes, per method: prefill against decode steps, how many of each,
the decode batch size, and the sweep's throughput (Little's law after the first wave) beside
Little's law over the first wave and the drain.

It found why the session-17 sweep priced speculation low at 16 streams (BENCHMARKS.md, session
18): with 4 prompts repeated, plain decoding's lockstep waves prefilled each repeated prompt once
for several requests, and the first wave paid its successors' prefills under speculation only.

    python benchmarks/load_split.py --concurrency 16 --rounds 2
    python benchmarks/load_split.py --concurrency 16 --repeat-prompts   # the old request list
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import prompts as P
from verispec.bench.cli import sweep_pool
from verispec.bench.runner import build_engine, busy_throughput, measured_requests, run_batch, sweep_requests
from verispec.engine import EngineConfig
from verispec.models import load_model, load_tokenizer

METHODS = {"plain": ("fixed", None, 0), "ngram k=1": ("fixed", "ngram", 1), "adaptive k<=7": ("adaptive", "ngram", 7)}


def timed_engine(target, tok, policy: str, drafter: str | None, k: int, n: int):
    """An engine whose prefill and decode steps log (kind, seconds, batch size). A decode step
    that carries prompt chunks (engine._decode_step's riders) logs as "decode+prefill"."""
    cfg = EngineConfig(model="gemma3-270m", drafter=drafter, num_draft_tokens=k, draft_policy=policy,
                       max_batch_size=n, max_model_len=512)
    eng = build_engine(target, tok, cfg)
    eng.steps_log = []
    prefill, decode = eng._run_prefill, eng._decode_step

    def timed_prefill(chunks, twins):
        t = time.perf_counter()
        events = prefill(chunks, twins)
        if chunks:
            eng.steps_log.append(("prefill", time.perf_counter() - t, len(events)))
        return events

    def timed_decode(seqs, chunks=((), {})):
        t = time.perf_counter()
        events = decode(seqs, chunks)
        eng.steps_log.append(("decode+prefill" if chunks[0] else "decode", time.perf_counter() - t, len(seqs)))
        return events

    eng._run_prefill, eng._decode_step = timed_prefill, timed_decode
    return eng


def level_requests(n: int, max_prompt: int | None):
    """The target, its tokenizer, and one sweep level's requests at n streams (the sweep's first
    wave, measured requests and queued wave) with how many are measured; max_prompt: the pool's
    longest prompt (None: the 4 prompts repeated, the pre-session-18 request list)."""
    tok, target = load_tokenizer("gemma3-270m"), load_model("gemma3-270m", torch.bfloat16)
    prompts = P.load(["mtbench", "humaneval"], 2)
    for p in prompts:
        p.ids = P.render(p, tok, target.config.model_type)
    pool = None if max_prompt is None else sweep_pool(prompts, ["mtbench", "humaneval"], 3 * n + len(prompts), tok,
                                                      target.config.model_type, max_prompt)
    return tok, target, sweep_requests(prompts, n, pool), measured_requests(len(prompts), n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat-prompts", action="store_true", help="the 4 prompts repeated (no distinct pool)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    n = args.concurrency
    tok, target, reqs, measured = level_requests(n, None if args.repeat_prompts else 400)
    engines = {name: timed_engine(target, tok, *m, n) for name, m in METHODS.items()}
    for r in range(args.rounds):
        for name, eng in engines.items():
            run_batch(eng, reqs[:n], 4)  # warm-up
            eng.steps_log.clear()
            seconds, rows, stats = run_batch(eng, reqs, args.max_tokens)
            first = rows[:measured]
            little_first = n * sum(x["tokens"] for x in first) / sum(x["end_s"] - x["admitted_s"] for x in first)
            pre = [x for x in eng.steps_log if x[0] == "prefill"]
            dec = [x for x in eng.steps_log if x[0] == "decode"]
            mixed = [x for x in eng.steps_log if x[0] == "decode+prefill"]
            print(f"round {r + 1} {name}: {busy_throughput(rows, n, measured):.1f} tok/s after the first wave "
                  f"({little_first:.1f} over the first wave, {sum(x['tokens'] for x in rows) / seconds:.1f} with the "
                  f"drain), tau {stats.tau:.2f}; {seconds:.1f} s: prefill {sum(x[1] for x in pre):.1f} s in "
                  f"{len(pre)} steps, decode with prompt chunks {sum(x[1] for x in mixed):.1f} s in {len(mixed)} steps, "
                  f"decode {sum(x[1] for x in dec):.1f} s in {len(dec)} steps "
                  f"(median {statistics.median(x[1] for x in dec) * 1e3:.0f} ms, mean batch "
                  f"{statistics.mean(x[2] for x in dec):.1f})", flush=True)


if __name__ == "__main__":
    main()
