"""Issue 4's load benchmark: throughput and time per output token through the real HTTP server at
several concurrency levels, with and without speculation, in the same run.

One server (drafter ngram, k = 5) serves both arms: the speculation-off arm sends the per-request
field `num_draft_tokens: 0`, so both arms share the process, the weights and the machine state;
arms alternate per concurrency level and round. Every request streams `--max-tokens` tokens
(`ignore_eos`), greedy, prompts are MT-Bench first turns and HumanEval problems, interleaved.

    python benchmarks/server_load.py --out benchmarks/results/server_load
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, k: int | None) -> dict:
    body = {"model": "gemma3-270m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if k is not None:
        body["num_draft_tokens"] = k
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"tokens": tokens, "ttft": first - t0, "tpot": (end - first) / max(tokens - 1, 1), "seconds": end - t0}


async def run_level(url: str, prompts: list[str], concurrency: int, max_tokens: int, k: int | None) -> dict:
    reqs = [prompts[i % len(prompts)] for i in range(max(concurrency, 4) * 2)]  # two waves per level
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def guarded(p):
            async with sem:
                return await one_request(client, url, p, max_tokens, k)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in reqs))
        wall = time.perf_counter() - t0
    toks = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(reqs), "tokens": toks, "seconds": wall,
            "throughput_tok_s": toks / wall, "median_tpot_ms": 1000 * statistics.median(r["tpot"] for r in results),
            "median_ttft_ms": 1000 * statistics.median(r["ttft"] for r in results),
            "per_user_tok_s": statistics.median(1 / r["tpot"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/server_load")
    args = ap.parse_args()

    from verispec.bench.prompts import load_humaneval, load_mtbench

    mt, he = load_mtbench()[:16], load_humaneval()[:16]
    prompts = []
    for a, b in zip(mt, he):  # raw text; the server's completions endpoint adds <bos>
        prompts += [f"<start_of_turn>user\n{a.turns[0]}<end_of_turn>\n<start_of_turn>model\n", b.turns[0]]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    levels = [int(c) for c in args.concurrency.split(",")]
    server = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--port", str(port), "--drafter", "ngram",
                               "-k", "5", "--max-batch-size", str(max(levels)), "--max-model-len", "1024"])
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        asyncio.run(run_level(url, prompts[:2], 2, 8, None))  # warm-up
        rows = []
        for r in range(args.rounds):
            for c in levels:
                arms = [("speculation", None), ("plain", 0)]
                if (r + c) % 2:
                    arms.reverse()
                for name, k in arms:
                    res = asyncio.run(run_level(url, prompts, c, args.max_tokens, k))
                    res.update(arm=name, round=r)
                    rows.append(res)
                    print(json.dumps(res), flush=True)
        metrics = httpx.get(url + "/metrics").text
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)

    summary = []
    for c in levels:
        row = {"concurrency": c}
        for arm in ("plain", "speculation"):
            pts = [x for x in rows if x["concurrency"] == c and x["arm"] == arm]
            row[arm] = {key: statistics.median(p[key] for p in pts)
                        for key in ("throughput_tok_s", "median_tpot_ms", "median_ttft_ms", "per_user_tok_s")}
        row["throughput_speedup"] = row["speculation"]["throughput_tok_s"] / row["plain"]["throughput_tok_s"]
        summary.append(row)
    import os

    os.makedirs(args.out, exist_ok=True)
    config = {"command": "python " + " ".join(sys.argv), "max_tokens": args.max_tokens, "rounds": args.rounds,
              "drafter": "ngram", "k": 5, "dtype": "bfloat16", "prompts": len(prompts),
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()}}
    with open(os.path.join(args.out, "server_load.json"), "w") as f:
        json.dump({"config": config, "summary": summary, "runs": rows}, f, indent=2)
    lines = ["| clients | plain tok/s | spec tok/s | speed-up | plain TPOT ms | spec TPOT ms | plain TTFT ms | spec TTFT ms |",
             "|---|---|---|---|---|---|---|---|"]
    for row in summary:
        p, s = row["plain"], row["speculation"]
        lines.append(f"| {row['concurrency']} | {p['throughput_tok_s']:.1f} | {s['throughput_tok_s']:.1f} | "
                     f"{row['throughput_speedup']:.2f}x | {p['median_tpot_ms']:.1f} | {s['median_tpot_ms']:.1f} | "
                     f"{p['median_ttft_ms']:.0f} | {s['median_ttft_ms']:.0f} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "server_load.md"), "w") as f:
        f.write(f"Command: `{config['command']}`\n\n{table}\n")
    print(table)
    spec_lines = [ln for ln in metrics.splitlines() if "spec_decode" in ln and not ln.startswith("#")]
    print("\n".join(spec_lines))


if __name__ == "__main__":
    main()
