"""Worker registry in Redis: heartbeats, membership, liveness.

Each worker refreshes its report under :func:`kvbm.protocol.worker_key` (JSON, with a TTL)
and its heartbeat's expiry (Redis's clock) as its score in the pool's ZSET
:func:`kvbm.protocol.alive_key`, which is the pool's membership. Whether a worker is live
is decided by one rule, :data:`kvbm.protocol.LIVE_LUA`, for every reader: the router's
scripts, the API's health and stream checks, and :func:`live_workers` here.

Queue depths (:func:`queue_depths`): every pool's shared queue and the own queue of each
of its workers, live ones and departed ones whose queue still holds messages, in one
round trip. Every heartbeat records its worker in :func:`kvbm.protocol.queue_owners_key`;
the depth script retires a worker from it once the worker is dead and its queue empty.
Flower's broker page, ``/metrics`` and ``conveyor queues`` all read this one snapshot.
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

from kvbm.protocol import (
    LIVE_LUA,
    LIVE_WORKERS_LUA,
    NOW_LUA,
    WORKER_DEATHS_CHANNEL,
    PoolQueues,
    WorkerQueue,
    alive_key,
    pool_queue,
    queue_lists,
    queue_owners_key,
    worker_key,
    worker_queue,
)

log = logging.getLogger(__name__)

# KEYS[1] report key, KEYS[2] alive zset, KEYS[3] queue owners set; ARGV: report, ttl ms,
# worker id
_BEAT_LUA = (
    NOW_LUA
    + """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
redis.call('SADD', KEYS[3], ARGV[3])
return 1
"""
)

# ARGV: n, the n suffixes of a queue's lists (kvbm.protocol.queue_lists), then per pool:
# its shared queue, alive key, queue owners key, worker queue prefix. Returns per pool
# {shared queue depth, {worker id, 1 if live else 0, own queue depth, ...}}: the live
# workers and the dead ones whose queue holds messages; dead ones with an empty queue
# leave the owners set.
QUEUE_DEPTHS_LUA = (
    NOW_LUA
    + LIVE_LUA
    + """
local n = tonumber(ARGV[1])
local function depth(q)
  local d = 0
  for i = 2, n + 1 do d = d + redis.call('LLEN', q .. ARGV[i]) end
  return d
end
local out = {}
for i = n + 2, #ARGV, 4 do
  local okey, wprefix = ARGV[i + 2], ARGV[i + 3]
  local live, ids = {}, {}
  for _, id in ipairs(live_ids(ARGV[i + 1], now)) do live[id] = true; ids[#ids + 1] = id end
  for _, id in ipairs(redis.call('SMEMBERS', okey)) do
    if not live[id] then ids[#ids + 1] = id end
  end
  table.sort(ids)
  local ws = {}
  for _, id in ipairs(ids) do
    local d = depth(wprefix .. id)
    if live[id] or d > 0 then
      ws[#ws + 1] = id; ws[#ws + 1] = live[id] and 1 or 0; ws[#ws + 1] = d
    else
      redis.call('SREM', okey, id)
    end
  end
  out[#out + 1] = {depth(ARGV[i]), ws}
end
return out
"""
)


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    pool: str
    load: dict  # the worker's last heartbeat report

    @property
    def queue(self) -> str:
        return worker_queue(self.pool, self.worker_id)


class Heartbeat:
    """Background thread that refreshes this worker's report and expiry every ``period_s``."""

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
        self._keys = [worker_key(pool, worker_id), alive_key(pool), queue_owners_key(pool)]
        self._beat = client.register_script(_BEAT_LUA)

    def beat(self) -> None:
        body = {
            "worker_id": self.worker_id,
            "pool": self.pool,
            "host": socket.gethostname(),
            "ts": time.time(),
            **self._report(),
        }
        self._beat(keys=self._keys, args=[json.dumps(body), self._ttl_ms, self.worker_id])

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


def queue_depths_args(pools: tuple[str, ...] | list[str]) -> list[str]:
    """The ARGV of :data:`QUEUE_DEPTHS_LUA` for ``pools``."""
    suffixes = queue_lists("")
    args = [str(len(suffixes)), *suffixes]
    for p in pools:
        args += [pool_queue(p), alive_key(p), queue_owners_key(p), worker_queue(p, "")]
    return args


def parse_queue_depths(pools: tuple[str, ...] | list[str], reply: list) -> list[PoolQueues]:
    """The reply of :data:`QUEUE_DEPTHS_LUA` as one :class:`PoolQueues` per pool."""
    out = []
    for pool, (shared, flat) in zip(pools, reply, strict=True):
        ws = [
            WorkerQueue(pool, wid.decode() if isinstance(wid, bytes) else wid, bool(live), int(d))
            for wid, live, d in zip(flat[::3], flat[1::3], flat[2::3], strict=True)
        ]
        out.append(PoolQueues(pool, int(shared), ws))
    return out


def queue_depths(client: redis.Redis, pools: tuple[str, ...] | list[str]) -> list[PoolQueues]:
    """Every queue of ``pools`` with its depth (one round trip; see the module's doc)."""
    return parse_queue_depths(pools, client.eval(QUEUE_DEPTHS_LUA, 0, *queue_depths_args(pools)))


def live_workers(client: redis.Redis, pool: str) -> list[WorkerInfo]:
    """The live workers of ``pool`` with their last reports (one round trip)."""
    flat = client.eval(LIVE_WORKERS_LUA, 0, alive_key(pool), worker_key(pool, ""))
    return parse_live(pool, flat)


def parse_live(pool: str, flat: list) -> list[WorkerInfo]:
    """The reply of :data:`kvbm.protocol.LIVE_WORKERS_LUA` as :class:`WorkerInfo` s."""
    out = []
    for wid, raw in zip(flat[::2], flat[1::2], strict=True):
        wid = wid.decode() if isinstance(wid, bytes) else wid
        out.append(WorkerInfo(wid, pool, json.loads(raw) if raw else {}))
    return out
