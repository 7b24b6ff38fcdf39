"""api.tracing: the server span around an HTTP exchange (a stream's included), and the
request's GenAI attributes written as its streams end; on the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from api.tracing import RequestTrace, TracingMiddleware, request_trace
from kvbm.protocol import Sampling, Usage
from tests.unit.cluster.test_tracing import SID, TID, memory_tracing

SEEN: dict[str, object] = {}


async def chat(request: Request) -> StreamingResponse:
    tr = request_trace("chatcmpl-1", "m", Sampling(max_tokens=7, n=2, seed=3), 11, 0.0)
    SEEN["trace"] = tr

    async def body():  # type: ignore[no-untyped-def]
        yield b"data: 1\n\n"
        await asyncio.sleep(0.01)
        assert tr is not None
        tr.ended(1, Usage(11, 4), "stop", None, None, 0)
        tr.ended(0, Usage(11, 5), "length", None, 0.5, 1)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def embed(request: Request) -> JSONResponse:
    first = request_trace("emb-1.0", "m", None, 3, 0.0)
    # a second input of the same request (after the first's streams let go of its trace)
    SEEN["same"] = request_trace("emb-1.1", "m", None, 4, 0.0) is first
    return JSONResponse({})


async def batch(request: Request) -> JSONResponse:
    """A batch of two prompts (each its own id), two choices each; a retried attempt of
    the second prompt's first choice ends under its key first."""
    a = request_trace("cmpl-a", "m", Sampling(max_tokens=4, n=2), 5, 0.0)
    b = request_trace("cmpl-b", "m", Sampling(max_tokens=4, n=2), 6, 0.0)
    assert a is b and a is not None
    a.ended(("cmpl-b", 0), None, None, None, None, 0)  # the lost attempt
    for key, out, at in [(("cmpl-a", 0), 1, 0.7), (("cmpl-a", 1), 2, None),
                         (("cmpl-b", 0), 3, 0.4), (("cmpl-b", 1), 4, 0.9)]:  # fmt: skip
        a.ended(key, Usage(5, out), "stop", None, at, 0)
    return JSONResponse({})


async def boom(request: Request) -> PlainTextResponse:
    return PlainTextResponse("no", status_code=503)


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def _app():  # type: ignore[no-untyped-def]
    t, exporter = memory_tracing()
    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/embeddings", embed, methods=["POST"]),
                            Route("/v1/completions", batch, methods=["POST"]),
                            Route("/boom", boom), Route("/health", health)])  # fmt: skip
    return TracingMiddleware(app, t), exporter


async def _send(app, method: str, path: str, **kw: object) -> httpx.Response:  # type: ignore[no-untyped-def]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await c.request(method, path, **kw)  # type: ignore[arg-type]


def test_a_streamed_request_s_span_and_its_attributes() -> None:
    app, exporter = _app()
    r = asyncio.run(_send(app, "POST", "/v1/chat/completions",
                          headers={"traceparent": f"00-{TID}-{SID}-01"}))  # fmt: skip
    assert r.status_code == 200 and r.text.endswith("[DONE]\n\n")
    (s,) = exporter.get_finished_spans()
    assert (s.name, s.kind) == ("POST /v1/chat/completions", SpanKind.SERVER)
    assert f"{s.context.trace_id:032x}" == TID and f"{s.parent.span_id:016x}" == SID  # type: ignore[union-attr]
    a = dict(s.attributes or {})
    assert a["http.response.status_code"] == 200
    assert (a["gen_ai.request.id"], a["gen_ai.request.max_tokens"]) == ("chatcmpl-1", 7)
    assert (a["gen_ai.request.choice.count"], a["gen_ai.request.seed"]) == (2, 3)
    # both choices' tokens and reasons; the first choice's time to first token
    assert a["gen_ai.usage.output_tokens"] == 9 and a["gen_ai.usage.input_tokens"] == 11
    assert list(a["gen_ai.response.finish_reasons"]) == ["stop", "length"]  # type: ignore[arg-type]
    assert a["gen_ai.latency.time_to_first_token"] == 0.5 and a["conveyor.migrations"] == 1
    tr = SEEN["trace"]
    assert isinstance(tr, RequestTrace) and tr.parent.split("-")[2] == f"{s.context.span_id:016x}"


def test_embeddings_add_up_and_errors_and_probes() -> None:
    app, exporter = _app()
    asyncio.run(_send(app, "POST", "/v1/embeddings"))
    (s,) = exporter.get_finished_spans()
    a = dict(s.attributes or {})
    assert a["gen_ai.usage.input_tokens"] == 7 and "gen_ai.request.max_tokens" not in a
    assert SEEN["same"] is True and a["gen_ai.request.id"] == "emb-1.0"
    assert s.parent is None  # no caller: a trace of its own
    exporter.clear()
    asyncio.run(_send(app, "GET", "/boom"))
    asyncio.run(_send(app, "GET", "/health"))
    (s,) = exporter.get_finished_spans()  # /health makes none
    assert (
        s.status.status_code == StatusCode.ERROR
        and s.attributes["http.response.status_code"] == 503
    )  # type: ignore[index]


def test_a_batch_of_prompts_adds_up_on_one_trace() -> None:
    app, exporter = _app()
    asyncio.run(_send(app, "POST", "/v1/completions"))
    (s,) = exporter.get_finished_spans()
    a = dict(s.attributes or {})
    assert (a["gen_ai.request.id"], a["gen_ai.usage.input_tokens"]) == ("cmpl-a", 11)
    assert a["gen_ai.usage.output_tokens"] == 10  # the lost attempt replaced, not added
    assert list(a["gen_ai.response.finish_reasons"]) == ["stop"] * 4  # type: ignore[arg-type]
    assert a["gen_ai.latency.time_to_first_token"] == 0.4  # the earliest of any stream


def test_no_span_no_trace() -> None:
    assert request_trace("r", "m", None, 1, 0.0) is None


def test_an_ended_span_is_left_alone() -> None:
    app, exporter = _app()
    asyncio.run(_send(app, "POST", "/v1/chat/completions"))
    tr = SEEN["trace"]
    assert isinstance(tr, RequestTrace)
    tr.ended(0, Usage(1, 99), "stop", "late", None, 0)  # after the response: not recording
    (s,) = exporter.get_finished_spans()
    assert (
        s.attributes["gen_ai.usage.output_tokens"] == 9 and s.status.status_code == StatusCode.UNSET
    )  # type: ignore[index]


@pytest.mark.parametrize(("path", "status"), [("/nope", 404), ("/v1/chat/completions", 405)])
def test_client_errors_leave_the_status_unset(path: str, status: int) -> None:
    app, exporter = _app()
    assert asyncio.run(_send(app, "GET", path)).status_code == status
    (s,) = exporter.get_finished_spans()
    assert s.status.status_code == StatusCode.UNSET
    assert s.attributes["http.response.status_code"] == status  # type: ignore[index]
