"""The load sweep through the HTTP server: what a user of `verispec serve` sees under load.

One `verispec serve` process per method (plain = `--drafter none`), started afresh for every round
and alive together through it, so each level runs every method back to back in a rotated order and
machine noise hits them alike (an idle server costs no CPU). Fresh each round because two
processes can run the same forwards at different speeds: at 32 streams the policy's server,
running plain decoding's very schedule, took 4-5% less per full-batch step than the plain server
in both rounds of a sweep (BENCHMARKS.md, session 35; whether the process or the minutes set it
was not told apart there). One process per method for the whole sweep would carry such a
difference into every round, where a median over rounds cannot average it. So an adaptive
policy lives through one round's levels, as in a server under a changing load, and starts cold
in the next. At each concurrency level the same
requests as the in-process sweep (`runner.sweep_requests`: a first wave, the measured requests and
a wave behind them, from the sweep's pool of distinct prompts) are streamed with that many in flight
at once (greedy, `ignore_eos`, token-id prompts); time to first token and time per output token are
measured at the client, tau from the server's Prometheus counters over the level. Throughput is
`runner.busy_throughput` over the measured requests' send and finish times at the client; the
drain is reported apart.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Callable

import httpx

from ..server.process import ServerProcess
from .metrics import spread
from ..prompts import Prompt
from .runner import busy_throughput, measured_requests, parse_method_spec, sweep_requests


async def _one(client: httpx.AsyncClient, url: str, model: str, ids: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, tokens, text = None, 0, []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"server answered {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"tokens": tokens, "seconds": end - t0, "ttft_s": first - t0,
            "tpot_s": (end - first) / (tokens - 1) if tokens > 1 else None, "text": "".join(text),
            "start": t0, "end": end}


async def _level(url: str, model: str, reqs: list[Prompt], concurrency: int, max_tokens: int) -> tuple[float, list]:
    """Stream every request with `concurrency` in flight: (seconds until the last one finished,
    rows with each request's admission (sent) and finish times from the level's start)."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=1800) as client:
        async def guarded(p: Prompt):
            async with sem:
                return {"prompt": p.id, **await _one(client, url, model, p.ids, max_tokens)}

        t0 = time.perf_counter()
        rows = await asyncio.gather(*(guarded(p) for p in reqs))
        seconds = time.perf_counter() - t0
        for x in rows:
            x["admitted_s"], x["end_s"] = x.pop("start") - t0, x.pop("end") - t0
        return seconds, rows


def _counters(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("verispec:") and "{" in line:
            name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value
    return out


def _start_servers(model: str, drafters: list[str | None], k: int, dtype: str, max_batch: int, max_model_len: int,
                   threads: int | None, quant: str, device: str, waits: dict[str | None, set[str]]) -> dict:
    """A server per method, started one at a time (each reads the machine's load when it starts,
    threads.py, and must find the others idle, or the methods would run with different OpenMP
    waits); the waits each chose are added to `waits`. A failed start stops those started."""
    servers: dict = {}
    try:
        for spec in drafters:
            drafter, tree, kk, policy = parse_method_spec(spec, k) if spec else ("none", "chain", 0, "fixed")
            args = ["--model", model, "--drafter", drafter, "-k", str(kk), "--tree", tree, "--draft-policy", policy,
                    "--dtype", dtype, "--quant", quant, "--max-batch-size", str(max_batch), "--max-model-len", str(max_model_len),
                    "--prefill-chunk", "256", "--device", device]
            # a server whose cached cost profile stops short of its largest forward measures it
            # before it is ready (to 1,024 tokens: 213 s on the 2-core AVX2 EPYC)
            servers[spec] = ServerProcess(*args, threads=threads).wait_ready(timeout=1800)
            waits[spec].add(next((ln.split("OpenMP waits: ", 1)[1] for ln in servers[spec].output().splitlines()
                                  if "OpenMP waits: " in ln), "unknown"))
    except BaseException:
        for srv in servers.values():
            srv.stop()
        raise
    return servers


def run_server_sweep(model: str, drafters: list[str | None], k: int, dtype: str, concurrency: list[int],
                     prompts: list[Prompt], max_tokens: int, max_model_len: int, rounds: int = 1,
                     threads: int | None = None, progress: Callable[[str], None] | None = None,
                     quant: str = "none", pool: list[Prompt] | None = None, device: str = "cpu") -> list[dict]:
    """Sweep points (the in-process sweep's dict shape, `"via": "server"`), medians over rounds."""
    names = {spec: f"{spec or 'plain'} (server)" for spec in drafters}
    waits: dict[str | None, set[str]] = {spec: set() for spec in drafters}
    runs: dict[tuple, list] = {}
    for r in range(rounds):
        servers = _start_servers(model, drafters, k, dtype, max(concurrency), max_model_len, threads, quant, device, waits)
        try:
            for spec, srv in servers.items():
                asyncio.run(_level(srv.url, model, prompts[:2], 2, 4))  # warm-up, untimed
            for c in concurrency:
                reqs = sweep_requests(prompts, c, pool)
                order = list(servers)
                j = (r + concurrency.index(c)) % len(order)
                for spec in order[j:] + order[:j]:
                    url = servers[spec].url
                    before = _counters(url)
                    seconds, rows = asyncio.run(_level(url, model, reqs, c, max_tokens))
                    busy = busy_throughput(rows, c, measured_requests(len(prompts), c))
                    after = _counters(url)
                    fwd = after.get("verispec:spec_decode_num_target_forwards_total", 0) - \
                        before.get("verispec:spec_decode_num_target_forwards_total", 0)
                    gen = after.get("verispec:generation_tokens_total", 0) - before.get("verispec:generation_tokens_total", 0)
                    # the first token of each request comes from its prefill, not from a decode forward
                    runs.setdefault((spec, c), []).append((seconds, rows, (gen - len(rows)) / fwd if fwd else None, busy))
                    if progress:
                        tok = sum(x["tokens"] for x in rows)
                        progress(f"server sweep {names[spec]} @ {c}, round {r + 1}: {busy:.1f} tok/s "
                                 f"({tok / seconds:.1f} with the drain)")
        finally:
            for srv in servers.values():
                srv.stop()
    points = []
    for (spec, c), reps in runs.items():
        seconds = statistics.median(s for s, _, _, _ in reps)
        rows = [x for _, rs, _, _ in reps for x in rs]
        tokens = sum(x["tokens"] for x in reps[0][1])
        tpots = [x["tpot_s"] for x in rows if x["tpot_s"]]
        taus = [t for _, _, t, _ in reps if t]
        points.append({
            "method": names[spec], "via": "server", "concurrency": c, "requests": len(reps[0][1]), "openmp_waits": ", ".join(sorted(waits[spec])),
            "output_tokens": tokens, "seconds": seconds,
            "throughput_tok_s": statistics.median(th for _, _, _, th in reps),
            "throughput_rounds": [th for _, _, _, th in reps],
            "drain_throughput_tok_s": tokens / seconds, "measured_requests": measured_requests(len(prompts), c),
            "tau": statistics.median(taus) if taus else None,
            "tpot_ms": spread([x * 1e3 for x in tpots]), "per_user_tok_s": spread([1 / x for x in tpots]),
            "ttft_ms": spread([x["ttft_s"] * 1e3 for x in rows]),
            "per_request": rows,
        })
    order = {name: i for i, name in enumerate(names.values())}
    points.sort(key=lambda p: (p["concurrency"], order[p["method"]]))
    return points
