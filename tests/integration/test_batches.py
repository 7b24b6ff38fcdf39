"""The Files and Batch APIs with real processes (a mock worker, the API, ``conveyor
batch-runner``) and the official openai client: a batch's output holds every request's
answer once, in OpenAI's format, a bad request's error in the error file; a batch runner
stopped mid-batch hands the batch on and the next one finishes it with no request lost or
repeated; a cancel stops a batch with what was answered so far."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tasks.batches import runners_key
from tests.integration.conftest import (
    BIN,
    Proc,
    base_env,
    free_port,
    spawn,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def env(fresh_db: str, tiny_model_dir: Path, tmp_path: Path) -> dict[str, str]:
    # ~10 ms a token: a request of 8 tokens takes ~0.1 s
    return base_env(fresh_db, tiny_model_dir, CONVEYOR_ENGINE="mock",
                    CONVEYOR_MOCK__DECODE_STEP_MS="10", CONVEYOR_MOCK__SPEEDUP="1",
                    CONVEYOR_FILES_DIR=str(tmp_path / "files"),
                    CONVEYOR_BATCH_MAX_IN_FLIGHT="2")  # fmt: skip


@pytest.fixture
def deployment(env: dict[str, str], tmp_path: Path) -> Iterator[tuple[str, Proc]]:
    worker = start_worker("batch-worker", "generate", "batch-w", env, tmp_path)
    with stop_on_error(worker):
        api, url = start_api("batch-api", env, tmp_path)
    env["CONVEYOR_BATCH_API_URL"] = url
    with stop_on_error(worker, api):
        runner = spawn("batch-runner", [str(BIN / "conveyor"), "batch-runner"], env, tmp_path)
    with stop_on_error(worker, api, runner):
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "a live worker",
                 [worker, api, runner])  # fmt: skip
        wait_for(lambda: _runners(env), 60, "a live batch runner", [runner])
    yield url, runner
    for p in (runner, api, worker):
        p.stop()


def _runners(env: dict[str, str]) -> int:
    return int(redis.Redis.from_url(env["CONVEYOR_REDIS_URL"]).zcount(
        runners_key(), int(time.time() * 1000), "+inf"))  # fmt: skip


def _jsonl(model: str, n: int, bad: tuple[int, ...] = ()) -> bytes:
    lines = []
    for i in range(n):
        body = {"model": model, "max_tokens": -1 if i in bad else 8, "temperature": 0,
                "messages": [{"role": "user", "content": f"question {i}"}]}  # fmt: skip
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}))  # fmt: skip
    return ("\n".join(lines) + "\n").encode()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _until(client: openai.OpenAI, batch_id: str, states: tuple[str, ...], timeout: float = 90):  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while (b := client.batches.retrieve(batch_id)).status not in states:
        assert time.monotonic() - t0 < timeout, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.2)
    return b


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x]


def test_a_batch_answers_every_request_once(deployment: tuple[str, Proc],
                                            tiny_model_dir: Path) -> None:  # fmt: skip
    url, _ = deployment
    c = _client(url)
    f = c.files.create(file=("in.jsonl", io.BytesIO(_jsonl(tiny_model_dir.name, 12, bad=(5,)))),
                       purpose="batch")  # fmt: skip
    assert f.purpose == "batch" and f.bytes > 0
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h", metadata={"run": "one"})  # fmt: skip
    assert b.status == "in_progress" and b.request_counts.total == 12
    done = _until(c, b.id, ("completed",))
    assert done.request_counts.completed == 11 and done.request_counts.failed == 1
    assert done.metadata == {"run": "one"}
    out, err = _lines(c, done.output_file_id), _lines(c, done.error_file_id)
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(12) if i != 5]
    for x in out:  # OpenAI's output line
        assert x["id"].startswith("batch_req_") and x["error"] is None
        assert x["response"]["status_code"] == 200
        body = x["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 8
        assert x["response"]["request_id"] == body["id"]
    (e,) = err
    assert e["custom_id"] == "req-5" and e["response"]["status_code"] == 400
    assert e["error"]["message"]
    assert [x.id for x in c.batches.list().data][0] == b.id
    with pytest.raises(openai.BadRequestError):  # a file whose lines are not requests
        bad = c.files.create(file=("x.jsonl", io.BytesIO(b"nope\n")), purpose="batch")
        c.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions",
                         completion_window="24h")  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_000000000000000000000000")


def test_a_batch_survives_a_runner_restart_and_a_cancel_keeps_what_was_answered(
    deployment: tuple[str, Proc], env: dict[str, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    url, runner = deployment
    c = _client(url)
    f = c.files.create(file=("in.jsonl", io.BytesIO(_jsonl(tiny_model_dir.name, 40))),
                       purpose="batch")  # fmt: skip
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h")  # fmt: skip
    wait_for(lambda: c.batches.retrieve(b.id).request_counts.completed >= 5, 60,
             "a few requests answered")  # fmt: skip
    runner.popen.send_signal(signal.SIGTERM)  # a warm shutdown: it hands the batch on
    assert runner.popen.wait(60) == 0
    assert not _runners(env)  # it said it left
    mid = c.batches.retrieve(b.id)
    assert mid.status == "in_progress" and mid.request_counts.completed < 40
    second = spawn("batch-runner-2", [str(BIN / "conveyor"), "batch-runner"], env, tmp_path)
    try:
        wait_for(lambda: _runners(env), 60, "the second batch runner", [second])
        done = _until(c, b.id, ("completed",))
        out = _lines(c, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(40))
        assert len({x["custom_id"] for x in out}) == len(out) == 40  # each exactly once
        assert done.request_counts.completed == 40 and done.error_file_id is None
        # a cancel: the runner stops sending, the answers so far are the output
        b2 = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")  # fmt: skip
        wait_for(lambda: c.batches.retrieve(b2.id).request_counts.completed >= 3, 60,
                 "a few requests of the second batch")  # fmt: skip
        assert c.batches.cancel(b2.id).status == "cancelling"
        stopped = _until(c, b2.id, ("cancelled",))
        kept = _lines(c, stopped.output_file_id)
        assert 3 <= len(kept) == stopped.request_counts.completed < 40
    finally:
        second.stop()


def test_a_batch_survives_a_restart_of_serve(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``conveyor serve`` stopped (SIGINT) mid-batch and started again on the same state:
    the batch completes with every request answered exactly once (its embedded Redis keeps
    an append-only file: CONVEYOR_REDIS_APPENDONLY)."""
    api_port, flower_port, redis_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_ENGINE="mock", CONVEYOR_MOCK__DECODE_STEP_MS="10",
               CONVEYOR_MOCK__SPEEDUP="1", CONVEYOR_HEARTBEAT_S="0.5",
               CONVEYOR_SERVE_STATE_DIR=str(tmp_path / "state"),
               CONVEYOR_FILES_DIR=str(tmp_path / "files"), CONVEYOR_BATCH_MAX_IN_FLIGHT="2",
               CONVEYOR_REDIS_APPENDONLY="true")  # fmt: skip
    argv = [str(BIN / "conveyor"), "serve", "--model", str(tiny_model_dir), "--port",
            str(api_port), "--flower-port", str(flower_port), "--redis-port", str(redis_port),
            "--no-flower"]  # fmt: skip
    url = f"http://127.0.0.1:{api_port}"
    c = _client(url)

    def up(name: str) -> Proc:
        serve = spawn(name, argv, env, tmp_path)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, 120,
                 "serve healthy", [serve])  # fmt: skip
        return serve

    serve = up("serve-1")
    try:
        f = c.files.create(file=("in.jsonl", io.BytesIO(_jsonl(tiny_model_dir.name, 40))),
                           purpose="batch")  # fmt: skip
        wait_for(lambda: _try_create(c, f.id) is not None, 60, "a live batch runner", [serve])
        b = _created[-1]
        wait_for(lambda: c.batches.retrieve(b.id).request_counts.completed >= 5, 60,
                 "a few requests answered", [serve])  # fmt: skip
        assert c.batches.retrieve(b.id).request_counts.completed < 40  # mid-batch
        serve.popen.send_signal(signal.SIGINT)
        assert serve.popen.wait(90) == 0, serve.tail()
        serve = up("serve-2")
        done = _until(c, b.id, ("completed",), timeout=120)
        out = _lines(c, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(40))
        assert len(out) == 40 and done.error_file_id is None, done
    finally:
        serve.stop(signal.SIGINT)


_created: list = []


def _try_create(c: openai.OpenAI, file_id: str) -> object | None:
    """Create the batch once a runner is live (503 until then)."""
    try:
        b = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")  # fmt: skip
    except openai.InternalServerError:
        return None
    _created.append(b)
    return b
