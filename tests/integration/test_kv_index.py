"""The KV-block index (workers' sets and the pool's event stream in Redis, each router's
local index) and the router (local scoring, the commit script), on a real redis-server.

Workers here are registry entries (written by the real :class:`cluster.membership.Heartbeat`)
and event batches applied by the real publisher or index code; what is under test — the
Lua scripts, the followers and the cost model — runs for real.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import redis
import redis.asyncio as aioredis

from api.resp import RespConnection
from cluster.index import APPLY_LUA, KVIndex, apply_argv
from cluster.keys import alive_key, index_keys, load_key, worker_key
from cluster.ledger import COUNTED, DEAD, GUARDED, Ledger, parse_loads
from cluster.membership import Heartbeat
from kvbm.block_pool import BlockPool
from kvbm.events import KVEventPublisher
from kvbm.protocol import G1, G2, G3, block_hashes
from tasks.router import PinnedWorkerMissing, Router, RouterConfig, RouteRequest
from tests.integration.conftest import async_wait_for, wait_for
from workers.stream import FramePublisher

pytestmark = pytest.mark.integration

POOL = "generate"
BS = 16


@pytest.fixture
def db(fresh_db: str) -> str:
    return fresh_db


def register(url: str, *ids: str, ttl_s: float = 30.0, pool: str = POOL) -> None:
    r = redis.Redis.from_url(url)
    for wid in ids:
        Heartbeat(r, pool, wid, ttl_s=ttl_s).beat()


def kill(url: str, wid: str) -> None:
    """The worker's heartbeat expires (it died): what a lapsed TTL leaves in Redis."""
    r = redis.Redis.from_url(url)
    r.delete(worker_key(POOL, wid))
    r.zadd(alive_key(POOL), {wid: 1})


def index(url: str) -> KVIndex:
    return KVIndex(redis.Redis.from_url(url), POOL)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 400 + 50 for i in range(n)]


def pick(url: str, req: RouteRequest, n: int = 1, fast: bool = False, **cfg: object) -> list[str]:
    """``fast``: the pick script through api.resp.RespConnection, as the API runs it."""

    async def go() -> list[str]:
        client = aioredis.Redis.from_url(url)
        conn = RespConnection(url) if fast else None
        router = Router(client, RouterConfig(block_size=BS, **cfg), fast=conn)  # type: ignore[arg-type]
        out = []
        try:
            for _ in range(n):
                route = await router.pick(POOL, req)
                assert route is not None
                out.append(route.worker_id)
        finally:
            await router.aclose()
            await client.aclose()
            if conn is not None:
                conn.close()
        return out

    return asyncio.run(go())


# ---------------------------------------------------------------------------------------
# The index
# ---------------------------------------------------------------------------------------
def test_overlap_is_the_prefix_each_worker_holds(db: str) -> None:
    register(db, "a", "b", "c")
    idx = index(db)
    h = list(range(100, 110))
    assert idx.apply("a", 0, [("cleared", []), ("stored", h[:6])]).status == 1
    assert idx.apply("b", 0, [("stored", h[:3])]).status == 1
    assert idx.overlaps(h) == {"a": 6, "b": 3, "c": 0}
    # interleaved: a evicts its tail (blocks 4, 5), b grows to 7, c caches another branch
    assert idx.apply("a", 1, [("removed", [h[5], h[4]])]).status == 1
    assert idx.apply("b", 1, [("stored", h[3:7])]).status == 1
    assert idx.apply("c", 0, [("stored", [h[0], 555, 556])]).status == 1
    assert idx.overlaps(h) == {"a": 4, "b": 7, "c": 1}
    # a evicts everything and caches the prompt again, deeper than before
    assert idx.apply("a", 2, [("removed", h[:4]), ("stored", h[:9])]).status == 1
    assert idx.overlaps(h) == {"a": 9, "b": 7, "c": 1}
    assert idx.overlaps(h[:5]) == {"a": 5, "b": 5, "c": 1}
    assert idx.overlaps([999] + h) == {"a": 0, "b": 0, "c": 0}
    assert idx.holders(h[2]) == {"a", "b"}
    assert idx.worker_blocks("c") == {h[0], 555, 556}


def test_overlap_by_bisection_equals_a_block_by_block_walk(db: str) -> None:
    """Many workers, each holding a prefix of its own length: the bisection finds every
    one exactly, including 0 and the full length."""
    ids = [f"w{i:02d}" for i in range(40)]
    register(db, *ids)
    idx = index(db)
    h = list(range(1000, 1000 + 97))
    depth = {wid: (i * 37) % 98 for i, wid in enumerate(ids)}
    for wid in ids:
        idx.apply(wid, 0, [("stored", h[: depth[wid]])])
    assert idx.overlaps(h) == depth


def test_duplicates_are_dropped_and_gaps_ask_for_resync(db: str) -> None:
    register(db, "a")
    idx = index(db)
    assert idx.apply("a", 0, [("stored", [1, 2])]).status == 1
    assert idx.apply("a", 1, [("stored", [3])]).status == 1
    dup = idx.apply("a", 1, [("removed", [3])])
    assert (dup.status, dup.last_seq) == (0, 1)
    assert idx.holders(3) == {"a"}  # the duplicate was not applied
    gap = idx.apply("a", 3, [("removed", [1])])
    assert (gap.status, gap.last_seq) == (-1, 1)
    assert idx.holders(1) == {"a"}
    # a batch that starts with cleared is always applied (a fresh start)
    assert idx.apply("a", 0, [("cleared", []), ("stored", [9])]).status == 1
    assert idx.worker_blocks("a") == {9}
    assert idx.holders(1) == set()


def test_a_dead_worker_stops_counting_at_once_and_is_forgotten(db: str) -> None:
    register(db, "a", "b")
    idx = index(db)
    h = [11, 12, 13]
    idx.apply("a", 0, [("stored", h)])
    idx.apply("b", 0, [("stored", h[:1])])
    kill(db, "a")
    assert idx.overlaps(h) == {"b": 1}
    assert idx.holders(h[0]) == {"b"}
    assert idx.worker_blocks("a") == set()
    r = redis.Redis.from_url(db)
    assert r.zscore(alive_key(POOL), "a") is None


def test_the_commit_reckons_redis_s_clock_from_the_view_and_checks_the_true_load(db: str) -> None:
    """Before its first view the ledger's commit reads Redis's clock in the script; after
    it, the router's reckoning (the view's ``now``) decides liveness the same way: a lapsed
    worker is refused either way. The guard's limit is checked against the worker's true
    counts in Redis, not the caller's view of them."""
    register(db, "a", "b", ttl_s=30.0)
    r = redis.Redis.from_url(db)
    r.zadd(alive_key(POOL), {"gone": int(time.time() * 1000) - 50})  # lapsed 50 ms ago

    async def go() -> list:
        client = aioredis.Redis.from_url(db)
        ledger = Ledger(client)
        out = [ledger.redis_now_ms()]  # 0: not reckoned yet, the script reads TIME
        out.append((await ledger.commit(POOL, "gone", 16)).status)
        out.append((await ledger.commit(POOL, "a", 16)).status)
        view = await ledger.view(POOL)
        out.append(view.live)
        out.append(abs(ledger.redis_now_ms() - int(r.time()[0]) * 1000) < 1500)
        out.append((await ledger.commit(POOL, "gone", 16)).status)
        # a holds 1 request and 16 prompt tokens (1 block): a limit of 0 blocks guards it,
        # a limit of 1 lets it in; b, holding nothing, passes a limit of 0
        out.append((await ledger.commit(POOL, "a", 16, limit=0)).status)
        out.append((await ledger.commit(POOL, "a", 16, limit=1)).status)
        out.append((await ledger.commit(POOL, "b", 16, limit=0)).status)
        await client.aclose()
        return out

    (before, gone0, a0, live, close, gone1, guarded, within, empty) = asyncio.run(go())
    assert before == 0 and gone0 == DEAD and a0 == COUNTED
    assert live == ["a", "b"] and close
    assert gone1 == DEAD
    assert (guarded, within, empty) == (GUARDED, COUNTED, COUNTED)
    assert parse_loads(r.hgetall(load_key(POOL))) == {
        "a": {"reqs": 2, "prefill": 32},
        "b": {"reqs": 1, "prefill": 16},
    }


def _publisher(url: str, pool: BlockPool, interval_s: float = 0.0):  # type: ignore[no-untyped-def]
    """The engine process's pair: KV events on the frame publisher's connection."""
    frames = FramePublisher(redis.Redis.from_url(url))
    pub = KVEventPublisher(frames, POOL, "w", snapshot=pool.cached_hashes,
                           interval_s=interval_s)  # fmt: skip
    return frames, pub.start()


def _cache(pool: BlockPool, hashes: list[int]) -> list[int]:
    blocks = pool.allocate(len(hashes))
    assert blocks is not None
    for b, h in zip(blocks, hashes, strict=True):
        pool.cache(b, h)
    return blocks


def test_publisher_numbers_batches_and_resyncs_after_index_loss(db: str) -> None:
    register(db, "w")
    pool = BlockPool(8, record_events=True)
    r = redis.Redis.from_url(db)
    r.sadd(index_keys(POOL).worker_blocks + "w", "dead")  # an old entry of a worker with this id
    frames, pub = _publisher(db, pool)
    try:
        wait_for(lambda: index(db).worker_blocks("w") == set(), 5, "the opening cleared")
        blocks = _cache(pool, [21, 22, 23])
        pub.publish(pool.take_events())
        wait_for(lambda: index(db).worker_blocks("w") == {21, 22, 23}, 5, "stored events")
        pool.free(blocks)
        assert pool.allocate(8) is not None  # evicts all three
        pub.publish(pool.take_events())
        wait_for(lambda: index(db).worker_blocks("w") == set(), 5, "removed events")
        # batches are numbered 0, 1, 2, ... (how many depends on how events were folded)
        assert int(r.get(index_keys(POOL).seq + "w")) == pub.batches_sent - 1 >= 2
        assert frames.wait_replies(5) and pub.errors == 0 and pub.resyncs == 0
        # Redis loses the index (restart, flush): the next batch finds a gap, and once its
        # answer is read the publisher sends cleared + a snapshot of the pool
        r.flushdb()
        register(db, "w")
        pool.free(list(range(8)))
        assert pool.allocate(1) == [0]
        pool.cache(0, 77)
        pub.publish(pool.take_events())
        assert frames.wait_replies(5)
        assert index(db).worker_blocks("w") == set()  # refused: it would skip numbers
        pub.publish([])  # the next step, events or none
        assert pub.resyncs == 1
        wait_for(lambda: index(db).worker_blocks("w") == {77}, 5, "the snapshot")
        _cache(pool, [78])
        pub.publish(pool.take_events())  # numbering goes on after the resync
        wait_for(lambda: index(db).worker_blocks("w") == {77, 78}, 5, "events after it")
        assert frames.wait_replies(5) and pub.resyncs == 1
        # the same loss when the engine goes idle: the answer is read and the index
        # repaired right away, not at the next request
        r.flushdb()
        register(db, "w")
        _cache(pool, [79])
        pub.publish(pool.take_events(), idle=True)
        assert pub.resyncs == 2  # no later publish needed
        wait_for(lambda: index(db).worker_blocks("w") == {77, 78, 79}, 5, "the idle resync")
        # a resync still owed when the worker stops: the final cleared wins over it
        r.set(index_keys(POOL).seq + "w", 0)
        _cache(pool, [80])
        pub.publish(pool.take_events())
        assert frames.wait_replies(5) and pub._resync
    finally:
        pub.close()
        frames.stop()
    assert index(db).worker_blocks("w") == set()  # close() takes the worker's entries away


def test_publisher_holds_events_for_interval_but_not_when_idle(db: str) -> None:
    register(db, "w")
    pool = BlockPool(8, record_events=True)
    frames, pub = _publisher(db, pool, interval_s=3600)
    try:
        _cache(pool, [31])
        pub.publish(pool.take_events())  # within the interval of the opening batch: held
        _cache(pool, [32])
        pub.publish(pool.take_events())
        assert frames.wait_replies(5)
        assert index(db).worker_blocks("w") == set() and pub.batches_sent == 1
        pub.publish([], idle=True)  # the engine has nothing left to run: out now, as one
        wait_for(lambda: index(db).worker_blocks("w") == {31, 32}, 5, "the held events")
        assert pub.batches_sent == 2
    finally:
        pub.close()
        frames.stop()


def test_publisher_reloads_a_flushed_script_and_survives_a_killed_connection(
    own_redis: str,
) -> None:
    db = own_redis  # SCRIPT FLUSH is server-wide
    register(db, "w")
    pool = BlockPool(8, record_events=True)
    r = redis.Redis.from_url(db)
    frames, pub = _publisher(db, pool)
    try:
        _cache(pool, [41])
        pub.publish(pool.take_events())
        assert frames.wait_replies(5)
        r.script_flush()  # EVALSHA now answers NOSCRIPT: that batch is lost
        _cache(pool, [42])
        pub.publish(pool.take_events())
        assert frames.wait_replies(5) and pub.errors == 1
        pub.publish([])  # EVAL: loads the script again, with cleared + the snapshot
        wait_for(lambda: index(db).worker_blocks("w") == {41, 42}, 5, "the snapshot")
        # the publisher's connection dies under it (a Redis restart, a proxy's timeout);
        # only that one: the session's other clients share this redis-server
        assert frames.wait_replies(5)
        frames._conn.send_command("CLIENT", "ID")
        r.client_kill_filter(_id=frames._conn.read_response())
        _cache(pool, [43])
        pub.publish(pool.take_events())  # lost with the connection, or written anew
        frames.wait_replies(5)
        pub.publish([])
        _cache(pool, [44])
        pub.publish(pool.take_events())
        wait_for(lambda: index(db).worker_blocks("w") == {41, 42, 43, 44}, 5, "all blocks")
        assert frames.wait_replies(5)
        assert frames.publish_errors + pub.errors >= 1  # the kill was noticed
    finally:
        pub.close()
        frames.stop()


# ---------------------------------------------------------------------------------------
# The router
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fast", [False, True])
def test_kv_mode_picks_the_prefix_holder_when_loads_are_equal(db: str, fast: bool) -> None:
    register(db, "a", "b", "c", "d")
    idx = index(db)
    for i, wid in enumerate("abcd"):
        idx.apply(wid, 0, [("stored", block_hashes(prompt(i, 256), BS))])
    for i, wid in enumerate("abcd"):
        req = RouteRequest(block_hashes(prompt(i, 300), BS), 300)
        assert pick(db, req, fast=fast) == [wid]
        # released right away, so loads stay equal: still the holder
        asyncio.run(_release_all(db))


@pytest.mark.parametrize("fast", [False, True])
def test_kv_mode_prefers_g1_over_g2_over_g3_over_nothing(db: str, fast: bool) -> None:
    """All else equal (loads, overlap length), a cached block weighs by the tier it would
    come from: the engine pool, then host memory, then disk, then nothing."""
    register(db, "g1", "g2", "g3", "none")
    idx = index(db)
    hs = block_hashes(prompt(7, 512), BS)
    assert idx.apply("g1", 0, [("stored", hs)]).status == 1
    assert idx.apply("g2", 0, [("stored", hs[:4]), ("stored", hs, G2)]).status == 1
    assert idx.apply("g3", 0, [("stored", hs, G3)]).status == 1
    assert idx.tier_overlaps(hs) == {
        "g1": (32, 32, 32), "g2": (4, 32, 32), "g3": (0, 0, 32), "none": (0, 0, 0),
    }  # fmt: skip
    req = RouteRequest(hs, 520)
    order = []
    for _ in range(4):
        req.exclude = set(order)
        order += pick(db, req, fast=fast)
        asyncio.run(_release_all(db))
    assert order == ["g1", "g2", "g3", "none"]
    # the weights are settings: with G3 worth as much as G1, the disk holder ties the G1
    # one and a pick falls on either
    picks = set()
    for _ in range(12):
        picks.update(pick(db, RouteRequest(hs, 520, exclude={"g2"}), fast=fast,
                          tier_weights=(1.0, 0.75, 1.0)))  # fmt: skip
        asyncio.run(_release_all(db))
    assert picks == {"g1", "g3"}


def test_tier_events_and_snapshots_in_redis(db: str) -> None:
    register(db, "w")
    idx = index(db)
    assert idx.apply("w", 0, [("cleared", []), ("stored", [1, 2]), ("stored", [2, 3], G2),
                              ("stored", [3, 4], G3)]).status == 1  # fmt: skip
    assert (idx.worker_blocks("w"), idx.worker_blocks("w", G2), idx.worker_blocks("w", G3)) == (
        {1, 2}, {2, 3}, {3, 4})  # fmt: skip
    local = idx.local()
    assert local.tiers_of("w", 2) == {G1, G2} and local.tiers_of("w", 4) == {G3}
    assert idx.apply("w", 1, [("removed", [3], G3)]).status == 1
    assert idx.worker_blocks("w", G3) == {4}
    assert idx.apply("w", 2, [("cleared", [])]).status == 1  # cleared covers every tier
    assert not (idx.worker_blocks("w") | idx.worker_blocks("w", G2) | idx.worker_blocks("w", G3))
    # a dead worker's tiers go with it
    idx.apply("w", 3, [("stored", [5], G2)])
    kill(db, "w")
    assert idx.prune() == ["w"] and idx.worker_blocks("w", G2) == set()


async def _release_all(url: str) -> None:
    r = aioredis.Redis.from_url(url)
    await r.delete(load_key(POOL))
    await r.aclose()


def test_overloaded_holder_is_guarded_and_traffic_spreads(db: str) -> None:
    register(db, "a", "b", "c", "d")
    shared = prompt(1, 512)  # a system prompt every request shares; only a caches it
    index(db).apply("a", 0, [("stored", block_hashes(shared, BS))])
    r = redis.Redis.from_url(db)
    r.hset(load_key(POOL), mapping={"a:blocks": 400, "a:reqs": 10})
    req = RouteRequest(block_hashes(shared + prompt(2, 64), BS), 576)
    picks = pick(db, req, n=12)
    assert "a" not in picks, picks
    counts = {w: picks.count(w) for w in "bcd"}
    assert all(c == 4 for c in counts.values()), counts  # least-loaded among the rest


@pytest.mark.parametrize("fast", [False, True])
def test_picks_made_at_once_in_one_router_spread_over_the_workers(db: str, fast: bool) -> None:
    """Requests that arrive together are picked while each other's commits are still on
    their way to Redis: every pick counts the ones before it, so 12 fresh prompts at once
    land 4, 4 and 4, not wherever one stale view points."""
    register(db, "a", "b", "c")

    async def go() -> list[str]:
        client = aioredis.Redis.from_url(db)
        conn = RespConnection(db) if fast else None
        router = Router(client, RouterConfig(block_size=BS), fast=conn)  # type: ignore[arg-type]
        try:
            await router.start(POOL)
            reqs = [RouteRequest(block_hashes(prompt(100 + i, 64), BS), 64) for i in range(12)]
            routes = await asyncio.gather(*(router.pick(POOL, q) for q in reqs))
            return [r.worker_id for r in routes if r is not None]
        finally:
            await router.aclose()
            await client.aclose()
            if conn is not None:
                conn.close()

    picks = asyncio.run(go())
    assert sorted(picks.count(w) for w in "abc") == [4, 4, 4], picks


def test_a_shared_prefix_does_not_pile_every_request_on_its_holder(db: str) -> None:
    """Requests that stay running accumulate decode load: after the holder takes its
    share, the cost model and the guard send the rest elsewhere (Dynamo #737, #7836)."""
    register(db, "a", "b", "c", "d")
    shared = prompt(3, 256)
    index(db).apply("a", 0, [("stored", block_hashes(shared, BS))])

    async def go() -> list[str]:
        client = aioredis.Redis.from_url(db)
        router = Router(client, RouterConfig(block_size=BS))
        picks = []
        for i in range(40):
            p = shared + prompt(100 + i, 48)
            route = await router.pick(POOL, RouteRequest(block_hashes(p, BS), len(p)))
            assert route is not None
            await router.prefilled(route)  # first token out: now decoding, still running
            picks.append(route.worker_id)
        await router.aclose()
        await client.aclose()
        return picks

    picks = asyncio.run(go())
    counts = {w: picks.count(w) for w in "abcd"}
    r = redis.Redis.from_url(db)
    loads = [int(r.hget(load_key(POOL), f"{w}:blocks") or 0) for w in "abcd"]
    assert max(loads) / (sum(loads) / 4) <= 1.5, (counts, loads)
    assert picks[0] == "a"  # with no load yet, the cache decides
    assert min(counts.values()) >= 8, counts


def _picks_at_fixed_costs(url: str, req: RouteRequest, n: int, temperature: float) -> dict:
    """How often each worker is picked in ``n`` picks, each released at once (so every
    pick sees the same costs)."""

    async def go() -> dict[str, int]:
        client = aioredis.Redis.from_url(url)
        router = Router(client, RouterConfig(block_size=BS, temperature=temperature))
        counts: dict[str, int] = {}
        try:
            for _ in range(n):
                route = await router.pick(POOL, req)
                assert route is not None
                counts[route.worker_id] = counts.get(route.worker_id, 0) + 1
                await router.release(route)
        finally:
            await client.aclose()
        return counts

    return asyncio.run(go())


def test_temperature_spreads_picks_with_probability_falling_with_cost(db: str) -> None:
    """CONVEYOR_ROUTER_TEMPERATURE: at 0 the cheapest worker always wins; above 0 picks
    are sampled (a softmax over the costs), so every worker gets some, and the cheaper a
    worker the more. Costs here: a holds the whole prompt, b half of it, c none of it
    (0, 40 and 80 at the default overlap weight). At temperature 0.5 the expected shares
    are about 67%, 25% and 9%: over 300 picks the order below fails with a probability
    under 1e-5."""
    register(db, "a", "b", "c")
    p = prompt(21, 160)  # 10 blocks
    hashes = block_hashes(p, BS)
    idx = index(db)
    idx.apply("a", 0, [("stored", hashes)])
    idx.apply("b", 0, [("stored", hashes[:5])])
    req = RouteRequest(hashes, len(p))
    assert idx.overlaps(hashes) == {"a": 10, "b": 5, "c": 0}
    assert _picks_at_fixed_costs(db, req, 300, temperature=0.0) == {"a": 300}
    counts = _picks_at_fixed_costs(db, req, 300, temperature=0.5)
    assert sum(counts.values()) == 300
    assert counts.get("a", 0) > counts.get("b", 0) > counts.get("c", 0) >= 5, counts
    assert counts["a"] <= 250, counts  # sampled, not the cheapest every time


@pytest.mark.parametrize("fast", [False, True])
def test_round_robin_random_and_pinning(own_redis: str, fast: bool) -> None:
    db = own_redis  # SCRIPT FLUSH is server-wide
    register(db, "a", "b", "c")
    req = RouteRequest(block_hashes(prompt(5, 64), BS), 64)
    if fast:  # a Redis that lost its scripts (restarted, SCRIPT FLUSH): EVAL reloads it
        redis.Redis.from_url(db).script_flush()
    assert pick(db, req, n=6, fast=fast, mode="round_robin") == ["a", "b", "c", "a", "b", "c"]
    rnd = pick(db, req, n=60, fast=fast, mode="random")
    assert set(rnd) == {"a", "b", "c"}
    pinned = RouteRequest(req.block_hashes, 64, pin="b")
    assert pick(db, pinned, n=3, fast=fast) == ["b", "b", "b"]
    with pytest.raises(PinnedWorkerMissing):
        pick(db, RouteRequest(req.block_hashes, 64, pin="zz"), fast=fast)


def test_approximate_mode_remembers_its_own_decisions_for_a_ttl(db: str) -> None:
    register(db, "a", "b", "c", "d")
    p = prompt(6, 200)
    req = RouteRequest(block_hashes(p, BS), len(p))
    first = pick(db, req, kv_events=False, approx_ttl_s=1.0)[0]
    asyncio.run(_release_all(db))
    # no events at all, yet the router sends the same prefix where it sent it before
    for _ in range(3):
        assert pick(db, req, kv_events=False, approx_ttl_s=1.0) == [first]
        asyncio.run(_release_all(db))
    time.sleep(1.2)  # the TTL's passing is what is tested: the remembered picks lapse

    async def approx_overlaps() -> dict[str, int]:  # what a router starting now counts
        client = aioredis.Redis.from_url(db)
        router = Router(client, RouterConfig(block_size=BS, kv_events=False, approx_ttl_s=1.0))
        try:
            v = await router.view(POOL)
            assert v.follower is not None
            return v.follower.index.overlaps(v.live, req.block_hashes, approx=True)
        finally:
            await router.aclose()
            await client.aclose()

    assert set(asyncio.run(approx_overlaps()).values()) == {0}  # forgotten after the TTL


_CONCURRENT_PICKER = """
import asyncio, sys
import redis.asyncio as aioredis
from tasks.router import Router, RouterConfig, RouteRequest
async def main():
    client = aioredis.Redis.from_url(sys.argv[1])
    router = Router(client, RouterConfig(block_size=16, guard_min_blocks=0))
    hashes = [int(h) for h in sys.argv[3].split(",")]
    for _ in range(int(sys.argv[2])):
        route = await router.pick("generate", RouteRequest(hashes, 16 * len(hashes) + 16))
        await router.prefilled(route)  # each stays running: decode load piles up
    await router.aclose()
    await client.aclose()
asyncio.run(main())
"""


def test_two_router_processes_never_pile_past_the_guard(db: str) -> None:
    """Two API processes routing a burst of prompts that share a prefix only worker a holds,
    at once: each scores with its own (stale) view of the others' load, and the commit
    re-checks a's true load against the guard's limit, so a takes no more than the guard
    allows (its load within ratio x the mean, plus the one request that reached it)."""
    register(db, "a", "b", "c", "d")
    shared = block_hashes(prompt(8, 512), BS)
    index(db).apply("a", 0, [("stored", shared)])
    arg = ",".join(map(str, shared))
    procs = [subprocess.Popen([sys.executable, "-c", _CONCURRENT_PICKER, db, "40", arg])
             for _ in range(2)]  # fmt: skip
    for p in procs:
        assert p.wait(60) == 0
    r = redis.Redis.from_url(db)
    reqs = [int(r.hget(load_key(POOL), f"{w}:reqs") or 0) for w in "abcd"]
    blocks = [int(r.hget(load_key(POOL), f"{w}:blocks") or 0) for w in "abcd"]
    assert sum(reqs) == 80
    per_request = len(shared) + 2  # the prompt's blocks + one to decode in
    assert blocks[0] <= 1.5 * sum(blocks) / 4 + per_request, (reqs, blocks)
    assert reqs[0] >= 2, reqs  # the holder still gets its share first


def test_a_router_starting_late_loads_the_snapshot_and_follows(db: str) -> None:
    """A replica that starts (or restarts) after events were published sees them from the
    workers' sets at once, then follows the stream; a batch it missed (a gap in that
    worker's numbers) reloads that worker alone."""
    register(db, "a", "b")
    idx = index(db)
    h = block_hashes(prompt(9, 160), BS)  # 10 blocks
    idx.apply("a", 0, [("cleared", []), ("stored", h[:6])])

    async def go() -> None:
        client = aioredis.Redis.from_url(db)
        router = Router(client, RouterConfig(block_size=BS))
        try:
            v = await router.view(POOL)
            assert v.follower is not None
            f = v.follower
            assert f.stats.snapshot_loads == 1
            assert f.index.overlaps(["a", "b"], h) == {"a": 6, "b": 0}
            route = await router.pick(POOL, RouteRequest(h, 160))
            assert route is not None and route.worker_id == "a" and route.overlap_blocks == 6
            await router.release(route)
            # a batch follows through the stream
            idx.apply("b", 0, [("cleared", []), ("stored", h)])
            await async_wait_for(lambda: f.index.overlaps(["a", "b"], h)["b"] == 10, 5,
                                 "b's 10 blocks in the index")  # fmt: skip
            # a's next batch is lost before this router reads it (trimmed away, say): the
            # store applies it, its stream entry goes to a stream nobody follows (the
            # follower's blocking read would take a real entry at once)
            r = redis.Redis.from_url(db)
            lost = apply_argv(POOL, "a", 1, [("stored", h[6:8])])
            lost[2] = "lost-entries"
            assert r.eval(APPLY_LUA, 0, *lost) == [1, 1]
            idx.apply("a", 2, [("removed", [h[7]])])
            await async_wait_for(lambda: f.stats.worker_reloads == 1, 5, "a reloaded after its gap")
            assert f.index.overlaps(["a", "b"], h) == {"a": 7, "b": 10}
            assert f.index.seq("a") == 2
        finally:
            await router.aclose()
            await client.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("fast", [False, True])
def test_release_gives_back_exactly_what_the_pick_counted(own_redis: str, fast: bool) -> None:
    """``fast``: every script through api.resp.RespConnection, as the API runs them (a
    flushed script cache included: the give-back is reloaded with EVAL), and the release
    with a command of the caller's ahead of it in the same round trip."""
    db = own_redis  # SCRIPT FLUSH is server-wide
    register(db, "a")

    async def go() -> dict:
        client = aioredis.Redis.from_url(db)
        conn = RespConnection(db) if fast else None
        router = Router(client, RouterConfig(block_size=BS), fast=conn)  # type: ignore[arg-type]
        route = await router.pick(POOL, RouteRequest([], 100))
        assert route is not None
        during = await router.ledger.load(POOL, "a")
        await router.prefilled(route)
        after_prefill = await router.ledger.load(POOL, "a")
        await client.script_flush()
        await router.release(route, before=(("SET", "test:before", 7),))
        after = await router.ledger.load(POOL, "a")
        assert await client.get("test:before") == b"7"
        await router.aclose()
        await client.aclose()
        if conn is not None:
            conn.close()
        return {"during": during, "prefilled": after_prefill, "after": after}

    out = asyncio.run(go())
    assert out["during"] == {"reqs": 1, "blocks": 0, "prefill": 100}
    # once prefilled it is decode load: ceil(100 / 16) prompt blocks + 1
    assert out["prefilled"] == {"reqs": 1, "blocks": 8, "prefill": 0}
    assert out["after"] == {"reqs": 0, "blocks": 0, "prefill": 0}
    # plain ints, not floats or bytes (1.0 == 1 would pass the comparisons above)
    assert {type(v) for d in out.values() for v in d.values()} == {int}, out


@pytest.mark.parametrize("fast", [False, True])
def test_one_release_gives_back_every_route_of_a_request(db: str, fast: bool) -> None:
    """A disaggregated request holds a prefill and a decode route: one call (one round
    trip through ``fast``) releases both pools' counts."""
    for pool in ("prefill", "decode"):
        register(db, "a", pool=pool)

    async def go() -> list[dict]:
        client = aioredis.Redis.from_url(db)
        conn = RespConnection(db) if fast else None
        router = Router(client, RouterConfig(block_size=BS), fast=conn)  # type: ignore[arg-type]
        routes = [await router.pick(pool, RouteRequest([], 40)) for pool in ("prefill", "decode")]
        assert all(r is not None for r in routes)
        during = [await router.ledger.load(pool, "a") for pool in ("prefill", "decode")]
        await router.release(*routes)  # type: ignore[arg-type]
        after = [await router.ledger.load(pool, "a") for pool in ("prefill", "decode")]
        await asyncio.wait_for(router.release(), 1.0)  # nothing picked: nothing to wait for
        await router.aclose()
        await client.aclose()
        if conn is not None:
            conn.close()
        return during + after

    during_p, during_d, after_p, after_d = asyncio.run(go())
    assert during_p["reqs"] == during_d["reqs"] == 1
    assert after_p == after_d == {"reqs": 0, "blocks": 0, "prefill": 0}


# ---------------------------------------------------------------------------------------
# The request cap (admission): checked in the commit, so it holds across API replicas
# ---------------------------------------------------------------------------------------
_CAPPED_PICKER = """
import asyncio, sys
import redis.asyncio as aioredis
from tasks.router import Router, RouterConfig, RouteRequest, WorkersBusy
async def main():
    client = aioredis.Redis.from_url(sys.argv[1])
    router = Router(client, RouterConfig(block_size=16, max_requests=int(sys.argv[2])))
    picked = busy = 0
    for i in range(int(sys.argv[3])):
        try:
            await router.pick("generate", RouteRequest([], 16 + i % 50))
            picked += 1
        except WorkersBusy:
            busy += 1
    print(picked, busy)
    await router.aclose()
    await client.aclose()
asyncio.run(main())
"""


def test_two_router_processes_never_count_a_worker_past_its_cap(db: str) -> None:
    """Two API processes (their own stale views) routing 60 requests each at 3 workers
    capped at 10: the commit refuses a worker at its cap, so exactly 30 are counted, 10 per
    worker, and every other pick raises WorkersBusy (nothing is lost between the two)."""
    register(db, "a", "b", "c")
    procs = [subprocess.Popen([sys.executable, "-c", _CAPPED_PICKER, db, "10", "60"],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    picked, busy = (sum(int(o.split()[i]) for o in outs) for i in (0, 1))
    assert (picked, busy) == (30, 90), outs
    r = redis.Redis.from_url(db)
    assert [int(r.hget(load_key(POOL), f"{w}:reqs") or 0) for w in "abc"] == [10, 10, 10]


def test_a_capped_worker_takes_requests_again_once_one_is_released(db: str) -> None:
    """At the cap a pick (a pinned one too) raises WorkersBusy without counting anything;
    a release frees one slot for one pick; a router with no cap (a worker re-routing an
    accepted request) is never refused, nor is a migrated stream (``admitted``)."""
    from tasks.router import WorkersBusy

    register(db, "a")

    async def go() -> None:
        client = aioredis.Redis.from_url(db)
        released = []
        router = Router(client, RouterConfig(block_size=BS, max_requests=2),
                        on_release=lambda: released.append(1))  # fmt: skip
        routes = [await router.pick(POOL, RouteRequest([], 20)) for _ in range(2)]
        for req in (RouteRequest([], 20), RouteRequest([], 20, pin="a")):
            with pytest.raises(WorkersBusy):
                await router.pick(POOL, req)
        assert await router.ledger.load(POOL, "a") == {"reqs": 2, "blocks": 0, "prefill": 40}
        await router.release(routes[0])  # type: ignore[arg-type]
        assert released == [1]
        assert (await router.pick(POOL, RouteRequest([], 20))) is not None
        with pytest.raises(WorkersBusy):
            await router.pick(POOL, RouteRequest([], 20))
        uncapped = Router(client, RouterConfig(block_size=BS), follow=False)
        assert (await uncapped.pick(POOL, RouteRequest([], 20))) is not None
        assert (await router.ledger.load(POOL, "a"))["reqs"] == 3
        # an accepted stream moving on (migration) is not refused by the capped router
        moving = RouteRequest([], 20, admitted=True)
        assert (await router.pick(POOL, moving)) is not None
        assert (await router.ledger.load(POOL, "a"))["reqs"] == 4
        await router.aclose()
        await client.aclose()

    asyncio.run(go())


def test_a_request_of_choices_counts_each_and_gives_them_back_one_at_a_time(db: str) -> None:
    """n choices hold n sequences: the pick counts n requests against the cap and a
    decode block for each; each choice gives its request back as it ends (release
    ``one``), the last the blocks too. More choices than the cap go to an empty worker."""
    from tasks.router import WorkersBusy

    register(db, "a")

    async def go() -> None:
        client = aioredis.Redis.from_url(db)
        router = Router(client, RouterConfig(block_size=BS, max_requests=4))
        route = await router.pick(POOL, RouteRequest([], 100, choices=3))
        assert route is not None
        assert await router.ledger.load(POOL, "a") == {"reqs": 3, "blocks": 0, "prefill": 100}
        with pytest.raises(WorkersBusy):  # 3 + 2 > 4
            await router.pick(POOL, RouteRequest([], 20, choices=2))
        await router.prefilled(route)
        blocks = -(-100 // BS) + 3  # the prompt's blocks once, one per choice to decode
        assert await router.ledger.load(POOL, "a") == {"reqs": 3, "blocks": blocks, "prefill": 0}
        for left in (2, 1):
            await router.release(route, one=True)
            assert await router.ledger.load(POOL, "a") == {"reqs": left, "blocks": blocks,
                                                    "prefill": 0}  # fmt: skip
        await router.release(route, one=True)
        assert await router.ledger.load(POOL, "a") == {"reqs": 0, "blocks": 0, "prefill": 0}
        big = await router.pick(POOL, RouteRequest([], 20, choices=6))
        assert big is not None and (await router.ledger.load(POOL, "a"))["reqs"] == 6
        with pytest.raises(WorkersBusy):
            await router.pick(POOL, RouteRequest([], 20))
        await router.release(big)  # all of it at once (a plan given up)
        assert await router.ledger.load(POOL, "a") == {"reqs": 0, "blocks": 0, "prefill": 0}
        await router.aclose()
        await client.aclose()

    asyncio.run(go())
