"""Pick the worker (and so the per-worker queue) for each stage of a request.

One Redis round trip (a Lua script) reads the pool's live workers, prunes dead ones, picks
the least loaded and counts the new request against it — atomically, so several API
replicas routing at once spread their requests instead of piling onto one worker. The load
is the number of requests dispatched to a worker and not yet finished; the API releases
its count when the request's stream ends. The counters expire when left untouched, so an
API process that died cannot pin load on a worker for good.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from workers.registry import POOL_SET, WORKER_KEY, worker_queue

INFLIGHT_KEY = "conveyor:inflight:{pool}:{id}"
INFLIGHT_TTL_S = 600

# KEYS[1] pool set; ARGV[1] worker key prefix; ARGV[2] inflight key prefix; ARGV[3] ttl
_PICK_LUA = """
local ids = redis.call('SMEMBERS', KEYS[1])
table.sort(ids)
local best, best_load, best_info = nil, nil, nil
for _, id in ipairs(ids) do
  local info = redis.call('GET', ARGV[1] .. id)
  if not info then
    redis.call('SREM', KEYS[1], id)
  else
    local load = tonumber(redis.call('GET', ARGV[2] .. id) or '0')
    if best_load == nil or load < best_load then
      best, best_load, best_info = id, load, info
    end
  end
end
if best == nil then return nil end
local k = ARGV[2] .. best
redis.call('INCR', k)
redis.call('EXPIRE', k, tonumber(ARGV[3]))
return {best, best_load, best_info}
"""


@dataclass(slots=True)
class Route:
    pool: str
    worker_id: str
    load_before: int
    info: dict

    @property
    def queue(self) -> str:
        return worker_queue(self.pool, self.worker_id)


class Router:
    def __init__(self, client: aioredis.Redis) -> None:
        self._r = client
        self._pick = client.register_script(_PICK_LUA)

    async def pick(self, pool: str) -> Route | None:
        """Least-loaded live worker of ``pool``, already counted; ``None`` if none lives."""
        res = await self._pick(
            keys=[POOL_SET.format(pool=pool)],
            args=[
                WORKER_KEY.format(pool=pool, id=""),
                INFLIGHT_KEY.format(pool=pool, id=""),
                INFLIGHT_TTL_S,
            ],
        )
        if res is None:
            return None
        wid, load, info = res
        wid = wid.decode() if isinstance(wid, bytes) else wid
        return Route(pool, wid, int(load), json.loads(info))

    async def release(self, route: Route) -> None:
        """The request routed by ``route`` is over: stop counting it."""
        key = INFLIGHT_KEY.format(pool=route.pool, id=route.worker_id)
        n = await self._r.decr(key)
        if n < 0:  # the counter expired meanwhile; never go negative
            await self._r.set(key, 0, ex=INFLIGHT_TTL_S)

    async def all_alive(self, routes: Iterable[Route]) -> bool:
        """Whether every routed worker still heartbeats (one round trip)."""
        keys = [WORKER_KEY.format(pool=r.pool, id=r.worker_id) for r in routes]
        return not keys or await self._r.exists(*keys) == len(keys)

    async def live_count(self, pool: str) -> int:
        members = await self._r.smembers(POOL_SET.format(pool=pool))
        if not members:
            return 0
        ids = [m.decode() if isinstance(m, bytes) else m for m in members]
        vals = await self._r.mget([WORKER_KEY.format(pool=pool, id=i) for i in ids])
        return sum(v is not None for v in vals)
