"""OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Handlers validate, tokenize and submit; the engine thread (worker.py) does the rest. Each choice
of a request is one engine sequence; its tokens come back on an asyncio queue and leave as text
through a `TextStream` that enforces stop strings."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..chat import format_chat
from ..engine import Engine
from ..sampling import SamplingParams
from .metrics import Metrics
from .protocol import ChatRequest, CompletionRequest, error_body
from .text import TextStream
from .worker import EngineWorker, Handle


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def create_app(engine: Engine, model_name: str) -> FastAPI:
    metrics = Metrics(model_name)
    worker = EngineWorker(engine, metrics)
    tok = engine.tokenizer

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", ""
        return JSONResponse(error_body(msg, param=loc or None), status_code=400)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        typ = "invalid_request_error" if exc.status < 500 else "server_error"
        return JSONResponse(error_body(exc.message, typ, exc.param, exc.code), status_code=exc.status)

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

    def check_model(name: str):
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "model", "model_not_found")

    def make_params(req, prompt_len: int, logprobs: int | None, default_max: int) -> SamplingParams:
        room = engine.max_len - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens; the context is {engine.max_len}", "prompt")
        max_tokens = req.max_completion_tokens or req.max_tokens or min(default_max, room)
        if max_tokens > room:
            raise APIError(400, f"max_tokens ({max_tokens}) + prompt ({prompt_len} tokens) exceeds the context of "
                           f"{engine.max_len} tokens", "max_tokens")
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                                  top_p=req.top_p, seed=req.seed, ignore_eos=req.ignore_eos, logprobs=logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def submit(prompt_ids, params: SamplingParams, req, index: int) -> Handle:
        if req.seed is not None and index:
            params = SamplingParams(**{**params.__dict__, "seed": req.seed + index})
        h = Handle(prompt_ids, params, req.num_draft_tokens, asyncio.get_running_loop())
        worker.submit(h)
        return h

    async def run_choice(h: Handle, stream: TextStream):
        """Yield (text delta, new token ids, finish_reason or None) until the sequence ends."""
        while True:
            tokens, finish = await h.events.get()
            if isinstance(finish, str) and finish.startswith("error"):
                raise APIError(500, finish)
            n_before = len(stream.ids)
            delta = stream.push(tokens, final=finish is not None)
            if stream.stopped:
                worker.abort(h, "stop")
                used = max(0, stream.tokens_used - n_before)
                yield delta, tokens[:used], "stop"
                return
            yield delta, tokens, ("stop" if finish == "stop" else finish)
            if finish is not None:
                return

    def tokenize(text: str) -> list[int]:
        return tok(text).input_ids

    def logprob_entries(h: Handle, start: int, n: int) -> list[tuple[int, float, dict]]:
        return h.seq.logprobs[start : start + n] if h.seq is not None else []

    # ---- /v1/completions --------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
            prompts = [list(req.prompt)]
        else:
            prompts = [tokenize(p) for p in ([req.prompt] if isinstance(req.prompt, str) else req.prompt)]
        if not prompts or not all(prompts):
            raise APIError(400, "the prompt is empty", "prompt")
        params = [make_params(req, len(p), req.logprobs, 16) for p in prompts]
        handles = [submit(p, sp, req, i) for p, sp in zip(prompts, params) for i in range(req.n)]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

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
            async def sse():
                async def one(i, h):
                    ts, n_tok, text_len = TextStream(tok, req.stop_list), 0, 0
                    async for delta, toks, finish in run_choice(h, ts):
                        lp = legacy_logprobs(logprob_entries(h, n_tok, len(toks)), text_len)
                        n_tok += len(toks)
                        text_len += len(delta)
                        if delta or finish or lp:
                            yield {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                                   "choices": [{"index": i, "text": delta, "logprobs": lp, "finish_reason": finish}]}
                async for chunk in _merge([one(i, h) for i, h in enumerate(handles)]):
                    yield chunk
                yield _usage_chunk(rid, "text_completion", created, model_name, prompts, req.n, handles)
            return _sse_response(sse(), handles, worker, req)

        choices = []
        try:
            for i, h in enumerate(handles):
                ts, text, toks_all, finish = TextStream(tok, req.stop_list), "", [], None
                async for delta, toks, finish in run_choice(h, ts):
                    text += delta
                    toks_all += toks
                choices.append({"index": i, "text": text,
                                "logprobs": legacy_logprobs(logprob_entries(h, 0, len(toks_all)), 0),
                                "finish_reason": finish})
        finally:
            for h in handles:
                worker.abort(h)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": choices,
                "usage": _usage(prompts, req.n, handles), "verispec": _spec_stats(handles)}

    # ---- /v1/chat/completions ---------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check_model(req.model)
        text = format_chat(tok, engine.model.config.model_type, [m.model_dump(exclude_none=True) for m in req.messages])
        prompt = tok(text, add_special_tokens=not text.startswith(tok.bos_token or "\0")).input_ids
        n_lp = (req.top_logprobs or 0) if req.logprobs else None
        sp = make_params(req, len(prompt), n_lp, engine.max_len)
        handles = [submit(prompt, sp, req, i) for i in range(req.n)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

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
            async def sse():
                async def one(i, h):
                    yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                           "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None}]}
                    ts, n_tok = TextStream(tok, req.stop_list), 0
                    async for delta, toks, finish in run_choice(h, ts):
                        lp = chat_logprobs(logprob_entries(h, n_tok, len(toks)))
                        n_tok += len(toks)
                        if delta or finish or lp:
                            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                                   "choices": [{"index": i, "delta": {"content": delta} if delta else {},
                                                "logprobs": lp, "finish_reason": finish}]}
                async for chunk in _merge([one(i, h) for i, h in enumerate(handles)]):
                    yield chunk
                yield _usage_chunk(rid, "chat.completion.chunk", created, model_name, [prompt], req.n, handles)
            return _sse_response(sse(), handles, worker, req)

        choices = []
        try:
            for i, h in enumerate(handles):
                ts, out, toks_all, finish = TextStream(tok, req.stop_list), "", [], None
                async for delta, toks, finish in run_choice(h, ts):
                    out += delta
                    toks_all += toks
                choices.append({"index": i, "message": {"role": "assistant", "content": out},
                                "logprobs": chat_logprobs(logprob_entries(h, 0, len(toks_all))), "finish_reason": finish})
        finally:
            for h in handles:
                worker.abort(h)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name, "choices": choices,
                "usage": _usage([prompt], req.n, handles), "verispec": _spec_stats(handles)}

    return app


def _usage(prompts, n, handles) -> dict:
    p = sum(len(x) for x in prompts) * n
    c = sum(h.seq.num_output for h in handles if h.seq is not None)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _spec_stats(handles) -> dict:
    from ..sequence import SpecStats

    total = SpecStats()
    for h in handles:
        if h.seq is not None:
            total.merge(h.seq.stats)
    return total.to_dict()


def _usage_chunk(rid, obj, created, model, prompts, n, handles) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": _usage(prompts, n, handles)}


async def _merge(gens):
    """Interleave several async generators (the n choices of one request) as items arrive."""
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


def _sse_response(chunks, handles, worker, req) -> StreamingResponse:
    include_usage = (req.stream_options or {}).get("include_usage", True)

    async def body():
        try:
            async for chunk in chunks:
                if not chunk["choices"] and not include_usage:
                    continue
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield f"data: {json.dumps(error_body(e.message, 'server_error'))}\n\n"
        finally:  # client gone or stream over: free the KV slots at once
            for h in handles:
                worker.abort(h)

    return StreamingResponse(body(), media_type="text/event-stream")
