"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Only the API turns errors into HTTP. Invalid bodies answer **400** (as OpenAI and vLLM do,
not FastAPI's default 422); unknown model 404; body too large 413; no live worker, or a
broker that refuses the request, 503; a worker that never answers 504; admission
(:mod:`api.admission`): every worker at its cap 503, a client over its own 429, both with
``Retry-After``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


# the names pydantic gives a union's members in an error's location (``prompt.str``,
# ``input.list[int]``): not part of the field's path
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    parts = [p for p in parts if p not in _UNION_MEMBERS and "[" not in p]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first: dict[str, Any] = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        param = _loc_to_param(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid request")
        if param:
            msg = f"{param}: {msg}"
        if len(errs) > 1:
            msg += f" (and {len(errs) - 1} more error(s))"
        return JSONResponse(
            error_body(msg, "invalid_request_error", param, "invalid_value"), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(
            error_body(str(exc.detail), type_, None, None), status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", "server_error", None, None),
            status_code=500,
        )


def first_error(eg: BaseExceptionGroup) -> BaseException:
    """The first exception of a task group's failure (nested groups opened): what a
    request whose parallel parts failed answers."""
    first = eg.exceptions[0]
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first
