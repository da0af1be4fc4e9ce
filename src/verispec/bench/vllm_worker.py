"""vLLM behind a pipe: the worker process of the vLLM peers in `verispec bench` and of the vLLM
interop test. It runs in vLLM's own virtual environment (benchmarks/vllm_env.sh), so it imports
vLLM and the standard library only, never verispec.

    VENV/bin/python vllm_worker.py '{"model": DIR, "dtype": "bfloat16", "max_model_len": 512,
                                     "speculative_config": null, "seed": 0, "llm_kwargs": {}}'

It loads one `vllm.LLM`, answers one JSON line {"ready": true, "vllm": VERSION, ...} (or
{"error": ...}), then serves one request per stdin line:

    {"ids": [...], "max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": null,
     "ignore_eos": true}
 -> {"tokens": [...], "seconds": s, "ttft": s, "first_tokens": n, "steps": n,
     "spec": {"drafts": n, "draft_tokens": n, "accepted": n, "accepted_per_pos": [...]}}

Requests run one at a time through `LLMEngine.step`, so the first token's time is observed and
the engine steps (one target forward each, a verification when speculating) are counted.
`spec` is the change of vLLM's own speculative-decoding counters over the request. Only the
reply lines go to the real stdout: everything vLLM or its libraries print goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _reply_stream():
    """The original stdout for replies; fd 1 then points at stderr for everyone else (vLLM logs to
    stdout, and so may its worker processes and C libraries)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _spec_counters(llm) -> dict:
    from vllm.v1.metrics.reader import Counter, Vector

    c = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in names:
            c[names[m.name]] += m.value
        elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            v = c["accepted_per_pos"]
            c["accepted_per_pos"] = [a + b for a, b in zip(v + [0] * (len(m.values) - len(v)),
                                                           m.values + [0] * (len(v) - len(m.values)))]
    return c


def _diff(after: dict, before: dict) -> dict:
    pos_b = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    return {"drafts": after["drafts"] - before["drafts"], "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted"] - before["accepted"],
            "accepted_per_pos": [a - b for a, b in zip(after["accepted_per_pos"], pos_b)]}


def serve(conf: dict, out) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    kwargs = dict(conf.get("llm_kwargs", {}))
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":  # everything in this one process
        kwargs.setdefault("distributed_executor_backend", "uni")
    llm = LLM(model=conf["model"], dtype=conf.get("dtype", "bfloat16"), max_model_len=conf["max_model_len"],
              speculative_config=conf.get("speculative_config"), seed=conf.get("seed", 0),
              disable_log_stats=False, enable_prefix_caching=False, max_num_seqs=1, **kwargs)
    engine = llm.llm_engine
    out.write(json.dumps({"ready": True, "vllm": vllm.__version__, "load_seconds": time.perf_counter() - t0}) + "\n")
    for n, line in enumerate(sys.stdin):
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            top_k = req.get("top_k") or 0
            params = SamplingParams(max_tokens=req["max_tokens"], temperature=req.get("temperature", 0.0),
                                    top_p=req.get("top_p", 1.0), top_k=top_k if top_k > 0 else 0,
                                    seed=req.get("seed"), ignore_eos=req.get("ignore_eos", True), detokenize=False)
        except (ValueError, KeyError, TypeError) as e:
            out.write(json.dumps({"error": f"bad request: {e}"}) + "\n")
            continue
        before = _spec_counters(llm)
        t = time.perf_counter()
        engine.add_request(f"r{n}", {"prompt_token_ids": req["ids"]}, params)
        tokens, ttft, first, steps = [], None, 0, 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                new = list(o.outputs[0].token_ids)
                if len(new) > len(tokens):
                    steps += 1
                    if ttft is None:
                        ttft, first = time.perf_counter() - t, len(new)
                tokens = new
        seconds = time.perf_counter() - t
        out.write(json.dumps({"tokens": tokens, "seconds": seconds, "ttft": ttft if ttft is not None else seconds,
                              "first_tokens": first, "steps": steps,
                              "spec": _diff(_spec_counters(llm), before)}) + "\n")


def main() -> None:
    out = _reply_stream()
    try:
        conf = json.loads(sys.argv[1])
        serve(conf, out)
    except Exception as e:  # noqa: BLE001 - the parent reads vLLM's own error from this line
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        raise SystemExit(1)


if __name__ == "__main__":  # vLLM starts worker processes that re-import the main module
    main()
