"""The server's one error type and the one place exceptions become HTTP answers.

`ApiError` is every error a client of this server can get: a status and OpenAI's body,
`{"error": {"message", "type", "param", "code"}}` (llama.cpp's fields beside them where its web UI reads them,
`context_exceeded`). Routes, request parsing (schema, tools, structured output), the guard's refusals, the worker
(a full queue, a shutdown, a failed job: `worker.Failed` carries one) and a streamed reply's last event all raise or
carry it; `api_error` maps anything else (Starlette's routing errors, FastAPI's validation, a bug) to one, and
`install` makes it every route's answer. Nothing else in the server defines an exception a client sees
(tests/test_server_errors.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("localspec.server")

NO_ROUTE = ("no route {path}: this server has /v1/chat/completions, /v1/completions, /v1/models, /health and "
            "llama-server's /completion, /infill, /tokenize, /detokenize, /apply-template, /props, /slots (and "
            "/metrics with --metrics)")


class ApiError(Exception):
    """An error answer: `status` with OpenAI's error body (`body`), and `headers` (Retry-After, ...). A request the
    server cannot run as sent is a 400 naming the field (`param`)."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers
        self.extra = extra

    @property
    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code, self.extra)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's error shape, the one every error of this server has; `extra` adds fields beside them (llama.cpp's
    `n_prompt_tokens`, ...)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code, **(extra or {})}}


def context_exceeded(n_prompt_tokens: int, n_ctx: int) -> dict[str, Any]:
    """A prompt too long for the context: OpenAI's code, llama.cpp's type and numbers (its web UI reads them);
    `n_prompt_tokens` at least the prompt's tokens where they were not all counted."""
    return {"code": "context_length_exceeded", "kind": "exceed_context_size_error",
            "extra": {"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx}}


def shutting_down(message: str = "the server is shutting down") -> ApiError:
    return ApiError(503, message, kind="server_error", code="shutdown")


def client_gone(message: str = "the client disconnected") -> ApiError:
    """Nobody will read it: nginx's "client closed request"."""
    return ApiError(499, message, code="client_closed_request")


def internal(where: str, exc: BaseException, message: str | None = None) -> ApiError:
    """A bug: one logged line (the traceback with LOCALSPEC_DEBUG=1) and a 500 naming only the exception's class."""
    if os.environ.get("LOCALSPEC_DEBUG", "") not in ("", "0"):
        log.error("internal error on %s", where, exc_info=exc)
    else:
        log.error("internal error on %s: %s: %s (LOCALSPEC_DEBUG=1 shows the traceback)", where,
                  type(exc).__name__, exc)
    return ApiError(500, message or f"internal error: {type(exc).__name__}", kind="server_error",
                    code="internal_error")


def api_error(request: Request, exc: Exception) -> ApiError:
    """The one mapping from an exception to the answer a client gets."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, StarletteHTTPException):
        message = NO_ROUTE.format(path=request.url.path) if exc.status_code == 404 else \
            f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, message, code=str(exc.status_code), headers=getattr(exc, "headers", None))
    if isinstance(exc, RequestValidationError):
        return ApiError(400, f"invalid request: {exc}")
    return internal(request.url.path, exc)


def install(app: FastAPI) -> None:
    """Every exception a route lets out answers through `api_error`."""

    async def answer(request: Request, exc: Exception) -> JSONResponse:
        return api_error(request, exc).response()

    for caught in (ApiError, StarletteHTTPException, RequestValidationError, Exception):
        app.add_exception_handler(caught, answer)
