"""64 distinct prompts, plain decoding, 16 tokens each, batch 64: wall time (prefill dominated).

    python benchmarks/prefill_ab.py                       # this checkout
    PYTHONPATH=OTHER/src python benchmarks/prefill_ab.py  # another build, e.g. a git worktree
"""
import statistics
import time

import torch

from verispec.engine import Engine, EngineConfig
from verispec.models import load_model, load_tokenizer
from verispec.sampling import SamplingParams
from verispec import prompts as P
import verispec
model = load_model("gemma3-270m", dtype=torch.bfloat16)
tok = load_tokenizer("gemma3-270m")
ps = P.load(["mtbench", "humaneval"], limit=40)
ids = [P.render(p, tok, "gemma3_text") for p in ps][:64]
sp = SamplingParams(max_tokens=16, ignore_eos=True)
ts = []
for r in range(3):
    eng = Engine(model, tok, EngineConfig(drafter=None, max_batch_size=64, max_model_len=1024), None)
    t0 = time.perf_counter()
    seqs = [eng.add_request(p, sp) for p in ids]
    while eng.has_work:
        eng.step()
    ts.append(time.perf_counter() - t0)
print(verispec.__file__, "prompt tokens", sum(map(len, ids)), "seconds", [round(t, 2) for t in ts], "median", round(statistics.median(ts), 2))
print("first outputs", [s.output_ids[:4] for s in seqs[:2]])
