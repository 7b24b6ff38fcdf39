"""Pick the worker (and so the per-worker queue) for each stage of a request.

One Redis round trip (a Lua script) reads the pool's live workers (pruning and forgetting
dead ones), walks the KV-block index for the request's block hashes, scores every worker,
picks one and counts the request against it — atomically, so any number of API replicas
routing at once see each other's load and spread instead of stampeding onto one "best"
worker.

Modes (``CONVEYOR_ROUTER_MODE``):

``kv`` (default)
    cost(w) = overlap_weight x (prompt blocks w would still compute + blocks of prompt
    tokens already queued for prefill on w) + active decode blocks on w. The first term
    is the work ahead of this request's first token, the second the decode load it joins.
    Lowest cost wins (ties broken at random), or with a temperature > 0 a softmax over
    the normalised costs. A load guard first drops workers whose load (decode blocks +
    queued prefill blocks) exceeds ``guard_ratio`` x the mean and ``guard_min_blocks``
    above the least loaded one, so a system prompt shared by every request cannot send
    all traffic to the worker that cached it first.
    With ``router_kv_events`` off (engines that emit no KV events) the index is
    approximate: the router records its own decisions as the chosen worker's cache
    contents, forgotten after ``router_approx_ttl_s``.
``round_robin`` / ``random``
    Cache-blind baselines.

A request may pin a worker id; it then goes to that worker if it is alive in the pool.

Load, per worker, lives in the pool's hash :func:`kvbm.protocol.load_key` (fields
``<worker>:reqs|prefill|blocks``): requests routed and not finished; prompt tokens routed
and not yet prefilled; and the KV blocks (prompt + one for decoding) of requests past
their first token. A request counts as prefill work until its first token arrives, then
the API moves it to decode blocks; it gives everything back when the request ends. The
hash expires when nobody touches it, so an API process that died cannot pin load on a
worker for good.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from kvbm.index import FORGET_LUA, LOCALS_LUA, OVERLAP_LUA, PRUNE_LUA, hex_hashes, index_args
from kvbm.protocol import (
    ALL_LIVE_LUA,
    LIVE_WORKERS_LUA,
    NOW_LUA,
    alive_key,
    load_key,
    round_robin_key,
    worker_key,
    worker_queue,
)
from tasks.settings import Settings
from workers.registry import (
    QUEUE_DEPTHS_LUA,
    PoolQueues,
    WorkerInfo,
    parse_live,
    parse_queue_depths,
    queue_depths_args,
)

LOAD_TTL_S = 600
MODES = ("kv", "round_robin", "random")

_PICK_LUA = (
    LOCALS_LUA + "local lkey = ARGV[6]\n"
    "local function forget_more(wid) redis.call('HDEL', lkey, wid .. ':reqs', "
    "wid .. ':blocks', wid .. ':prefill') end\n"
    + FORGET_LUA
    + PRUNE_LUA
    + OVERLAP_LUA
    + NOW_LUA
    + """
local wprefix, rrkey, mode, approx, pin = ARGV[7], ARGV[8], ARGV[9], ARGV[10] == '1', ARGV[11]
local plen, bs = tonumber(ARGV[12]), tonumber(ARGV[13])
local weight, temp = tonumber(ARGV[14]), tonumber(ARGV[15])
local gratio, gmin, u = tonumber(ARGV[16]), tonumber(ARGV[17]), tonumber(ARGV[18])
local load_ttl, approx_ttl = tonumber(ARGV[19]), tonumber(ARGV[20])
local excluded = {}
for id in string.gmatch(ARGV[21], "[^\\n]+") do excluded[id] = true end
local hashes = {}
for i = 22, #ARGV do hashes[#hashes + 1] = ARGV[i] end

local ids = {}
for _, id in ipairs(live(now)) do if not excluded[id] then ids[#ids + 1] = id end end
if #ids == 0 then return false end
local nblocks = math.ceil(plen / bs)

local fields = {}
for _, id in ipairs(ids) do
  fields[#fields + 1] = id .. ':blocks'
  fields[#fields + 1] = id .. ':prefill'
end
local raw = redis.call('HMGET', lkey, unpack(fields))
local blocks, queued = {}, {}
for i, id in ipairs(ids) do
  blocks[id] = math.max(tonumber(raw[2 * i - 1] or '0') or 0, 0)
  queued[id] = math.max(tonumber(raw[2 * i] or '0') or 0, 0)
end

local chosen, reason, ov, best_ov = nil, mode, nil, 0
if pin ~= '' then
  if blocks[pin] == nil then return {'', 'pin_missing'} end
  chosen, reason = pin, 'pinned'
elseif mode == 'round_robin' then
  chosen = ids[(redis.call('INCR', rrkey) - 1) % #ids + 1]
elseif mode == 'random' then
  chosen = ids[math.min(math.floor(u * #ids), #ids - 1) + 1]
else
  ov = overlaps(ids, hashes, approx, now)
  local load, sum, minl = {}, 0, nil
  for _, id in ipairs(ids) do
    load[id] = blocks[id] + math.ceil(queued[id] / bs)
    sum = sum + load[id]
    if minl == nil or load[id] < minl then minl = load[id] end
    if ov[id] > best_ov then best_ov = ov[id] end
  end
  local limit = math.max(gratio * sum / #ids, minl + gmin)
  local costs, cmin, cmax, guarded = {}, nil, nil, false
  for _, id in ipairs(ids) do
    if load[id] <= limit then
      local c = weight * (nblocks - ov[id] + math.ceil(queued[id] / bs)) + blocks[id]
      costs[#costs + 1] = {id, c}
      if cmin == nil or c < cmin then cmin = c end
      if cmax == nil or c > cmax then cmax = c end
    elseif ov[id] > 0 then
      guarded = true
    end
  end
  if temp <= 0 then
    local tied = {}
    for _, e in ipairs(costs) do if e[2] == cmin then tied[#tied + 1] = e[1] end end
    chosen = tied[math.min(math.floor(u * #tied), #tied - 1) + 1]
  else
    local span, total, w = math.max(cmax - cmin, 1), 0, {}
    for i, e in ipairs(costs) do
      w[i] = math.exp(-((e[2] - cmin) / span) / temp)
      total = total + w[i]
    end
    local x, acc = u * total, 0
    chosen = costs[#costs][1]
    for i, e in ipairs(costs) do
      acc = acc + w[i]
      if x < acc then chosen = e[1]; break end
    end
  end
  if guarded and ov[chosen] < best_ov then reason = 'kv_guarded' end
end
if ov == nil then ov = overlaps({chosen}, hashes, approx, now) end

local hit = ov[chosen]
local add_blocks = nblocks + 1
local add_prefill = math.max(plen - hit * bs, 1)
redis.call('HINCRBY', lkey, chosen .. ':reqs', 1)
redis.call('HINCRBY', lkey, chosen .. ':prefill', add_prefill)
redis.call('PEXPIRE', lkey, load_ttl)
if approx and mode == 'kv' then
  for _, h in ipairs(hashes) do
    redis.call('ZADD', kva .. h, now + approx_ttl, chosen)
    redis.call('PEXPIRE', kva .. h, approx_ttl)
  end
end
local info = redis.call('GET', wprefix .. chosen) or '{}'
return {chosen, reason, info, hit, best_ov, add_blocks, add_prefill}
"""
)

# KEYS[1] the pool's load hash; ARGV: field, amount to take off (negative: to add), ...;
# ttl ms last. Never below 0.
_GIVE_BACK_LUA = """
for i = 1, #ARGV - 1, 2 do
  local n = tonumber(ARGV[i + 1])
  if n ~= 0 then
    local v = redis.call('HINCRBY', KEYS[1], ARGV[i], 0 - n)
    if v < 0 then redis.call('HSET', KEYS[1], ARGV[i], 0) end
  end
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[#ARGV]))
return 1
"""


@dataclass(slots=True)
class RouteRequest:
    """What the router needs to know of a request."""

    block_hashes: list[int]  # of the prompt's full blocks
    prompt_len: int
    pin: str | None = None  # a worker id the request must run on
    exclude: set[str] = field(default_factory=set)  # worker ids it must not run on


@dataclass(slots=True)
class RouterConfig:
    mode: str = "kv"
    kv_events: bool = True
    approx_ttl_s: float = 120.0
    overlap_weight: float = 8.0
    temperature: float = 0.0
    guard_ratio: float = 1.5
    guard_min_blocks: int = 256
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown router mode {self.mode!r}; known: {list(MODES)}")

    @classmethod
    def from_settings(cls, s: Settings) -> RouterConfig:
        return cls(
            mode=s.router_mode,
            kv_events=s.router_kv_events,
            approx_ttl_s=s.router_approx_ttl_s,
            overlap_weight=s.router_overlap_weight,
            temperature=s.router_temperature,
            guard_ratio=s.router_guard_ratio,
            guard_min_blocks=s.router_guard_min_blocks,
            block_size=s.block_size,
        )


@dataclass(slots=True)
class Route:
    pool: str
    worker_id: str
    info: dict
    reason: str = ""  # kv | kv_guarded | round_robin | random | pinned
    overlap_blocks: int = 0  # leading prompt blocks the chosen worker holds
    best_overlap_blocks: int = 0  # the most any live worker holds (kv mode)
    blocks: int = 0  # decode load once the first token is out, until released
    prefill_tokens: int = 0  # prefill load until the first token (or release)
    decoding: bool = False  # the blocks count (the first token arrived)

    @property
    def queue(self) -> str:
        return worker_queue(self.pool, self.worker_id)


class PinnedWorkerMissing(Exception):
    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.worker_id = worker_id


class Router:
    """``fast``, if given, runs the router's scripts (the pick, and the load given back
    at the first token and at the end): any object whose ``await execute(*commands)``
    returns the replies, as ``api.resp.RespConnection`` does, writing the command before
    it first yields. redis-py's asyncio client yields to the event loop first, so on a
    busy API loop every pick (one per request, before anything is sent) waited a turn."""

    def __init__(
        self, client: aioredis.Redis, config: RouterConfig | None = None, fast: Any = None
    ) -> None:
        self._r = client
        self.config = config or RouterConfig()
        self._pick = client.register_script(_PICK_LUA)
        self._give_back = client.register_script(_GIVE_BACK_LUA)
        self._live = client.register_script(LIVE_WORKERS_LUA)
        self._all_live = client.register_script(ALL_LIVE_LUA)
        self._depths = client.register_script(QUEUE_DEPTHS_LUA)
        self._fast = fast

    async def pick(self, pool: str, req: RouteRequest | None = None) -> Route | None:
        """The best live worker of ``pool`` for ``req``, already counted; ``None`` if no
        worker lives. Raises :class:`PinnedWorkerMissing` when the pinned worker is not a
        live member of ``pool``."""
        c = self.config
        req = req or RouteRequest([], 1)
        res = await self._run(
            self._pick,
            [
                alive_key(pool),
                *index_args(pool),
                load_key(pool),
                worker_key(pool, ""),
                round_robin_key(pool),
                c.mode,
                int(not c.kv_events),
                req.pin or "",
                max(req.prompt_len, 1),
                c.block_size,
                c.overlap_weight,
                c.temperature,
                c.guard_ratio,
                c.guard_min_blocks,
                random.random(),
                LOAD_TTL_S * 1000,
                int(c.approx_ttl_s * 1000),
                "\n".join(sorted(req.exclude)),
                *(hex_hashes(req.block_hashes) if c.mode == "kv" or req.pin else []),
            ],
        )
        if res is None:
            return None
        if len(res) == 2:
            raise PinnedWorkerMissing(req.pin or "")
        wid, reason, info, hit, best, blocks, prefill = res
        return Route(
            pool, _str(wid), json.loads(info), _str(reason), int(hit), int(best), int(blocks),
            int(prefill),
        )  # fmt: skip

    async def _run(self, script: AsyncScript, args: list, keys: tuple[str, ...] = ()) -> Any:
        """``script`` on ``keys`` and ``args``, through ``fast`` when there is one."""
        return (await self._run_all(script, [(keys, args)]))[0]

    async def _run_all(
        self, script: AsyncScript, calls: list[tuple[tuple[str, ...], list]],
        before: tuple[tuple, ...] = (),
    ) -> list[Any]:  # fmt: skip
        """``script`` once per ``(keys, args)`` of ``calls``, after the commands ``before``;
        through ``fast``, all of them in one round trip. The scripts' results, in order."""
        if not calls and not before:
            return []
        if self._fast is None:
            for command in before:
                await self._r.execute_command(*command)
            return [await script(keys=list(keys), args=args) for keys, args in calls]
        try:
            replies = await self._fast.execute(
                *before, *(("EVALSHA", script.sha, len(k), *k, *a) for k, a in calls)
            )
        except ResponseError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
            # The script cache was flushed: every EVALSHA failed alike (``before`` ran).
            return await self._fast.execute(
                *(("EVAL", script.script, len(k), *k, *a) for k, a in calls)
            )
        return replies[len(before) :]

    async def prefilled(self, route: Route) -> None:
        """The route's prompt is prefilled: its tokens no longer queue on the worker; its
        blocks count as decode load from now on."""
        if route.decoding:
            return
        route.decoding = True
        n, route.prefill_tokens = route.prefill_tokens, 0
        await self._run(
            self._give_back,
            [f"{route.worker_id}:prefill", n, f"{route.worker_id}:blocks", -route.blocks,
             LOAD_TTL_S * 1000],
            keys=(load_key(route.pool),),
        )  # fmt: skip

    async def release(self, *routes: Route, before: tuple[tuple, ...] = ()) -> None:
        """The request routed by ``routes`` is over: stop counting it. ``before``: commands
        to run first, in the same round trip (the caller's own clean-up)."""
        calls = []
        for route in routes:
            w = route.worker_id
            calls.append((
                (load_key(route.pool),),
                [f"{w}:reqs", 1, f"{w}:blocks", route.blocks if route.decoding else 0,
                 f"{w}:prefill", route.prefill_tokens, LOAD_TTL_S * 1000],
            ))  # fmt: skip
        await self._run_all(self._give_back, calls, before)
        for route in routes:
            route.prefill_tokens = 0
            route.decoding = False

    async def load(self, pool: str, worker_id: str) -> dict[str, int]:
        """What the router counts on one worker: reqs, blocks, prefill."""
        names = ("reqs", "blocks", "prefill")
        raw = await self._r.hmget(load_key(pool), [f"{worker_id}:{n}" for n in names])
        return {n: int(v or 0) for n, v in zip(names, raw, strict=True)}

    async def loads(self, pool: str) -> dict[str, dict[str, int]]:
        """Every worker's counts in ``pool`` (workers with no entry are absent)."""
        return parse_loads(await self._r.hgetall(load_key(pool)))

    async def all_live(self, routes: Iterable[Route]) -> bool:
        """Whether every routed worker is still live (one round trip)."""
        args = [a for r in routes for a in (alive_key(r.pool), r.worker_id)]
        return not args or bool(await self._run(self._all_live, args))

    async def live_workers(self, pool: str) -> list[WorkerInfo]:
        """``pool``'s live workers with their last heartbeat reports."""
        return parse_live(pool, await self._live(args=[alive_key(pool), worker_key(pool, "")]))

    async def queue_depths(self, pools: tuple[str, ...]) -> list[PoolQueues]:
        """The depths of ``pools``' queues (:func:`workers.registry.queue_depths`)."""
        return parse_queue_depths(pools, await self._depths(args=queue_depths_args(pools)))


def parse_loads(raw: dict) -> dict[str, dict[str, int]]:
    """The load hash's fields ``<worker id>:<count>`` -> {worker id: {count: value}}."""
    out: dict[str, dict[str, int]] = {}
    for k, v in raw.items():
        wid, _, name = _str(k).rpartition(":")
        out.setdefault(wid, {})[name] = int(v)
    return out


def _str(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
