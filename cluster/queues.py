"""The queue layout: which Celery queue reaches which workers, the Redis lists kombu keeps
a queue in, and every pool's queues with their depths in one round trip.

A pool has a shared queue (:func:`pool_queue`) every worker of it consumes, and each
worker its own (:func:`worker_queue`): the router sends there to reach exactly that
worker. kombu's Redis transport keeps a queue's messages of priority 0 in the list named
after the queue and those of priority p in ``<queue>\\x06\\x16<p>``: its default separator
and priority steps, which tasks.app leaves alone. :func:`queue_lists` is the only place
that naming is spelled; scripts get the suffixes as arguments (:func:`list_suffixes`),
and tests/unit/cluster/test_queues.py holds it to kombu's own.

Queue depths (:func:`queue_depths`): every pool's shared queue and the own queue of each
of its workers, live ones and departed ones whose queue still holds messages. Every
heartbeat records its worker in :func:`cluster.keys.queue_owners_key`; the depth script
retires a worker from it once the worker is dead and its queue empty. Flower's broker
page, ``/metrics`` and ``conveyor queues`` all read this one snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from cluster.keys import alive_key, queue_owners_key
from cluster.lua import LIVE_LUA, NOW_LUA

QUEUE_PRIORITY_SEP = "\x06\x16"
QUEUE_PRIORITY_STEPS = (0, 3, 6, 9)


def worker_queue(pool: str, worker_id: str) -> str:
    """A worker's own Celery queue: the router sends here to reach exactly this worker."""
    return f"{pool}.{worker_id}"


def pool_queue(pool: str) -> str:
    """A pool's shared Celery queue: every worker of the pool consumes it. Work bound to no
    worker goes here (a dead worker's stranded messages are moved here)."""
    return pool


def queue_lists(queue: str) -> list[str]:
    """The Redis lists that hold ``queue``'s messages: its depth is their total length."""
    return [f"{queue}{QUEUE_PRIORITY_SEP}{p}" if p else queue for p in QUEUE_PRIORITY_STEPS]


def list_suffixes() -> list[str]:
    """What :func:`queue_lists` appends to a queue's name, per list (scripts' arguments)."""
    return queue_lists("")


@dataclass(slots=True)
class WorkerQueue:
    """A worker's own queue: a live worker's, or a departed one's still holding messages."""

    pool: str
    worker_id: str
    live: bool
    depth: int  # messages waiting

    @property
    def queue(self) -> str:
        return worker_queue(self.pool, self.worker_id)


@dataclass(slots=True)
class PoolQueues:
    """The depths of one pool's queues at one moment."""

    pool: str
    shared: int  # messages in the pool's shared queue
    workers: list[WorkerQueue]

    @property
    def total(self) -> int:
        """Everything waiting for the stage: its shared queue and its workers' own."""
        return self.shared + sum(w.depth for w in self.workers)

    @property
    def queues(self) -> dict[str, int]:
        """Queue name -> depth, the shared queue first."""
        return {pool_queue(self.pool): self.shared, **{w.queue: w.depth for w in self.workers}}

    @property
    def in_use(self) -> bool:
        """Whether the pool has workers or messages (a pool outside the mode may)."""
        return bool(self.workers) or self.shared > 0


# ARGV: n, the n list suffixes of a queue (list_suffixes), then per pool: its shared
# queue, alive key, queue owners key, worker queue prefix. Returns per pool {shared queue
# depth, {worker id, 1 if live else 0, own queue depth, ...}}: the live workers and the
# dead ones whose queue holds messages; dead ones with an empty queue leave the owners set.
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


def queue_depths_args(pools: tuple[str, ...] | list[str]) -> list[str]:
    """The ARGV of :data:`QUEUE_DEPTHS_LUA` for ``pools``."""
    suffixes = list_suffixes()
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


async def aqueue_depths(client: aioredis.Redis,
                        pools: tuple[str, ...] | list[str]) -> list[PoolQueues]:  # fmt: skip
    """:func:`queue_depths` on an asyncio client."""
    reply = await client.eval(QUEUE_DEPTHS_LUA, 0, *queue_depths_args(pools))
    return parse_queue_depths(pools, reply)
