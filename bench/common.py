"""Helpers the bench scripts share: free loopback ports, reading an OpenAI SSE stream."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator

import httpx


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


async def stream_chunks(
    client: httpx.AsyncClient, path: str, body: dict
) -> AsyncIterator[tuple[float, dict]]:
    """POST ``body`` with ``stream: true`` and yield ``(arrival time, chunk)`` for every
    data chunk up to ``[DONE]``; an HTTP error or an error event raises ``RuntimeError``
    with the server's message."""
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {error_text(await r.aread())}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            now = time.perf_counter()
            obj = json.loads(data)
            if "error" in obj:
                err = obj["error"]
                msg = err.get("message", err) if isinstance(err, dict) else err
                raise RuntimeError(f"stream error: {msg}")
            yield now, obj


def error_text(body: bytes) -> str:
    """The OpenAI error body's message, else the body's head."""
    try:
        err = json.loads(body)["error"]
        return str(err.get("message", err))[:300]
    except (ValueError, KeyError, TypeError, AttributeError):
        return body[:300].decode(errors="replace")
