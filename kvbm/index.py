"""The KV-block index in Redis: which worker holds which cached block.

Workers' block pools emit ``stored`` / ``removed`` / ``cleared`` events; one publisher per
worker (:mod:`kvbm.events`) applies them here, each batch with the next number of that
worker's monotonic sequence. The router asks, in the same round trip in which it picks a
worker, how long a prefix of a request's block hashes each live worker holds.

Keys, per worker pool (a prefill worker's cache says nothing about a decode worker's),
named in :func:`kvbm.protocol.index_keys`: the holders of each block (a SET of worker ids,
event-fed), each worker's blocks (for cleanup), each worker's last applied batch number,
and the approximate index (a ZSET worker id -> expiry per block: the router's own past
decisions, for engines that emit no events, forgotten after a TTL).

Block hashes travel as lowercase hex (a 64-bit hash is not exact in a Lua number).

Consistency rules:
* a batch whose number is not above the last applied one is a duplicate: dropped;
* a batch that skips numbers means the index lost events (Redis restarted, a batch was
  lost): it is refused with ``resync`` and the publisher answers with ``cleared`` plus a
  snapshot of every cached block; a batch that starts with ``cleared`` is always applied
  (a worker starting fresh, possibly under an id used before);
* a dead worker (its heartbeat expired) stops counting at once, since every query
  checks liveness, and the first query that notices removes its entries.

Everything here is plain Redis + Lua; the keys are computed inside the scripts, so the
index needs one Redis (not Redis Cluster).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import redis

from kvbm.protocol import LIVE_LUA, NOW_LUA, alive_key, index_keys, pool_queue, worker_queue


def hex_hashes(hashes: list[int]) -> list[str]:
    return [format(h, "x") for h in hashes]


def encode_batch(events: list[tuple[str, list[int]]]) -> str:
    """``[(kind, hashes), ...]`` -> the JSON the apply script reads; kinds are
    ``stored`` / ``removed`` / ``cleared``."""
    return json.dumps([[kind[0], hex_hashes(hs)] for kind, hs in events])


# --- apply one batch of a worker's events ------------------------------------------------
# ARGV: kv prefix, worker-blocks key, seq key, worker id, seq, batch JSON
# returns {status, last}: status 1 applied, 0 duplicate, -1 resync needed
APPLY_LUA = """
local kv, wkey, skey, wid = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local seq = tonumber(ARGV[5])
local batch = cjson.decode(ARGV[6])
local last = tonumber(redis.call('GET', skey) or '-1')
local fresh = batch[1] ~= nil and batch[1][1] == 'c'
if not fresh then
  if seq <= last then return {0, last} end
  if seq ~= last + 1 then return {-1, last} end
end
for _, ev in ipairs(batch) do
  local kind, hs = ev[1], ev[2]
  if kind == 's' then
    for _, h in ipairs(hs) do
      redis.call('SADD', kv .. h, wid)
      redis.call('SADD', wkey, h)
    end
  elseif kind == 'r' then
    for _, h in ipairs(hs) do
      redis.call('SREM', kv .. h, wid)
      redis.call('SREM', wkey, h)
    end
  elseif kind == 'c' then
    for _, h in ipairs(redis.call('SMEMBERS', wkey)) do redis.call('SREM', kv .. h, wid) end
    redis.call('DEL', wkey)
  end
end
redis.call('SET', skey, seq)
return {1, seq}
"""

APPLY_SHA = hashlib.sha1(APPLY_LUA.encode()).hexdigest()

# --- Lua helpers shared by the scripts that read the index -------------------------------
# Locals the helpers expect: kv, kva, wblocks, seqk (index prefixes), alive (the registry's
# ZSET worker id -> heartbeat expiry in ms), forget_more (a function(wid) the including
# script may use to drop more of a dead worker's state).

# forget(wid): drop every index entry of a (dead) worker, and move the messages stranded on
# its own queue to its pool's queue, where any live worker of the pool takes them (oldest
# first, behind what the pool queue holds). Kombu keeps a queue's messages in a list named
# after it, and those of priorities 3/6/9 in lists suffixed "\x06\x16" + the priority.
FORGET_LUA = """
local function forget(wid)
  local wkey = wblocks .. wid
  local hs = redis.call('SMEMBERS', wkey)
  for _, h in ipairs(hs) do redis.call('SREM', kv .. h, wid) end
  redis.call('DEL', wkey, seqk .. wid)
  redis.call('ZREM', alive, wid)
  for _, sfx in ipairs({'', '\6\0223', '\6\0226', '\6\0229'}) do
    while redis.call('LMOVE', wqueue .. wid .. sfx, pqueue .. sfx, 'RIGHT', 'LEFT') do end
  end
  forget_more(wid)
end
"""

# live(now) -> sorted live worker ids (kvbm.protocol's rule); workers whose heartbeat
# expired are forgotten on the way
PRUNE_LUA = (
    LIVE_LUA
    + """
local function live(now)
  for _, id in ipairs(redis.call('ZRANGE', alive, '-inf', now, 'BYSCORE')) do
    forget(id)
  end
  return live_ids(alive, now)
end
"""
)

# overlaps(ids, hashes, approx, now) -> {wid = number of leading blocks held}.
# Block hashes are chained and a block pool evicts a sequence's descendants before its
# ancestors (blocks are freed tail first, and a hit refreshes the whole prefix), so a worker
# that holds block k holds blocks 1..k: its overlap is the deepest block it holds. That
# depth is found by bisection, all workers at once: a group of workers known to hold block
# lo asks who holds block mid and splits. About log2(blocks) set reads per distinct
# overlap, instead of one read per block.
OVERLAP_LUA = """
local function holders(h, approx, now)
  local set = {}
  local members
  if approx then
    members = redis.call('ZRANGE', kva .. h, now, '+inf', 'BYSCORE')
  else
    members = redis.call('SMEMBERS', kv .. h)
  end
  for _, m in ipairs(members) do set[m] = true end
  return set
end

local function overlaps(ids, hashes, approx, now)
  local out = {}
  for _, id in ipairs(ids) do out[id] = 0 end
  local n = #hashes
  if n == 0 or #ids == 0 then return out end
  local first = holders(hashes[1], approx, now)
  local group = {}
  for _, id in ipairs(ids) do if first[id] then group[#group + 1] = id end end
  local todo = {{1, n, group}}
  while #todo > 0 do
    local job = table.remove(todo)
    local lo, hi, g = job[1], job[2], job[3]
    if lo == hi then
      for _, id in ipairs(g) do out[id] = lo end
    else
      local mid = math.floor((lo + hi + 1) / 2)
      local held = holders(hashes[mid], approx, now)
      local yes, no = {}, {}
      for _, id in ipairs(g) do
        if held[id] then yes[#yes + 1] = id else no[#no + 1] = id end
      end
      if #yes > 0 then todo[#todo + 1] = {mid, hi, yes} end
      if #no > 0 then todo[#todo + 1] = {lo, mid - 1, no} end
    end
  end
  return out
end
"""

# The first seven ARGV of every script that reads the index: ``script_args(pool)``.
# Scripts put this first, then FORGET_LUA (after a ``forget_more``).
LOCALS_LUA = (
    "local alive, kv, kva, wblocks, seqk, pqueue, wqueue = "
    "ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]\n"
)

# ARGV: the seven above, approx (0/1), hashes...
# returns a flat list: wid1, overlap1, wid2, overlap2, ... for every live worker
QUERY_LUA = (
    LOCALS_LUA
    + "local function forget_more(wid) end\n"
    + FORGET_LUA
    + PRUNE_LUA
    + OVERLAP_LUA
    + NOW_LUA
    + """
local ids = live(now)
local hashes = {}
for i = 9, #ARGV do hashes[#hashes + 1] = ARGV[i] end
local ov = overlaps(ids, hashes, ARGV[8] == '1', now)
local out = {}
for _, id in ipairs(ids) do out[#out + 1] = id; out[#out + 1] = ov[id] end
return out
"""
)


def apply_argv(pool: str, worker_id: str, seq: int,
               events: list[tuple[str, list[int]]]) -> list[str | int]:  # fmt: skip
    """ARGV of :data:`APPLY_LUA` for one batch of ``worker_id``'s events."""
    kv, _, wblocks, seqk = index_args(pool)
    return [kv, wblocks + worker_id, seqk + worker_id, worker_id, seq, encode_batch(events)]


def apply_command(pool: str, worker_id: str, seq: int, events: list[tuple[str, list[int]]],
                  load: bool = False) -> tuple[str | int, ...]:  # fmt: skip
    """The whole command that applies one batch, for a connection of one's own:
    ``EVALSHA`` (``EVAL``, which also loads the script, with ``load``)."""
    head = ("EVAL", APPLY_LUA) if load else ("EVALSHA", APPLY_SHA)
    return (*head, 0, *apply_argv(pool, worker_id, seq, events))


def index_args(pool: str) -> list[str]:
    """The key prefixes of ``pool``'s index, in the order the scripts take them."""
    return index_keys(pool).as_args()


def script_args(pool: str) -> list[str]:
    """The first ARGV of every script that reads ``pool``'s index (LOCALS_LUA)."""
    return [alive_key(pool), *index_args(pool), pool_queue(pool), worker_queue(pool, "")]


@dataclass(slots=True)
class ApplyResult:
    status: int  # 1 applied, 0 duplicate (dropped), -1 the index needs a resync
    last_seq: int


class KVIndex:
    """Synchronous access to one pool's index (workers publish, tools and tests read)."""

    def __init__(self, client: redis.Redis, pool: str) -> None:
        self._r = client
        self.pool = pool
        self._keys = index_keys(pool)
        self._apply = client.register_script(APPLY_LUA)
        self._query = client.register_script(QUERY_LUA)

    def apply(self, worker_id: str, seq: int, events: list[tuple[str, list[int]]]) -> ApplyResult:
        status, last = self._apply(args=apply_argv(self.pool, worker_id, seq, events))
        return ApplyResult(int(status), int(last))

    def overlaps(self, hashes: list[int], approx: bool = False) -> dict[str, int]:
        """Each live worker's number of leading blocks of ``hashes`` held (dead workers
        are pruned and forgotten on the way)."""
        flat = self._query(
            args=[*script_args(self.pool), int(approx),
                  *hex_hashes(hashes)]
        )  # fmt: skip
        ids = [w.decode() if isinstance(w, bytes) else w for w in flat[::2]]
        return dict(zip(ids, map(int, flat[1::2]), strict=True))

    def holders(self, block_hash: int) -> set[str]:
        """Workers the index says hold one block (live or not)."""
        members = self._r.smembers(self._keys.holders + format(block_hash, "x"))
        return {m.decode() if isinstance(m, bytes) else m for m in members}

    def worker_blocks(self, worker_id: str) -> set[int]:
        key = self._keys.worker_blocks + worker_id
        return {int(h, 16) for h in self._r.smembers(key)}
