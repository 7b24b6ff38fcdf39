"""Helpers the bench scripts share: free loopback ports, an HTTP session, reading an
OpenAI SSE stream.

The load generator shares this machine's cores with the server it measures, so it should
cost as little as it can: aiohttp (C HTTP parser) reads a stream for less CPU than httpx,
and ``bench/sse_client.py`` goes further for the serving benchmark (docs/performance.md,
"Bench client: a lean SSE reader").
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator

import aiohttp


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all held open until all are picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def session(url: str, max_connections: int, timeout_s: float) -> aiohttp.ClientSession:
    """A keep-alive HTTP session on ``url`` (use as ``async with``); no proxies from env."""
    return aiohttp.ClientSession(
        url,
        connector=aiohttp.TCPConnector(limit=max_connections),
        timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=10.0),
    )


async def stream_chunks(
    client: aiohttp.ClientSession, path: str, body: dict
) -> AsyncIterator[tuple[float, dict]]:
    """POST ``body`` with ``stream: true`` and yield ``(arrival time, chunk)`` for every
    data chunk up to ``[DONE]``; an HTTP error or an error event raises ``RuntimeError``
    with the server's message."""
    async with client.post(path, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {error_text(await r.read())}")
        async for line in r.content:  # one line at a time, as they arrive
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            now = time.perf_counter()
            obj = json.loads(data)
            if (msg := event_error(obj)) is not None:
                raise RuntimeError(f"stream error: {msg}")
            yield now, obj
        raise RuntimeError("stream ended without [DONE]")


def event_error(obj: dict) -> object | None:
    """An SSE error event's message (its ``error`` value if that has no message); None
    when the event is not an error."""
    if "error" not in obj:
        return None
    err = obj["error"]
    return err.get("message", err) if isinstance(err, dict) else err


def error_text(body: bytes) -> str:
    """The OpenAI error body's message, else the body's head."""
    try:
        err = json.loads(body)["error"]
        return str(err.get("message", err))[:300]
    except (ValueError, KeyError, TypeError, AttributeError):
        return body[:300].decode(errors="replace")
