"""Where the server's time goes at N concurrent streams: plain vs a drafter, served in this process.

For each method one engine is served by uvicorn in a thread of this process (the `verispec serve`
app), and the same requests are streamed to it from a separate client process (the sweep's client:
`bench.server_sweep._level`), levels interleaved plain / drafter. Around the engine thread's loop it
records the time inside `Engine.step` and the time the engine thread spends between steps (inbox,
handing out events, metrics), and it reads each thread's CPU time from /proc: the engine thread,
the event loop thread (HTTP, text, stop strings, SSE), torch's worker threads, and the client.
The same requests also run through `Engine.step` alone (no server), for the in-process number.

With --cprofile the engine thread and the event loop thread run under cProfile (slower; for the
breakdown, not the speed) and the top functions of each are printed.

    PYTHONPATH=src python benchmarks/profile_server.py --concurrency 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the commands do (threads.py)

CLIENT = """
import asyncio, json, resource, sys
from verispec.bench.server_sweep import _level
from verispec.prompts import Prompt
url, model, c, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ids = json.loads(sys.stdin.read())
reqs = [Prompt(dataset="x", id=str(i), category="x", kind="completion", turns=[""], ids=x) for i, x in enumerate(ids)]
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
c0 = cpu()
seconds, rows = asyncio.run(_level(url, model, reqs, c, n))
print(json.dumps({"seconds": seconds, "tokens": sum(r["tokens"] for r in rows), "cpu": cpu() - c0,
                  "texts": [r["text"] for r in rows]}))
"""


def thread_cpu(tid: int) -> float:
    """CPU seconds (user + system) of one thread of this process."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def all_threads_cpu() -> dict[int, float]:
    return {int(t): thread_cpu(int(t)) for t in os.listdir("/proc/self/task")}


class StepTimer:
    """Wraps engine.step: time inside each step, what the step served, and the gaps between steps."""

    def __init__(self, engine):
        self.engine, self.orig = engine, engine.step
        self.reset()
        engine.step = self.step

    def reset(self):
        self.rows = []  # (seconds in step, running before, prefilling + waiting before, tokens out)
        self.gap_s, self._end = 0.0, None

    def step(self):
        eng = self.engine
        t0 = time.perf_counter()
        if self._end is not None:
            self.gap_s += t0 - self._end
        running, other = len(eng.running), len(eng.prefilling) + len(eng.waiting)
        events = self.orig()
        t1 = time.perf_counter()
        self._end = t1 if eng.has_work else None
        self.rows.append((t1 - t0, running, other, sum(len(e.new_tokens) for e in events)))
        return events

    def summary(self) -> dict:
        rows = self.rows
        decode = [r for r in rows if r[2] == 0]  # steps with no prompt to prefill: pure decode
        return dict(steps=len(rows), step_s=sum(r[0] for r in rows), tokens=sum(r[3] for r in rows),
                    decode_steps=len(decode), decode_ms=1e3 * sum(r[0] for r in decode) / max(len(decode), 1),
                    decode_batch=sum(r[1] for r in decode) / max(len(decode), 1),
                    gap_ms=1e3 * self.gap_s / max(len(rows) - 1, 1))


class Served:
    """One method: an engine served in a thread, with its engine thread's loop timed."""

    def __init__(self, name, llm, cprofile: bool):
        from verispec.server import create_app
        from verispec.server.process import ThreadServer

        self.name, self.engine = name, llm.engine
        self.app = create_app(llm.engine, "m")
        self.worker = self.app.state.worker
        self.timer = StepTimer(self.engine)
        self.profiles = {}
        if cprofile:  # the engine thread's target was bound when the worker was made
            self.worker.thread._target = self._profile("engine thread", self.worker.thread._target)
        self.server = ThreadServer(self.app)
        if cprofile:  # uvicorn's serve() runs on the event loop thread
            prof, serve = cProfile.Profile(), self.server.server.serve
            self.profiles["event loop thread"] = prof

            async def profiled_serve(*a, **kw):
                prof.enable()
                try:
                    return await serve(*a, **kw)
                finally:
                    prof.disable()

            self.server.server.serve = profiled_serve
        self.server.start()

    def _profile(self, label, fn):
        prof = self.profiles[label] = cProfile.Profile()

        def run(*a, **kw):
            prof.enable()
            try:
                return fn(*a, **kw)
            finally:
                prof.disable()

        return run


def report(name, r, via, tok_s, st, seconds, cpu=None):
    line = (f"{name:6s} r{r + 1} {via:10s}: {tok_s:6.1f} tok/s in {seconds:6.2f} s; {st['steps']} steps "
            f"({st['tokens'] / max(st['steps'], 1):.1f} tok/step), {1e3 * st['step_s'] / max(st['steps'], 1):.1f} ms/step, "
            f"pure decode steps {st['decode_steps']} at {st['decode_ms']:.1f} ms (batch {st['decode_batch']:.1f}); "
            f"engine thread between steps {st['gap_ms']:.2f} ms")
    if cpu:
        line += (f"; CPU s: engine thread {cpu['engine']:.2f}, event loop {cpu['loop']:.2f}, "
                 f"other server threads {cpu['others']:.2f}, client {cpu['client']:.2f}")
    print(line, flush=True)


def run_client(url, ids, c, n):
    r = subprocess.run([sys.executable, "-c", CLIENT, url, "m", str(c), str(n)], input=__import__("json").dumps(ids),
                       capture_output=True, text=True, check=True)
    return __import__("json").loads(r.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-max-batch", type=int, default=None, help="KV slots of the served engines "
                    "(default: --concurrency; the server sweep uses its largest level)")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process (no server) runs")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from verispec import prompts as P
    from verispec.bench.runner import build_engine, engine_config, run_batch, sweep_requests
    from verispec.engine import LLM

    prompts = P.load(["mtbench", "humaneval"], args.limit)
    slots = args.server_max_batch or args.concurrency
    plain = LLM(args.model, drafter=None, dtype="bfloat16", max_batch_size=slots, max_model_len=512, prefill_chunk=256)
    for p in prompts:
        p.ids = P.render(p, plain.tokenizer, plain.engine.model.config.model_type)
    reqs = sweep_requests(prompts, args.concurrency)
    ids = [p.ids for p in reqs]
    spec = LLM(args.model, drafter=args.drafter, num_draft_tokens=args.k, dtype="bfloat16",
               max_batch_size=slots, max_model_len=512, prefill_chunk=256)
    methods = [Served("plain", plain, args.cprofile), Served(args.drafter, spec, args.cprofile)]
    for m in methods:  # warm-up, untimed
        run_client(m.server.url, ids[:2], 2, 4)
    for r in range(args.rounds):
        for m in (methods if r % 2 == 0 else methods[::-1]):
            if not args.no_engine:  # the same requests through Engine.step alone
                eng = build_engine(m.engine.model, plain.tokenizer,
                                   engine_config(args.model, None if m.name == "plain" else args.drafter, args.k,
                                                 "bfloat16", False, args.concurrency, 512))
                run_batch(eng, reqs[: args.concurrency], 4)
                timer = StepTimer(eng)
                secs, out, _ = run_batch(eng, reqs, args.max_tokens)
                report(m.name, r, "in process", sum(x["tokens"] for x in out) / secs, timer.summary(), secs)
                del eng, timer
            m.timer.reset()
            loop_tid, eng_tid = m.server.thread.native_id, m.worker.thread.native_id
            cpu0 = all_threads_cpu()
            res = run_client(m.server.url, ids, args.concurrency, args.max_tokens)
            cpu1 = all_threads_cpu()
            d = {t: cpu1[t] - cpu0.get(t, 0.0) for t in cpu1}
            cpu = dict(engine=d.get(eng_tid, 0.0), loop=d.get(loop_tid, 0.0),
                       others=sum(v for t, v in d.items() if t not in (loop_tid, eng_tid)), client=res["cpu"])
            report(m.name, r, "server", res["tokens"] / res["seconds"], m.timer.summary(), res["seconds"], cpu)
    for m in methods:  # (ends the profiled threads, so that their profiles can be read)
        m.server.stop()
    for m in methods:
        for label, prof in m.profiles.items():
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            print(f"==== {m.name}: {label} (tottime)\n" + s.getvalue()[-6000:])


if __name__ == "__main__":
    main()
