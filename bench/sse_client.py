"""A lean HTTP/1.1 client for OpenAI SSE streams, for load generators that share the
server's cores.

aiohttp spends CPU per streamed token (its stream reader, a coroutine resumed per line, and
the default asyncio loop) on the core where the API, Redis and the Celery worker run: load
the client adds there is overhead the bench then charges to the server (docs/performance.md,
"Bench client: a lean SSE reader"). This client is an ``asyncio.Protocol`` on keep-alive
connections: httptools (the C parser uvicorn uses) undoes the chunked encoding, each SSE
event's data is kept as raw bytes with its arrival time as the bytes are received, and JSON
is decoded once the stream has ended. Run it under uvloop (:func:`run_loop`) for the
cheapest transport.

Plain ``http://host:port`` only: no TLS, proxies or redirects.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from typing import Any
from urllib.parse import urlsplit

import httptools
from common import error_text, event_error


class StreamError(RuntimeError):
    """The server answered with an error status or an error event, or the stream broke."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request on it at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self._done: asyncio.Future[None] | None = None
        self._events: list[tuple[float, bytes]] = []
        self._buf = b""
        self._raw = b""
        self._status = 0
        self._sse = True
        self.answered = False  # any byte of the current request's response came

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(StreamError(f"bad HTTP response: {e}"))
            self.transport.close()  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(StreamError(f"connection closed mid-response: {exc or 'by the server'}"))

    # -- httptools callbacks
    def on_headers_complete(self) -> None:
        self._status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self._sse or self._status != 200:
            self._raw += body
            return
        now = time.perf_counter()
        lines = (self._buf + body).split(b"\n")
        self._buf = lines.pop()  # the part of a line still to come
        for line in lines:
            if line.startswith(b"data:"):
                self._events.append((now, line[5:].strip()))

    def on_message_complete(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(None)
        if not self.parser.should_keep_alive():
            self.lost = True  # not to be reused; connection_lost comes later
            self.transport.close()  # type: ignore[union-attr]

    # --
    def _fail(self, exc: Exception) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)

    async def request(
        self, head: bytes, body: bytes, timeout: float, sse: bool
    ) -> tuple[int, list[tuple[float, bytes]], bytes]:
        """Send one request: (status, [(arrival time, SSE data)] when ``sse`` and the
        status is 200, else [], the body otherwise)."""
        self._done = asyncio.get_running_loop().create_future()
        self._events, self._buf, self._raw, self._status, self._sse = [], b"", b"", 0, sse
        self.answered = False
        self.transport.write(head + body)  # type: ignore[union-attr]
        await asyncio.wait_for(self._done, timeout)
        return self._status, self._events, self._raw


class SSEClient:
    """``await client.stream(path, body)`` POSTs a JSON body with ``stream: true`` and
    returns ``[(arrival time, chunk dict)]`` up to ``[DONE]``; an error status or an error
    event raises :class:`StreamError` with the server's message. Up to ``max_connections``
    keep-alive connections, opened as needed."""

    def __init__(self, url: str, max_connections: int, timeout_s: float) -> None:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"plain http://host:port URLs only, not {url!r}")
        self.host, self.port = u.hostname, u.port or 80
        self.timeout_s = timeout_s
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def __aenter__(self) -> SSEClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.transport.close()  # type: ignore[union-attr]
        self._idle.clear()

    async def _connection(self, reuse: bool = True) -> tuple[_Connection, bool]:
        """An idle connection (and True), else a new one (and False)."""
        while reuse and self._idle:
            conn = self._idle.pop()
            if not conn.lost:
                return conn, True
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, self.host, self.port)
        return conn, False

    async def _send(self, head: bytes, body: bytes, sse: bool) -> tuple[int, list, bytes]:
        async with self._slots:
            conn, reused = await self._connection()
            while True:
                try:
                    out = await conn.request(head, body, self.timeout_s, sse)
                    break
                except StreamError:
                    conn.transport.close()  # type: ignore[union-attr]
                    if not reused or conn.answered:
                        raise
                    # the server closed the idle connection as we sent on it (an idle
                    # keep-alive timeout): nothing was answered, so once more on a new one
                    conn, reused = await self._connection(reuse=False)
                except BaseException:
                    conn.transport.close()  # type: ignore[union-attr]
                    raise
            if not conn.lost:
                self._idle.append(conn)
        if out[0] != 200:
            raise StreamError(f"HTTP {out[0]}: {error_text(out[2])}")
        return out

    async def stream(self, path: str, body: dict) -> list[tuple[float, dict]]:
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        _, events, _ = await self._send(head, data, sse=True)
        out: list[tuple[float, dict]] = []
        for now, raw in events:
            if raw == b"[DONE]":
                return out
            obj = json.loads(raw)
            if (msg := event_error(obj)) is not None:
                raise StreamError(f"stream error: {msg}")
            out.append((now, obj))
        raise StreamError("stream ended without [DONE]")

    async def get_json(self, path: str) -> Any:
        """GET ``path``; the decoded JSON body."""
        head = f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode()
        _, _, body = await self._send(head, b"", sse=False)
        return json.loads(body)


def run_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """Run ``main`` on uvloop when it is installed (it comes with uvicorn[standard]),
    else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
