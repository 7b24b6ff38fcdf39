"""A pool's shared queue is the fallback for work bound to no live worker: the API's router
prunes dead workers every ``prune_s`` (1 s), the messages stranded on a dead worker's own
queue move to its pool's queue, and a live worker of the pool serves them (real
redis-server, real worker and API)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import redis

from cluster.keys import alive_key
from cluster.queues import pool_queue, worker_queue
from kvbm.protocol import StagePayload, TokenFrame, tokens_channel
from tasks.app import declare_queues
from tasks.pipeline import Plan, build_chain
from tasks.router import Route
from tests.integration.conftest import (
    base_env,
    celery_at,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration


def test_a_dead_workers_stranded_message_is_served_by_its_pool(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(fresh_db)
    env = base_env(fresh_db, tiny_model_dir)
    worker = start_worker("pq-worker", "generate", "pq-live", env, tmp_path)
    with stop_on_error(worker):
        api, api_url = start_api("pq-api", env, tmp_path)
    try:
        wait_for(lambda: httpx.get(f"{api_url}/health", timeout=1).status_code == 200, 90,
                 "a live worker", [worker, api])  # fmt: skip
        celery_at(fresh_db)
        ghost = Route("generate", "ghost")
        declare_queues([ghost.queue])
        payload = StagePayload(request_id="stranded-1", model=tiny_model_dir.name,
                               prompt_token_ids=[1, 40, 41, 42], created=time.time(),
                               sampling={"max_tokens": 5, "temperature": 0,
                                         "ignore_eos": True})  # fmt: skip
        sub = r.pubsub()
        sub.subscribe(tokens_channel("stranded-1"))
        build_chain(Plan([("generate", ghost)]), payload).apply_async(declare=[])
        # a worker that died holding that message: a member of the pool whose heartbeat is
        # long expired (made a member after the send, so no prune can come in between)
        assert r.llen(worker_queue("generate", "ghost")) == 1
        r.zadd(alive_key("generate"), {"ghost": 1})
        # the API's router forgets the dead worker and moves its message
        wait_for(lambda: r.zscore(alive_key("generate"), "ghost") is None, 10, "the prune",
                 [worker, api])  # fmt: skip
        assert r.llen(worker_queue("generate", "ghost")) == 0

        frames: list[TokenFrame] = []
        deadline = time.monotonic() + 30
        while not (frames and frames[-1].done) and time.monotonic() < deadline:
            msg = sub.get_message(timeout=1.0)
            if msg and msg["type"] == "message":
                frames.append(TokenFrame.decode(msg["data"]))
        assert frames and frames[-1].done, "the stranded request was never served"
        assert frames[-1].error is None and frames[-1].finish_reason == "length"
        assert frames[-1].usage is not None and frames[-1].usage.completion_tokens == 5
        assert [f.seq for f in frames] == list(range(len(frames)))
        assert r.llen(pool_queue("generate")) == 0
        log = json.dumps(worker.log.read_text())
        assert "stranded-1" in log
    finally:
        api.stop()
        worker.stop()
        r.flushdb()
