"""cluster.tracing: the exporters' URLs and transports, the traceparent carried to the
workers, and spans made after the fact, checked on the SDK's in-memory exporter."""

from __future__ import annotations

import sys
import time

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from cluster.tracing import (
    GRPC,
    HTTP,
    Tracing,
    TracingUnavailable,
    check_transport,
    parent_context,
    start_tracing,
    traceparent,
    traces_url,
    wall_ns,
)

TID, SID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def memory_tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "t"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider.get_tracer("t"), provider), exporter


@pytest.mark.parametrize(("given", "url"), [
    ("http://c:4318", "http://c:4318/v1/traces"),
    ("http://c:4318/", "http://c:4318/v1/traces"),
    ("https://c/otlp/v1/traces", "https://c/otlp/v1/traces"),
    ("http://c:4318/custom", "http://c:4318/custom"),
])  # fmt: skip
def test_the_http_traces_url(given: str, url: str) -> None:
    assert traces_url(given) == url


def test_no_endpoint_no_tracing_and_nothing_imported() -> None:
    assert start_tracing(None, HTTP, "x") is None
    assert start_tracing("", GRPC, "x") is None
    check_transport(None, GRPC)  # nothing asked for: nothing missing


def test_an_exporter_per_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    t = start_tracing("http://127.0.0.1:9/", HTTP, "svc", **{"conveyor.pool": "decode"})
    assert t is not None
    res = t.provider.resource.attributes
    assert (res["service.name"], res["conveyor.pool"]) == ("svc", "decode")
    t.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "mine")
    t = start_tracing("http://127.0.0.1:9", GRPC, "svc")
    assert t is not None and t.provider.resource.attributes["service.name"] == "mine"
    t.shutdown()
    with pytest.raises(ValueError, match="unknown OTLP protocol"):
        start_tracing("http://127.0.0.1:9", "thrift", "svc")


def test_grpc_without_its_exporter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                        None)  # fmt: skip
    with pytest.raises(TracingUnavailable, match=r"conveyor\[tracing-grpc\]"):
        check_transport("http://c:4317", GRPC)
    check_transport("http://c:4318", HTTP)


def test_traceparent_round_trip_and_sampling() -> None:
    from opentelemetry.trace import get_current_span

    t, exporter = memory_tracing()
    ctx = parent_context(f"00-{TID}-{SID}-01", "k=v")
    assert ctx is not None
    with t.tracer.start_as_current_span("s", context=ctx) as span:
        header = traceparent(span)
    assert header is not None and header.startswith(f"00-{TID}-") and header.endswith("-01")
    assert header.split("-")[2] != SID  # the span's own id, the caller's its parent
    (done,) = exporter.get_finished_spans()
    assert done.parent is not None and f"{done.parent.span_id:016x}" == SID
    assert done.context.trace_state.get("k") == "v"
    # unsampled, missing or malformed: nothing to carry on / a new trace
    ctx = parent_context(f"00-{TID}-{SID}-00")
    assert traceparent(get_current_span(ctx)) is None
    assert parent_context(None) is None
    assert not get_current_span(parent_context("00-zz-bad")).get_span_context().is_valid


def test_a_span_made_after_the_fact() -> None:
    t, exporter = memory_tracing()
    t0 = time.perf_counter()
    start = wall_ns(t0)
    assert abs(start - time.time_ns()) < 50_000_000
    t.span("prefill", f"00-{TID}-{SID}-01", start, start + 5_000, {"a": 1, "b": None},
           kind="CONSUMER", error="KV export failed")  # fmt: skip
    t.span("late", None, start, start - 10, {})  # an end before its start is clamped
    s, late = exporter.get_finished_spans()
    assert (s.name, s.kind, s.start_time, s.end_time) == ("prefill", SpanKind.CONSUMER, start,
                                                          start + 5_000)  # fmt: skip
    assert f"{s.context.trace_id:032x}" == TID and s.parent is not None
    assert dict(s.attributes or {}) == {"a": 1}  # None dropped
    assert (s.status.status_code, s.status.description) == (StatusCode.ERROR, "KV export failed")
    assert late.parent is None and late.end_time == late.start_time
