"""OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Handlers read and validate the body (size-limited), tokenize in a worker thread (never on the event
loop: one huge prompt must not stall the other streams), and submit; the engine thread (worker.py)
does the rest. Each choice of a request is one engine sequence; its tokens come back on an asyncio
queue and leave as text through a `TextStream` that enforces stop strings. Every error answer, from
any route, has the OpenAI shape and is counted in /metrics (errors.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from ..chat import encode_chat, turn_end_ids
from ..engine import Engine
from ..sampling import SamplingParams
from .cli import DEFAULT_MAX_PROMPTS, DEFAULT_MAX_REQUEST_BYTES
from .errors import APIError, install_error_handlers
from .metrics import Metrics
from .protocol import BodyError, ChatRequest, CompletionRequest, error_body, parse_body, validation_message
from .text import TextStream
from .worker import EngineWorker, Handle

DISCONNECT_POLL_S = 0.25


@dataclasses.dataclass
class ServerLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies: 413 before they are read
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS  # prompts in one /v1/completions list


def create_app(engine: Engine, model_name: str, limits: ServerLimits | None = None,
               chat_stop_ids: tuple[int, ...] | None = None) -> FastAPI:
    """chat_stop_ids: tokens that end a chat turn besides EOS (default: from the chat template)."""
    limits = limits or ServerLimits()
    metrics = Metrics(model_name)
    worker = EngineWorker(engine, metrics)
    tok = engine.tokenizer
    model_type = engine.model.config.model_type
    vocab = engine.model.config.vocab_size
    if chat_stop_ids is None:
        chat_stop_ids = turn_end_ids(tok, model_type)
    pool = ThreadPoolExecutor(1, thread_name_prefix="verispec-tokenize")

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.limits = worker, metrics, limits
    install_error_handlers(app, metrics)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "verispec",
                                            "max_model_len": engine.max_len}]}

    # ---- request intake -------------------------------------------------------------------
    async def read_request(request: Request, model: type):
        if worker.draining:
            raise APIError(503, "the server is shutting down; retry on another instance", code="shutting_down")
        limit = limits.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body has {declared} bytes, over the limit of {limit} "
                                "(--max-request-bytes)", code="request_too_large")
        raw, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes (--max-request-bytes)",
                               code="request_too_large")
            raw.append(chunk)
        try:
            req = parse_body(b"".join(raw), model)
        except BodyError as e:
            raise APIError(400, e.message, e.param, e.code) from None
        except ValidationError as e:
            msg, param = validation_message(e)
            raise APIError(400, msg, param, "invalid_value") from None
        if req.model != model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                           "model", "model_not_found")
        return req

    async def off_loop(fn, *args):
        """Run tokenization or chat templating in the tokenizer thread, not on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def check_ids(ids: list[int]) -> None:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt",
                           "invalid_token_id")

    def make_params(req, prompt_len: int, logprobs: int | None, default_max: int,
                    stop_ids: tuple[int, ...] = ()) -> SamplingParams:
        room = engine.max_len - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens; the context is {engine.max_len}", "prompt",
                           "context_length_exceeded")
        max_tokens = req.max_completion_tokens or req.max_tokens or min(default_max, room)
        if max_tokens > room:
            raise APIError(400, f"max_tokens ({max_tokens}) + prompt ({prompt_len} tokens) exceeds the context of "
                           f"{engine.max_len} tokens", "max_tokens", "context_length_exceeded")
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                                  top_p=req.top_p, seed=req.seed, ignore_eos=req.ignore_eos, logprobs=logprobs,
                                  stop_token_ids=stop_ids)
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from e

    def submit(prompt_ids, params: SamplingParams, req, index: int) -> Handle:
        params = dataclasses.replace(params, seed=req.choice_seed(index))
        h = Handle(prompt_ids, params, req.num_draft_tokens, asyncio.get_running_loop(), choice=index,
                   draft_tree=req.draft_tree)
        worker.submit(h)
        return h

    async def run_choice(h: Handle, stream: TextStream):
        """Yield (text delta, new token ids, finish_reason or None) until the sequence ends."""
        while True:
            tokens, finish = await h.events.get()
            if finish == "error":
                status, code, message = h.error
                raise APIError(status, message, code=code)
            before = stream.tokens_released
            delta = stream.push(tokens, final=finish is not None)
            new = stream.ids[before : stream.tokens_released]  # the tokens of the released text
            if stream.stopped:
                h.returned = stream.tokens_released  # tokens past the stop string are neither sent nor counted
                worker.release(h, "stop")
                yield delta, new, "stop"
                return
            yield delta, new, finish
            if finish is not None:
                return

    def logprob_entries(h: Handle, start: int, n: int) -> list[tuple[int, float, dict]]:
        return h.seq.logprobs[start : start + n] if h.seq is not None else []

    async def until_disconnected(request: Request, coro):
        """Await coro; if the client goes away first, cancel it (its handles are released, so the
        engine stops generating for them) and answer nobody."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise _ClientGone
        finally:
            if not task.done():
                task.cancel()

    # ---- /v1/completions --------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_request(request, CompletionRequest)
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
            prompts = [list(req.prompt)]
            check_ids(prompts[0])
        else:
            texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
            if len(texts) > limits.max_prompts_per_request:
                raise APIError(400, f"prompt: {len(texts)} prompts in one request, over the limit of "
                                    f"{limits.max_prompts_per_request} (--max-prompts-per-request)", "prompt",
                               "too_many_prompts")
            prompts = await off_loop(lambda: [list(tok(t).input_ids) for t in texts])
        if not prompts or not all(prompts):
            raise APIError(400, "the prompt is empty", "prompt", "empty_prompt")
        params = [make_params(req, len(p), req.logprobs, 16) for p in prompts]
        handles = [submit(p, sp, req, i) for p, sp in zip(prompts, params) for i in range(req.n)]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}

        def legacy_logprobs(entries, offset0):
            if req.logprobs is None:
                return None
            out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            off = offset0
            for t, lp, alts in entries:
                s = tok.decode([t])
                out["tokens"].append(s)
                out["token_logprobs"].append(lp)
                out["top_logprobs"].append({tok.decode([a]): v for a, v in alts.items()})
                out["text_offset"].append(off)
                off += len(s)
            return out

        if req.stream:
            async def chunks():
                sent = [0] * len(handles)  # tokens each choice's chunks have carried

                async def one(i, h):
                    ts, text_len = TextStream(tok, req.stop_list), 0
                    async for delta, toks, finish in run_choice(h, ts):
                        lp = legacy_logprobs(logprob_entries(h, sent[i], len(toks)), text_len)
                        sent[i] += len(toks)
                        text_len += len(delta)
                        if delta or finish or lp:
                            yield with_usage({**head, "choices": [{"index": i, "text": delta, "logprobs": lp,
                                                                   "finish_reason": finish}]}, req, prompts, sent)
                async for chunk in _merge([one(i, h) for i, h in enumerate(handles)]):
                    yield chunk
            return _sse_response(chunks(), handles, worker, metrics, req, head, prompts)

        async def collect():
            choices = []
            for i, h in enumerate(handles):
                ts, text, toks_all, finish = TextStream(tok, req.stop_list), "", [], None
                async for delta, toks, finish in run_choice(h, ts):
                    text += delta
                    toks_all += toks
                choices.append({"index": i, "text": text,
                                "logprobs": legacy_logprobs(logprob_entries(h, 0, len(toks_all)), 0),
                                "finish_reason": finish})
            return choices

        try:
            choices = await until_disconnected(request, collect())
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        finally:
            for h in handles:
                worker.release(h)
        return {**head, "choices": choices, "usage": _usage(prompts, handles), "verispec": _spec_stats(handles)}

    # ---- /v1/chat/completions ---------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await read_request(request, ChatRequest)
        msgs = [m.model_dump(exclude_none=True) for m in req.messages]
        prompt = await off_loop(encode_chat, tok, model_type, msgs)
        n_lp = (req.top_logprobs or 0) if req.logprobs else None
        sp = make_params(req, len(prompt), n_lp, engine.max_len, () if req.ignore_eos else chat_stop_ids)
        handles = [submit(prompt, sp, req, i) for i in range(req.n)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}

        def chat_logprobs(entries):
            if not req.logprobs:
                return None
            content = []
            for t, lp, alts in entries:
                s = tok.decode([t])
                content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                                "top_logprobs": [{"token": tok.decode([a]), "logprob": v, "bytes": list(tok.decode([a]).encode())}
                                                 for a, v in alts.items()]})
            return {"content": content}

        if req.stream:
            async def chunks():
                sent = [0] * len(handles)

                async def one(i, h):
                    yield with_usage({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                           "logprobs": None, "finish_reason": None}]}, req, [prompt], sent)
                    ts = TextStream(tok, req.stop_list)
                    async for delta, toks, finish in run_choice(h, ts):
                        lp = chat_logprobs(logprob_entries(h, sent[i], len(toks)))
                        sent[i] += len(toks)
                        if delta or finish or lp:
                            yield with_usage({**head, "choices": [{"index": i, "delta": {"content": delta} if delta else {},
                                                                   "logprobs": lp, "finish_reason": finish}]}, req, [prompt], sent)
                async for chunk in _merge([one(i, h) for i, h in enumerate(handles)]):
                    yield chunk
            return _sse_response(chunks(), handles, worker, metrics, req, head, [prompt])

        async def collect():
            choices = []
            for i, h in enumerate(handles):
                ts, out, toks_all, finish = TextStream(tok, req.stop_list), "", [], None
                async for delta, toks, finish in run_choice(h, ts):
                    out += delta
                    toks_all += toks
                choices.append({"index": i, "message": {"role": "assistant", "content": out},
                                "logprobs": chat_logprobs(logprob_entries(h, 0, len(toks_all))), "finish_reason": finish})
            return choices

        try:
            choices = await until_disconnected(request, collect())
        except _ClientGone:
            return Response(status_code=499)
        finally:
            for h in handles:
                worker.release(h)
        return {**head, "object": "chat.completion", "choices": choices, "usage": _usage([prompt], handles),
                "verispec": _spec_stats(handles)}

    return app


class _ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer was ready."""


def with_usage(chunk: dict, req, prompts, sent: list[int]) -> dict:
    """The chunk, with the usage so far when the request asked for stream_options.continuous_usage_stats
    (completion tokens: those the stream's chunks have carried, to every choice)."""
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        p, c = sum(len(x) for x in prompts), sum(sent)
        chunk["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    return chunk


def _usage(prompts, handles) -> dict:
    """Each prompt counts once however many choices it has (as OpenAI and vLLM count); completion
    tokens are those the client received (none past a stop string)."""
    p = sum(len(x) for x in prompts)
    c = sum(h.num_returned for h in handles)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _spec_stats(handles) -> dict:
    from ..sequence import SpecStats

    total = SpecStats()
    for h in handles:
        if h.seq is not None:
            total.merge(h.seq.stats)
    return total.to_dict()


async def _merge(gens):
    """Interleave several async generators (the n choices of one request) as items arrive. One
    generator (n = 1, nearly every request) is read directly: no task and no queue per chunk."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield item
        return
    q: asyncio.Queue = asyncio.Queue()
    DONE = object()

    async def pump(g):
        try:
            async for item in g:
                await q.put(item)
        except Exception as e:  # surface the error in the consumer
            await q.put(e)
        finally:
            await q.put(DONE)

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    remaining = len(tasks)
    try:
        while remaining:
            item = await q.get()
            if item is DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


def _sse_response(chunks, handles, worker, metrics, req, head, prompts) -> StreamingResponse:
    """Server-sent events, ending with [DONE]. The final chunk carries the `verispec` statistics:
    the usage chunk (choices [], as OpenAI sends it), or, when stream_options.include_usage is
    false, the last chunk of the choices. An error ends the stream with an OpenAI-shaped error event
    and [DONE]; every handle is released however the stream ends."""
    include_usage = req.stream_options is None or req.stream_options.include_usage

    async def body():
        last = None  # a choice's finishing chunk, held back so that the final one carries the statistics
        try:
            try:
                async for chunk in chunks:
                    if last is not None:
                        yield f"data: {json.dumps(last)}\n\n"
                        last = None
                    if chunk["choices"][0]["finish_reason"] is not None:
                        last = chunk
                    else:
                        yield f"data: {json.dumps(chunk)}\n\n"
                if include_usage:
                    if last is not None:
                        yield f"data: {json.dumps(last)}\n\n"
                    last = {**head, "choices": [], "usage": _usage(prompts, handles)}
                if last is not None:
                    last["verispec"] = _spec_stats(handles)
                    yield f"data: {json.dumps(last)}\n\n"
            except APIError as e:
                if last is not None:
                    yield f"data: {json.dumps(last)}\n\n"
                metrics.error(e.status, e.code)
                typ = "invalid_request_error" if e.status < 500 else "server_error"
                yield f"data: {json.dumps(error_body(e.message, typ, e.param, e.code))}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # client gone or stream over: free the KV slots at once
            for h in handles:
                worker.release(h)

    return StreamingResponse(body(), media_type="text/event-stream")
