"""One plain decode step of the engine at a given batch size, with the slots a server would have.

    python benchmarks/batched_step.py --batch 1 16 [--steps 12] [--profile]

Per batch size: an engine with max_batch_size = batch runs a short warm-up batch first, so that
its KV slots come back in the order a finished batch freed them (not consecutive, as in a server),
then prefills `batch` requests (2 MT-Bench + 2 HumanEval prompts, repeated), and times `--steps`
greedy decode steps; it prints the median step. `--profile` adds the torch profiler's top
operators over 10 more steps. For A/B runs of two checkouts on one machine
(`PYTHONPATH=<other checkout>/src python benchmarks/batched_step.py ...`), back to back; compare
ratios, not absolute numbers. Session 16, 16 requests: 125 / 140 ms before the KV slots were read
in place and greedy verdicts came from one argmax, 88 / 103 ms after (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import prompts as P
from verispec.engine import Engine, EngineConfig
from verispec.models import load_model, load_tokenizer
from verispec.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model)
    target = load_model(a.model, torch.bfloat16)
    prompts = P.load(["mtbench", "humaneval"], 2)
    ids = [P.render(p, tok, target.config.model_type) for p in prompts]
    for batch in a.batch:
        eng = Engine(target, tok, EngineConfig(model=a.model, drafter=None, num_draft_tokens=0, draft_policy="fixed",
                                               max_batch_size=batch, max_model_len=512))
        for i in range(batch):  # warm-up: leaves the slots in the order a finished batch frees them
            eng.add_request(ids[i % len(ids)], SamplingParams(max_tokens=4, ignore_eos=True))
        while eng.has_work:
            eng.step()
        for i in range(batch):
            eng.add_request(ids[i % len(ids)], SamplingParams(max_tokens=a.steps + 16, ignore_eos=True))
        while eng.waiting or eng.prefilling:
            eng.step()
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        print(f"batch {batch}: {statistics.median(times) * 1e3:.1f} ms a decode step (median of {a.steps})", flush=True)
        if a.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    eng.step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
