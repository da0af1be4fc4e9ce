"""Every error answer in the OpenAI shape ({"error": {"message", "type", "param", "code"}}), and
counted in /metrics by status and reason: our own APIError, FastAPI's request validation, routing
errors (unknown route, wrong method) and anything unexpected (500, never text/plain)."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import error_body

log = logging.getLogger(__name__)

HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 400: "invalid_request"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def install_error_handlers(app: FastAPI, metrics) -> None:
    def answer(status: int, message: str, param: str | None, code: str | None, headers=None) -> JSONResponse:
        metrics.error(status, code)
        typ = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse(error_body(message, typ, param, code), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return answer(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        return answer(400, f"{loc}: {msg}" if loc else msg, loc or None, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = f"no route {request.url.path}; the API is /v1/completions, /v1/chat/completions, /v1/models"
        elif exc.status_code == 405:
            msg = f"{request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return answer(exc.status_code, msg, None, HTTP_CODES.get(exc.status_code, "http_error"),
                      getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return answer(500, f"internal error ({type(exc).__name__}); the server goes on serving", None, "internal_error")
