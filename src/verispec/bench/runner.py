"""Timed runs: single-stream methods interleaved per prompt, and the in-process load sweep.

A *method* turns (prompt ids, max_tokens) into one `Trace`. Every method is warmed up once
(untimed), then for each round and each prompt all methods run back to back, in an order rotated
by (round + prompt index), so that machine noise hits every method alike; speed-ups are paired
per prompt and round (metrics.py).
"""

from __future__ import annotations

import statistics
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

from ..drafters import make_drafter
from ..engine import DRAFT_POLICIES, DTYPES, Engine, EngineConfig
from ..sequence import SpecStats
from ..sampling import SamplingParams
from .metrics import Trace, spec_fields
from ..prompts import Prompt

Result = tuple  # (output_ids, seconds, ttft, first_tokens, forwards | None, SpecStats | None)


@dataclass
class Method:
    name: str
    family: str  # "verispec" | "transformers" | "llama.cpp"
    baseline: str  # the plain method of the same engine it is paired with (itself when plain)
    run: Callable[[list[int], int], Result]
    config: dict

    @property
    def is_plain(self) -> bool:
        return self.baseline == self.name


# ---- verispec ------------------------------------------------------------------------------
def engine_config(model: str, drafter: str | None, k: int, dtype: str, exact: bool, max_batch: int,
                  max_model_len: int, device: str = "cpu", tree: str = "chain", policy: str = "adaptive") -> EngineConfig:
    return EngineConfig(model=model, drafter=drafter, num_draft_tokens=k if drafter else 0, dtype=dtype, device=device,
                        max_batch_size=max_batch, max_model_len=max_model_len, exact=exact, draft_tree=tree,
                        draft_policy=policy)


def parse_method_spec(spec: str, k: int, policy: str = "adaptive") -> tuple[str, str, int, str]:
    """'DRAFTER[@tree=SHAPE][@k=N][@policy=P]' -> (drafter spec, tree shape, draft budget, draft
    policy); e.g. 'ngram@tree=dynamic@k=16' is the n-gram trie with a 16-node budget, and
    'ngram@k=3@policy=fixed' always verifies 3 tokens."""
    drafter, *opts = spec.split("@")
    tree = "chain"
    for o in opts:
        key, _, val = o.partition("=")
        if key == "tree":
            tree = val
        elif key == "k" and val.isdigit() and int(val) >= 1:
            k = int(val)
        elif key == "policy" and val in DRAFT_POLICIES:
            policy = val
        else:
            raise ValueError(f"bad method option {o!r} in {spec!r}: use @tree=SHAPE, @k=N and "
                             f"@policy={'|'.join(DRAFT_POLICIES)}")
    return drafter, tree, k, policy


def build_engine(target, tokenizer, cfg: EngineConfig, drafter_factory=None, policy=None) -> Engine:
    """An Engine over a shared target; drafter_factory(target, max_batch, max_len) or the spec in cfg;
    `policy` a draft-length policy to carry over from another engine (default: cfg's, new)."""
    max_len = min(cfg.max_model_len, target.config.max_position_embeddings) + cfg.num_draft_tokens + 1
    if drafter_factory is not None:
        drafter = drafter_factory(target, cfg.max_batch_size, max_len)
    elif cfg.drafter:
        drafter = make_drafter(cfg.drafter, target, cfg.max_batch_size, max_len, DTYPES[cfg.dtype], cfg.device)
    else:
        drafter = None
    return Engine(target, tokenizer, cfg, drafter, policy=policy)


def engine_runner(engine: Engine, ignore_eos: bool = True, temperature: float = 0.0) -> Callable[[list[int], int], Result]:
    """Single stream through the engine, stepped by hand so the first token's time is observed.
    temperature > 0: sampled, seeded by the prompt (every method draws with the same seed; their
    outputs still differ, as speculation consumes random numbers differently)."""

    def run(ids: list[int], max_tokens: int) -> Result:
        seed = zlib.crc32(str(list(ids)).encode()) if temperature > 0 else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=temperature, seed=seed)
        t0 = time.perf_counter()
        seq = engine.add_request(ids, sp)
        ttft, first = None, 0
        while not seq.finished:
            engine.step()
            if ttft is None and seq.num_output:
                ttft, first = time.perf_counter() - t0, seq.num_output
        seconds = time.perf_counter() - t0
        while engine.has_work:  # nothing else should be queued; never leave work behind
            engine.step()
        st: SpecStats = seq.stats
        return seq.output_ids, seconds, ttft, first, st.forwards, st

    return run


def verispec_methods(target, tokenizer, model: str, drafters: list[str], k: int, dtype: str, modes: list[str],
                     max_model_len: int, ignore_eos: bool = True, factories: dict | None = None,
                     exact_drafters: list[str] | None = None, quant: str = "none",
                     temperature: float = 0.0) -> list[Method]:
    """plain + every drafter, in every mode ("normal", "exact"; exact mode only for `exact_drafters`
    when given); factories: drafter spec -> drafter factory (tests); quant: the target's
    quantization (the names of a quantized target's methods end in [int8] / [int4])."""
    out = []
    for mode in modes:
        exact = mode == "exact"
        tag = "".join(f" [{t}]" for t in (quant if quant != "none" else None, "exact" if exact else None) if t)
        plain = f"plain{tag}"
        for spec in [None, *drafters]:
            if exact and spec is not None and exact_drafters is not None and spec not in exact_drafters:
                continue
            drafter, tree, kk, policy = parse_method_spec(spec, k) if spec else (None, "chain", k, "fixed")
            cfg = engine_config(model, drafter, kk, dtype, exact, 1, max_model_len, str(target.device), tree, policy)
            factory = (factories or {}).get(drafter)
            eng = build_engine(target, tokenizer, cfg, factory)
            name = f"{spec}{tag}" if spec else plain
            conf = {"engine": "verispec", "drafter": drafter, "tree": tree, "num_draft_tokens": cfg.num_draft_tokens,
                    "draft_policy": policy, "dtype": dtype, "quant": quant,
                    "exact": exact, "max_model_len": max_model_len, "max_batch_size": 1}
            conf["temperature"] = temperature
            out.append(Method(name, "verispec", plain, engine_runner(eng, ignore_eos, temperature), conf))
    return out


# ---- the interleaved single-stream run -----------------------------------------------------
def run_interleaved(methods: list[Method], prompts: list[Prompt], max_tokens: int, rounds: int,
                    warmup_tokens: int = 4, progress: Callable[[str], None] | None = None) -> list[Trace]:
    for m in methods:  # untimed: first-call allocations, kernel selection
        m.run(prompts[0].ids, min(warmup_tokens, max_tokens))
    traces = []
    n = len(methods)
    for r in range(rounds):
        for i, p in enumerate(prompts):
            j = (r + i) % n
            for m in methods[j:] + methods[:j]:
                ids, seconds, ttft, first, forwards, stats = m.run(p.ids, max_tokens)
                traces.append(Trace(m.name, p.id, p.dataset, p.category, r, len(p.ids), list(ids), seconds,
                                    ttft if ttft is not None else seconds, first, forwards,
                                    spec_fields(stats) if stats is not None else None))
            if progress:
                progress(f"round {r + 1}/{rounds}, prompt {i + 1}/{len(prompts)} ({p.id})")
    return traces


# ---- load sweep ----------------------------------------------------------------------------
@dataclass
class SweepPoint:
    method: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float  # until the last request finished
    per_request: list[dict]  # prompt, tokens, seconds, ttft, tpot, output_ids
    tau: float
    throughput_rounds: list[float] = field(default_factory=list)  # tok/s of every round, in order

    measured: int = 0  # the requests after the first wave the throughput is measured on

    @property
    def throughput(self) -> float:
        """Tokens per second with `concurrency` requests in flight (`busy_throughput`); with
        several rounds, their median."""
        if self.throughput_rounds:
            return statistics.median(self.throughput_rounds)
        return busy_throughput(self.per_request, self.concurrency, self.measured)

    @property
    def drain_throughput(self) -> float:
        """All the requests' tokens over the time until the last one finished, the drain included."""
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        from .metrics import spread

        tpots = [r["tpot_s"] for r in self.per_request if r["tpot_s"]]
        return {"method": self.method, "concurrency": self.concurrency, "requests": self.requests,
                "output_tokens": self.output_tokens, "seconds": self.seconds, "throughput_tok_s": self.throughput,
                "throughput_rounds": self.throughput_rounds or [self.throughput],
                "drain_throughput_tok_s": self.drain_throughput, "measured_requests": self.measured,
                "tau": self.tau, "tpot_ms": spread([x * 1e3 for x in tpots]),
                "per_user_tok_s": spread([1 / x for x in tpots]),
                "ttft_ms": spread([r["ttft_s"] * 1e3 for r in self.per_request]),
                "per_request": self.per_request}


def sweep_requests(prompts: list[Prompt], concurrency: int, pool: list[Prompt] | None = None) -> list[Prompt]:
    """A level's requests, the prompts of `pool` (default: `prompts`) in order, repeated if need
    be: a first wave of `concurrency`, then the measured ones (`measured_requests`), then
    `concurrency` more to keep every slot busy while they run (`busy_throughput`).

    The pool should hold distinct prompts enough that none repeats within a batch: requests with
    the same prompt admitted together prefill it once (parallel sampling's twins), which plain
    decoding's lockstep waves got for free with 4 prompts repeated, and staggered speculative
    requests did not (at 16 streams: 9 prefill steps for 48 requests against 20)."""
    n = concurrency + measured_requests(len(prompts), concurrency) + concurrency
    source = pool or prompts
    return (source * -(-n // len(source)))[:n]


MIN_MEASURED = 16


def measured_requests(num_prompts: int, concurrency: int) -> int:
    """As many as the run's prompts, or one per slot, and never fewer than `MIN_MEASURED`: with 4
    requests measured at one stream the window was 4 requests long, and the same method's
    throughput moved 10-30% from round to round on this shared machine (session 25's sweep)."""
    return max(num_prompts, concurrency, MIN_MEASURED)


def busy_throughput(rows: list[dict], concurrency: int, measured: int) -> float:
    """Throughput with `concurrency` requests in flight, by Little's law over the measured requests
    (the `measured` after the first wave): concurrency x their tokens over the sum of their times
    from admission to finish. Every slot is busy while they run (a wave queued behind them), and
    every one of them runs in the steady mix, where a request's life overlaps about `concurrency`
    prefills of others, in lockstep (plain decoding) or staggered (speculation).

    Three measures this replaces were biased against speculation. The drain (all tokens over the
    time until the last finish): a speculative method gets there with its fast requests done,
    plain decoding in lockstep. Little's law over the first wave: it pays its own prefill in every
    method, but under speculation also the prefills of its early finishers' successors, which plain
    decoding runs once the wave is done. The tokens received between the first finish and the last
    admission: for plain decoding that window holds whole waves, but for a method nearly in
    lockstep the prefill bursts of two waves and the decoding of about one."""
    first = rows[concurrency : concurrency + measured]
    seconds = sum(r["end_s"] - r["admitted_s"] for r in first)
    return concurrency * sum(r["tokens"] for r in first) / seconds if seconds > 0 else 0.0


def run_batch(engine: Engine, prompts: list[Prompt], max_tokens: int, ignore_eos: bool = True
              ) -> tuple[float, list[dict], SpecStats]:
    """Add every request, step until all are done (`run_batches` with one engine)."""
    return run_batches([engine], prompts, max_tokens, ignore_eos)[0]


def run_batches(engines: list[Engine], prompts: list[Prompt], max_tokens: int, ignore_eos: bool = True
                ) -> list[tuple[float, list[dict], SpecStats]]:
    """Every engine runs the same requests; their steps alternate, one step of each engine with
    work in turn. Each engine's times are on its own clock, the sum of its own steps' durations:
    per request its admission (the start of the step that gave it a slot), first-token and finish
    times, and in all the seconds until its last request finished.

    Why alternate: on a shared machine the speed drifts over minutes (plain decoding at 16 streams
    ran 116, 68 and 82 tok/s in three rounds of one sweep, session 28), so methods run one after
    another, each for a minute or two, were compared at different machine speeds. Steps alternate
    every 0.01-1 s, so a drift slower than that hits every engine alike. What alternating costs a
    step was within the drift between runs alone: on the 2-core AVX2 EPYC, plain decoding at 64
    streams took 680 and 684 ms a step alternating with another plain engine, 641 and 615 alone
    before and after (`benchmarks/alternation_check.py`); whatever it costs, every engine pays."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    runs = []
    for eng in engines:
        seqs = [eng.add_request(p.ids, sp) for p in prompts]
        runs.append({"engine": eng, "seqs": seqs, "clock": 0.0, "first": {}, "end": {}, "admitted": {}})
    busy = list(runs)
    while busy:
        for run in busy:
            eng, seqs = run["engine"], run["seqs"]
            waiting = {s.id for s in eng.waiting}
            start = run["clock"]
            t = time.perf_counter()
            eng.step()
            run["clock"] = now = start + time.perf_counter() - t
            left = {s.id for s in eng.waiting}
            for s in seqs:
                if s.id in waiting and s.id not in left:  # every request starts in the queue
                    run["admitted"][s.id] = start
                if s.id not in run["first"] and s.num_output:
                    run["first"][s.id] = (now, s.num_output)
                if s.id not in run["end"] and s.finished:
                    run["end"][s.id] = now
        busy = [run for run in busy if run["engine"].has_work]
    out = []
    for run in runs:
        total = SpecStats()
        rows = []
        for p, s in zip(prompts, run["seqs"]):
            total.merge(s.stats)
            ttft, n0 = run["first"][s.id]
            n = s.num_output - n0
            end = run["end"][s.id]
            rows.append({"prompt": p.id, "tokens": s.num_output, "seconds": end, "ttft_s": ttft,
                         "tpot_s": (end - ttft) / n if n > 0 else None, "output_ids": list(s.output_ids),
                         "admitted_s": run["admitted"][s.id], "end_s": end})
        out.append((run["clock"], rows, total))
    return out


def run_sweep(target, tokenizer, model: str, drafters: list[str | None], k: int, dtype: str, mode: str,
              concurrency: list[int], prompts: list[Prompt], max_tokens: int, max_model_len: int,
              ignore_eos: bool = True, factories: dict | None = None, rounds: int = 1,
              progress: Callable[[str], None] | None = None, pool: list[Prompt] | None = None) -> list[SweepPoint]:
    """Each drafter (None = plain) at each concurrency; the engine is built once per point and warmed up.
    The requests come from `pool` (default: the prompts; `sweep_requests`).
    A method's draft-length policy lives through the whole sweep, as it does in a server process
    while the load changes: what an adaptive policy learned at one level (acceptance, the step
    cost by forward size) it keeps at the next, instead of learning it again in every 30-step
    burst. At each level every method runs the same requests at once, their steps alternating
    (`run_batches`). With several rounds, the whole sweep repeats (the methods' order rotated per
    round and level) and a point reports its median round."""
    policies: dict[str, object] = {}
    runs: dict[tuple[str | None, int], list[tuple[float, list[dict], float]]] = {}
    exact = mode == "exact"
    tag = " [exact]" if exact else ""
    for r in range(rounds):
        for c in concurrency:
            reqs = sweep_requests(prompts, c, pool)
            j = (r + concurrency.index(c)) % len(drafters)
            order = drafters[j:] + drafters[:j]
            engines = []
            for spec in order:
                drafter, tree, kk, policy = parse_method_spec(spec, k) if spec else (None, "chain", k, "fixed")
                cfg = engine_config(model, drafter, kk, dtype, exact, c, max_model_len, str(target.device), tree, policy)
                eng = build_engine(target, tokenizer, cfg, (factories or {}).get(drafter), policies.get(spec))
                if spec:
                    policies[spec] = eng.policy
                run_batch(eng, reqs[:c], min(4, max_tokens), ignore_eos)  # warm-up at this batch size, untimed
                engines.append(eng)
            for spec, (seconds, rows, st) in zip(order, run_batches(engines, reqs, max_tokens, ignore_eos)):
                point = SweepPoint("", c, len(rows), sum(x["tokens"] for x in rows), seconds, rows, st.tau,
                                   measured=measured_requests(len(prompts), c))
                runs.setdefault((spec, c), []).append(point)
                if progress:
                    name = f"{spec}{tag}" if spec else f"plain{tag}"
                    progress(f"sweep {name} @ {c}{f', round {r + 1}' if rounds > 1 else ''}: {point.throughput:.1f} "
                             f"tok/s ({point.drain_throughput:.1f} with the drain)")
            del engines
    points = []
    for c in concurrency:
        for spec in drafters:
            reps = runs[(spec, c)]
            mid = statistics.median(p.throughput for p in reps)
            point = min(reps, key=lambda p: abs(p.throughput - mid))  # the requests of the round nearest the median
            point.method = f"{spec}{tag}" if spec else f"plain{tag}"
            point.throughput_rounds = [p.throughput for p in reps]  # throughput: their median
            points.append(point)
    return points
