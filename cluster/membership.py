"""Membership: heartbeats, liveness, declare-dead, prune.

Each worker refreshes its report (:class:`HeartbeatReport`) under
:func:`cluster.keys.worker_key` (JSON, with a TTL) and its heartbeat's expiry (Redis's
clock) as its score in the pool's ZSET :func:`cluster.keys.alive_key`, which is the
pool's membership. Whether a worker is live is decided by one rule,
:data:`cluster.lua.LIVE_LUA`, for every reader. A worker whose heartbeat lapsed is
forgotten by :data:`PRUNE_LUA`, which routers run every second: its KV-index state, its
membership, its counted load (:data:`cluster.ledger.LEDGER_LUA`'s ``forget``), and the
messages stranded on its own queue move to its pool's queue.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis
import redis.asyncio as aioredis

from cluster.keys import (
    WORKER_DEATHS_CHANNEL,
    alive_key,
    index_keys,
    load_key,
    queue_owners_key,
    worker_key,
)
from cluster.ledger import LEDGER_LUA
from cluster.lua import LIVE_LUA, NOW_LUA
from cluster.queues import list_suffixes, pool_queue, worker_queue
from cluster.resp import as_str
from cluster.stats import EngineStats

log = logging.getLogger(__name__)


# ======================================================================================
# The report
# ======================================================================================
@dataclass(slots=True)
class HeartbeatReport:
    """What a worker says of itself every heartbeat; the API reads it back through this
    type (:meth:`decode`). On the wire one flat JSON object: the fields below, and the
    engine's counters (:class:`cluster.stats.EngineStats`) beside them."""

    worker_id: str
    pool: str
    host: str = ""
    ts: float = 0.0  # when it was written (time.time())
    active: int = 0  # requests running or waiting in the engine
    inflight: int = 0  # requests the worker has handed its engine and not heard end
    engine_pid: int | None = None
    stats: EngineStats = field(default_factory=EngineStats)  # the engine's counters

    _FIELDS = ("worker_id", "pool", "host", "ts", "active", "inflight", "engine_pid")

    def encode(self) -> str:
        return json.dumps({**self.stats.to_json(), **{f: getattr(self, f) for f in self._FIELDS}})

    @classmethod
    def decode(
        cls, raw: bytes | str | None, pool: str = "", worker_id: str = ""
    ) -> HeartbeatReport:
        """A report as :meth:`encode` wrote it, by this version or an older or newer one
        (``None``: it expired a moment ago; the worker's id and pool stand for it)."""
        d = json.loads(raw) if raw else {}
        known = {f: d[f] for f in cls._FIELDS if f in d}
        known.setdefault("worker_id", worker_id)
        known.setdefault("pool", pool)
        return cls(**known, stats=EngineStats.from_json(d))


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    pool: str
    report: HeartbeatReport  # its last heartbeat report

    @property
    def queue(self) -> str:
        return worker_queue(self.pool, self.worker_id)


# ======================================================================================
# Scripts
# ======================================================================================
# KEYS: report key, alive zset, queue owners set; ARGV: report, ttl ms, worker id
BEAT_LUA = (
    NOW_LUA
    + """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
redis.call('SADD', KEYS[3], ARGV[3])
return 1
"""
)

# ARGV: alive key, worker key prefix -> flat list id1, report1, id2, report2, ... of the
# pool's live workers (a report may be false if its key expired a moment earlier)
LIVE_WORKERS_LUA = (
    NOW_LUA
    + LIVE_LUA
    + """
local out = {}
for _, id in ipairs(live_ids(ARGV[1], now)) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('GET', ARGV[2] .. id)
end
return out
"""
)

# ARGV: alive key 1, worker id 1, alive key 2, worker id 2, ... -> 1 if every one is live
ALL_LIVE_LUA = (
    NOW_LUA
    + LIVE_LUA
    + """
for i = 1, #ARGV, 2 do
  if not is_live(ARGV[i], ARGV[i + 1], now) then return 0 end
end
return 1
"""
)

# Forget every worker whose heartbeat lapsed: its KV-index blocks (each tier) and batch
# number, its membership, its counted load (the ledger's rule), and the messages stranded
# on its own queue, which move to its pool's queue (oldest first, behind what the pool
# queue holds) where any live worker of the pool takes them.
# ARGV: alive, G1 / G2 / G3 worker-blocks prefixes, seq prefix, pool queue, worker queue
# prefix, load hash, then the queue's list suffixes -> the forgotten ids
PRUNE_LUA = (
    NOW_LUA
    + LEDGER_LUA
    + """
local alive, w1, w2, w3, seqk, pqueue, wqueue, lkey = unpack(ARGV, 1, 8)
local gone = redis.call('ZRANGE', alive, '-inf', now, 'BYSCORE')
for _, wid in ipairs(gone) do
  redis.call('DEL', w1 .. wid, w2 .. wid, w3 .. wid, seqk .. wid)
  redis.call('ZREM', alive, wid)
  for i = 9, #ARGV do
    local sfx = ARGV[i]
    while redis.call('LMOVE', wqueue .. wid .. sfx, pqueue .. sfx, 'RIGHT', 'LEFT') do end
  end
  forget(lkey, wid)
end
return gone
"""
)


def prune_argv(pool: str) -> list[str]:
    k = index_keys(pool)
    return [alive_key(pool), k.worker_blocks, k.host_blocks, k.disk_blocks, k.seq,
            pool_queue(pool), worker_queue(pool, ""), load_key(pool),
            *list_suffixes()]  # fmt: skip


def parse_live(pool: str, flat: list) -> list[WorkerInfo]:
    """The reply of :data:`LIVE_WORKERS_LUA` as :class:`WorkerInfo` s."""
    out = []
    for wid, raw in zip(flat[::2], flat[1::2], strict=True):
        wid = as_str(wid)
        out.append(WorkerInfo(wid, pool, HeartbeatReport.decode(raw, pool, wid)))
    return out


# ======================================================================================
# The synchronous face: workers and tools
# ======================================================================================
class Heartbeat:
    """Background thread that refreshes this worker's report and expiry every
    ``period_s``; ``report()`` gives the engine's side of it (a :class:`HeartbeatReport`
    whose active, inflight, engine_pid and stats this worker knows; its identity, host and
    time are stamped here). Without ``report`` the worker reports only that it is live."""

    def __init__(
        self,
        client: redis.Redis,
        pool: str,
        worker_id: str,
        report: Callable[[], HeartbeatReport] | None = None,
        period_s: float = 2.0,
        ttl_s: float = 10.0,
    ) -> None:
        self._r = client
        self.pool = pool
        self.worker_id = worker_id
        self._report = report
        self._period = period_s
        self._ttl_ms = int(ttl_s * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._keys = [worker_key(pool, worker_id), alive_key(pool), queue_owners_key(pool)]
        self._beat = client.register_script(BEAT_LUA)
        self._host = socket.gethostname()

    def beat(self) -> None:
        body = self._report() if self._report is not None else HeartbeatReport("", "")
        body.worker_id, body.pool = self.worker_id, self.pool
        body.host, body.ts = self._host, time.time()
        self._beat(keys=self._keys, args=[body.encode(), self._ttl_ms, self.worker_id])

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def halt(self) -> None:
        """Stop beating (the report stays until it expires or someone declares us dead)."""
        self._stop.set()
        if self._thread.ident is not None:  # started (stop may come before the first beat)
            self._thread.join(self._period + 1)

    def stop(self) -> None:
        """Stop beating and leave the pool at once (graceful shutdown)."""
        self.halt()
        try:
            pipe = self._r.pipeline(transaction=False)
            pipe.delete(self._keys[0])
            pipe.zrem(self._keys[1], self.worker_id)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not deregister worker %s", self.worker_id)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.beat()
            except redis.RedisError as e:  # keep trying; readers see us dead meanwhile
                log.warning("heartbeat failed: %s", e)


def declare_dead(client: redis.Redis, pool: str, worker_id: str) -> None:
    """Mark ``worker_id`` dead now, as if its heartbeat had lapsed (its report gone, its
    expiry in the past: routers stop picking it, the API moves its streams on, and its
    own queue's messages go back to the pool queue), rather than after ``worker_ttl_s``.
    Said by an engine process whose worker process died under it."""
    pipe = client.pipeline(transaction=True)
    pipe.delete(worker_key(pool, worker_id))
    pipe.zadd(alive_key(pool), {worker_id: 1}, xx=True)
    pipe.publish(WORKER_DEATHS_CHANNEL, worker_id)  # the APIs' streams move on at once
    pipe.execute()


def live_workers(client: redis.Redis, pool: str) -> list[WorkerInfo]:
    """The live workers of ``pool`` with their last reports (one round trip)."""
    flat = client.eval(LIVE_WORKERS_LUA, 0, alive_key(pool), worker_key(pool, ""))
    return parse_live(pool, flat)


def prune(client: redis.Redis, pool: str) -> list[str]:
    """Forget ``pool``'s dead workers (:data:`PRUNE_LUA`); their ids."""
    return [as_str(w) for w in client.eval(PRUNE_LUA, 0, *prune_argv(pool))]


# ======================================================================================
# The asynchronous face: routers and the API
# ======================================================================================
class Membership:
    """Liveness reads and the prune, on an asyncio client."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._live = client.register_script(LIVE_WORKERS_LUA)
        self._all_live = client.register_script(ALL_LIVE_LUA)
        self._prune = client.register_script(PRUNE_LUA)

    async def live_workers(self, pool: str) -> list[WorkerInfo]:
        """``pool``'s live workers with their last heartbeat reports."""
        return parse_live(pool, await self._live(args=[alive_key(pool), worker_key(pool, "")]))

    async def all_live(self, workers: Iterable[tuple[str, str]]) -> bool:
        """Whether every (pool, worker id) is still live (one round trip)."""
        args = [a for pool, wid in workers for a in (alive_key(pool), wid)]
        return not args or bool(await self._all_live(args=args))

    async def prune(self, pool: str) -> list[str]:
        """Forget ``pool``'s dead workers; their ids."""
        return [as_str(w) for w in await self._prune(args=prune_argv(pool))]
