"""The routers' load ledger: what every router counts against each worker, shared in Redis.

Per worker, in :func:`cluster.keys.load_key`, the fields of :data:`LOAD_FIELDS` (named
``<worker id>:<field>``): requests routed and not finished; prompt tokens routed and not
yet prefilled; KV blocks (prompt + one per choice for decoding) of requests past their
first token. The pool's totals of :data:`TOTALED` fields live in
:func:`cluster.keys.load_totals_key` (the load guard's mean). Each router also keeps what
it counted in a hash of its own (:func:`cluster.keys.load_owner_key`) under a lease
(:func:`cluster.keys.load_owners_key`) renewed every prune; when an API process dies with
requests counted, its lease lapses and the other routers give its counts back.

One rule moves every count, :data:`LEDGER_LUA`'s ``shift``: a field never goes below 0,
and its pool total moves by what the field really moved (never below 0 either). The
commit, the give-back, the reclaim and the prune of a dead worker all use it.

Scripts: :data:`COMMIT_LUA` (count a request against a live worker, within the guard and
the request cap), :data:`GIVE_BACK_LUA`, :data:`RECLAIM_LUA`, :data:`VIEW_LUA` (a pool's
live workers and their counts, for a router's local view). :class:`Ledger` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from cluster.keys import alive_key, load_key, load_owner_key, load_owners_key, load_totals_key
from cluster.lua import LIVE_LUA, NOW_LUA, lua_list

LOAD_TTL_S = 600  # the load keys' TTL, renewed by every router's view refresh
LOAD_FIELDS = ("reqs", "prefill", "blocks")  # a worker's counts
TOTALED = ("prefill", "blocks")  # the counts the pool also keeps a total of
FULL, DEAD, GUARDED, COUNTED = -2, -1, 0, 1  # the commit's answers

# The one rule, generated from LOAD_FIELDS / TOTALED. shift(lkey, tkey, wid, kind, d)
# moves ``<wid>:<kind>`` of the load hash by d, clamped at 0, and the pool total of kind
# (if it has one) by what really moved; returns the field's new value and that move.
# forget(lkey, tkey, wid) gives back all of a worker's counts and drops its fields.
LEDGER_LUA = f"""
local LOAD_FIELDS = {lua_list(LOAD_FIELDS)}
local TOTALED = {{{", ".join(f"{f} = true" for f in TOTALED)}}}
local function shift(lkey, tkey, wid, kind, d)
  local f = wid .. ':' .. kind
  local v = redis.call('HINCRBY', lkey, f, d)
  local moved = d
  if v < 0 then redis.call('HSET', lkey, f, 0); moved = d - v; v = 0 end
  if moved ~= 0 and TOTALED[kind] then
    local t = redis.call('HINCRBY', tkey, kind, moved)
    if t < 0 then redis.call('HSET', tkey, kind, 0) end
  end
  return v, moved
end
local function forget(lkey, tkey, wid)
  local fs = {{}}
  for i, kind in ipairs(LOAD_FIELDS) do fs[i] = wid .. ':' .. kind end
  local v = redis.call('HMGET', lkey, unpack(fs))
  for i, kind in ipairs(LOAD_FIELDS) do
    local n = tonumber(v[i] or '0')
    if n > 0 and TOTALED[kind] then shift(lkey, tkey, wid, kind, 0 - n) end
  end
  redis.call('HDEL', lkey, unpack(fs))
end
"""

# Count a request against one worker. KEYS: load hash, load totals, alive zset, and the
# committing router's own load hash (optional). ARGV: worker, prompt tokens to queue,
# guard (0/1), guard ratio, guard min blocks, live workers, least load (blocks, as the
# caller sees it), block size, the most requests a worker may hold (0: no cap), the
# requests this one counts as (its choices: n), then in approximate mode the pool's
# stream, the decision's TTL (ms), the hex hashes (JSON) and the stream's maxlen. A
# request of more choices than the cap still goes to a worker that holds none.
# Returns {1, blocks, prefill, reqs} counted; {0, blocks, prefill, reqs} over the guard;
# {-1} dead; {-2, blocks, prefill, reqs} at the request cap.
COMMIT_LUA = (
    NOW_LUA
    + LIVE_LUA
    + LEDGER_LUA
    + """
local wid = ARGV[1]
if not is_live(KEYS[3], wid, now) then return {-1} end
local v = redis.call('HMGET', KEYS[1], wid .. ':blocks', wid .. ':prefill', wid .. ':reqs')
local b, q, n = tonumber(v[1] or '0'), tonumber(v[2] or '0'), tonumber(v[3] or '0')
local cap, k = tonumber(ARGV[9]), tonumber(ARGV[10])
if cap > 0 and n > 0 and n + k > cap then return {-2, b, q, n} end
local bs = tonumber(ARGV[8])
if ARGV[3] == '1' then
  local t = redis.call('HMGET', KEYS[2], 'blocks', 'prefill')
  local mean = (tonumber(t[1] or '0') + math.ceil(tonumber(t[2] or '0') / bs)) / tonumber(ARGV[6])
  local limit = math.max(tonumber(ARGV[4]) * mean, tonumber(ARGV[7]) + tonumber(ARGV[5]))
  if b + math.ceil(q / bs) > limit then return {0, b, q, n} end
end
local add = tonumber(ARGV[2])
n = shift(KEYS[1], KEYS[2], wid, 'reqs', k)
q = shift(KEYS[1], KEYS[2], wid, 'prefill', add)
if #KEYS > 3 then
  redis.call('HINCRBY', KEYS[4], wid .. ':reqs', k)
  redis.call('HINCRBY', KEYS[4], wid .. ':prefill', add)
end
if #ARGV > 10 then
  redis.call('XADD', ARGV[11], 'MAXLEN', '~', ARGV[14], '*', 'w', wid, 'a', ARGV[12],
             'b', ARGV[13])
end
return {1, b, q, n}
"""
)

# Take load off one worker. KEYS: load hash, load totals, and the router's own load hash
# (optional). ARGV: worker, then (field, amount) pairs. An amount below 0 adds. With the
# router's own hash, no more is taken than it still holds there: what another router gave
# back for it (its lease lapsed while it stalled) is not taken a second time.
GIVE_BACK_LUA = (
    LEDGER_LUA
    + """
local wid = ARGV[1]
for i = 2, #ARGV, 2 do
  local kind, n = ARGV[i], tonumber(ARGV[i + 1])
  local f = wid .. ':' .. kind
  if #KEYS > 2 and n > 0 then
    n = math.min(n, tonumber(redis.call('HGET', KEYS[3], f) or '0'))
  end
  if n ~= 0 then
    shift(KEYS[1], KEYS[2], wid, kind, 0 - n)
    if #KEYS > 2 then
      local o = redis.call('HINCRBY', KEYS[3], f, 0 - n)
      if o <= 0 then redis.call('HDEL', KEYS[3], f) end
    end
  end
end
return 1
"""
)

# Renew this router's lease on the load it counted in a pool (and its own hash's TTL),
# then give back the load of the routers whose lease lapsed (their API process died with
# requests counted): what each counted comes off the pool's counts and totals, as their
# releases would have done. A router whose own lease had lapsed too (Redis was away, or
# this process stalled) only renews: the others may be alive and about to renew theirs.
# KEYS: owners zset, load hash, load totals. ARGV: router id, lease ms, the owners' hash
# key prefix (+ id), ttl ms. Returns {requests given back, ids of the routers that held any}.
RECLAIM_LUA = (
    NOW_LUA
    + LEDGER_LUA
    + """
local mine = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', ARGV[3] .. ARGV[1], ARGV[4])
if not mine or tonumber(mine) <= now then return {0} end
local out = {0}
for _, o in ipairs(redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE')) do
  local h = ARGV[3] .. o
  local f = redis.call('HGETALL', h)
  if #f > 0 then out[#out + 1] = o end  -- a router that ended holding nothing: no news
  for i = 1, #f, 2 do
    local n = tonumber(f[i + 1])
    if n > 0 and redis.call('HEXISTS', KEYS[2], f[i]) == 1 then
      local wid, kind = string.match(f[i], '^(.*):(%a+)$')
      local _, moved = shift(KEYS[2], KEYS[3], wid, kind, 0 - n)
      if kind == 'reqs' then out[1] = out[1] - moved end
    end
  end
  redis.call('DEL', h)
  redis.call('ZREM', KEYS[1], o)
end
return out
"""
)

# A pool's live workers and the counts, for a router's view; renews the load keys' TTL.
# ARGV: alive zset, load hash, load totals, ttl ms -> {{total blocks, total prefill},
# {live ids (unsorted)}, {the load hash, flat}}. One HGETALL, not a read per worker: the
# hash also holds dead workers' fields until a prune, which the reader skips.
VIEW_LUA = (
    NOW_LUA
    + """
redis.call('PEXPIRE', ARGV[2], ARGV[4])
redis.call('PEXPIRE', ARGV[3], ARGV[4])
return {redis.call('HMGET', ARGV[3], 'blocks', 'prefill'),
        redis.call('ZRANGE', ARGV[1], '(' .. now, '+inf', 'BYSCORE'),
        redis.call('HGETALL', ARGV[2])}
"""
)


def load_field(worker_id: str, name: str) -> str:
    """A field of the load hash: ``name`` (one of :data:`LOAD_FIELDS`) of ``worker_id``."""
    return f"{worker_id}:{name}"


def parse_loads(raw: dict) -> dict[str, dict[str, int]]:
    """The load hash's fields ``<worker id>:<count>`` -> {worker id: {count: value}}."""
    out: dict[str, dict[str, int]] = {}
    for k, v in raw.items():
        wid, _, name = _str(k).rpartition(":")
        out.setdefault(wid, {})[name] = int(v)
    return out


@dataclass(slots=True)
class PoolLoad:
    """:data:`VIEW_LUA`'s answer: a pool's live workers (sorted) and their counts."""

    totals: list[int]  # [blocks, prefill]
    live: list[str]
    loads: dict[str, list[int]] = field(default_factory=dict)  # worker -> [blocks, prefill]
    reqs: dict[str, int] = field(default_factory=dict)  # worker -> requests


@dataclass(slots=True)
class Commit:
    """:data:`COMMIT_LUA`'s answer: the status and the worker's counts it saw (after the
    request, when counted)."""

    status: int  # COUNTED, GUARDED, DEAD or FULL
    blocks: int = 0
    prefill: int = 0
    reqs: int = 0


class Ledger:
    """The load ledger's async face, for one router (``owner``: its id, under which it
    keeps its own counts for the lease; ``None``: it keeps none, holding counts for
    moments only). ``fast``: an object whose ``await execute(*commands)`` returns the
    replies in one round trip (``api.resp.RespConnection``); the commit and the
    give-backs go through it when given (docs/performance.md, "API: commands leave
    before the first await")."""

    def __init__(self, client: aioredis.Redis, owner: str | None = None, fast: Any = None) -> None:
        self._r = client
        self.owner = owner
        self._fast = fast
        self._commit = client.register_script(COMMIT_LUA)
        self._give_back = client.register_script(GIVE_BACK_LUA)
        self._reclaim = client.register_script(RECLAIM_LUA)
        self._view = client.register_script(VIEW_LUA)

    def _keys(self, pool: str) -> tuple[str, ...]:
        own = () if self.owner is None else (load_owner_key(pool, self.owner),)
        return (load_key(pool), load_totals_key(pool), *own)

    async def commit(self, pool: str, worker_id: str, prefill: int, *, cap: int = 0,
                     choices: int = 1, guard: tuple[float, int, int, int] | None = None,
                     block_size: int = 16, decision: list | None = None) -> Commit:  # fmt: skip
        """Count a request of ``choices`` and ``prefill`` prompt tokens against
        ``worker_id`` if it is live, holds fewer than ``cap`` requests (0: no cap) and,
        with ``guard`` (ratio, min blocks, live workers, least load), is within the load
        guard by the pool's totals. ``decision``: an approximate router's stream entry
        (:func:`cluster.index.decision_args`), appended in the same script."""
        g = guard or (0.0, 0, 1, 0)
        args: list = [worker_id, prefill, int(guard is not None), g[0], g[1], g[2], g[3],
                      block_size, cap, choices, *(decision or ())]  # fmt: skip
        k = self._keys(pool)
        res = (await self._run(self._commit, [((k[0], k[1], alive_key(pool), *k[2:]), args)]))[0]
        status = int(res[0])
        if status == DEAD:
            return Commit(DEAD)
        return Commit(status, int(res[1]), int(res[2]), int(res[3]))

    def give_back_call(self, pool: str, worker_id: str,
                       amounts: dict[str, int]) -> tuple[tuple[str, ...], list]:  # fmt: skip
        """One give-back (``amounts``: field -> amount, below 0 adds), for
        :meth:`give_back`."""
        args: list = [worker_id]
        for name, n in amounts.items():
            assert name in LOAD_FIELDS, f"{name!r} is not a load field {LOAD_FIELDS}"
            if n:
                args += [name, n]
        return self._keys(pool), args

    async def give_back(self, *calls: tuple[tuple[str, ...], list],
                        before: tuple[tuple, ...] = ()) -> None:  # fmt: skip
        """The give-backs of :meth:`give_back_call`, after the commands ``before``, in one
        round trip."""
        await self._run(self._give_back, [c for c in calls if len(c[1]) > 1], before)

    async def reclaim(self, pool: str, lease_s: float) -> tuple[int, list[str]]:
        """Renew this router's lease on ``pool``; give back the counts of routers whose
        lease lapsed. Returns (requests given back, the routers that held any)."""
        assert self.owner is not None, "a ledger without an owner holds no lease"
        res = await self._reclaim(
            keys=[load_owners_key(pool), load_key(pool), load_totals_key(pool)],
            args=[self.owner, int(lease_s * 1000), load_owner_key(pool, ""), LOAD_TTL_S * 1000],
        )  # fmt: skip
        return int(res[0]), [_str(o) for o in res[1:]]

    async def view(self, pool: str) -> PoolLoad:
        """``pool``'s live workers (sorted) and what is counted on each."""
        tot, ids, flat = await self._view(
            args=[alive_key(pool), load_key(pool), load_totals_key(pool), LOAD_TTL_S * 1000]
        )
        live = sorted(_str(w) for w in ids)
        out = PoolLoad([int(tot[0] or 0), int(tot[1] or 0)], live)
        loads, reqs = out.loads, out.reqs
        for w in live:
            loads[w] = [0, 0]
            reqs[w] = 0
        for i in range(0, len(flat), 2):
            wid, _, name = _str(flat[i]).rpartition(":")
            cur = loads.get(wid)
            if cur is None:
                continue  # a dead worker's, until the prune
            if name == "blocks":
                cur[0] = int(flat[i + 1])
            elif name == "prefill":
                cur[1] = int(flat[i + 1])
            elif name == "reqs":
                reqs[wid] = int(flat[i + 1])
        return out

    async def load(self, pool: str, worker_id: str) -> dict[str, int]:
        """What the routers count on one worker: reqs, blocks, prefill."""
        names = ("reqs", "blocks", "prefill")
        raw = await self._r.hmget(load_key(pool), [load_field(worker_id, n) for n in names])
        return {n: int(v or 0) for n, v in zip(names, raw, strict=True)}

    async def loads(self, pool: str) -> dict[str, dict[str, int]]:
        """Every worker's counts in ``pool`` (workers with no entry are absent)."""
        return parse_loads(await self._r.hgetall(load_key(pool)))

    # ----------------------------------------------------------------------------------
    async def _run(self, script: Any, calls: list[tuple[tuple[str, ...], list]],
                   before: tuple[tuple, ...] = ()) -> list[Any]:  # fmt: skip
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


def _str(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
