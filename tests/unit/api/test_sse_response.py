"""api.app._SSE: sse-starlette's response with the per-chunk cancel scope skipped only when
there is no send timeout; with one, a stuck send still times out."""

from __future__ import annotations

import asyncio

import pytest
from sse_starlette.sse import SendTimeoutError

from api.sse import SSEResponse as _SSE


async def _chunks():  # type: ignore[no-untyped-def]
    yield b"data: 1\r\n\r\n"


def test_without_a_send_timeout_chunks_go_straight_to_send() -> None:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def main() -> None:
        resp = _SSE(_chunks(), ping=0)
        assert resp.send_timeout is None
        await resp._send_with_timeout(send, {"type": "http.response.body", "body": b"x"})

    asyncio.run(main())
    assert sent == [{"type": "http.response.body", "body": b"x"}]


def test_with_a_send_timeout_a_stuck_send_still_times_out() -> None:
    async def stuck(message: dict) -> None:
        await asyncio.sleep(10)

    async def main() -> None:
        resp = _SSE(_chunks(), ping=0, send_timeout=0.05)
        with pytest.raises(SendTimeoutError):
            await resp._send_with_timeout(stuck, {"type": "http.response.body", "body": b"x"})

    asyncio.run(main())
