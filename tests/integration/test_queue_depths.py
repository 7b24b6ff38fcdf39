"""Queue depths from the worker registry (cluster.queues.queue_depths, tasks.queues) on a
real redis-server: which queues are listed, what they count, when a departed worker's
queue goes away. Workers are registry entries written by the real Heartbeat; messages are
pushed onto the queues' lists as kombu's Redis transport keeps them (nobody consumes them
here)."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from cluster.keys import alive_key, queue_owners_key, worker_key
from cluster.membership import Heartbeat
from cluster.queues import aqueue_depths, queue_depths, queue_lists
from tasks.modes import MODES, get_mode
from tasks.queues import format_table, snapshot

pytestmark = pytest.mark.integration


@pytest.fixture
def r(fresh_db: str) -> redis.Redis:
    return redis.Redis.from_url(fresh_db)


def beat(r: redis.Redis, pool: str, wid: str) -> Heartbeat:
    hb = Heartbeat(r, pool, wid, ttl_s=30)
    hb.beat()
    return hb


def expire(r: redis.Redis, pool: str, wid: str) -> None:
    """What a lapsed heartbeat leaves in Redis (a worker that died without leaving)."""
    r.delete(worker_key(pool, wid))
    r.zadd(alive_key(pool), {wid: 1})


def push(r: redis.Redis, queue: str, n: int, priority_list: int = 0) -> None:
    r.lpush(queue_lists(queue)[priority_list], *[f"m{i}" for i in range(n)])


def test_live_workers_queues_and_depths_with_priority_lists(r: redis.Redis) -> None:
    beat(r, "prefill", "p1")
    beat(r, "decode", "d1")
    beat(r, "decode", "d2")
    push(r, "decode.d2", 3)
    push(r, "decode.d2", 2, priority_list=3)  # kombu's priority-9 list of the same queue
    push(r, "prefill", 1)
    got = {p.pool: p for p in queue_depths(r, ("prefill", "decode"))}
    assert got["prefill"].queues == {"prefill": 1, "prefill.p1": 0}
    assert got["decode"].queues == {"decode": 0, "decode.d1": 0, "decode.d2": 5}
    assert got["decode"].total == 5 and got["prefill"].total == 1
    assert [(w.worker_id, w.live) for w in got["decode"].workers] == [("d1", True), ("d2", True)]


def test_departed_worker_is_listed_until_its_queue_is_empty(r: redis.Redis) -> None:
    beat(r, "decode", "d1")
    hb = beat(r, "decode", "d2")
    beat(r, "decode", "d3")
    push(r, "decode.d2", 2)
    hb.stop()  # d2 leaves (graceful) with 2 messages stranded in its queue
    expire(r, "decode", "d3")  # d3 dies, its queue empty
    (pool,) = queue_depths(r, ("decode",))
    assert [(w.queue, w.live, w.depth) for w in pool.workers] == [
        ("decode.d1", True, 0),
        ("decode.d2", False, 2),
    ]
    assert r.smembers(queue_owners_key("decode")) == {b"d1", b"d2"}  # d3 retired
    r.delete("decode.d2")  # moved elsewhere / consumed
    (pool,) = queue_depths(r, ("decode",))
    assert [w.queue for w in pool.workers] == ["decode.d1"]
    assert r.smembers(queue_owners_key("decode")) == {b"d1"}
    # a worker coming back under the same id is listed again from its first beat
    beat(r, "decode", "d2")
    (pool,) = queue_depths(r, ("decode",))
    assert [w.queue for w in pool.workers] == ["decode.d1", "decode.d2"]


def test_shown_pools_follow_the_mode_and_pools_in_use(r: redis.Redis) -> None:
    agg, disagg = MODES["agg"], get_mode("disagg")
    assert [p.pool for p in snapshot(r, agg)] == ["generate"]
    assert [p.pool for p in snapshot(r, disagg)] == ["prefill", "decode"]
    beat(r, "decode", "d1")  # a pool outside agg with a worker is shown too
    assert [p.pool for p in snapshot(r, agg)] == ["generate", "decode"]
    push(r, "prefill", 1)  # ... and one with messages
    assert [p.pool for p in snapshot(r, agg)] == ["generate", "decode", "prefill"]


def test_async_face_reads_the_same_snapshot(r: redis.Redis, fresh_db: str) -> None:
    beat(r, "decode", "d1")
    push(r, "decode.d1", 4)

    async def read() -> list:
        client = aioredis.Redis.from_url(fresh_db)  # r's database: the fixture's fresh_db
        try:
            return await aqueue_depths(client, ("prefill", "decode"))
        finally:
            await client.aclose()

    assert asyncio.run(read()) == queue_depths(r, ("prefill", "decode"))


def test_terminal_table(r: redis.Redis) -> None:
    beat(r, "decode", "d1")
    hb = beat(r, "decode", "d2")
    push(r, "decode.d2", 2)
    hb.stop()
    push(r, "decode", 1)
    assert format_table(snapshot(r, get_mode("disagg"))) == "\n".join([
        "POOL     QUEUE      STATE             DEPTH",
        "prefill  prefill    shared                0",
        "prefill  (total)    0 live worker(s)      0",
        "decode   decode     shared                1",
        "decode   decode.d1  live                  0",
        "decode   decode.d2  left                  2",
        "decode   (total)    1 live worker(s)      3",
    ])  # fmt: skip
