"""The API's part of a request's trace (cluster.tracing): a server span per HTTP request,
the request's GenAI attributes on it, and a child span for admission and routing.

``TracingMiddleware`` opens the span around the whole exchange (a stream's last event
included), as the current span of everything the request runs; the runner finds it there
(:func:`request_trace`), names it in the stage payload so the workers' spans join the
trace, and writes what the request did onto it as each of its streams ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.tracing import Tracing, parent_context, traceparent, wall_ns

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from kvbm.protocol import Sampling

# probes and scrapes: no span (they would drown the requests' traces)
UNTRACED = frozenset({"/health", "/ping", "/metrics", "/load"})


class TracingMiddleware:
    """Pure ASGI, so SSE responses stream untouched (api.middleware)."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in UNTRACED:
            await self.app(scope, receive, send)
            return
        from opentelemetry import context
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        headers = dict(scope.get("headers") or ())
        parent = parent_context(_header(headers, b"traceparent"),
                                _header(headers, b"tracestate"))  # fmt: skip
        method, path = scope.get("method", ""), scope.get("path", "")
        span = self.tracing.tracer.start_span(
            f"{method} {path}", context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path,
                        "server.address": (scope.get("server") or ("",))[0]},
        )  # fmt: skip
        status: list[int] = []

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                span.set_attribute("http.response.status_code", message["status"])
            await send(message)

        token = context.attach(set_span_in_context(span))
        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException as e:
            span.record_exception(e)
            span.set_status(Status(StatusCode.ERROR, type(e).__name__))
            raise
        finally:
            context.detach(token)
            _TRACES.pop(span.get_span_context().span_id, None)
            if status and status[0] >= 500:  # a server span's error: a 5xx (HTTP semconv)
                span.set_status(Status(StatusCode.ERROR, f"HTTP {status[0]}"))
            span.end()


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    v = headers.get(name)
    return v.decode("latin-1") if v else None


@dataclass(eq=False)
class RequestTrace:
    """A traced request's span and what its streams did, written onto the span as each
    one ends (its choices', and a batch's prompts', tokens and finish reasons add up)."""

    span: Span
    parent: str  # the span's traceparent, for the stage payloads
    started: float  # perf_counter at arrival
    outputs: dict[object, tuple[int, str | None]] = field(default_factory=dict)
    prompt_tokens: int = 0
    first_token_at: float | None = None  # the request's first token, of any stream

    def route(self, tracing: Tracing, t0: float, steps: list[tuple[str, Any]]) -> None:
        """The admission wait and the routing pick, from ``t0`` (perf counter) to now."""
        routes = [r for _, r in steps]
        tracing.span("route", self.span, wall_ns(t0), time.time_ns(), {
            "conveyor.stages": [name for name, _ in steps],
            "conveyor.workers": [r.worker_id for r in routes],
            "conveyor.pools": [r.pool for r in routes],
            "conveyor.route.reasons": [r.reason for r in routes],
            "conveyor.route.overlap_blocks": [r.overlap_blocks for r in routes],
        })  # fmt: skip

    def ended(self, stream: object, usage: Any, finish_reason: str | None, error: str | None,
              first_token_at: float | None, migrations: int) -> None:  # fmt: skip
        """One stream of the request ended (``stream``: what tells it from the request's
        others; its usage, if it got that far)."""
        s = self.span
        if not s.is_recording():
            return
        self.outputs[stream] = (usage.completion_tokens if usage else 0, finish_reason)
        s.set_attribute("gen_ai.usage.output_tokens", sum(n for n, _ in self.outputs.values()))
        s.set_attribute("gen_ai.response.finish_reasons",
                        [r or "abort" for _, r in self.outputs.values()])  # fmt: skip
        if usage is not None:
            s.set_attribute("conveyor.usage.cached_tokens", usage.cached_tokens)
        if first_token_at is not None and (self.first_token_at is None
                                           or first_token_at < self.first_token_at):  # fmt: skip
            self.first_token_at = first_token_at
            s.set_attribute("gen_ai.latency.time_to_first_token", first_token_at - self.started)
        s.set_attribute("gen_ai.latency.e2e", time.perf_counter() - self.started)
        if migrations:
            s.set_attribute("conveyor.migrations", migrations)
        if error:
            from opentelemetry.trace import Status, StatusCode

            s.set_status(Status(StatusCode.ERROR, error))


# each traced request's RequestTrace, by its span's id, until the middleware ends the span:
# the inputs of one request (embeddings, a batch of prompts) share one
_TRACES: dict[int, RequestTrace] = {}


def request_trace(request_id: str, model: str, sampling: Sampling | None, prompt_tokens: int,
                  started: float) -> RequestTrace | None:  # fmt: skip
    """The current request's trace (the middleware's span), its request attributes set
    (``sampling``: None for an embedding); ``None`` when it is not sampled. Another input
    of the same request adds its prompt tokens to the first's trace."""
    from opentelemetry.trace import get_current_span

    span = get_current_span()
    parent = traceparent(span) if span.is_recording() else None
    if parent is None:
        return None
    key = span.get_span_context().span_id
    if (tr := _TRACES.get(key)) is not None and tr.span is span:
        tr.prompt_tokens += prompt_tokens
        span.set_attribute("gen_ai.usage.input_tokens", tr.prompt_tokens)
        return tr
    tr = _TRACES[key] = RequestTrace(span, parent, started, prompt_tokens=prompt_tokens)
    span.set_attributes({"gen_ai.request.id": request_id, "gen_ai.request.model": model,
                         "gen_ai.usage.input_tokens": prompt_tokens})  # fmt: skip
    if sampling is not None:
        span.set_attributes({
            "gen_ai.request.max_tokens": sampling.max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.choice.count": sampling.n,
        })  # fmt: skip
        if sampling.seed is not None:
            span.set_attribute("gen_ai.request.seed", sampling.seed)
    return tr
