"""Packed against padded chain verification, paired in one run: the same target, two engines that
differ only in `Engine.packs_chains`, alternating per round (the order flipped every round).

    python benchmarks/packed_ab.py N POLICY K [ROUNDS]     e.g. 16 fixed 3 2, or 4 adaptive 7 3

N requests (2 MT-Bench + 2 HumanEval prompts, repeated) in N slots, the n-gram drafter, 48 greedy
tokens each; prints tok/s per round, the median paired ratio, and whether the outputs are equal.
Session 17 (BENCHMARKS.md): fixed k = 3 at 16 requests 1.08x, fixed k = 7 at 1 request 1.02x,
adaptive at 4 / 16 requests 1.03x / 0.99x.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from verispec import prompts as P
from verispec.bench.runner import build_engine
from verispec.engine import EngineConfig
from verispec.models import load_model, load_tokenizer
from verispec.sampling import SamplingParams


def main() -> None:
    N, policy, k = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    torch.set_num_threads(2)
    tok = load_tokenizer("gemma3-270m")
    target = load_model("gemma3-270m", torch.bfloat16)
    ids = [P.render(p, tok, target.config.model_type) for p in P.load(["mtbench", "humaneval"], 2)]
    engines = {}
    for packed in (True, False):
        cfg = EngineConfig(model="gemma3-270m", drafter="ngram", num_draft_tokens=k, draft_policy=policy,
                           max_batch_size=N, max_model_len=512)
        eng = build_engine(target, tok, cfg)
        eng.packs_chains = packed
        if hasattr(eng.policy, "packed_chains"):
            eng.policy.packed_chains = packed
        engines[packed] = eng
    speed, outputs = {True: [], False: []}, {}
    for r in range(rounds + 1):  # round 0 warms both engines up, untimed
        for packed in ((True, False) if r % 2 == 0 else (False, True)):
            eng = engines[packed]
            seqs = [eng.add_request(ids[i % len(ids)], SamplingParams(max_tokens=48 if r else 8, ignore_eos=True))
                    for i in range(N)]
            t = time.perf_counter()
            while eng.has_work:
                eng.step()
            if r:
                speed[packed].append(sum(s.num_output for s in seqs) / (time.perf_counter() - t))
                outputs[packed] = [s.output_ids for s in seqs]
    ratio = statistics.median(a / b for a, b in zip(speed[True], speed[False]))
    print(f"N={N} {policy} k={k}: packed {[round(x, 1) for x in speed[True]]} tok/s, padded "
          f"{[round(x, 1) for x in speed[False]]}; packed / padded {ratio:.3f}; outputs equal: {outputs[True] == outputs[False]}")


if __name__ == "__main__":
    main()
