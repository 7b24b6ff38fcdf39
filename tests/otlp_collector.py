"""A small OpenTelemetry collector for tests: it takes OTLP traces over HTTP
(``POST /v1/traces``, protobuf) and over gRPC (TraceService/Export), decodes them with the
OTLP protobuf classes and keeps every span, flattened, for the test to look at."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class Span:
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error
    status_message: str = ""

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Collector:
    spans: list[Span] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=lambda: {"http": 0, "grpc": 0})
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, body: bytes, transport: str) -> None:
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(body)
        got = []
        for rs in req.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                    s.name, s.kind, s.start_time_unix_nano, s.end_time_unix_nano,
                                    _attrs(s.attributes), resource, s.status.code,
                                    s.status.message))  # fmt: skip
        with self._lock:
            self.spans += got
            self.requests[transport] += 1

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, cond: Callable[[], bool], timeout: float = 20.0, what: str = "spans") -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                with self._lock:
                    names = [(s.service, s.name, s.trace_id[:8]) for s in self.spans[-20:]]
                raise TimeoutError(f"timed out waiting for {what}; last spans: {names}")
            time.sleep(0.05)


class _Handler(BaseHTTPRequestHandler):
    collector: Collector

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        self.collector.take(body, "http")
        out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *_: object) -> None:
        pass


def serve_http(collector: Collector, port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """An OTLP/HTTP receiver on loopback (a free port by default); returns it and its
    traces URL."""
    handler = type("Handler", (_Handler,), {"collector": collector})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1/traces"


def serve_grpc(collector: Collector) -> tuple[Any, str]:
    """An OTLP/gRPC receiver on a free loopback port; returns it and its address."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC's name
            collector.take(request.SerializeToString(), "grpc")
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"http://127.0.0.1:{port}"


if (
    __name__ == "__main__"
):  # a stand-alone collector (docs/performance.md, "Tracing: what a traced request costs")
    import sys

    c = Collector()
    _, url = serve_http(c, int(sys.argv[1]) if len(sys.argv) > 1 else 4318)
    print(f"OTLP/HTTP collector on {url}", flush=True)
    while True:
        time.sleep(10)
        print(f"{len(c.spans)} spans in {c.requests['http']} requests", flush=True)
