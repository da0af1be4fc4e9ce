"""Decode throughput of the engine at several batch sizes, in one process.

    python benchmarks/engine_throughput.py --batch 1 8 32 --tokens 64 [--drafter ngram] [--rounds 3]

Each round queues `batch` requests (MT-Bench prompts, greedy, fixed length), prefills them all,
then times the decode steps until every request has its `--tokens`; it prints output tokens per
second and prefill (prompt) tokens per second per batch size (medians of the rounds) as JSON lines. Meant for A/B runs of two checkouts
on the same machine back to back (`PYTHONPATH=<other checkout>/src python benchmarks/...`):
compare the ratio, not the absolute numbers, on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from verispec.threads import choose_wait_policy, setup_threads

choose_wait_policy()

import torch  # noqa: E402

from verispec.chat import encode_chat  # noqa: E402
from verispec.engine import Engine, EngineConfig  # noqa: E402
from verispec.models import load_model, load_tokenizer  # noqa: E402
from verispec.prompts import load_mtbench  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402


def one_round(model, tok, prompts, batch: int, tokens: int, drafter: str | None) -> float:
    from verispec.drafters import make_drafter

    cfg = EngineConfig(model="unused", drafter=None, num_draft_tokens=5 if drafter else 0, draft_policy="fixed",
                       max_batch_size=batch, max_model_len=1024, prefill_chunk=4096)
    dr = make_drafter(drafter, model, batch, 1024 + 8, model.dtype, model.device) if drafter else None
    eng = Engine(model, tok, cfg, dr)
    # a warm-up batch first: as in a server, the slots then come back in the order a finished batch
    # freed them (not consecutive), which is what a decode step normally attends over
    for i in range(batch):
        eng.add_request(prompts[i % len(prompts)][:16], SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_work:
        eng.step()
    seqs = [eng.add_request(prompts[i % len(prompts)],
                            SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)) for i in range(batch)]
    t = time.perf_counter()
    while eng.waiting or eng.prefilling:
        eng.step()
    prefill_s = time.perf_counter() - t
    done0 = sum(s.num_output for s in seqs)
    t = time.perf_counter()
    while eng.has_work:
        eng.step()
    return (sum(s.num_output for s in seqs) - done0) / (time.perf_counter() - t), sum(len(s.prompt_ids) for s in seqs) / prefill_s


def anon_huge_mb() -> float | None:
    """The process's anonymous memory in transparent huge pages, MB (Linux), as a check on what
    THP_MEM_ALLOC_ENABLE or a huge-page mapping did."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration):
        return None
    return kb / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    setup_threads(a.threads)  # as every command: the thread count and the freed memory kept
    model = load_model(a.model, torch.bfloat16, "cpu")
    tok = load_tokenizer(a.model)
    prompts = [encode_chat(tok, model.config.model_type, [{"role": "user", "content": p.turns[0]}])[:400]
               for p in load_mtbench()]
    for b in a.batch:
        runs = [one_round(model, tok, prompts, b, a.tokens, a.drafter) for _ in range(a.rounds)]
        rates, prefill = [r for r, _ in runs], [p for _, p in runs]
        print(json.dumps({"batch": b, "drafter": a.drafter, "tokens": a.tokens, "tok_s": round(statistics.median(rates), 2),
                          "prefill_tok_s": round(statistics.median(prefill), 1), "rounds": [round(r, 2) for r in rates],
                          "anon_huge_mb": anon_huge_mb()}),
              flush=True)


if __name__ == "__main__":
    main()
