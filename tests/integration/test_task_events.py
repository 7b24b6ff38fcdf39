"""The task events a worker sends for Flower (real redis-server, real workers, real HTTP):
every request's task is seen received, started and succeeded, and each worker sends them
in batches at most once per EVENT_FLUSH_S (tasks.consumer), not a message per event."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest
import redis

from tasks.celery_ext import EVENT_FLUSH_S
from tests.integration.conftest import Cluster, celery_events

pytestmark = pytest.mark.integration

TASK_EVENTS = ("task-received", "task-started", "task-succeeded")


def _events(pubsub: redis.client.PubSub, until: float) -> list[tuple[str, list[dict]]]:
    """(channel, events) per message until ``until``: a ``task.multi`` message carries a
    list of events, any other one event."""
    out = []
    while time.monotonic() < until:
        msg = pubsub.get_message(timeout=0.1)
        if msg is None or msg["type"] != "pmessage":
            continue
        body = json.loads(base64.b64decode(json.loads(msg["data"])["body"]))
        out.append((msg["channel"].decode(), body if isinstance(body, list) else [body]))
    return out


def test_worker_task_events_arrive_for_every_request_in_batches(cluster: Cluster) -> None:
    r = redis.Redis.from_url(cluster.redis_url)
    pubsub = r.pubsub()
    pubsub.psubscribe(celery_events(cluster.redis_url))
    assert pubsub.get_message(timeout=2)["type"] == "psubscribe"

    async def run() -> list[str]:
        client = cluster.async_client()
        # requests of different lengths end at different engine steps, some ms apart:
        # one message per event (or per loop turn) without batching
        outs = await asyncio.gather(*(
            client.completions.create(model=cluster.model_name, prompt=f"events {i}",
                                      max_tokens=2 + 4 * i, temperature=0)
            for i in range(16)
        ))  # fmt: skip
        return [o.id for o in outs]

    ids = asyncio.run(run())
    messages = _events(pubsub, time.monotonic() + 1.0)  # > the batching window
    pubsub.close()

    task_msgs = [evs for ch, evs in messages if ch.endswith("task.multi")]
    seen = {(e["uuid"], e["type"]) for evs in task_msgs for e in evs if "uuid" in e}
    for rid in ids:
        for kind in TASK_EVENTS:
            assert (rid, kind) in seen, f"{kind} missing for {rid}"
    by_worker: dict[str, list[list[dict]]] = {}
    for evs in task_msgs:
        by_worker.setdefault(evs[0]["hostname"], []).append(evs)
    for host, batches in by_worker.items():
        # flushes are >= EVENT_FLUSH_S apart, and each goes out within EVENT_FLUSH_S of
        # its last event (plus a turn of its loop): n batches span about n - 2 windows
        stamps = [e["timestamp"] for evs in batches for e in evs]
        span = max(stamps) - min(stamps)
        assert len(batches) <= span / EVENT_FLUSH_S + 3, (
            f"{host}: {len(batches)} messages for {len(stamps)} events over {span:.3f}s"
        )
    # the API's task-sent events go out with each send, as before
    sent = {e["uuid"] for ch, evs in messages if ch.endswith("task.sent") for e in evs}
    assert set(ids) <= sent
