"""A/B of the adaptive policy's pricing of prompt chunks that ride in a verify forward, in process at
one load level: plain decoding, the adaptive policy as it is ("priced": engine._decode_step calls
`policy.riders` before `policy.admit`, and a plan is priced by what it adds to the forward the
riders are in) and the session-25 rule ("unpriced": riders reported after the plan, only to
time the step). Session 26's results file was measured with the first version of the priced
rule, which counted the riders' own cost in the plan's step (BENCHMARKS.md, session 26). Each adaptive policy
first lives through the given lower levels, as in the sweep; then rounds at the level, the
methods' order rotated; busy throughput as the sweep measures it (`runner.busy_throughput`).

    python benchmarks/riders_ab.py 64 3 8,32     # level, rounds, levels seen before

Session 26 (BENCHMARKS.md): benchmarks/results/adaptive-s26/riders_ab.txt.
"""
from verispec.memory import keep_freed_memory
keep_freed_memory()
import statistics, sys, time
import torch
from verispec import prompts as P
from verispec.adaptive.policy import AdaptiveDraftLength
from verispec.bench.cli import sweep_pool
from verispec.bench.runner import build_engine, busy_throughput, engine_config, measured_requests, run_batch, sweep_requests
from verispec.models import load_model, load_tokenizer

class Unpriced(AdaptiveDraftLength):
    """The session-25 rule: riders reported after admit, only to time the step."""
    def riders(self, tokens, head_rows):
        self._late = (tokens, head_rows)
    def admit(self, seqs, drafts, draft_seconds):
        out = super().admit(seqs, drafts, draft_seconds)
        t, r = getattr(self, "_late", (0, 0)); self._late = (0, 0)
        if self._verify_started is not None:
            n, tt, rr, t0 = self._verify_started
            self._verify_started = (n, tt + t, rr + r, t0)
        return out

n = int(sys.argv[1]); rounds = int(sys.argv[2]); pre = [int(x) for x in sys.argv[3].split(",")]
torch.set_num_threads(2)
tok, target = load_tokenizer("gemma3-270m"), load_model("gemma3-270m", torch.bfloat16)
prompts = P.load(["mtbench", "humaneval"], 2)
for p in prompts:
    p.ids = P.render(p, tok, target.config.model_type)
pool = sweep_pool(prompts, ["mtbench", "humaneval"], 3 * 64 + len(prompts), tok, target.config.model_type, 140)
reqs = sweep_requests(prompts, n, pool); measured = measured_requests(len(prompts), n)
def adaptive_engine(c, policy):
    return build_engine(target, tok, engine_config("gemma3-270m", "ngram", 7, "bfloat16", False, c, 204, policy="adaptive"), None, policy)
pols = {}
for name, cls in (("priced", None), ("unpriced", Unpriced)):
    pol = None
    for c in pre:
        e = adaptive_engine(c, pol)
        if pol is None and cls is not None:
            e.policy.__class__ = cls
        pol = e.policy
        run_batch(e, sweep_requests(prompts, c, pool), 64)
    pols[name] = pol
engs = {"plain": build_engine(target, tok, engine_config("gemma3-270m", None, 7, "bfloat16", False, n, 204, policy="fixed")),
        "priced": adaptive_engine(n, pols["priced"]), "unpriced": adaptive_engine(n, pols["unpriced"])}
assert type(engs["unpriced"].policy) is Unpriced and type(engs["priced"].policy) is AdaptiveDraftLength
res = {k: [] for k in engs}
for rnd in range(rounds):
    names = list(engs)
    names = names[rnd % 3:] + names[:rnd % 3]
    for name in names:
        eng = engs[name]
        run_batch(eng, reqs[:n], 4)
        seconds, rows, st = run_batch(eng, reqs, 64)
        res[name].append(busy_throughput(rows, n, measured))
        print(f"r{rnd+1} {name}: busy {res[name][-1]:.1f} tok/s, drain {sum(r['tokens'] for r in rows)/seconds:.1f}, tau {st.tau:.2f}", flush=True)
for k, v in res.items():
    print(k, f"median {statistics.median(v):.1f}", [round(x) for x in v], f"/ plain {statistics.median(v)/statistics.median(res['plain']):.3f}")
