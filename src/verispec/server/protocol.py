"""Request bodies of the OpenAI-compatible API, validated strictly: a body that is not UTF-8 JSON,
a field of the wrong type, an unknown field, an out-of-range value or a string that is not valid
Unicode is a 4xx with the OpenAI error shape, never a crash."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


class BodyError(ValueError):
    """A request body that cannot be read as a JSON object: message, and the field when one is at fault."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_json"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class StreamOptions(BaseModel):
    """include_usage: end the stream with a usage chunk (default on); continuous_usage_stats
    (vLLM's extension): every chunk also carries the usage so far, the tokens the client has
    received by then."""
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = True
    continuous_usage_stats: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    user: str | None = None
    # verispec extensions: draft tokens (tree: nodes) verified per step for this request (0 turns
    # speculation off; capped by the server's -k), and the draft shape (chain | dynamic[:W] | static:B1,..)
    num_draft_tokens: int | None = Field(None, ge=0, le=64)
    draft_tree: str | None = None

    @field_validator("draft_tree")
    @classmethod
    def _tree_shape(cls, v):
        if v is not None:
            from ..drafters.base import TreeShape

            TreeShape.parse(v)  # a ValueError becomes a 400 naming the field
        return v

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice `index` of n: seed + index, wrapped into the generator's 64 bits
        (choice 0 keeps the seed itself: the generator reads a negative seed modulo 2**64 too)."""
        if self.seed is None or index == 0:
            return self.seed
        return (self.seed + index) % 2**64


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def parse_body(raw: bytes, model: type[_Request]) -> _Request:
    """bytes -> a validated request, or BodyError / pydantic ValidationError with what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise BodyError("the request body nests JSON too deeply") from None
    except json.JSONDecodeError:
        raise BodyError("the request body is not valid JSON") from None
    if not isinstance(obj, dict):
        raise BodyError("the request body must be a JSON object")
    _check_strings(obj)
    return model.model_validate(obj)


MAX_DEPTH = 32  # no request field nests deeper than a few levels


def _check_strings(obj) -> None:
    """Reject nesting deeper than MAX_DEPTH and strings (or keys) with a lone surrogate: JSON escapes
    can spell "\ud800", which no UTF-8 text holds and the tokenizer cannot encode. Iterative, so a
    deep body cannot exhaust the stack."""
    stack = [(obj, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise BodyError(f"{path or 'body'}: the string holds a lone surrogate (\\ud800-\\udfff), which is "
                                "not valid Unicode", path or None, "invalid_unicode") from None
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth >= MAX_DEPTH:
            raise BodyError(f"the request body nests JSON deeper than {MAX_DEPTH} levels")
        for k, x in (v.items() if isinstance(v, dict) else enumerate(v)):
            sub = f"{path}.{k}" if path else str(k)
            stack.append((x, sub, depth + 1))
            if isinstance(k, str):
                stack.append((k, sub, depth + 1))


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """(message, param) of the first validation error, e.g. ("max_tokens: Input should be ...", "max_tokens")."""
    errs = e.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(x) for x in first.get("loc", ()))
    msg = first.get("msg", "invalid request")
    return (f"{loc}: {msg}" if loc else msg), (loc or None)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
