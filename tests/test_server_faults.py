"""The server under hostile but fair clients, on a tiny random Gemma 3 with a character tokenizer,
served in this process (so a test can reach into the engine: inject faults, slow it down).

Faults stay local: a bad request is a 4xx in the OpenAI shape, an exception in an engine step
fails only that step's requests (each gets a terminal error), huge bodies are refused at once and
never stall the event loop, a vanished client frees its slot, SIGTERM drains the open streams."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time

import httpx
import pytest
import torch

from conftest import build_hf, char_tokenizer, ours_from_hf
from verispec.drafters import NgramDrafter
from verispec.engine import Engine, EngineConfig
from verispec.server import create_app
from verispec.server.app import ServerLimits
from verispec.server.process import ServerProcess, ThreadServer

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOK = char_tokenizer()
V = len(TOK)
NAME = "tiny"
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
T = 60  # seconds: no request loop in this file waits longer


def tiny_target(seed: int = 3, **overrides):
    """Embeddings (= the tied LM head) scaled down: the random model's text is varied, not one
    token repeated, so outputs, stop strings and sampling have something to show."""
    hf = build_hf("gemma3", seed=seed, vocab_size=V, max_position_embeddings=4096, **overrides)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(0.1)
    return hf, ours_from_hf(hf)


def make_app(model=None, max_batch_size: int = 4, limits: ServerLimits | None = None, **kw):
    model = model if model is not None else tiny_target()[1]
    cfg = EngineConfig(model=NAME, drafter=None, num_draft_tokens=4, dtype="float32", max_batch_size=max_batch_size,
                       max_model_len=2048, exact=True)
    return create_app(Engine(model, TOK, cfg, NgramDrafter()), NAME, limits, **kw)


@pytest.fixture(scope="module")
def srv():
    app = make_app()
    with ThreadServer(app) as s:
        s.app, s.engine = app, app.state.worker.engine
        yield s


def post(url, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=data, headers={"content-type": "application/json"}, timeout=T, **kw)


def sse_events(r) -> list:
    """The data events of a streamed response: dicts, and the string "[DONE]"."""
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def metrics(url) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=T).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(m, name, **labels) -> float:
    lbl = ",".join(f'{k}="{v}"' for k, v in sorted({"model_name": NAME, **labels}.items()))
    return m.get(f"verispec:{name}{{{lbl}}}", 0.0)


def wait_for(cond, timeout: float = 10) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


class EngineHook:
    """Wraps engine.step for one test: `before(engine, call_index)` runs before each step (raise to
    inject a fault, sleep to slow the engine down)."""

    def __init__(self, engine, before):
        self.engine, self.before, self.calls = engine, before, 0
        self.orig = engine.step

    def __enter__(self):
        def step():
            self.calls += 1
            self.before(self.engine, self.calls)
            return self.orig()
        self.engine.step = step
        return self

    def __exit__(self, *exc):
        self.engine.step = self.orig


def assert_openai_error(r, status, needle="", code=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert needle in err["message"] + str(err["param"]), err
    if code:
        assert err["code"] == code, err


def completion(url, **kw):
    r = post(url, "/v1/completions", {"model": NAME, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


# ---- 1. token ids outside the vocabulary, and faults inside the engine step ----------------------
@pytest.mark.parametrize("ids", [[2, 999999], [2, V], [2, -1], [2, 2**70]])
def test_out_of_vocabulary_token_ids_are_a_400(srv, ids):
    assert_openai_error(post(srv.url, "/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": 4}), 400,
                        "outside the vocabulary", "invalid_token_id")
    assert completion(srv.url, prompt=[1, 40, 41], max_tokens=3)["choices"][0]["finish_reason"] in ("length", "stop")


def _run_clients(url, n_stream, n_plain, max_tokens=40, extra=None):
    """n_stream streamed and n_plain non-streamed greedy requests at once; each result is
    ("ok", text) or ("error", message), and every one must arrive within T seconds."""
    prompts = [CODE[i:] for i in range(n_stream + n_plain)]

    async def main():
        async with httpx.AsyncClient(timeout=T) as ac:
            async def streamed(p):
                body = {"model": NAME, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True, **(extra or {})}
                async with ac.stream("POST", url + "/v1/completions", json=body) as r:
                    events = [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]"
                              async for x in r.aiter_lines() if x.startswith("data: ")]
                assert events[-1] == "[DONE]", events[-3:]  # every stream ends properly
                errors = [e for e in events if isinstance(e, dict) and "error" in e]
                if errors:
                    assert errors[0]["error"]["type"] == "server_error" and events[-2] is errors[0]
                    return "error", errors[0]["error"]["message"]
                return "ok", "".join(c["text"] for e in events if isinstance(e, dict) for c in e["choices"])

            async def plain(p):
                r = await ac.post(url + "/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": max_tokens,
                                                                 "temperature": 0, "ignore_eos": True, **(extra or {})})
                if r.status_code != 200:
                    assert_openai_error(r, 500)
                    return "error", r.json()["error"]["message"]
                return "ok", r.json()["choices"][0]["text"]

            jobs = [streamed(p) for p in prompts[:n_stream]] + [plain(p) for p in prompts[n_stream:]]
            return await asyncio.wait_for(asyncio.gather(*jobs), T)

    return prompts, asyncio.run(main())


def test_a_fault_in_any_engine_step_fails_only_that_steps_requests(srv):
    """Six requests on four KV slots; a step raises while four run and two wait. The four get a
    terminal error (stream: error event + [DONE]; plain: a 500), the two waiting ones finish with
    their normal output, and the engine serves new requests. Then: a fault at every step index."""
    alone = {p: completion(srv.url, prompt=p, max_tokens=40, ignore_eos=True)["choices"][0]["text"]
             for p in [CODE[i:] for i in range(6)]}
    hit = {}

    def fault(eng, call):
        time.sleep(0.02)  # all six arrive while the first four run
        if not hit and len(eng.running) == 4 and len(eng.waiting) == 2 and eng.running[0].num_output >= 3:
            hit["admitted"] = [s.prompt_ids for s in eng.running]
            raise RuntimeError("injected fault")

    with EngineHook(srv.engine, fault):
        prompts, results = _run_clients(srv.url, 4, 2)
    assert hit, "the fault was never injected"
    admitted = {TOK.decode(ids, skip_special_tokens=True) for ids in hit["admitted"]}
    for p, (kind, out) in zip(prompts, results):
        if p in admitted:
            assert kind == "error" and "RuntimeError: injected fault" in out
        else:
            assert (kind, out) == ("ok", alone[p])  # a waiting request is untouched
    assert wait_for(lambda: metric(metrics(srv.url), "kv_cache_usage_perc") == 0)
    # a fault at each step index in turn (prefill, first decodes, later ones): nobody waits forever
    for k in (1, 2, 3, 5, 9):
        def fault_k(eng, call, k=k):
            if call == k:
                raise ValueError(f"fault at step {k}")
        with EngineHook(srv.engine, fault_k):
            _, results = _run_clients(srv.url, 3, 1, max_tokens=16, extra={"num_draft_tokens": k % 2})
        assert any(kind == "error" for kind, _ in results), k
        assert completion(srv.url, prompt=CODE, max_tokens=5)["usage"]["completion_tokens"] == 5
    m = metrics(srv.url)
    assert metric(m, "request_errors_total", status="500", reason="engine_error") >= 5
    assert metric(m, "num_requests_running") == 0 and metric(m, "kv_cache_usage_perc") == 0


# ---- 2, 3. big bodies, many prompts, vanished clients ----------------------------------------------
def test_body_limit_is_answered_at_once_and_tokenization_never_stalls_the_loop(srv):
    limits = srv.app.state.limits
    big = json.dumps({"model": NAME, "prompt": "x" * 12_000_000}).encode()
    t0 = time.time()
    r = post(srv.url, "/v1/completions", big)
    assert_openai_error(r, 413, "--max-request-bytes", "request_too_large")
    assert time.time() - t0 < 5
    # chunked (no content-length): counted while read
    r = httpx.post(srv.url + "/v1/completions", content=iter([big[:800_000], big[800_000:1_600_000]]), timeout=T,
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 413, "limit", "request_too_large")
    # within a raised limit, a 3 MB prompt tokenizes for seconds, beside /health and a running stream
    limits.max_request_bytes = 8 << 20
    try:
        gaps, done = [], threading.Event()
        result = {}

        def huge():
            result["r"] = post(srv.url, "/v1/completions", {"model": NAME, "prompt": "ab " * 1_000_000, "max_tokens": 1})
            done.set()

        th = threading.Thread(target=huge)
        th.start()
        time.sleep(0.3)
        while not done.is_set():
            t = time.time()
            assert httpx.get(srv.url + "/health", timeout=T).status_code == 200
            gaps.append(time.time() - t)
            time.sleep(0.05)
        th.join(T)
        assert_openai_error(result["r"], 400, "context", "context_length_exceeded")
        assert len(gaps) >= 5, "the big prompt tokenized too fast to observe the loop"
        assert max(gaps) < 1.0, f"/health waited {max(gaps):.2f} s while a prompt tokenized"
    finally:
        limits.max_request_bytes = ServerLimits().max_request_bytes


def test_prompts_per_request_are_capped(srv):
    limit = srv.app.state.limits.max_prompts_per_request
    r = post(srv.url, "/v1/completions", {"model": NAME, "prompt": ["a"] * (limit + 1), "max_tokens": 1})
    assert_openai_error(r, 400, "--max-prompts-per-request", "too_many_prompts")
    r = completion(srv.url, prompt=["a", "b", "c"], max_tokens=2)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]


def test_a_vanished_non_streaming_client_frees_its_slot(srv):
    before = metrics(srv.url)
    with EngineHook(srv.engine, lambda eng, call: time.sleep(0.02)):  # 1000 tokens: ~20 s of engine time
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", timeout=1.0,
                       json={"model": NAME, "prompt": CODE, "max_tokens": 1000, "ignore_eos": True, "temperature": 0})
        aborted = lambda: metric(metrics(srv.url), "request_success_total", finished_reason="abort") > \
            metric(before, "request_success_total", finished_reason="abort")  # noqa: E731
        assert wait_for(aborted, 3), "the request went on after its client left"
        assert wait_for(lambda: metric(metrics(srv.url), "kv_cache_usage_perc") == 0, 3)


# ---- 4. bad bodies: always a 4xx in the OpenAI shape ------------------------------------------------
@pytest.mark.parametrize("method,path,body,status,needle", [
    ("POST", "/v1/completions", '{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}', 400, "surrogate"),
    ("POST", "/v1/completions", '{"model": "tiny", "prompt": ["ok", "a\\udfffb"], "max_tokens": 2}', 400, "prompt.1"),
    ("POST", "/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages.0.content"),
    ("POST", "/v1/completions", '{"model": "tiny", "prompt": "x", "stop": ["\\ud83d"], "max_tokens": 2}', 400, "stop"),
    ("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": "x", "seed": 2**70}), 400, "seed"),
    ("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": "x", "seed": -2**70}), 400, "seed"),
    ("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": "x", "seed": 2**64}), 400, "seed"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("POST", "/v1/completions", "[" * 100_000 + "]" * 100_000, 400, "nests"),
    ("POST", "/v1/completions", '{"model": "tiny", "prompt": "x", "stream_options": ' + "{\"a\": " * 40 + "1" + "}" * 41,
     400, "nests"),
    ("POST", "/v1/completions", "[1, 2]", 400, "JSON object"),
    ("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": "x", "draft_tree": "bush"}), 400, "tree shape"),
    ("GET", "/v1/completions", None, 405, "GET is not allowed"),
    ("GET", "/v1/nothing", None, 404, "no route"),
    ("POST", "/v2/completions", "{}", 404, "no route"),
])
def test_bad_requests_are_openai_shaped_4xx(srv, method, path, body, status, needle):
    r = httpx.request(method, srv.url + path, content=body, timeout=T, headers={"content-type": "application/json"})
    assert_openai_error(r, status, needle)


def test_64_bit_seeds_at_the_edges(srv):
    for seed in (2**64 - 1, -2**63):
        kw = dict(prompt=CODE, max_tokens=6, temperature=0.9, seed=seed, n=2)
        a, b = completion(srv.url, **kw), completion(srv.url, **kw)
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
        with httpx.stream("POST", srv.url + "/v1/completions", json={"model": NAME, **kw, "stream": True}, timeout=T) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])


# ---- 5. usage ---------------------------------------------------------------------------------------
def test_usage_and_metrics_count_returned_tokens_and_each_prompt_once(srv):
    kw = dict(prompt=CODE, max_tokens=60, ignore_eos=True, logprobs=0, temperature=1.0, seed=11)
    text = completion(srv.url, **kw)["choices"][0]["text"]
    i, stop = next((i, text[i : i + 3]) for i in range(12, 50) if text.find(text[i : i + 3]) == i)
    prompt_len = len(TOK(CODE).input_ids)
    before = metrics(srv.url)
    r = completion(srv.url, **kw, stop=stop)
    returned = len(r["choices"][0]["logprobs"]["tokens"])
    assert r["choices"][0]["text"] == text[:i] and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": returned,
                          "total_tokens": prompt_len + returned}
    grown = lambda: metric(metrics(srv.url), "generation_tokens_total") - \
        metric(before, "generation_tokens_total")  # noqa: E731 (recorded by the engine thread: poll)
    assert wait_for(lambda: grown() >= returned) and grown() == returned
    # streamed: the same usage, with the verispec statistics, in the final chunk
    with httpx.stream("POST", srv.url + "/v1/completions", json={"model": NAME, **kw, "stop": stop, "stream": True},
                      timeout=T) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]" and events[-2]["usage"] == r["usage"] and events[-2]["choices"] == []
    assert events[-2]["verispec"]["target_forwards"] > 0
    # n choices of one prompt: the prompt counts once, in usage and in /metrics
    before = metrics(srv.url)
    r = completion(srv.url, prompt=CODE, max_tokens=5, ignore_eos=True, n=3)
    assert r["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 15, "total_tokens": prompt_len + 15}
    assert metric(metrics(srv.url), "prompt_tokens_total") - metric(before, "prompt_tokens_total") == prompt_len
    r = completion(srv.url, prompt=[CODE, CODE[5:]], max_tokens=5, ignore_eos=True, n=2)
    assert r["usage"]["prompt_tokens"] == 2 * prompt_len - 5


def test_streams_carry_the_verispec_statistics_without_usage_too(srv):
    for path, body in (("/v1/completions", {"prompt": CODE}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        body = {"model": NAME, **body, "max_tokens": 8, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": False}}
        with httpx.stream("POST", srv.url + path, json=body, timeout=T) as s:
            events = sse_events(s)
        assert events[-1] == "[DONE]" and "usage" not in events[-2]
        assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-2]["verispec"]["target_forwards"] > 0
        assert not any("verispec" in e for e in events[:-2])


def test_continuous_usage_counts_the_tokens_each_chunk_delivered(srv):
    """stream_options.continuous_usage_stats (vLLM's extension): every chunk carries the usage so
    far, rising to the final usage; it is what the server load sweep counts in its window."""
    prompt_len = len(TOK(CODE).input_ids)
    body = {"model": NAME, "prompt": CODE, "max_tokens": 12, "ignore_eos": True, "temperature": 0, "stream": True, "n": 2,
            "logprobs": 0, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=T) as s:
        events = sse_events(s)[:-1]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 24 and all(e["usage"]["prompt_tokens"] == prompt_len for e in events)
    # each choice chunk's count = the logprob tokens delivered so far, over both choices
    delivered = list(itertools.accumulate(len(e["choices"][0]["logprobs"]["tokens"]) for e in events if e["choices"]))
    assert [e["usage"]["completion_tokens"] for e in events if e["choices"]] == delivered
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=chat, timeout=T) as s:
        events = sse_events(s)[:-1]
    assert events[0]["usage"]["completion_tokens"] == 0 and events[-1]["usage"]["completion_tokens"] == 6
    assert_openai_error(post(srv.url, "/v1/completions", {**body, "stream_options": {"continuous": True}}), 400,
                        "continuous")
    assert_openai_error(post(srv.url, "/v1/completions", {**body, "stream_options": {"include_usage": "yes"}}), 400,
                        "include_usage")


# ---- 6. chat stops on the turn-end token ----------------------------------------------------------
def test_chat_stops_on_the_turn_end_token_and_completions_do_not():
    """A Gemma 3 target rigged to answer <end_of_turn> after any token: attention and MLP outputs
    zeroed, so the final state is the token's normalized embedding; the final norm keeps only
    dimension 0, which is 1 for every token and 50 for <end_of_turn>: the tied LM head's largest
    logit is always <end_of_turn>. (Gemma base checkpoints have no chat template: the written-out
    turn format is used, and its turn end must stop the chat.)"""
    hf = build_hf("gemma3", seed=1, vocab_size=V)
    eot = TOK.convert_tokens_to_ids("<end_of_turn>")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = hf.model.embed_tokens.weight
        emb.mul_(0.01)
        emb[:, 0] = 1.0
        emb[eot, 0] = 50.0
        hf.model.norm.weight.fill_(-1.0)  # Gemma's norm scales by (1 + w)
        hf.model.norm.weight[0] = 0.0
    with ThreadServer(make_app(ours_from_hf(hf))) as s:
        msgs = [{"role": "user", "content": "Say hi."}]
        r = post(s.url, "/v1/chat/completions", {"model": NAME, "messages": msgs, "max_tokens": 20})
        assert r.status_code == 200, r.text
        c = r.json()
        assert c["choices"][0]["finish_reason"] == "stop" and c["choices"][0]["message"]["content"] == ""
        assert c["usage"]["completion_tokens"] == 1
        # ignore_eos asks for max_tokens tokens, turn ends included; raw completions have no turns
        r = post(s.url, "/v1/chat/completions", {"model": NAME, "messages": msgs, "max_tokens": 5, "ignore_eos": True})
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = post(s.url, "/v1/completions", {"model": NAME, "prompt": "Say hi.", "max_tokens": 5})
        assert r.json()["choices"][0]["finish_reason"] == "length"


# ---- 7. errors are counted ------------------------------------------------------------------------
def test_error_answers_are_counted_by_status_and_reason(srv):
    before = metrics(srv.url)
    post(srv.url, "/v1/completions", {"model": NAME, "prompt": [5, 10**6]})
    post(srv.url, "/v1/completions", {"model": NAME, "prompt": [5, 10**6]})
    post(srv.url, "/v1/completions", {"model": "other", "prompt": "x"})
    post(srv.url, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": "ten"})
    httpx.get(srv.url + "/v1/completions", timeout=T)
    httpx.get(srv.url + "/nowhere", timeout=T)
    after = metrics(srv.url)
    d = lambda status, reason: metric(after, "request_errors_total", status=status, reason=reason) - \
        metric(before, "request_errors_total", status=status, reason=reason)  # noqa: E731
    assert d("400", "invalid_token_id") == 2 and d("404", "model_not_found") == 1 and d("400", "invalid_value") == 1
    assert d("405", "method_not_allowed") == 1 and d("404", "not_found") == 1


# ---- 8. SIGTERM drains --------------------------------------------------------------------------
def test_sigterm_drain_ends_open_streams_with_a_finish_reason_and_done():
    app = make_app()
    s = ThreadServer(app, drain_s=1.0).start()
    slow = EngineHook(app.state.worker.engine, lambda eng, call: time.sleep(0.02))  # 1900 tokens: ~40 s
    with slow:
        got = {}

        def client(i):
            body = {"model": NAME, "prompt": CODE[i:], "max_tokens": 1900, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=T) as r:
                got[i] = (sse_events(r), time.time())

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert wait_for(lambda: app.state.worker.engine.num_active == 3 and slow.calls > 10, 20)
        t0 = time.time()
        s.terminate()
        for t in threads:
            t.join(T)
        s.thread.join(T)
    assert not s.thread.is_alive()
    for i, (events, t_end) in got.items():
        assert events[-1] == "[DONE]", events[-2:]
        finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["abort"], finishes
        assert t_end - t0 < 5, f"stream {i} ended {t_end - t0:.1f} s after SIGTERM (drain 1 s)"
    assert len(got) == 3


def test_serve_logs_its_address_and_drains_on_sigterm(tmp_path):
    """The real command in a subprocess: one ready line with the address; SIGTERM ends a long
    stream within the drain time with finish_reason "abort" and [DONE], and the process exits."""
    import signal

    hf, _ = tiny_target(num_hidden_layers=4, hidden_size=128, intermediate_size=384)
    hf.save_pretrained(tmp_path)
    TOK.save_pretrained(tmp_path)
    srv = ServerProcess("--model", str(tmp_path), "--dtype", "float32", "--drain-timeout", "1", "--max-model-len",
                        "4096", "--max-batch-size", "16", threads=1).wait_ready(2 * T)
    try:
        assert f"ready at http://127.0.0.1:{srv.port}/v1" in srv.output()
        body = {"model": str(tmp_path), "prompt": CODE, "max_tokens": 4000, "ignore_eos": True, "stream": True, "n": 16}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=T) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 20:
                        t0 = time.time()
                        srv.proc.send_signal(signal.SIGTERM)
        took = time.time() - t0
        assert events[-1] == "data: [DONE]"
        finishes = {c["finish_reason"] for e in events[:-1] for c in json.loads(e[6:])["choices"] if c["finish_reason"]}
        assert finishes == {"abort"} and took < 6, (finishes, took)
        assert srv.proc.wait(timeout=T) in (0, -signal.SIGTERM)
    finally:
        srv.stop()


# ---- 7. the engine thread only steps; text, stop strings and SSE happen on the event loop -----------
def test_the_engine_thread_hands_each_step_off_once_and_never_touches_text(srv):
    from verispec.server import text as text_mod

    worker, pushes, deliveries = srv.app.state.worker, [], []
    orig_push, orig_deliver = text_mod.TextStream.push, worker._deliver

    def push(self, *a, **kw):
        pushes.append(threading.current_thread().name)
        return orig_push(self, *a, **kw)

    def deliver(batch):
        deliveries.append(len(batch))
        return orig_deliver(batch)

    text_mod.TextStream.push, worker._deliver = push, deliver
    try:
        with EngineHook(srv.engine, lambda eng, call: time.sleep(0.01)) as hook:
            _, results = _run_clients(srv.url, 4, 0, max_tokens=24, extra={"stop": ["zz"]})
    finally:
        text_mod.TextStream.push, worker._deliver = orig_push, orig_deliver
    assert all(kind == "ok" for kind, _ in results)
    assert pushes and "verispec-engine" not in pushes
    assert len(deliveries) <= hook.calls  # one hand-off per step, not one per request
    assert max(deliveries) > 1  # ... and the steps did serve several requests at once


def test_a_stop_string_found_on_the_event_loop_ends_the_request_in_the_engine_within_a_step(srv):
    """The event loop finds the stop string while the engine already runs the next step; the
    request leaves the engine right after that step, instead of decoding on to max_tokens."""
    kw = dict(prompt=CODE, max_tokens=300, ignore_eos=True, temperature=0)
    text = completion(srv.url, **kw)["choices"][0]["text"]
    i, stop = next((i, text[i : i + 2]) for i in range(6, 40) if text.find(text[i : i + 2]) == i)
    seen = []  # before each step: (sequence, tokens it had generated), for every running sequence

    def slow(eng, call):
        time.sleep(0.05)  # the event loop has time to see each step's tokens before the next one
        seen.extend((s, s.num_output) for s in eng.running)

    with EngineHook(srv.engine, slow):
        r = completion(srv.url, **kw, stop=[stop])
        assert r["choices"][0]["text"] == text[:i] and r["choices"][0]["finish_reason"] == "stop"
        seq = next(s for s, _ in seen if s.prompt_ids == TOK(CODE).input_ids)
        assert wait_for(lambda: seq.finish_reason is not None)  # the answer may leave before the engine acts
    n_stop = next(n for n in range(1, seq.num_output + 1) if stop in TOK.decode(seq.output_ids[:n], skip_special_tokens=True))
    steps_after = [n for s, n in seen if s is seq and n >= n_stop]
    assert len(steps_after) <= 1, (n_stop, steps_after)
    assert seq.finish_reason == "abort" and seq.num_output < 300


# ---- the property that must survive all of the above ------------------------------------------------
def test_64_concurrent_mixed_streams_each_equal_the_same_request_alone(srv):
    reqs = []
    for i in range(64):
        body = {"model": NAME, "prompt": CODE[i % 17 :], "max_tokens": 8 + i % 9, "ignore_eos": i % 3 == 0}
        if i % 2:
            body.update(temperature=0.9, top_p=0.9, top_k=40, seed=i)
        else:
            body.update(temperature=0)
        if i % 4 == 1:
            body["num_draft_tokens"] = i % 5
        if i % 4 == 2:  # token trees beside chains in the same batches
            body["draft_tree"] = "dynamic:3" if i % 8 == 2 else "static:2,1"
        if i % 8 == 3:
            body["stop"] = ["e", "\n\n"]
        reqs.append(body)

    async def one(ac, body):
        text, finish = "", []
        async with ac.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for c in json.loads(line[6:])["choices"]:
                        text += c["text"]
                        finish += [c["finish_reason"]] if c["finish_reason"] else []
        return text, finish

    async def main():
        async with httpx.AsyncClient(timeout=T, limits=httpx.Limits(max_connections=64)) as ac:
            return await asyncio.wait_for(asyncio.gather(*(one(ac, b) for b in reqs)), 4 * T)

    together = asyncio.run(main())
    for body, (text, finish) in zip(reqs, together):
        alone = completion(srv.url, **body)["choices"][0]
        assert (text, finish) == (alone["text"], [alone["finish_reason"]]), body


def test_text_stream_releases_tokens_with_their_text():
    from verispec.server.text import TextStream

    ids = lambda s: TOK(s, add_special_tokens=False).input_ids  # noqa: E731 (one token per character)
    ts = TextStream(TOK, ["abc"])
    assert (ts.push(ids("xa")), ts.tokens_released) == ("x", 1)  # "a" may start the stop string: held
    assert (ts.push(ids("b")), ts.tokens_released) == ("", 1)
    assert (ts.push(ids("d")), ts.tokens_released) == ("abd", 4)  # not a stop after all: all out
    ts = TextStream(TOK, ["abc"])
    for ch in "xab":
        ts.push(ids(ch))
    assert (ts.push(ids("cyz")), ts.stopped, ts.tokens_released) == ("", True, 1)  # only "x" and its token
    ts = TextStream(TOK, [])
    assert (ts.push(ids("hi") + [TOK.eos_token_id], final=True), ts.tokens_released) == ("hi", 3)
