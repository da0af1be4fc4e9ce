"""Per-step trace of every verispec engine in any Python process started with this folder on
PYTHONPATH and VERISPEC_STEP_TRACE set to a folder: the processes the benchmarks start
(`verispec serve` under the server sweep) write one JSON file each, `<VERISPEC_STEP_TRACE>/<pid>.json`,
at exit or on SIGTERM, with one record per engine step:

    t (perf_counter at the step's start: CLOCK_MONOTONIC, comparable across processes), method
    (the engine's: plain or drafter@k=K@policy, and #its number in this process),
    s (seconds), kind (decode / prefill), n (running requests), prompt (prompt tokens in the
    step), emitted (decode tokens), head_s / head_rows / head_faults (the LM head call and the
    minor page faults the process took during it), faults (the process's minor page faults, any
    thread, while the step ran: fresh pages the kernel zeroed), gc_s / gc_full (the seconds of
    Python's garbage collections, on any thread, and the full ones among them, while the step ran);
    under the adaptive policy: drafted / admitted / accepted nodes, draft_s, probe, predicted
    (the plan's predicted throughput over plain decoding's), cost_plan / cost_plain (their priced
    seconds), expected (accepted tokens the plan expected), head_priced (the profile's head cost),
    load (the requests holding a slot, running or prefilling), floor / ceiling (a node's least
    price and a plan's most gain at that load, `_nodes`), hopeless (the ceiling is under
    MIN_CEILING: nothing drafted but pinned drafts);

and the client of a server sweep (`verispec bench --sweep-via server`) records each level's
server URL, concurrency and start and end ("levels").

Nothing in verispec changes: the engine, the adaptive policy and the sweep's client are wrapped
when their modules are first imported (an import hook, so that the serve command still chooses
its OpenMP waits before torch loads). Read by `benchmarks/sweep_trace.py`.
"""

from __future__ import annotations

import atexit
import gc
import importlib.abc
import json
import os
import resource
import signal
import sys
import time

OUT = os.environ.get("VERISPEC_STEP_TRACE")
RECORDS: list[dict] = []
CURRENT: list = [None]
LEVELS: list[dict] = []
WRITTEN: list = []
ENGINES = [0]  # engines seen so far (`_method`)
GC = {"seconds": 0.0, "full": 0, "since": None}  # collections so far (`_on_gc`)


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        GC["since"] = time.perf_counter()
    elif GC["since"] is not None:
        GC["seconds"] += time.perf_counter() - GC["since"]
        GC["full"] += info.get("generation") == 2
        GC["since"] = None


def _patch_engine(mod) -> None:
    Engine = mod.Engine
    decode, prefill = Engine._decode_step, Engine._run_prefill

    def traced_decode(self, seqs, chunks=((), {})):
        t = time.perf_counter()
        rec = {"t": t, "kind": "decode", "n": len(seqs), "prompt": sum(len(c[2]) for c in chunks[0]), "method": _method(self)}
        CURRENT[0] = self._trace_rec = rec
        gc_s, gc_full, faults = GC["seconds"], GC["full"], _faults()
        events = decode(self, seqs, chunks)
        rec["s"] = time.perf_counter() - t
        rec["faults"] = _faults() - faults
        rec["gc_s"], rec["gc_full"] = GC["seconds"] - gc_s, GC["full"] - gc_full
        ids = {id(q) for q in seqs}  # not the first tokens of prompts that ended in this step
        rec["emitted"] = sum(len(e.new_tokens) for e in events if id(e.seq) in ids)
        RECORDS.append(rec)
        return events

    def traced_prefill(self, chunks, twins):
        t = time.perf_counter()
        events = prefill(self, chunks, twins)
        if chunks and not getattr(self, "_trace_rec", None):
            RECORDS.append({"t": t, "kind": "prefill", "n": len(chunks), "prompt": sum(len(c[2]) for c in chunks),
                            "s": time.perf_counter() - t, "method": _method(self)})
        return events

    Engine._decode_step, Engine._run_prefill = traced_decode, traced_prefill
    head = Engine._head

    def traced_head(self, h, seqs):
        t, faults = time.perf_counter(), _faults()
        out = head(self, h, seqs)
        rec = CURRENT[0] if getattr(self, "_trace_rec", None) is not None else None
        if rec is not None:
            rec["head_s"] = rec.get("head_s", 0.0) + time.perf_counter() - t
            rec["head_rows"] = rec.get("head_rows", 0) + h.shape[0]
            rec["head_faults"] = rec.get("head_faults", 0) + _faults() - faults
        return out

    Engine._head = traced_head
    step = Engine.step

    def traced_step(self):
        self._trace_rec = None
        return step(self)

    Engine.step = traced_step


def _patch_policy(mod) -> None:
    Policy = mod.AdaptiveDraftLength
    scored = mod.budget_throughput
    theta: list[float] = [0.0]

    def scoring(*a, **kw):
        theta[:] = scored(*a, **kw)
        return theta

    mod.budget_throughput = scoring
    admit, observe = Policy.admit, Policy.observe
    step_costs = mod.StepCost.costs
    costs: list[float] = []

    def recorded_costs(self, *a, **kw):
        out = step_costs(self, *a, **kw)
        costs[:] = out
        return out

    mod.StepCost.costs = recorded_costs
    floored = Policy._floored

    def recorded_floor(self, *a, **kw):  # a plan's costs as the planner saw them (after the node floor)
        out = floored(self, *a, **kw)
        costs[:] = out
        return out

    Policy._floored = recorded_floor

    budgets = Policy.budgets
    load = [0]  # the requests budgets judged the ceiling at: running, and prefilling ones

    def traced_budgets(self, seqs, cap, holding=0):
        load[0] = max(len(seqs), holding)
        return budgets(self, seqs, cap, holding)

    Policy.budgets = traced_budgets

    def traced_admit(self, seqs, drafts, draft_seconds):
        theta[:], costs[:] = [0.0], []
        out = admit(self, seqs, drafts, draft_seconds)
        rec = _current()
        if rec is not None:
            chosen = theta[min(self.last_admitted, len(theta) - 1)]
            rec.update(drafted=self.last_drafted, admitted=self.last_admitted, probe=self._probe,
                       draft_s=draft_seconds, predicted=chosen / theta[0] if theta[0] else None)
            nodes = self._dear_at.get(load[0])  # (step, dear, floor, ceiling) as budgets last priced them
            if nodes is not None:
                rec.update(load=load[0], floor=nodes[2], ceiling=nodes[3], hopeless=self._hopeless_now)
            b = min(self.last_admitted, len(theta) - 1)
            if theta[0] and len(costs) == len(theta):  # the plan's priced step and plain decoding's, seconds
                rec.update(cost_plan=costs[b], cost_plain=costs[0], expected=chosen * costs[b] - len(seqs))
        return out

    def traced_observe(self, seqs, drafts, verdicts):
        rec = _current()
        if rec is not None:
            rec["accepted"] = sum(v.accepted for v in verdicts)
            if rec.get("head_rows"):
                rec["head_priced"] = self.profile.head_cost(rec["head_rows"])
        return observe(self, seqs, drafts, verdicts)

    Policy.admit, Policy.observe = traced_admit, traced_observe


def _method(engine) -> str:
    """Which engine ran a step: its method and a number counting the engines this process built
    (the in-process sweep alternates several in one process, and builds new ones every level)."""
    if not hasattr(engine, "_trace_no"):
        engine._trace_no = ENGINES[0] = ENGINES[0] + 1
    c = engine.config
    name = "plain" if c.drafter is None else f"{c.drafter}@k={c.num_draft_tokens}@{c.draft_policy}"
    return f"{name}#{engine._trace_no}"


def _faults() -> int:
    """The process's minor page faults so far (every thread)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _current():
    """The decode record being filled (one engine thread per process)."""
    return CURRENT[0]


def _patch_sweep(mod) -> None:
    """The client side of a server sweep: each level's run (server URL, concurrency, start, end)."""
    level = mod._level

    async def traced_level(url, model, reqs, concurrency, max_tokens):
        t = time.perf_counter()
        out = await level(url, model, reqs, concurrency, max_tokens)
        LEVELS.append({"url": url, "concurrency": concurrency, "requests": len(reqs), "t0": t, "t1": time.perf_counter()})
        return out

    mod._level = traced_level


PATCHES = {"verispec.bench.server_sweep": _patch_sweep, "verispec.engine": _patch_engine, "verispec.adaptive.policy": _patch_policy}


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            from importlib.util import find_spec
            spec = find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module):
            exec_module(module)
            PATCHES[name](module)

        loader.exec_module = patched
        return spec


def _write() -> None:
    if (RECORDS or LEVELS) and not WRITTEN:
        WRITTEN.append(True)
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, f"{os.getpid()}.json"), "w") as f:
            json.dump({"argv": sys.argv, "records": RECORDS, "levels": LEVELS}, f)


def _on_sigterm(sig, frame) -> None:
    """uvicorn drains on SIGTERM, then raises it again under the handler found at start (this
    one): write, then die of it as the server would have."""
    _write()
    signal.signal(sig, signal.SIG_DFL)
    signal.raise_signal(sig)


if OUT:
    gc.callbacks.append(_on_gc)
    sys.meta_path.insert(0, _Hook())
    atexit.register(_write)
    signal.signal(signal.SIGTERM, _on_sigterm)
