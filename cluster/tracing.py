"""OpenTelemetry traces (vLLM's ``--otlp-traces-endpoint``), shared by every process.

A request is one trace across processes: the API's span for its HTTP request (a child of
the caller's ``traceparent``, when it sends one) with the request's GenAI attributes, a
child span for its admission and routing, and one span per stage task on the worker that
ran it. The API's span reaches the workers as a W3C ``traceparent`` in the stage payload
(``kvbm.protocol.StagePayload.trace``).

OpenTelemetry is imported only when an endpoint is set: with tracing off none of it is
loaded, and a request pays an ``is None`` test where a span would be made.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

HTTP, GRPC = "http/protobuf", "grpc"


class TracingUnavailable(RuntimeError):
    """The traces' transport is not installed."""


@dataclass
class Tracing:
    """One process's tracer and the provider that exports its spans in batches."""

    tracer: Tracer
    provider: TracerProvider

    def span(self, name: str, parent: str | Span | None, start_ns: int, end_ns: int,
             attributes: dict[str, Any], *, kind: str = "INTERNAL",
             error: str | None = None) -> None:  # fmt: skip
        """A finished span made in one go: its times known after the fact (a stage task's,
        a route's). ``parent``: a traceparent string or a live span."""
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        ctx = parent_context(parent) if isinstance(parent, str) or parent is None \
            else set_span_in_context(parent)  # fmt: skip
        span = self.tracer.start_span(name, context=ctx, kind=SpanKind[kind],
                                      start_time=start_ns,
                                      attributes=_clean(attributes))  # fmt: skip
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=max(end_ns, start_ns))

    def shutdown(self) -> None:
        """Export what is left, then stop (bounded by the exporter's timeout)."""
        self.provider.shutdown()


def start_tracing(endpoint: str | None, protocol: str, service: str,
                  **resource: str) -> Tracing | None:  # fmt: skip
    """This process's tracing, or ``None`` when ``endpoint`` is unset. ``service``: its
    ``service.name`` unless ``OTEL_SERVICE_NAME`` says otherwise; ``resource``: more
    attributes of every span it sends (``conveyor.worker.id``, ...). The sampler, the batch
    sizes, headers and timeouts are the SDK's ``OTEL_*`` variables."""
    if not endpoint:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or service, **resource}
    provider = TracerProvider(resource=Resource.create(attrs))
    provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint, protocol)))
    return Tracing(provider.get_tracer("conveyor"), provider)


def check_transport(endpoint: str | None, protocol: str) -> None:
    """Raise :class:`TracingUnavailable` when traces are asked for over a transport this
    install lacks (a process checks before it starts serving)."""
    if endpoint and protocol == GRPC:
        _grpc_exporter()


def _grpc_exporter() -> type:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise TracingUnavailable(
            "CONVEYOR_OTLP_TRACES_PROTOCOL=grpc needs the gRPC exporter: "
            "pip install 'conveyor[tracing-grpc]' (or use http/protobuf)"
        ) from e
    return OTLPSpanExporter


def _exporter(endpoint: str, protocol: str) -> SpanExporter:
    if protocol == GRPC:
        return _grpc_exporter()(endpoint=endpoint)  # http://: plaintext, https://: TLS
    if protocol != HTTP:
        raise ValueError(f"unknown OTLP protocol {protocol!r} (http/protobuf or grpc)")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=traces_url(endpoint))


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: as given when it has a path, else the
    collector's default one (``http://collector:4318`` -> ``.../v1/traces``)."""
    u = urlsplit(endpoint)
    if u.path in ("", "/"):
        return urlunsplit((u.scheme, u.netloc, "/v1/traces", u.query, ""))
    return endpoint


def traceparent(span: Span) -> str | None:
    """``span``'s W3C traceparent, for the processes that carry its trace on; ``None`` when
    it is not sampled (they then make no spans)."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def parent_context(header: str | None, state: str | None = None) -> Context | None:
    """The context a ``traceparent`` header (and its ``tracestate``) names; ``None`` (a new
    trace) when it is missing or malformed, as the W3C spec has a receiver do."""
    if not header:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": header} | ({"tracestate": state} if state else {})
    return TraceContextTextMapPropagator().extract(carrier)


def wall_ns(perf: float) -> int:
    """A ``time.perf_counter()`` reading of this process as wall-clock nanoseconds (spans
    are stamped in wall time; durations here are measured on the perf counter)."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """Attributes without their unset values (OpenTelemetry refuses ``None``)."""
    return {k: v for k, v in attributes.items() if v is not None}
