"""Pure-ASGI middleware: API keys (401), request body size limit (413) and per-endpoint
status counts.

Pure ASGI rather than ``BaseHTTPMiddleware`` so SSE responses stream untouched.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import shaped_error
from api.metrics import ApiMetrics

# vLLM's endpoints outside /v1/ that run the model or its tokenizer: counted and keyed like
# /v1/ (vLLM leaves them open to callers without a key; here a key that guards the API
# guards them too)
MODEL_PATHS = frozenset({"/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank",
                         "/invocations", "/pooling", "/classify", "/reset_prefix_cache",
                         "/clear_kv_blocks", "/inference/v1/generate",
                         "/inference/v1/abort_requests", "/abort_requests", "/pause",
                         "/resume", "/is_paused"})  # fmt: skip
# health and metrics: keyed only with CONVEYOR_API_KEYS_PROTECT_OPS
OPS_PATHS = frozenset({"/health", "/ping", "/metrics", "/load"})


def presented_key(scope: Scope) -> bytes:
    """The API key a request presents: ``Authorization: Bearer <key>`` (OpenAI's clients),
    or ``x-api-key`` (Anthropic's); empty when it presents none."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, given = value.partition(b" ")
            if scheme.lower() == b"bearer" and given.strip():
                return given.strip()
        elif name == b"x-api-key" and value.strip():
            return value.strip()
    return b""


class _TooLarge(Exception):
    pass


class AccessMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: ApiMetrics) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        status: list[int] = []

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.limit
                except ValueError:
                    too_big = False
                if too_big:
                    await self._reject(send_wrapper, scope)
                    self._count(path, 413)
                    return

        seen = 0

        async def receive_wrapper() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except _TooLarge:
            if not status:
                await self._reject(send_wrapper, scope)
        finally:
            self._count(path, status[0] if status else 500)

    async def _reject(self, send: Send, scope: Scope) -> None:
        body = json.dumps(shaped_error(scope, 413, f"request body exceeds the limit of "
                                       f"{self.limit} bytes", "invalid_request_error", None,
                                       "request_too_large")).encode()  # fmt: skip
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _count(self, path: str, status: int) -> None:
        if path.startswith("/v1/") or path in MODEL_PATHS:
            self.metrics.requests.labels(path, str(status)).inc()


class AuthMiddleware:
    """``Authorization: Bearer <key>`` with one of ``keys`` for ``/v1/...`` and
    ``MODEL_PATHS`` (and, with ``protect_ops``, ``OPS_PATHS``), as
    OpenAI and vLLM's ``--api-key`` do; anything else answers 401 in OpenAI's error shape.
    Keys compare in constant time."""

    def __init__(self, app: ASGIApp, keys: list[str], protect_ops: bool = False) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.protect_ops = protect_ops

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._protected(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        given = presented_key(scope)
        if given and any(hmac.compare_digest(given, k) for k in self.keys):
            await self.app(scope, receive, send)
            return
        message = (
            "Incorrect API key provided."
            if given
            else (
                "You didn't provide an API key: send it as 'Authorization: Bearer <key>' "
                "(or 'x-api-key: <key>')."
            )
        )
        body = json.dumps(shaped_error(scope, 401, message,
                                       "invalid_request_error", None,
                                       "invalid_api_key")).encode()  # fmt: skip
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    def _protected(self, path: str) -> bool:
        if path.startswith("/v1/") or path in MODEL_PATHS:
            return True
        return self.protect_ops and path in OPS_PATHS
