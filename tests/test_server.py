"""The OpenAI-compatible server, as a real process on loopback, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from verispec.server.process import ServerProcess

pytestmark = pytest.mark.real_model
openai = pytest.importorskip("openai")

MODEL = "gemma3-270m"
CODE = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def start_server(*extra) -> ServerProcess:
    """A server with every requested draft token verified (`--draft-policy fixed`): the adaptive
    default decides from a cost profile measured on the machine, so whether a request drafts at all
    would depend on how busy the machine was when that profile was taken (a full-suite run once got
    0 drafts from `num_draft_tokens: 3`); the adaptive policy has its own tests (test_adaptive.py)."""
    return ServerProcess("--max-batch-size", "8", "--max-model-len", "512", "--draft-policy", "fixed",
                         *extra).wait_ready()


@pytest.fixture(scope="module")
def server():
    srv = start_server()
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=300, max_retries=0)


def metrics(url) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(m, name, **labels) -> float:
    labels = {"model_name": MODEL, **labels}
    lbl = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the exposition sorts label names
    return m.get(f"verispec:{name}{{{lbl}}}", 0.0)


# ---- API behaviour ------------------------------------------------------------------------------
def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_completion_stream_equals_non_stream_and_speculation_off(client):
    r = client.completions.create(model=MODEL, prompt=CODE, max_tokens=32, temperature=0)
    text = r.choices[0].text
    assert r.usage.completion_tokens == 32 and r.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=CODE, max_tokens=32, temperature=0, stream=True) if c.choices)
    assert streamed == text
    # per-request speculation setting: off for this request, same greedy text, no drafts
    off = client.completions.create(model=MODEL, prompt=CODE, max_tokens=32, temperature=0,
                                    extra_body={"num_draft_tokens": 0})
    assert off.choices[0].text == text
    assert off.model_extra["verispec"]["drafts"] == 0
    on = client.completions.create(model=MODEL, prompt=CODE, max_tokens=32, temperature=0,
                                   extra_body={"num_draft_tokens": 3})
    assert on.choices[0].text == text and on.model_extra["verispec"]["drafts"] > 0
    v = on.model_extra["verispec"]
    per_pos = v["acceptance_per_position_unconditional"]
    assert 1 <= len(per_pos) <= 3  # one entry per draft position, at most the request's 3
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # position k is accepted only after k - 1
    assert abs(sum(per_pos) * v["drafts"] - v["accepted_tokens"]) < 0.01 * v["drafts"]


def test_stop_strings_inside_accepted_runs(client, server):
    before = metrics(server)
    full = client.completions.create(model=MODEL, prompt=CODE, max_tokens=48, temperature=0).choices[0].text
    for stop in ("return", "n ==", "\n    "):
        i = full.find(stop)
        assert i > 0, f"{stop!r} must occur in {full!r}"
        r = client.completions.create(model=MODEL, prompt=CODE, max_tokens=48, temperature=0, stop=[stop, "zzz"])
        assert r.choices[0].text == full[:i] and r.choices[0].finish_reason == "stop"
        streamed = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=CODE, max_tokens=48, temperature=0, stop=stop, stream=True) if c.choices]
        assert "".join(streamed) == full[:i]
    # a stop string ends the request as "stop", not as an abort (recorded by the engine thread, so poll)
    stopped = lambda: metric(metrics(server), "request_success_total", finished_reason="stop") - \
        metric(before, "request_success_total", finished_reason="stop")  # noqa: E731
    deadline = time.time() + 20
    while stopped() < 6 and time.time() < deadline:
        time.sleep(0.2)
    assert stopped() == 6


def test_seeds_n_and_logprobs(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    a = client.completions.create(**kw, n=3)
    b = client.completions.create(**kw, n=3)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len(a.choices) == 3 and len({c.text for c in a.choices}) > 1
    lp = client.completions.create(model=MODEL, prompt=CODE, max_tokens=8, temperature=0, logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 8
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert abs(chosen - max(top.values())) < 1e-4


def test_chat_completions(client):
    msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, logprobs=True,
                                       top_logprobs=1)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and text
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,status,needle", [
    ("{not json", 400, "not valid JSON"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "exceeds the context"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "n": "two"}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "frobnicate": True}, 400, "frobnicate"),
    ({"model": MODEL, "prompt": "word " * 600}, 400, "context"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    ({"model": MODEL}, 400, "prompt"),
])
def test_bad_input_is_a_4xx_and_the_server_keeps_serving(server, body, status, needle):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server + "/v1/completions", content=data, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] + str(err["param"]) and err["type"] == "invalid_request_error"
    ok = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


# ---- concurrency, cancellation, metrics -------------------------------------------------------------
def test_concurrent_streams_and_metrics(client, server):
    prompts = [CODE, "The capital of France is", "import numpy as np\n", "1, 2, 3, 4,", "Dear Sir,"] * 8  # 40
    before = metrics(server)

    async def main():
        ac = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", timeout=300, max_retries=0)

        async def one(i, p):
            greedy = i % 2 == 0
            kw = dict(model=MODEL, prompt=p, max_tokens=12 + i % 5, stream=True,
                      temperature=0 if greedy else 0.8, seed=i)
            if not greedy:
                kw.update(top_p=0.9, extra_body={"top_k": 40, "num_draft_tokens": i % 4})
            text, finish = "", None
            async for c in await ac.completions.create(**kw):
                if c.choices:
                    text += c.choices[0].text
                    finish = c.choices[0].finish_reason or finish
            return text, finish
        return await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), 600)

    results = asyncio.run(main())
    assert all(f in ("length", "stop") for _, f in results)
    for i, (p, (text, _)) in enumerate(zip(prompts, results)):
        if i % 2 == 0 and i < 10:  # greedy: identical to the same prompt sent alone
            alone = client.completions.create(model=MODEL, prompt=p, max_tokens=12 + i % 5, temperature=0)
            assert alone.choices[0].text == text
    after = metrics(server)
    done = sum(metric(after, "request_success_total", finished_reason=r) - metric(before, "request_success_total", finished_reason=r)
               for r in ("length", "stop"))
    assert done >= len(prompts)
    assert metric(after, "num_requests_running") == 0


def test_metrics_agree_with_request_statistics(client, server):
    before = metrics(server)
    stats = []
    for p in (CODE, "The capital of France is"):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0)
        stats.append(r.model_extra["verispec"])
    after = metrics(server)
    delta = lambda n, **kw: metric(after, n, **kw) - metric(before, n, **kw)  # noqa: E731
    assert delta("spec_decode_num_drafts_total") == sum(s["drafts"] for s in stats)
    assert delta("spec_decode_num_draft_tokens_total") == sum(s["drafted_tokens"] for s in stats)
    assert delta("spec_decode_num_accepted_tokens_total") == sum(s["accepted_tokens"] for s in stats)
    assert delta("generation_tokens_total") == 40
    per_pos = [delta("spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) for k in range(5)]
    assert sum(per_pos) == sum(s["accepted_tokens"] for s in stats)


def test_client_disconnect_frees_the_kv_slot(server):
    before = metrics(server)
    with httpx.stream("POST", server + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": CODE, "max_tokens": 400, "temperature": 0, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # leave mid-stream
    deadline = time.time() + 30
    while time.time() < deadline:
        m = metrics(server)
        if metric(m, "kv_cache_usage_perc") == 0 and metric(m, "request_success_total", finished_reason="abort") > \
                metric(before, "request_success_total", finished_reason="abort"):
            break
        time.sleep(0.2)
    else:
        pytest.fail("the aborted request still holds its KV slot")


def test_sigterm_ends_streams_cleanly():
    srv = start_server("--drafter", "none")
    proc, url = srv.proc, srv.url
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": CODE, "max_tokens": 60, "temperature": 0, "stream": True}) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    proc.send_signal(signal.SIGTERM)
        data = [ln for ln in lines if ln.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        # uvicorn finishes the open streams, then exits by re-raising the signal it caught
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
