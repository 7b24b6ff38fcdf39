"""A failed worker loses no accepted request silently: a request whose worker dies before
answering is sent to another worker; one whose worker dies mid-stream ends at once with a
clear error instead of hanging until the timeout."""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import redis

from cluster.keys import alive_key, load_key, worker_key
from cluster.membership import Heartbeat, declare_dead, live_workers
from cluster.queues import pool_queue, worker_queue
from kvbm.protocol import Sampling, StagePayload, cancelled_key, tokens_channel
from tasks.app import app, declare_queues, queue
from tasks.pipeline import Plan, build_chain
from tasks.router import Route
from tests.integration.conftest import (
    base_env,
    celery_at,
    celery_events,
    start_api,
    start_redis,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _worker_and_api(redis_url: str, model_dir: Path, logdir: Path, wid: str):  # type: ignore[no-untyped-def]
    """One real generate worker and an API in front of it, once the worker is live."""
    env = base_env(redis_url, model_dir)
    worker = start_worker(f"w-{wid}", "generate", wid, env, logdir)
    with stop_on_error(worker):
        api, url = start_api(f"api-{wid}", env, logdir)
    with stop_on_error(worker, api):
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "worker", [worker])
    return worker, api, url


def _long_stream(url: str, model: str, max_tokens: int, stream_options: dict | None = None):  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    return client.completions.create(
        model=model,
        prompt="hello",
        max_tokens=max_tokens,
        stream=True,
        stream_options=stream_options if stream_options is not None else openai.NOT_GIVEN,
        extra_body={"ignore_eos": True},
    )


@pytest.mark.parametrize("death", ["heartbeat_lapses", "declared"])
def test_request_redispatched_when_worker_dies_before_answering(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path, death: str
) -> None:
    """A worker that registered and then froze: the real one looks busy, so the router
    picks the frozen one. "declared": its death is announced (as its engine process does
    when its worker process dies) and the API re-sends the request at once.
    "heartbeat_lapses": nobody says so; 3 s later its heartbeat lapses and whichever comes
    first recovers the request: the API's liveness check (it re-sends the request) or a
    router's prune (it moves the stranded message to the pool's queue, where the live
    worker runs it). Either way it runs once and completes."""
    r = redis.Redis.from_url(fresh_db)
    env = base_env(fresh_db, tiny_model_dir)
    worker = start_worker("w-real", "generate", "zzz-real", env, tmp_path)
    with stop_on_error(worker):
        wait_for(lambda: [w.worker_id for w in live_workers(r, "generate")] == ["zzz-real"], 60,
                 "the real worker", [worker])  # fmt: skip
    # the frozen worker and the real one's load are in Redis before the API starts, so its
    # router's first view holds them (no waiting for a refresh of the view)
    Heartbeat(r, "generate", "aaa-hung", ttl_s=60.0).beat()
    r.hset(load_key("generate"), "zzz-real:blocks", 10_000)
    with stop_on_error(worker):
        api, url = start_api("api-failover", env, tmp_path)
    watcher: threading.Thread | None = None
    try:
        stranded = worker_queue("generate", "aaa-hung")
        at_hung = threading.Event()

        def watch() -> None:  # the request waits in the frozen worker's queue ...
            wait_for(lambda: r.llen(stranded) == 1, 10, "the request at the frozen worker")
            at_hung.set()
            if death == "declared":  # ... then its death is announced
                declare_dead(r, "generate", "aaa-hung")
            else:  # ... or its last heartbeat lapses, 3 s from now
                Heartbeat(r, "generate", "aaa-hung", ttl_s=3.0).beat()

        watcher = threading.Thread(target=watch)
        watcher.start()
        t0 = time.monotonic()
        out = openai.OpenAI(base_url=f"{url}/v1", api_key="x").completions.create(
            model=tiny_model_dir.name,
            prompt="hello",
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        took = time.monotonic() - t0
        assert out.usage.completion_tokens == 5
        # the request went to the frozen worker: what follows tests a failover
        assert at_hung.is_set(), "the router never sent the request to the frozen worker"
        assert took < (10 if death == "heartbeat_lapses" else 3), took
        redispatched = _metric(url, "conveyor_requests_redispatched_total")
        if death == "declared" or redispatched:
            assert redispatched == 1
            # the lost attempt does not stay stranded: the router prunes the dead worker,
            # its message moves to the pool's queue, and the live worker skips it
            wait_for(lambda: r.llen(stranded) == 0 and r.llen(pool_queue("generate")) == 0,
                     10, "the stranded attempt moved")  # fmt: skip
            skipped = (
                f"[{out.id}] cancelled before it started",
                f"[{out.id}] abandoned before it started",
            )  # begun on receipt, or not
            wait_for(lambda: any(s in worker.log.read_text() for s in skipped), 10,
                     "the moved attempt skipped", [worker])  # fmt: skip
            ran = f"[{out.id}.r1] length: "
        else:  # a prune moved the message first: the original ran on the live worker
            assert r.llen(stranded) == 0
            ran = f"[{out.id}] length: "
        wait_for(lambda: worker.log.read_text().count(ran) == 1, 10, "the one run", [worker])
    finally:
        if watcher is not None:
            watcher.join(15)
        api.stop()
        worker.stop()
        r.flushdb()


def _payload(request_id: str, model: str, prompt: list[int], max_tokens: int) -> StagePayload:
    sampling = Sampling(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return StagePayload(request_id=request_id, model=model, prompt_token_ids=prompt,
                        sampling=sampling, created=time.time())  # fmt: skip


def test_a_redelivered_task_of_an_abandoned_request_is_skipped(
    redis_url: str, fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """docs/operations.md: "Abandoned requests are marked in Redis, so a task the broker redelivers
    later is skipped." A generate task, sent as the API sends it, for a request the API is
    done with (its cancelled key set) comes back to a worker's own queue by kombu's own
    redelivery (a consumer took it and went away without acking it). The worker acks it
    without running it: its engine never sees the prompt and nothing is streamed for it,
    while a request sent after it is served."""
    r = redis.Redis.from_url(fresh_db)
    wid, model = "redelivered", tiny_model_dir.name
    q = worker_queue("generate", wid)
    plan = Plan(steps=[("generate", Route("generate", wid, {}))])
    abandoned = _payload("cmpl-abandoned", model, [1] + [7 + i % 300 for i in range(99)], 50)
    control = _payload("cmpl-control", model, [1] + [11 + i % 200 for i in range(39)], 6)
    listen = r.pubsub()
    worker = None
    celery_at(fresh_db)
    try:
        declare_queues([q])
        r.set(cancelled_key(abandoned.request_id), 1, ex=3600)  # as the API's clean-up does
        build_chain(plan, abandoned).apply_async()
        with app.connection_for_write() as conn:  # taken, never acked: kombu puts it back
            channel = conn.channel()
            taken = queue(q)(channel).get(no_ack=False)
            assert taken is not None and taken.headers["id"] == abandoned.request_id
            channel.close()
        waiting = [json.loads(m) for m in r.lrange(q, 0, -1)]
        assert [m["headers"]["id"] for m in waiting] == [abandoned.request_id]
        assert waiting[0]["headers"]["redelivered"] is True and r.hlen("unacked") == 0

        listen.subscribe(tokens_channel(abandoned.request_id), tokens_channel(control.request_id))
        listen.psubscribe(celery_events(fresh_db))
        worker = start_worker("w-redelivered", "generate", wid,
                              base_env(fresh_db, tiny_model_dir), tmp_path)  # fmt: skip
        frames: dict[str, list[dict]] = {abandoned.request_id: [], control.request_id: []}
        done: dict[str, str] = {}  # request id -> the result its task-succeeded event shows

        def read(until: Callable[[], bool], timeout: float, what: str) -> None:
            deadline = time.monotonic() + timeout
            while not until():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                assert worker.popen.poll() is None, worker.tail()
                msg = listen.get_message(timeout=0.2)
                if msg is None or msg["type"] not in ("message", "pmessage"):
                    continue
                rid = msg["channel"].decode().removeprefix(tokens_channel(""))
                if rid in frames:
                    frames[rid].append(json.loads(msg["data"]))
                    continue
                body = json.loads(base64.b64decode(json.loads(msg["data"])["body"]))
                for ev in body if isinstance(body, list) else [body]:
                    if ev.get("type") == "task-succeeded":
                        done[ev["uuid"]] = ev["result"]

        read(lambda: abandoned.request_id in done, 120, "the redelivered task to end")
        assert "'finish_reason': 'abort'" in done[abandoned.request_id]
        build_chain(plan, control).apply_async()  # same worker, same engine, after it
        read(lambda: any(f.get("done") for f in frames[control.request_id]), 60, "control")
        assert frames[abandoned.request_id] == []  # nothing streamed for it ...
        served = frames[control.request_id]
        assert [f["finish_reason"] for f in served if f.get("done")] == ["length"]
        assert sum(len(f["token_ids"]) for f in served) == 6

        def report() -> dict:
            return json.loads(r.get(worker_key("generate", wid)) or "{}")

        # ... and its prompt never reached the engine: only the control request's did
        n = len(control.prompt_token_ids)
        wait_for(lambda: report()["prompt_tokens_seen"] >= n, 10, "a fresh report", [worker])
        assert report()["prompt_tokens_seen"] == n
        # both messages acked: nothing left to deliver again
        wait_for(lambda: r.llen(q) + r.hlen("unacked") == 0, 10, "acks", [worker])
    finally:
        listen.close()
        if worker is not None:
            worker.stop()
        celery_at(redis_url)
        r.flushdb()


def test_worker_killed_mid_stream_ends_stream_with_error(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    worker, api, url = _worker_and_api(fresh_db, tiny_model_dir, tmp_path, "doomed")
    try:
        stream = _long_stream(url, tiny_model_dir.name, 2000)
        got = 0
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                got += 1
                if got == 3:
                    worker.stop(signal.SIGKILL)
                    killed_at = time.monotonic()
        assert got >= 3
        assert "worker died" in str(e.value.message) or "worker_lost" in str(e.value.body)
        assert time.monotonic() - killed_at < 8  # TTL 3 s + checks, far below the 30 s timeout
    finally:
        api.stop()
        worker.stop()


def test_a_lost_broker_connection_does_not_run_a_request_twice(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Acks are late, so a worker whose broker connection drops puts the task it is
    running back on the queue, and gets it again: that second delivery waits for the run
    in progress instead of starting the request over (which made the engine fail every
    request it held)."""
    rp, rurl = start_redis(tmp_path)  # its own: the test kills broker connections
    worker, api, url = _worker_and_api(rurl, tiny_model_dir, tmp_path, "flaky")
    r = redis.Redis.from_url(rurl)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        body = dict(model=tiny_model_dir.name, prompt="hello", max_tokens=1000, temperature=0,
                    extra_body={"ignore_eos": True})  # fmt: skip
        stream = client.completions.create(**body, stream=True,
                                           stream_options={"include_usage": True})  # fmt: skip
        chunks, text, usage, reason = 0, [], None, None
        for chunk in stream:
            chunks += 1
            if chunks == 3:  # the worker's consumer loses Redis (a failover, a blip)
                # the consumer blocks in BLMPOP (tasks.broker), or BRPOP before Redis 7
                consumers = [c["id"] for c in r.client_list() if c["cmd"] in ("blmpop", "brpop")]
                assert consumers
                for cid in consumers:
                    r.client_kill_filter(_id=cid)
            if chunk.choices:
                text.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        assert reason == "length" and usage is not None and usage.completion_tokens == 1000
        log = worker.log
        wait_for(lambda: "delivered again while it runs here" in log.read_text(), 10,
                 "the redelivered task", [worker])  # fmt: skip
        assert "engine step failed" not in log.read_text()
        # both deliveries are acked once the run ends: nothing is left to redeliver
        wait_for(lambda: r.hlen("unacked") == 0 and r.llen("generate") == 0, 10, "acks")
        again = client.completions.create(**body)
        assert again.choices[0].text == "".join(text)  # the stream was one greedy run
    finally:
        api.stop()
        worker.stop()
        rp.stop()


def test_sigterm_drains_the_worker(fresh_db: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM to the worker's whole process group (as `docker stop` or a supervisor sends
    it): the worker leaves the pool at once, so no new request is routed to it, while the
    stream it holds runs to its end; its engine process is not killed under it."""
    r = redis.Redis.from_url(fresh_db)
    worker, api, url = _worker_and_api(fresh_db, tiny_model_dir, tmp_path, "drain")
    try:
        stream = _long_stream(url, tiny_model_dir.name, 1500, {"include_usage": True})
        chunks, left_while_streaming, usage, reason = 0, False, None, None
        for chunk in stream:
            chunks += 1
            if chunks == 3:
                os.killpg(worker.popen.pid, signal.SIGTERM)
            elif chunks > 3 and not left_while_streaming:
                left_while_streaming = r.zscore(alive_key("generate"), "drain") is None
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        assert reason == "length" and usage is not None and usage.completion_tokens == 1500
        assert left_while_streaming, "the worker stayed in the pool while draining"
        assert httpx.get(f"{url}/health").status_code == 503  # no live worker now
        assert worker.popen.wait(30) == 0, worker.tail()
        log = worker.log.read_text(errors="replace")
        assert "leaving pool generate" in log
        assert "exited unexpectedly" not in log and "engine process died" not in log
    finally:
        api.stop()
        worker.stop()
        r.flushdb()
