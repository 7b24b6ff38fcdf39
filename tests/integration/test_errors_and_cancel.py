"""Bad input gets its documented 4xx in OpenAI's error shape; a cancelled stream frees its
KV blocks on the worker; no worker means 503; a worker that never answers means 504; a
worker that goes silent mid-stream ends the stream with a timeout error event."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from cluster.membership import Heartbeat
from tests.integration.conftest import (
    Cluster,
    RedisDbs,
    base_env,
    one_worker,
    start_api,
    wait_for,
)

pytestmark = pytest.mark.integration


def _post(cluster: Cluster, path: str, body: object, **kw: object) -> httpx.Response:
    return httpx.post(f"{cluster.url}{path}", json=body, timeout=30, **kw)  # type: ignore[arg-type]


def _assert_error(
    r: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def _chat(cluster: Cluster, **kw: object) -> dict:
    return {"model": cluster.model_name, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_unknown_model_404(cluster: Cluster) -> None:
    r = _post(cluster, "/v1/chat/completions", _chat(cluster, model="nope"))
    _assert_error(r, 404, "model", "model_not_found")


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": None}, "messages"),
        ({"temperature": 5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice.function.name",
        ),
        ({"stop": ["a"] * 20}, "stop"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_invalid_chat_body_400(cluster: Cluster, patch: dict, param: str) -> None:
    r = _post(cluster, "/v1/chat/completions", _chat(cluster, **patch))
    _assert_error(r, 400, param)


def test_invalid_completion_bodies_400(cluster: Cluster) -> None:
    m = cluster.model_name
    _assert_error(_post(cluster, "/v1/completions", {"model": m}), 400, "prompt")
    _assert_error(_post(cluster, "/v1/completions", {"model": m, "prompt": ""}), 400, "prompt")
    _assert_error(
        _post(cluster, "/v1/completions", {"model": m, "prompt": [1, 99999]}), 400, "prompt"
    )
    _assert_error(
        _post(cluster, "/v1/completions", {"model": m, "prompt": ["a", ""]}), 400, "prompt"
    )  # a batch with an empty prompt
    _assert_error(
        _post(cluster, "/v1/completions", {"model": m, "prompt": ["a", [1, 2]]}), 400, "prompt"
    )  # strings and token ids mixed
    _assert_error(
        _post(cluster, "/v1/completions", {"model": m, "prompt": "x", "suffix": "y"}), 400,
        "suffix",
    )  # fmt: skip
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    _assert_error(r, 400)


def test_context_window_400(cluster: Cluster) -> None:
    m = cluster.model_name
    long_prompt = [1] + [300] * 2100  # > 2048 context
    r = _post(cluster, "/v1/completions", {"model": m, "prompt": long_prompt})
    _assert_error(r, 400, "prompt", "context_length_exceeded")
    r = _post(cluster, "/v1/completions", {"model": m, "prompt": [1, 300], "max_tokens": 5000})
    _assert_error(r, 400, "max_tokens", "context_length_exceeded")


def test_body_too_large_413(cluster: Cluster) -> None:
    big = "x" * (9 * 1024 * 1024)
    r = _post(cluster, "/v1/completions", {"model": cluster.model_name, "prompt": big})
    _assert_error(r, 413, code="request_too_large")


def test_metrics_exposed(cluster: Cluster) -> None:
    cluster.client().completions.create(model=cluster.model_name, prompt="m", max_tokens=3)
    text = httpx.get(f"{cluster.url}/metrics").text
    for name in (
        "conveyor_requests_total",
        "conveyor_time_to_first_token_seconds_bucket",
        "conveyor_inter_token_latency_seconds_bucket",
        "conveyor_prompt_tokens_total",
        "conveyor_completion_tokens_total",
        "conveyor_requests_in_flight",
        'conveyor_worker_frame_publish_errors_total{pool="generate",worker="itest-w0"} 0.0',
    ):
        assert name in text, name
    ok = [
        ln
        for ln in text.splitlines()
        if ln.startswith('conveyor_requests_total{endpoint="/v1/completions",status="200"}')
    ]
    assert ok and float(ok[0].split()[-1]) >= 1


# ----------------------------------------------------------------------------------------
# Deployments without (answering) workers: separate Redis databases, same redis-server
# ----------------------------------------------------------------------------------------


def test_no_live_worker_503(fresh_db: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    api, url = start_api("api-noworkers", base_env(fresh_db, tiny_model_dir), tmp_path)
    try:
        h = httpx.get(f"{url}/health")
        assert h.status_code == 503
        assert h.json()["workers"] == {"generate": 0}
        body = {"model": tiny_model_dir.name, "prompt": "hi", "max_tokens": 3}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_live_worker"
    finally:
        api.stop()


def test_worker_that_never_answers_gives_504(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A worker registered as alive that never consumes (hung): the client gets a timeout
    error, not a hung request — both non-stream and stream."""
    r6 = redis.Redis.from_url(fresh_db)
    Heartbeat(r6, "generate", "hung", ttl_s=120).beat()
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_FIRST_FRAME_TIMEOUT_S="2")
    api, url = start_api("api-hung", env, tmp_path)
    try:
        body = {"model": tiny_model_dir.name, "prompt": "hi", "max_tokens": 3}
        for stream in (False, True):
            t0 = time.monotonic()
            r = httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=30)
            took = time.monotonic() - t0
            assert r.status_code == 504, r.text
            assert r.json()["error"]["code"] == "timeout"
            # the API's first-frame timeout (2 s) answered, not the client's own (30 s)
            assert 2 <= took < 15, took
        # the hung worker's queue holds the two requests nobody consumed
        assert r6.llen("generate.hung") == 2
    finally:
        api.stop()
        r6.flushdb()


# ----------------------------------------------------------------------------------------
# A slow deployment of its own: cancellation and the inter-frame timeout
# ----------------------------------------------------------------------------------------
STEP_MS = 20  # a decode step: a 1500-token request runs for 30 s


@pytest.fixture(scope="module")
def slow(
    redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """One worker and an API on a Redis database of their own. The worker runs the mock
    engine (the reference engine's scheduler, block pool and frame publisher; simulated
    step times) at STEP_MS a decode step, so a long request outlives every bound below;
    the API gives up on a stream silent for 2 s, and a heartbeat lasts 60 s."""
    url = redis_dbs.take(__name__)
    logdir = tmp_path_factory.mktemp("slow")
    env = base_env(url, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_MOCK__DECODE_STEP_MS=str(STEP_MS), CONVEYOR_FRAME_TIMEOUT_S="2",
                   CONVEYOR_WORKER_TTL_S="60")  # fmt: skip
    with one_worker("slow", "slow", env, tiny_model_dir, logdir) as c:
        yield c


def _blocks_used(cluster: Cluster) -> int:
    return sum(int(w["blocks_used"]) for w in cluster.worker_loads().values())


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _long_request(cluster: Cluster, stream: bool = True) -> dict:
    return {"model": cluster.model_name, "prompt": "Once upon a time", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip


def test_cancelled_stream_frees_blocks(slow: Cluster) -> None:
    """A client that goes away mid-stream: the API cancels the request, the engine drops
    it and frees its KV blocks, long before the run would have ended on its own (1500
    tokens at STEP_MS: 30 s)."""
    wait_for(lambda: _blocks_used(slow) == 0, 30, "an idle worker", slow.workers)
    cancelled = _metric(slow.url, "conveyor_requests_cancelled_total")
    with httpx.stream("POST", f"{slow.url}/v1/completions", json=_long_request(slow),
                      timeout=30) as r:  # fmt: skip
        assert r.status_code == 200
        lines = r.iter_lines()  # held, not exhausted: breaking out of it would close the body
        first = next(line for line in lines if line.startswith("data:"))
        request_id = json.loads(first.removeprefix("data:"))["id"]
        # blocks are held while the stream runs (as the worker's heartbeat reports them)
        wait_for(lambda: _blocks_used(slow) > 0, 10, "blocks in use", slow.workers)
    # client gone: unless cancelled, the run would hold its blocks ~28 s more
    wait_for(lambda: _blocks_used(slow) == 0, 10, "blocks freed by the cancel", slow.workers)
    assert _metric(slow.url, "conveyor_requests_cancelled_total") == cancelled + 1
    # the worker's own account of the run: aborted, far short of its 1500 tokens
    log = slow.workers[0].log
    pattern = re.compile(rf"\[{request_id}\] abort: \d+ prompt \+ (\d+) output tokens")
    wait_for(lambda: pattern.search(log.read_text()), 10, "the worker's log line")
    assert int(pattern.search(log.read_text())[1]) < 1000


def test_a_worker_gone_silent_mid_stream_ends_it_with_a_timeout_event(slow: Cluster) -> None:
    """CONVEYOR_FRAME_TIMEOUT_S: a stream whose worker stops sending frames mid-stream (its
    whole process tree stopped) ends with an SSE error event, code "timeout", once 2 s
    pass without a frame. The worker's heartbeat stops too, but its last one lasts 60 s:
    the liveness check (code "worker_lost") cannot be what ends it."""
    wait_for(lambda: _blocks_used(slow) == 0, 30, "an idle worker", slow.workers)
    client = slow.client(max_retries=0, timeout=60)
    body = _long_request(slow)
    stream = client.completions.create(
        model=body["model"], prompt=body["prompt"], max_tokens=body["max_tokens"],
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    worker = slow.workers[0].popen.pid
    chunks, stopped = 0, None
    try:
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                chunks += 1
                if chunks == 3:
                    os.killpg(worker, signal.SIGSTOP)
                    stopped = time.monotonic()
        assert stopped is not None, f"the stream ended after {chunks} chunks"
        silent = time.monotonic() - stopped
    finally:
        os.killpg(worker, signal.SIGCONT)
    assert e.value.body["code"] == "timeout", e.value.body
    assert 1.5 <= silent < 15, silent  # the 2 s timeout, far before the heartbeat's 60 s
    # the worker, running again, hears the cancel and frees what the request held
    wait_for(lambda: _blocks_used(slow) == 0, 20, "blocks freed", slow.workers)
