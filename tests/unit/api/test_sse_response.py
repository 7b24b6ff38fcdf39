"""api.sse: LeanSSEResponse skips sse-starlette's per-chunk cancel scope only when there is
no send timeout (with one, a stuck send still times out); it is used only on the
sse-starlette versions it was tested on, and sends what the stock response sends."""

from __future__ import annotations

import asyncio
from importlib.metadata import version
from pathlib import Path

import pytest
from sse_starlette.sse import EventSourceResponse, SendTimeoutError

from api.sse import SSE_DONE, SSE_STARLETTE_TESTED, LeanSSEResponse, SSEResponse, lean_fits


async def _chunks():  # type: ignore[no-untyped-def]
    yield b"data: 1\r\n\r\n"
    yield SSE_DONE


def test_without_a_send_timeout_chunks_go_straight_to_send() -> None:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def main() -> None:
        resp = LeanSSEResponse(_chunks(), ping=0)
        assert resp.send_timeout is None
        await resp._send_with_timeout(send, {"type": "http.response.body", "body": b"x"})

    asyncio.run(main())
    assert sent == [{"type": "http.response.body", "body": b"x"}]


def test_with_a_send_timeout_a_stuck_send_still_times_out() -> None:
    async def stuck(message: dict) -> None:
        await asyncio.sleep(10)

    async def main() -> None:
        resp = LeanSSEResponse(_chunks(), ping=0, send_timeout=0.05)
        with pytest.raises(SendTimeoutError):
            await resp._send_with_timeout(stuck, {"type": "http.response.body", "body": b"x"})

    asyncio.run(main())


def _messages(cls: type[EventSourceResponse]) -> list[dict]:
    """What ``cls`` sends for a two-event stream through a real ASGI call."""
    sent: list[dict] = []

    async def receive() -> dict:
        await asyncio.sleep(10)  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
    asyncio.run(cls(_chunks(), ping=0, headers={"x-request-id": "r1"})(scope, receive, send))
    return sent


def test_the_lean_and_the_stock_response_send_the_same_messages() -> None:
    lean, stock = _messages(LeanSSEResponse), _messages(EventSourceResponse)
    assert lean == stock
    bodies = [m["body"] for m in lean if m["type"] == "http.response.body" and m["body"]]
    assert bodies == [b"data: 1\r\n\r\n", SSE_DONE]
    assert lean[0]["status"] == 200 and (b"x-request-id", b"r1") in lean[0]["headers"]


@pytest.mark.parametrize(("installed", "fits"), [
    ("3.7.0", True), ("3.7.12", True), ("3.8.0", False), ("3.6.1", False), ("2.1.3", False),
    ("4.0.0", False), ("3.7rc1", False),
])  # fmt: skip
def test_the_override_is_used_only_on_the_tested_versions(installed: str, fits: bool) -> None:
    assert lean_fits(installed) is fits


def test_the_routes_get_the_lean_response_on_the_installed_version() -> None:
    (lo_major, lo_minor), (hi_major, hi_minor) = SSE_STARLETTE_TESTED
    pin = f'"sse-starlette>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"'
    assert pin in (Path(__file__).parents[3] / "pyproject.toml").read_text(), pin
    assert SSEResponse is (LeanSSEResponse if lean_fits(version("sse-starlette"))
                           else EventSourceResponse)  # fmt: skip
    assert SSEResponse is LeanSSEResponse, f"sse-starlette {version('sse-starlette')} untested"
