"""Train <-> serve consistency on the real target: the trainer's held-out acceptance estimate against
the engine's acceptance at the same anchors (train/consistency.py), and against normal generation.

    python benchmarks/consistency.py drafters/gemma3-270m-eagle3 --data datasets/gemma3-270m-mix \
        --samples 4 --max-len 768 --out benchmarks/results/eagle3/consistency.json

Takes the first --samples held-out samples of the data (the trainer's own split: --val-fraction and
--seed as in training), truncated to --max-len tokens as in training, and reports per position:
1. the trainer's estimate (`trainer.evaluate`, the drafter's weights as exported, bf16 autocast);
2. the engine at every one of those anchors (`engine_acceptance_at_every_anchor`, bf16);
3. the engine in normal generation from the same prompts (greedy, k drafts per step): the anchors
   its steps happen to start from, a different sample (see train/consistency.py).
1 and 2 must agree within 0.05 per position; a gap to 3 is the anchor sample, not a mismatch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from verispec.drafters import make_drafter
from verispec.engine import Engine, EngineConfig
from verispec.models import load_model
from verispec.sampling import SamplingParams
from verispec.sequence import SpecStats
from verispec.threads import setup_threads
from verispec.train.consistency import engine_acceptance_at_every_anchor
from verispec.train.dataset import HiddenStateData
from verispec.train.trainer import TrainConfig, evaluate


def normal_generation(target, drafter, samples, k: int) -> dict:
    """Per-position acceptance of ordinary greedy decoding from each sample's prompt, as long as its answer."""
    cfg = EngineConfig(model="unused", drafter=None, num_draft_tokens=k, draft_policy="fixed", dtype="bfloat16",
                       max_batch_size=len(samples), max_model_len=2048)
    eng = Engine(target, None, cfg, drafter)
    seqs = []
    for ids, mask in samples:
        p = int((~mask).sum())
        seqs.append(eng.add_request(ids[:p].tolist(), SamplingParams(max_tokens=int(mask.sum()), ignore_eos=True)))
    while eng.has_work:
        eng.step()
    merged = SpecStats()
    for s in seqs:
        merged.merge(s.stats)
    return {"acceptance_conditional": merged.acceptance_conditional,
            "acceptance_unconditional": merged.acceptance_unconditional, "steps": merged.drafts,
            "outputs_equal_data": sum(s.output_ids == ids[int((~m).sum()):].tolist() for s, (ids, m) in zip(seqs, samples))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter")
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    setup_threads(a.threads)
    data = HiddenStateData(a.data, a.max_len)
    _, val = data.split(a.val_fraction, a.seed)
    val = val[: a.samples]
    target = load_model(a.model, torch.bfloat16)
    drafter = make_drafter(a.drafter, target, 16, 2048 + a.k + 1, torch.bfloat16, "cpu")
    model = make_drafter(a.drafter, target, 1, 16, torch.float32, "cpu").model  # the trainer's view: fp32 weights
    cfg = TrainConfig(data=a.data, out="unused", ttt_steps=a.k, max_len=a.max_len)
    trainer = evaluate(model, target, data, val, cfg)
    samples = [(data.samples[j].ids, data.samples[j].mask) for j in val]
    engine = engine_acceptance_at_every_anchor(target, drafter, samples, a.k, max_model_len=2048)
    fresh = make_drafter(a.drafter, target, len(samples), 2048 + a.k + 1, torch.bfloat16, "cpu")
    normal = normal_generation(target, fresh, samples, a.k)
    rep = {"drafter": a.drafter, "data": a.data, "held_out_samples": val, "max_len": a.max_len, "k": a.k,
           "trainer": {k: trainer[k] for k in ("acceptance_conditional", "acceptance_unconditional", "expected_tau")},
           "engine_at_every_anchor": engine, "normal_generation": normal,
           "max_gap_unconditional": max(abs(x - y) for x, y in zip(trainer["acceptance_unconditional"],
                                                                   engine["acceptance_unconditional"]))}
    print(json.dumps(rep, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(rep, indent=1) + "\n")


if __name__ == "__main__":
    main()
