"""OpenTelemetry traces (``CONVEYOR_OTLP_TRACES_ENDPOINT``) from a real deployment: a
disaggregated one (a prefill and a decode worker, KV over Redis) whose API and workers
export to a collector in this test (tests/otlp_collector.py), which decodes what arrives.

A request sent with a ``traceparent`` is one trace: the API's server span under the
caller's span, its route span, and a span per stage task on the worker that ran it, each
from its own process, with the request's attributes."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.conftest import (
    Proc,
    RedisDbs,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)
from tests.otlp_collector import Collector, Span, serve_grpc, serve_http

pytestmark = pytest.mark.integration

SERVER, CONSUMER = 2, 5  # OTLP span kinds
MIN_PD = 64  # prompts shorter than this run whole on the decode worker (generate)


@dataclass
class Traced:
    url: str
    model: str
    collector: Collector
    env: dict[str, str]
    procs: list[Proc]

    def client(self, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url or self.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def traced(
    redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Traced]:
    collector = Collector()
    server, endpoint = serve_http(collector)
    logdir = tmp_path_factory.mktemp("tracing")
    env = base_env(
        redis_dbs.take(__name__), tiny_model_dir,
        CONVEYOR_MODE="disagg", CONVEYOR_KV_TRANSFER="redis",
        CONVEYOR_DISAGG_MIN_PROMPT_TOKENS=str(MIN_PD),
        CONVEYOR_OTLP_TRACES_ENDPOINT=endpoint,
        OTEL_BSP_SCHEDULE_DELAY="100",  # export within 0.1 s, not the SDK's 5 s
        CONVEYOR_LOG_FORMAT="json",  # and their log lines name the trace (cluster.logs)
    )  # fmt: skip
    pre = start_worker("trace-prefill", "prefill", "trace-p", env, logdir)
    dec = start_worker("trace-decode", "decode", "trace-d", env, logdir)
    with stop_on_error(pre, dec):
        api, url = start_api("trace-api", env, logdir)
    procs = [api, pre, dec]
    with stop_on_error(*procs):
        wait_for(lambda: httpx.get(f"{url}/health").json()["workers"] ==
                 {"prefill": 1, "decode": 1}, 90, "workers", procs)  # fmt: skip
    yield Traced(url, tiny_model_dir.name, collector, env, procs)
    for p in procs:
        p.stop()
    server.shutdown()


def _ids() -> tuple[str, str]:
    return secrets.token_hex(16), secrets.token_hex(8)


def _spans(c: Collector, trace_id: str, names: set[str]) -> dict[str, Span]:
    """The trace's spans once every one of ``names`` is in, by name."""
    c.wait(lambda: names <= {s.name for s in c.of_trace(trace_id)}, what=f"spans {names}")
    spans = c.of_trace(trace_id)
    assert len(spans) == len({s.name for s in spans}), [s.name for s in spans]
    return {s.name: s for s in spans}


LONG = " ".join(f"word{i}" for i in range(60))  # well over MIN_PD tokens once templated


def test_a_disaggregated_request_is_one_trace_across_its_processes(traced: Traced) -> None:
    trace_id, caller = _ids()
    r = traced.client().chat.completions.create(
        model=traced.model, messages=[{"role": "user", "content": LONG}], max_tokens=12,
        temperature=0, extra_headers={"traceparent": f"00-{trace_id}-{caller}-01"},
    )  # fmt: skip
    assert r.usage is not None and r.usage.prompt_tokens >= MIN_PD
    got = _spans(traced.collector, trace_id,
                 {"POST /v1/chat/completions", "route", "prefill", "decode"})  # fmt: skip
    api, route, pre, dec = (got[n] for n in ("POST /v1/chat/completions", "route", "prefill",
                                             "decode"))  # fmt: skip

    # the API's span: under the caller's, with the request's GenAI attributes
    assert (api.parent_id, api.kind, api.service) == (caller, SERVER, "conveyor-api")
    a = api.attributes
    assert a["http.response.status_code"] == 200 and api.status != 2
    assert a["gen_ai.request.model"] == traced.model and a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.request.id"] == r.id
    assert a["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == r.usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == [r.choices[0].finish_reason]
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["gen_ai.latency.e2e"] * 1e9 <= api.end_ns - api.start_ns

    # the route: both stages, on the workers that ran them
    assert route.parent_id == api.span_id
    assert route.attributes["conveyor.stages"] == ["prefill", "decode"]
    assert route.attributes["conveyor.workers"] == ["trace-p", "trace-d"]
    assert api.start_ns <= route.start_ns <= route.end_ns <= pre.start_ns

    # each stage task: a span of its worker's process, under the API's
    for span, pool, wid in ((pre, "prefill", "trace-p"), (dec, "decode", "trace-d")):
        assert (span.parent_id, span.kind, span.service) == (api.span_id, CONSUMER,
                                                             "conveyor-worker")  # fmt: skip
        assert (span.resource["conveyor.pool"], span.resource["conveyor.worker.id"]) == (pool, wid)
        assert span.attributes["conveyor.worker.id"] == wid
        assert span.attributes["conveyor.request_id"] == r.id
        assert span.attributes["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens
        assert span.attributes["gen_ai.latency.time_in_queue"] >= 0
    assert pre.attributes["conveyor.kv_backend"] == "redis"
    assert pre.attributes["gen_ai.latency.time_to_first_token"] > 0
    assert dec.attributes["conveyor.kv_backend"] == "redis"
    assert dec.attributes["conveyor.prefill_worker"] == "trace-p"
    assert dec.attributes["gen_ai.usage.output_tokens"] == r.usage.completion_tokens
    assert dec.attributes["gen_ai.response.finish_reasons"] == [r.choices[0].finish_reason]
    assert pre.start_ns <= dec.start_ns

    # the processes log JSON lines (CONVEYOR_LOG_FORMAT=json); a request's lines name it,
    # and the API's, logged inside its span, name the trace too
    lines = {p.name: _json_lines(p) for p in traced.procs}
    sent = [ln for ln in lines["trace-api"] if ln.get("request_id") == r.id]
    assert sent and all(ln["trace_id"] == trace_id for ln in sent), sent
    assert any(ln.get("request_id") == r.id for ln in lines["trace-prefill"])
    assert {"time", "level", "logger", "pid", "message"} <= set(sent[0])


def _json_lines(p: Proc) -> list[dict]:
    """Every line ``p`` wrote, each of which must be a JSON object."""
    out = []
    for ln in p.log.read_text().splitlines():
        if ln.strip():
            try:
                out.append(json.loads(ln))
            except ValueError:
                raise AssertionError(f"{p.name} wrote a line that is not JSON: {ln!r}") from None
    return out


def test_a_streamed_request_without_a_caller_starts_its_own_trace(traced: Traced) -> None:
    before = {s.trace_id for s in traced.collector.spans}
    stream = traced.client().completions.create(
        model=traced.model, prompt="Hello there", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    rid, usage = chunks[0].id, chunks[-1].usage
    assert usage is not None

    def mine() -> list[Span]:
        return [s for s in traced.collector.spans if s.trace_id not in before
                and s.attributes.get("conveyor.request_id") == rid]  # fmt: skip

    traced.collector.wait(lambda: bool(mine()), what="the generate span")
    (gen,) = mine()
    got = _spans(traced.collector, gen.trace_id, {"POST /v1/completions", "route", "generate"})
    api = got["POST /v1/completions"]
    assert api.parent_id == "" and gen.parent_id == api.span_id  # a root: no caller
    assert got["route"].attributes["conveyor.stages"] == ["generate"]  # short: on decode
    assert gen.resource["conveyor.pool"] == "decode"
    assert api.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 6
    assert gen.attributes["gen_ai.usage.output_tokens"] == 6
    assert api.attributes["gen_ai.response.finish_reasons"] == ["length"]
    # the span lasts until the stream's last event is out
    assert (
        api.attributes["gen_ai.latency.e2e"] >= api.attributes["gen_ai.latency.time_to_first_token"]
    )


def test_an_unsampled_caller_gets_no_spans_and_a_bad_request_no_stage(traced: Traced) -> None:
    unsampled, caller = _ids()
    r = traced.client().chat.completions.create(
        model=traced.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        extra_headers={"traceparent": f"00-{unsampled}-{caller}-00"},
    )  # fmt: skip
    assert r.choices[0].message.content is not None

    bad, caller2 = _ids()
    with pytest.raises(openai.BadRequestError):
        traced.client().chat.completions.create(
            model=traced.model, messages=[{"role": "user", "content": "hi"}], max_tokens=10**6,
            extra_headers={"traceparent": f"00-{bad}-{caller2}-01"},
        )  # fmt: skip
    (api,) = _spans(traced.collector, bad, {"POST /v1/chat/completions"}).values()
    assert api.attributes["http.response.status_code"] == 400
    assert api.status == 0  # a client's error is not the server span's (HTTP semconv)
    # a sampled request sent after the unsampled one: once its spans are in (the API's and
    # the worker's, exported in the order they ended), none of the other came
    later, caller3 = _ids()
    traced.client().chat.completions.create(
        model=traced.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        extra_headers={"traceparent": f"00-{later}-{caller3}-01"},
    )  # fmt: skip
    _spans(traced.collector, later, {"POST /v1/chat/completions", "route", "generate"})
    assert traced.collector.of_trace(unsampled) == []
    assert {s.name for s in traced.collector.of_trace(bad)} == {"POST /v1/chat/completions"}


def test_traces_over_grpc(traced: Traced, tmp_path: Path) -> None:
    """An API process that exports over OTLP/gRPC beside the HTTP one, on the same
    workers: its spans arrive by gRPC, the workers' by HTTP, in one trace."""
    grpc_collector = Collector()
    server, address = serve_grpc(grpc_collector)
    env = traced.env | {"CONVEYOR_OTLP_TRACES_ENDPOINT": address,
                        "CONVEYOR_OTLP_TRACES_PROTOCOL": "grpc"}  # fmt: skip
    api, url = start_api("trace-api-grpc", env, tmp_path)
    try:
        trace_id, caller = _ids()
        traced.client(url).chat.completions.create(
            model=traced.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_headers={"traceparent": f"00-{trace_id}-{caller}-01"},
        )  # fmt: skip
        got = _spans(grpc_collector, trace_id, {"POST /v1/chat/completions", "route"})
        gen = _spans(traced.collector, trace_id, {"generate"})["generate"]
        assert gen.parent_id == got["POST /v1/chat/completions"].span_id
        assert grpc_collector.requests["grpc"] >= 1 and grpc_collector.requests["http"] == 0
    finally:
        api.stop()
        server.stop(0)
