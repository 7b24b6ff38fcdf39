"""Bad input gets its documented 4xx in OpenAI's error shape; a cancelled stream frees its
KV blocks on the worker; no worker means 503; a worker that never answers means 504."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import redis

from tests.integration.conftest import Cluster, base_env, redis_db, start_api, wait_for
from workers.registry import Heartbeat

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
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
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
        _post(cluster, "/v1/completions", {"model": m, "prompt": ["a", "b"]}), 400, "prompt"
    )
    _assert_error(
        _post(cluster, "/v1/completions", {"model": m, "prompt": "x", "echo": True}), 400, "echo"
    )
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


def _blocks_used(cluster: Cluster) -> int:
    return sum(int(w["blocks_used"]) for w in cluster.worker_loads().values())


def test_cancelled_stream_frees_blocks(cluster: Cluster) -> None:
    wait_for(lambda: _blocks_used(cluster) == 0, 10, "idle workers")
    body = {
        "model": cluster.model_name,
        "prompt": "Once upon a time " * 20,
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held, not exhausted: breaking out of it would close the body
        data = 0
        while data < 5:
            data += next(lines).startswith("data:")
        # blocks are held while the stream runs
        wait_for(lambda: _blocks_used(cluster) > 0, 5, "blocks in use")
        used = _blocks_used(cluster)
    assert used > 0
    # client gone: the API cancels, the engine drops the sequence and frees its blocks
    t0 = time.monotonic()
    wait_for(lambda: _blocks_used(cluster) == 0, 10, "blocks freed after cancel")
    assert time.monotonic() - t0 < 10
    metrics = httpx.get(f"{cluster.url}/metrics").text
    line = next(
        ln for ln in metrics.splitlines() if ln.startswith("conveyor_requests_cancelled_total")
    )
    assert float(line.split()[-1]) >= 1


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


def test_no_live_worker_503(redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    url5 = redis_db(redis_url, 5)
    api, url = start_api("api-noworkers", base_env(url5, tiny_model_dir), tmp_path)
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
    redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A worker registered as alive that never consumes (hung): the client gets a timeout
    error, not a hung request — both non-stream and stream."""
    url6 = redis_db(redis_url, 6)
    r6 = redis.Redis.from_url(url6)
    Heartbeat(r6, "generate", "hung", lambda: {"host": "x"}, ttl_s=120).beat()
    env = base_env(url6, tiny_model_dir, CONVEYOR_FIRST_FRAME_TIMEOUT_S="2")
    api, url = start_api("api-hung", env, tmp_path)
    try:
        body = {"model": tiny_model_dir.name, "prompt": "hi", "max_tokens": 3}
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "timeout"
        assert time.monotonic() - t0 < 10
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=30)
        assert r.status_code == 504
        # the hung worker's queue holds the two requests nobody consumed
        assert r6.llen("generate.hung") == 2
    finally:
        api.stop()
        r6.flushdb()
