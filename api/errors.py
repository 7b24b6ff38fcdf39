"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Only the API turns errors into HTTP. Invalid bodies answer **400** (as OpenAI and vLLM do,
not FastAPI's default 422); unknown model 404; body too large 413; no live worker, or a
broker that refuses the request, 503; a worker that never answers 504; admission
(:mod:`api.admission`): every worker at its cap 503, a client over its own 429, both with
``Retry-After``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on 429 and 503

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Anthropic's error types by HTTP status (its Messages API answers errors in its own shape)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 504: "timeout_error"}  # fmt: skip


def anthropic_path(path: str) -> bool:
    """Whether ``path`` is one of Anthropic's Messages API (errors in Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict:
    """``{"type": "error", "error": {"type", "message"}}``, as Anthropic's API answers,
    with the field at fault as ``param`` (an addition its clients ignore)."""
    default = "invalid_request_error" if status < 500 else "api_error"
    err: dict[str, Any] = {"type": ANTHROPIC_ERROR_TYPES.get(status, default), "message": message}
    if param is not None:
        err["param"] = param
    return {"type": "error", "error": err}


def anthropic_client(scope: Mapping[str, Any]) -> bool:
    """Whether a request (its ASGI scope) gets Anthropic's shapes: it is on the Messages
    API's paths, or sent by an Anthropic client (an ``anthropic-version`` header)."""
    if anthropic_path(scope.get("path", "")):
        return True
    return any(name == b"anthropic-version" for name, _ in scope.get("headers", ()))


def shaped_error(scope: Mapping[str, Any], status: int, message: str, type_: str,
                 param: str | None = None, code: str | None = None) -> dict:  # fmt: skip
    """An error body in the shape the request (its ASGI scope) is answered in: OpenAI's,
    or Anthropic's (:func:`anthropic_client`)."""
    if anthropic_client(scope):
        return anthropic_error_body(status, message, param)
    return error_body(message, type_, param, code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def redis_unavailable(e: BaseException, what: str = "Redis did not answer") -> OpenAIError:
    """503 ``redis_unavailable``: a request that needed Redis while it was away (restarting,
    unreachable). Retryable, as a client's retry policy reads a 503."""
    return OpenAIError(503, f"{what}: {e}", "server_error", None, "redis_unavailable")


# the names pydantic gives a union's members in an error's location (``prompt.str``,
# ``input.list[int]``): not part of the field's path
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _loc_to_param(loc: tuple) -> str | None:
    # a query or path parameter by its own name, as a body field is (OpenAI's ``param``)
    if loc and loc[0] in ("query", "path"):
        loc = loc[1:]
    parts = [str(p) for p in loc if p != "body"]
    parts = [p for p in parts if p not in _UNION_MEMBERS and "[" not in p]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        body = shaped_error(request.scope, exc.status, exc.message, exc.type, exc.param,
                            exc.code)  # fmt: skip
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first: dict[str, Any] = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        param = _loc_to_param(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid request")
        if param:
            msg = f"{param}: {msg}"
        if len(errs) > 1:
            msg += f" (and {len(errs) - 1} more error(s))"
        body = shaped_error(request.scope, 400, msg, "invalid_request_error", param,
                            "invalid_value")  # fmt: skip
        return JSONResponse(body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = shaped_error(request.scope, exc.status_code, str(exc.detail), type_)
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def _redis_away(request: Request, exc: Exception) -> JSONResponse:
        # a route that needed Redis while it was away: retryable, not an internal error
        return await _openai(request, redis_unavailable(exc))

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        body = shaped_error(request.scope, 500, f"internal error: {type(exc).__name__}",
                            "server_error")  # fmt: skip
        return JSONResponse(body, status_code=500)


def first_error(eg: BaseExceptionGroup) -> BaseException:
    """The first exception of a task group's failure (nested groups opened): what a
    request whose parallel parts failed answers."""
    first = eg.exceptions[0]
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first
