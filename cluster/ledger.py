"""The routers' load ledger: what every router counts against each worker, shared in Redis.

Per worker, in :func:`cluster.keys.load_key`, the fields of :data:`LOAD_FIELDS` (named
``<worker id>:<field>``): requests routed and not finished; prompt tokens routed and not
yet prefilled; KV blocks (prompt + one per choice for decoding) of requests past their
first token. A router reads the whole hash every refresh (:data:`VIEW_LUA`) and sums the
pool's load from it, so no total is kept in Redis. Each router also keeps what it counted
in a hash of its own (:func:`cluster.keys.load_owner_key`) under a lease
(:func:`cluster.keys.load_owners_key`) renewed every prune; when an API process dies with
requests counted, its lease lapses and the other routers give its counts back.

One rule moves every count, :data:`LEDGER_LUA`'s ``shift``: a field never goes below 0.
The commit, the give-back, the reclaim and the prune of a dead worker all use it.

Scripts: :data:`COMMIT_LUA` (count a request against a live worker, within the guard's
limit and the request cap), :data:`GIVE_BACK_LUA`, :data:`RECLAIM_LUA`, :data:`VIEW_LUA` (a
pool's live workers and their counts, for a router's local view). :class:`Ledger` runs them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from cluster.keys import alive_key, load_key, load_owner_key, load_owners_key
from cluster.lua import CLOCK_LUA, LIVE_LUA, NOW_LUA, lua_list
from cluster.resp import as_str

LOAD_TTL_S = 600  # the load keys' TTL, renewed by every router's view refresh
LOAD_FIELDS = ("reqs", "prefill", "blocks")  # a worker's counts
FULL, DEAD, GUARDED, COUNTED = -2, -1, 0, 1  # the commit's answers

# The one rule, generated from LOAD_FIELDS. shift(lkey, wid, kind, d) moves
# ``<wid>:<kind>`` of the load hash by d, clamped at 0; returns the field's new value and
# what really moved. forget(lkey, wid) drops all of a worker's counts.
LEDGER_LUA = f"""
local LOAD_FIELDS = {lua_list(LOAD_FIELDS)}
local function shift(lkey, wid, kind, d)
  local f = wid .. ':' .. kind
  local v = redis.call('HINCRBY', lkey, f, d)
  local moved = d
  if v < 0 then redis.call('HSET', lkey, f, 0); moved = d - v; v = 0 end
  return v, moved
end
local function forget(lkey, wid)
  local fs = {{}}
  for i, kind in ipairs(LOAD_FIELDS) do fs[i] = wid .. ':' .. kind end
  redis.call('HDEL', lkey, unpack(fs))
end
"""

# Count a request against one worker. KEYS: load hash, alive zset, and the committing
# router's own load hash (optional). ARGV: worker, prompt tokens to queue, the guard's
# limit in blocks (below 0: no guard; the router computes it from its view of the pool),
# block size, the most requests a worker may hold (0: no cap), the requests this one
# counts as (its choices: n), Redis's now in ms as the router reckons it (0: read it
# here), then in approximate mode the pool's stream, the decision's TTL (ms), the hex
# hashes (JSON) and the stream's maxlen. The worker's own counts are read here, so two
# routers racing for one worker cannot both pass the guard or the cap on stale views. A
# request of more choices than the cap still goes to a worker that holds none.
# Returns {1, blocks, prefill, reqs} counted; {0, blocks, prefill, reqs} over the guard;
# {-1} dead; {-2, blocks, prefill, reqs} at the request cap.
COMMIT_LUA = (
    CLOCK_LUA
    + LIVE_LUA
    + LEDGER_LUA
    + """
local wid = ARGV[1]
local now = tonumber(ARGV[7])
if now <= 0 then now = clock() end
if not is_live(KEYS[2], wid, now) then return {-1} end
local v = redis.call('HMGET', KEYS[1], wid .. ':blocks', wid .. ':prefill', wid .. ':reqs')
local b, q, n = tonumber(v[1] or '0'), tonumber(v[2] or '0'), tonumber(v[3] or '0')
local cap, k = tonumber(ARGV[5]), tonumber(ARGV[6])
if cap > 0 and n > 0 and n + k > cap then return {-2, b, q, n} end
local limit = tonumber(ARGV[3])
if limit >= 0 and b + math.ceil(q / tonumber(ARGV[4])) > limit then return {0, b, q, n} end
local add = tonumber(ARGV[2])
n = shift(KEYS[1], wid, 'reqs', k)
q = shift(KEYS[1], wid, 'prefill', add)
if #KEYS > 2 then
  redis.call('HINCRBY', KEYS[3], wid .. ':reqs', k)
  redis.call('HINCRBY', KEYS[3], wid .. ':prefill', add)
end
if #ARGV > 7 then
  redis.call('XADD', ARGV[8], 'MAXLEN', '~', ARGV[11], '*', 'w', wid, 'a', ARGV[9],
             'b', ARGV[10])
end
return {1, b, q, n}
"""
)

# Take load off one worker. KEYS: load hash and the router's own load hash (optional).
# ARGV: worker, then (field, amount) pairs. An amount below 0 adds. With the router's own
# hash, no more is taken than it still holds there: what another router gave back for it
# (its lease lapsed while it stalled) is not taken a second time.
GIVE_BACK_LUA = (
    LEDGER_LUA
    + """
local wid = ARGV[1]
for i = 2, #ARGV, 2 do
  local kind, n = ARGV[i], tonumber(ARGV[i + 1])
  local f = wid .. ':' .. kind
  if #KEYS > 1 and n > 0 then
    n = math.min(n, tonumber(redis.call('HGET', KEYS[2], f) or '0'))
  end
  if n ~= 0 then
    shift(KEYS[1], wid, kind, 0 - n)
    if #KEYS > 1 then
      local o = redis.call('HINCRBY', KEYS[2], f, 0 - n)
      if o <= 0 then redis.call('HDEL', KEYS[2], f) end
    end
  end
end
return 1
"""
)

# Renew this router's lease on the load it counted in a pool (and its own hash's TTL),
# then give back the load of the routers whose lease lapsed (their API process died with
# requests counted): what each counted comes off the pool's counts, as their
# releases would have done. A router whose own lease had lapsed too (Redis was away, or
# this process stalled) only renews: the others may be alive and about to renew theirs.
# KEYS: owners zset, load hash. ARGV: router id, lease ms, the owners' hash
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
      local _, moved = shift(KEYS[2], wid, kind, 0 - n)
      if kind == 'reqs' then out[1] = out[1] - moved end
    end
  end
  redis.call('DEL', h)
  redis.call('ZREM', KEYS[1], o)
end
return out
"""
)

# A pool's live workers and the counts, for a router's view; renews the load key's TTL.
# ARGV: alive zset, load hash, ttl ms -> {Redis's now (ms), {live ids (unsorted)}, {the
# load hash, flat}}. One HGETALL, not a read per worker: the hash also holds dead workers'
# fields until a prune, which the reader skips.
VIEW_LUA = (
    NOW_LUA
    + """
redis.call('PEXPIRE', ARGV[2], ARGV[3])
return {now, redis.call('ZRANGE', ARGV[1], '(' .. now, '+inf', 'BYSCORE'),
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
        wid, _, name = as_str(k).rpartition(":")
        out.setdefault(wid, {})[name] = int(v)
    return out


@dataclass(slots=True)
class PoolLoad:
    """:data:`VIEW_LUA`'s answer: a pool's live workers (sorted) and their counts."""

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
    before the first await").

    Each :meth:`view` also sets the ledger's reckoning of Redis's clock, so a commit need
    not read it (``TIME`` in the script): the offset of Redis's now from this host's, as
    the view's reply carried it (off by at most a round trip: a worker's heartbeat lapses
    in seconds). Until the first view, the commit reads Redis's clock itself."""

    def __init__(self, client: aioredis.Redis, owner: str | None = None, fast: Any = None) -> None:
        self._r = client
        self.owner = owner
        self._fast = fast
        self._clock_offset_ms: float | None = None
        self._commit = client.register_script(COMMIT_LUA)
        self._give_back = client.register_script(GIVE_BACK_LUA)
        self._reclaim = client.register_script(RECLAIM_LUA)
        self._view = client.register_script(VIEW_LUA)

    def _keys(self, pool: str) -> tuple[str, ...]:
        own = () if self.owner is None else (load_owner_key(pool, self.owner),)
        return (load_key(pool), *own)

    def redis_now_ms(self) -> int:
        """Redis's clock as this process reckons it (0: not known yet)."""
        off = self._clock_offset_ms
        return 0 if off is None else int(time.time() * 1000 + off)

    async def commit(self, pool: str, worker_id: str, prefill: int, *, cap: int = 0,
                     choices: int = 1, limit: float | None = None, block_size: int = 16,
                     decision: list | None = None) -> Commit:  # fmt: skip
        """Count a request of ``choices`` and ``prefill`` prompt tokens against
        ``worker_id`` if it is live, holds fewer than ``cap`` requests (0: no cap) and,
        with a guard ``limit`` (blocks), has no more load than that. ``decision``: an
        approximate router's stream entry (:func:`cluster.index.decision_args`), appended
        in the same script."""
        args: list = [worker_id, prefill, -1 if limit is None else limit, block_size, cap,
                      choices, self.redis_now_ms(), *(decision or ())]  # fmt: skip
        k = self._keys(pool)
        res = (await self._run(self._commit, [((k[0], alive_key(pool), *k[1:]), args)]))[0]
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
            keys=[load_owners_key(pool), load_key(pool)],
            args=[self.owner, int(lease_s * 1000), load_owner_key(pool, ""), LOAD_TTL_S * 1000],
        )  # fmt: skip
        return int(res[0]), [as_str(o) for o in res[1:]]

    async def view(self, pool: str) -> PoolLoad:
        """``pool``'s live workers (sorted) and what is counted on each."""
        now, ids, flat = await self._view(args=[alive_key(pool), load_key(pool), LOAD_TTL_S * 1000])
        self._clock_offset_ms = int(now) - time.time() * 1000
        live = sorted(as_str(w) for w in ids)
        out = PoolLoad(live)
        loads, reqs = out.loads, out.reqs
        for w in live:
            loads[w] = [0, 0]
            reqs[w] = 0
        for i in range(0, len(flat), 2):
            wid, _, name = as_str(flat[i]).rpartition(":")
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
