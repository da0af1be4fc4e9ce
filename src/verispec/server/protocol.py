"""Request bodies of the OpenAI-compatible API, validated strictly: a field of the wrong type, an
unknown field or an out-of-range value is a 400 with the OpenAI error shape, never a crash."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    user: str | None = None
    # verispec extension: draft tokens verified per step for this request (0 turns speculation off)
    num_draft_tokens: int | None = Field(None, ge=0, le=64)

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


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


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
