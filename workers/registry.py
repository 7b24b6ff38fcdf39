"""Worker registry in Redis: heartbeats, liveness and load.

Each worker keeps ``conveyor:worker:{pool}:{id}`` alive (a JSON load report with a TTL), is
a member of the set ``conveyor:workers:{pool}`` and has its heartbeat's expiry (Redis's
clock) in the ZSET ``conveyor:alive:{pool}``, so the router's script finds the live workers
of a pool with one range read. A worker whose key expired is dead at once for every
reader; readers prune it.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

log = logging.getLogger(__name__)

WORKER_KEY = "conveyor:worker:{pool}:{id}"
POOL_SET = "conveyor:workers:{pool}"
ALIVE_KEY = "conveyor:alive:{pool}"  # ZSET worker id -> heartbeat expiry (ms, Redis clock)

# KEYS[1] heartbeat key, KEYS[2] pool set, KEYS[3] alive zset; ARGV: body, ttl ms, id
_BEAT_LUA = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[2]), ARGV[3])
return 1
"""


def worker_queue(pool: str, worker_id: str) -> str:
    """The per-worker queue: the router sends here to reach exactly this worker."""
    return f"{pool}.{worker_id}"


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    pool: str
    load: dict

    @property
    def queue(self) -> str:
        return worker_queue(self.pool, self.worker_id)


class Heartbeat:
    """Background thread that refreshes this worker's key every ``period_s``."""

    def __init__(
        self,
        client: redis.Redis,
        pool: str,
        worker_id: str,
        report: Callable[[], dict],
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
        self._key = WORKER_KEY.format(pool=pool, id=worker_id)
        self._beat = client.register_script(_BEAT_LUA)

    def beat(self) -> None:
        body = {
            "worker_id": self.worker_id,
            "pool": self.pool,
            "host": socket.gethostname(),
            "ts": time.time(),
            **self._report(),
        }
        self._beat(
            keys=[self._key, POOL_SET.format(pool=self.pool), ALIVE_KEY.format(pool=self.pool)],
            args=[json.dumps(body), self._ttl_ms, self.worker_id],
        )

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and leave the pool at once (graceful shutdown)."""
        self._stop.set()
        if self._thread.ident is not None:  # started (stop may come before the first beat)
            self._thread.join(self._period + 1)
        try:
            pipe = self._r.pipeline(transaction=False)
            pipe.delete(self._key)
            pipe.srem(POOL_SET.format(pool=self.pool), self.worker_id)
            pipe.zrem(ALIVE_KEY.format(pool=self.pool), self.worker_id)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not deregister worker %s", self.worker_id)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.beat()
            except redis.RedisError as e:  # keep trying; readers see us dead meanwhile
                log.warning("heartbeat failed: %s", e)


def live_workers(client: redis.Redis, pool: str) -> list[WorkerInfo]:
    """Workers of ``pool`` whose heartbeat key is alive; dead members are pruned."""
    members = sorted(_str(m) for m in client.smembers(POOL_SET.format(pool=pool)))
    if not members:
        return []
    values = client.mget([WORKER_KEY.format(pool=pool, id=m) for m in members])
    live, dead = split_live(pool, members, values)
    if dead:
        client.srem(POOL_SET.format(pool=pool), *dead)
    return live


def split_live(
    pool: str, members: list[str], values: list[bytes | str | None]
) -> tuple[list[WorkerInfo], list[str]]:
    """Pair set members with their heartbeat values: (live workers, dead ids)."""
    live: list[WorkerInfo] = []
    dead: list[str] = []
    for wid, raw in zip(members, values, strict=True):
        if raw is None:
            dead.append(wid)
        else:
            live.append(WorkerInfo(wid, pool, json.loads(raw)))
    return live, dead


def _str(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
