"""The KV-block index: which worker holds which cached block, as each router sees it.

Redis keeps only what routers must share (:func:`cluster.keys.index_keys`): per worker,
the set of block hashes it holds in each tier (G1 engine pool, G2 host memory, G3 disk)
and the number of its last applied event batch; per pool, a stream of event batches. Each
router (one per API process) keeps a :class:`LocalIndex` per pool, block hash -> holding
workers (and tiers), fed by that stream (:class:`IndexFollower`), and computes a request's
overlap in-process: no index read in Redis per routing decision.

Writing (a worker's publisher, :mod:`kvbm.events`, through :func:`apply_command`):
:data:`APPLY_LUA` applies one numbered batch to the worker's set and appends it to the
pool's stream, atomically:

* a batch whose number is not above the last applied one is a duplicate: dropped;
* a batch that skips numbers means events were lost (Redis restarted, a batch was lost):
  refused with ``resync``, and the publisher answers with ``cleared`` plus a snapshot;
* a batch that starts with ``cleared`` is always applied (a worker starting fresh).

Following: a router that starts loads a snapshot (every live worker's set and number, and
the stream's position, in one script), then reads the stream from that position. A batch
whose number skips one of that worker's means this router missed events (the stream is
trimmed to ``EVENTS_MAXLEN``): that worker alone is reloaded. Workers whose heartbeat
lapsed leave the local index at the router's next liveness refresh;
:data:`cluster.membership.PRUNE_LUA` (run by routers) removes their state from Redis.

Approximate mode (engines that emit no events): routers append their own decisions to the
same stream with a TTL; every router applies them with an expiry, and one that starts
replays the last TTL's worth.

Block pools evict a sequence's descendants before its ancestors (blocks are freed tail
first; a hit refreshes the whole prefix), and each lower tier takes a block only after
its parent and evicts only leaves (:mod:`kvbm.tiers`): every tier of a worker holds a set
closed under "parent of", and so does any union of them. A worker that holds block k in
G1 (or in G1 or G2, or anywhere) holds blocks 1..k there too, so its overlap with a
request is found by bisection, once for the union of its tiers and, where lower tiers
hold blocks, once for G1 and once for G1 + G2 (:meth:`LocalIndex.tier_overlaps`): the
router weighs each block by the tier it would come from. Block hashes travel as
lowercase hex (a 64-bit hash is not exact in a Lua number). Tiers are numbered 1, 2, 3
as :mod:`kvbm.protocol` numbers G1, G2, G3 (tests/unit/cluster holds them equal).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import redis
import redis.asyncio as aioredis

from cluster.keys import alive_key, index_keys
from cluster.lua import LIVE_LUA, NOW_LUA
from cluster.membership import prune
from cluster.resp import as_str

log = logging.getLogger(__name__)

# a stream's entries as our clients read them (RESP2, bytes); redis-py types the replies
# for RESP3 and text clients too
_Entries = list[tuple[bytes, dict[bytes, bytes]]]

EVENTS_MAXLEN = 50_000  # entries a pool's stream keeps (approximately): minutes of events
G1, G2, G3 = 1, 2, 3  # the tiers as events name them (kvbm.protocol's G1, G2, G3)
TIER_BIT = {G1: 1, G2: 2, G3: 4}  # a worker's tiers holding a block, as a bit mask

# a batch of events: (kind, hashes) for G1, or (kind, hashes, tier)
Batch = list[tuple[str, list[int], int]]


def hex_hashes(hashes: list[int]) -> list[str]:
    return [format(h, "x") for h in hashes]


def encode_batch(events: list[tuple[str, list[int]]] | Batch) -> str:
    """``[(kind, hashes[, tier]), ...]`` -> the JSON the scripts and followers read; kinds
    are ``stored`` / ``removed`` / ``cleared``; the tier (1 ... 3: G1 ... G3)
    is written only when it is not G1, so a G1 batch reads as it always has."""
    out = []
    for ev in events:
        item: list = [ev[0][0], hex_hashes(ev[1])]
        if len(ev) > 2 and ev[2] != G1:
            item.append(ev[2])
        out.append(item)
    return json.dumps(out)


# ======================================================================================
# Scripts
# ======================================================================================
# ARGV: G1 worker-blocks key, seq key, stream key, worker id, seq, batch JSON, stream
# maxlen, G2 worker-blocks key, G3 worker-blocks key
# returns {status, last}: status 1 applied, 0 duplicate, -1 resync needed
APPLY_LUA = """
local skey, stream, wid = ARGV[2], ARGV[3], ARGV[4]
local tkeys = {ARGV[1], ARGV[8], ARGV[9]}
local seq = tonumber(ARGV[5])
local batch = cjson.decode(ARGV[6])
local last = tonumber(redis.call('GET', skey) or '-1')
local fresh = batch[1] ~= nil and batch[1][1] == 'c'
if not fresh then
  if seq <= last then return {0, last} end
  if seq ~= last + 1 then return {-1, last} end
end
local function each(cmd, key, hs)
  for i = 1, #hs, 1000 do redis.call(cmd, key, unpack(hs, i, math.min(i + 999, #hs))) end
end
for _, ev in ipairs(batch) do
  local kind, hs = ev[1], ev[2]
  local key = tkeys[ev[3] or 1]
  if kind == 's' and #hs > 0 then each('SADD', key, hs)
  elseif kind == 'r' and #hs > 0 then each('SREM', key, hs)
  elseif kind == 'c' then redis.call('DEL', unpack(tkeys)) end
end
redis.call('SET', skey, seq)
redis.call('XADD', stream, 'MAXLEN', '~', ARGV[7], '*', 'w', wid, 's', seq, 'b', ARGV[6])
return {1, seq}
"""

# ARGV: alive key, G1 worker-blocks prefix, seq prefix, stream key, one worker id ('' =
# every live worker), G2 and G3 worker-blocks prefixes -> {stream position, id1, seq1,
# {G1 hex...}, {G2 hex...}, {G3 hex...}, id2, ...}, read atomically
SNAPSHOT_LUA = (
    NOW_LUA
    + LIVE_LUA
    + """
local ids = ARGV[5] ~= '' and {ARGV[5]} or live_ids(ARGV[1], now)
local top = redis.call('XREVRANGE', ARGV[4], '+', '-', 'COUNT', 1)
local out = {#top > 0 and top[1][1] or '0-0'}
for _, id in ipairs(ids) do
  out[#out + 1] = id
  out[#out + 1] = tonumber(redis.call('GET', ARGV[3] .. id) or '-1')
  out[#out + 1] = redis.call('SMEMBERS', ARGV[2] .. id)
  out[#out + 1] = redis.call('SMEMBERS', ARGV[6] .. id)
  out[#out + 1] = redis.call('SMEMBERS', ARGV[7] .. id)
end
return out
"""
)


def apply_argv(pool: str, worker_id: str, seq: int,
               events: list[tuple[str, list[int]]] | Batch) -> list[str | int]:  # fmt: skip
    """ARGV of :data:`APPLY_LUA` for one batch of ``worker_id``'s events."""
    k = index_keys(pool)
    return [k.worker_blocks + worker_id, k.seq + worker_id, k.events, worker_id, seq,
            encode_batch(events), EVENTS_MAXLEN, k.host_blocks + worker_id,
            k.disk_blocks + worker_id]  # fmt: skip


def apply_command(pool: str, worker_id: str, seq: int,
                  events: list[tuple[str, list[int]]] | Batch,
                  load: bool = False) -> tuple[str | int, ...]:  # fmt: skip
    """The whole command that applies one batch, for a connection of one's own:
    ``EVALSHA`` (``EVAL``, which also loads the script, with ``load``)."""
    head = ("EVAL", APPLY_LUA) if load else ("EVALSHA", APPLY_SHA)
    return (*head, 0, *apply_argv(pool, worker_id, seq, events))


def snapshot_argv(pool: str, worker_id: str = "") -> list[str]:
    k = index_keys(pool)
    return [alive_key(pool), k.worker_blocks, k.seq, k.events, worker_id, k.host_blocks,
            k.disk_blocks]  # fmt: skip


def decision_args(pool: str, hashes: list[int], ttl_s: float) -> list:
    """An approximate router's decision as :data:`cluster.ledger.COMMIT_LUA` appends it to
    the pool's stream: the stream, its TTL (ms), the hex hashes (JSON), the maxlen."""
    hx = "[" + ",".join(f'"{h}"' for h in hex_hashes(hashes)) + "]"
    return [index_keys(pool).events, int(ttl_s * 1000), hx, EVENTS_MAXLEN]


APPLY_SHA = hashlib.sha1(APPLY_LUA.encode()).hexdigest()


# ======================================================================================
# The local index
# ======================================================================================
class LocalIndex:
    """One pool's index in a router's memory: block hash -> workers holding it (and in
    which tiers), from the workers' event batches (numbered per worker) and, in
    approximate mode, from routers' decisions (each with an expiry)."""

    def __init__(self) -> None:
        self._holders: dict[int, dict[str, int]] = {}  # hash -> worker -> TIER_BIT mask
        self._blocks: dict[str, dict[int, int]] = {}  # worker -> hash -> mask
        self._seq: dict[str, int] = {}
        self._approx: dict[int, dict[str, float]] = {}  # hash -> worker -> expiry (mono)
        self._lower = 0  # (worker, block) pairs held in G2 or G3: tier bisections needed

    @property
    def num_blocks(self) -> int:
        return len(self._holders)

    @property
    def workers(self) -> set[str]:
        return set(self._blocks)

    def seq(self, worker_id: str) -> int:
        return self._seq.get(worker_id, -1)

    def apply(self, worker_id: str, seq: int, batch: list[list]) -> bool:
        """Apply one batch (as :func:`encode_batch` wrote it). False: it skips numbers (this
        index missed some of the worker's batches; reload the worker)."""
        fresh = bool(batch) and batch[0][0] == "c"
        last = self._seq.get(worker_id, -1)
        if not fresh:
            if seq <= last:
                return True  # already applied (a snapshot covered it)
            if seq != last + 1:
                return False
        for ev in batch:
            kind, hs = ev[0], ev[1]
            bit = TIER_BIT[ev[2] if len(ev) > 2 else G1]
            if kind == "s":
                self._store(worker_id, [int(h, 16) for h in hs], bit)
            elif kind == "r":
                self._remove(worker_id, [int(h, 16) for h in hs], bit)
            elif kind == "c":
                self.drop(worker_id)
        self._seq[worker_id] = seq
        return True

    def load(self, worker_id: str, seq: int, hashes: list[int], host: Sequence[int] = (),
             disk: Sequence[int] = ()) -> None:  # fmt: skip
        """Replace what this index knows of a worker with a snapshot (its blocks in G1,
        and in G2 and G3)."""
        self.drop(worker_id)
        self._blocks[worker_id] = {}
        self._store(worker_id, hashes, TIER_BIT[G1])
        self._store(worker_id, list(host), TIER_BIT[G2])
        self._store(worker_id, list(disk), TIER_BIT[G3])
        self._seq[worker_id] = seq

    def drop(self, worker_id: str) -> None:
        for h, mask in self._blocks.pop(worker_id, {}).items():
            if mask & ~1:
                self._lower -= 1
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(worker_id, None)
                if not holders:
                    del self._holders[h]
        self._seq.pop(worker_id, None)

    def remember(self, worker_id: str, hashes: list[int], expiry: float) -> None:
        """Approximate mode: the router sent ``hashes`` to ``worker_id``; count it as
        holding them until ``expiry`` (time.monotonic())."""
        for h in hashes:
            self._approx.setdefault(h, {})[worker_id] = expiry

    def holders(self, block_hash: int, approx: bool = False, now: float = 0.0) -> set[str]:
        return set(self._held(block_hash, approx, now))

    def tiers_of(self, worker_id: str, block_hash: int) -> set[int]:
        """The tiers in which ``worker_id`` holds ``block_hash``."""
        mask = self._blocks.get(worker_id, {}).get(block_hash, 0)
        return {t for t, bit in TIER_BIT.items() if mask & bit}

    def worker_blocks(self, worker_id: str, tier: int | None = None) -> set[int]:
        """Blocks ``worker_id`` holds in ``tier`` (``None``: in any tier)."""
        mine = self._blocks.get(worker_id, {})
        if tier is None:
            return set(mine)
        bit = TIER_BIT[tier]
        return {h for h, m in mine.items() if m & bit}

    def overlaps(self, ids: list[str], hashes: list[int], approx: bool = False) -> dict[str, int]:
        """Each of ``ids``' number of leading blocks of ``hashes`` held, in any tier. By
        bisection, all workers at once: a group known to hold block lo asks who holds
        block mid, and splits (about log2(blocks) set reads per distinct overlap). Those
        holding the last block are found first: they hold the whole prompt, and need no
        bisection (the common case of a shared prefix held everywhere)."""
        out = dict.fromkeys(ids, 0)
        n = len(hashes)
        if not n or not ids:
            return out
        now = time.monotonic()
        # groups are sets, split by C-level intersections (a Python test per worker per
        # level was most of a pick's index time at 256 workers)
        group = set(ids).intersection(self._held(hashes[0], approx, now))
        if n > 1 and group:
            whole = group.intersection(self._held(hashes[n - 1], approx, now))
            if whole:
                out.update(dict.fromkeys(whole, n))
                group -= whole
            n -= 1
        todo = [(1, n, group)]
        while todo:
            lo, hi, group = todo.pop()
            if not group:
                continue
            if lo == hi:
                out.update(dict.fromkeys(group, lo))
                continue
            mid = (lo + hi + 1) // 2
            inside = group.intersection(self._held(hashes[mid - 1], approx, now))
            todo.append((mid, hi, inside))
            if len(inside) < len(group):
                todo.append((lo, mid - 1, group - inside))
        return out

    def tier_overlaps(self, ids: list[str], hashes: list[int]) -> dict[str, tuple[int, int, int]]:
        """Per worker, its leading blocks of ``hashes`` held in G1, in G1 or G2, and in any
        tier (each a prefix, as every tier keeps ancestors). Beyond the bisection of
        :meth:`overlaps`, a worker whose deepest block held is in G1 costs nothing more;
        only one whose overlap spans tiers is searched again (docs/performance.md, "KVBM
        tiers in the router's decision")."""
        any_tier = self.overlaps(ids, hashes)
        if not self._lower:
            return {w: (n, n, n) for w, n in any_tier.items()}
        out = {}
        col: list[dict[str, int]] = []  # who holds each block, in what tiers (as needed)
        for w, n in any_tier.items():
            if n:
                last = self._holders[hashes[n - 1]].get(w, 0)
                if not last & 1:  # else its deepest block is in G1, and so are all before
                    if len(col) < n:
                        col += [self._holders.get(h, {}) for h in hashes[len(col) : n]]
                    n12 = n if last & 2 else _held_up_to(col, w, 3, n)
                    out[w] = (_held_up_to(col, w, 1, n12), n12, n)
                    continue
            out[w] = (n, n, n)
        return out

    # ----------------------------------------------------------------------------------
    def _held(self, block_hash: int, approx: bool, now: float) -> dict[str, int] | set[str]:
        """Who holds ``block_hash`` (a worker -> tier mask map; a set in approximate mode)."""
        if not approx:
            return self._holders.get(block_hash, {})
        held = self._approx.get(block_hash)
        if not held:
            return set()
        live = {w for w, exp in held.items() if exp > now}
        if len(live) < len(held):  # forget the expired ones on the way
            for w in [w for w, exp in held.items() if exp <= now]:
                del held[w]
            if not held:
                del self._approx[block_hash]
        return live

    def _store(self, worker_id: str, hashes: list[int], bit: int) -> None:
        mine = self._blocks.setdefault(worker_id, {})
        for h in hashes:
            old = mine.get(h, 0)
            new = old | bit
            if new != old:
                mine[h] = new
                self._holders.setdefault(h, {})[worker_id] = new
                if new & ~1 and not old & ~1:
                    self._lower += 1

    def _remove(self, worker_id: str, hashes: list[int], bit: int) -> None:
        mine = self._blocks.get(worker_id)
        if mine is None:
            return
        for h in hashes:
            old = mine.get(h, 0)
            if not old & bit:
                continue
            new = old & ~bit
            if old & ~1 and not new & ~1:
                self._lower -= 1
            holders = self._holders[h]
            if new:
                mine[h] = new
                holders[worker_id] = new
            else:
                del mine[h]
                del holders[worker_id]
                if not holders:
                    del self._holders[h]


@dataclass(slots=True)
class WorkerSnapshot:
    worker_id: str
    seq: int
    hashes: list[int]  # held in G1
    host: list[int]  # held in G2
    disk: list[int]  # held in G3

    def load_into(self, index: LocalIndex) -> None:
        index.load(self.worker_id, self.seq, self.hashes, self.host, self.disk)


def _held_up_to(col: list[dict[str, int]], worker_id: str, mask: int, hi: int) -> int:
    """How many leading blocks (at most ``hi``) ``worker_id`` holds in the tiers of
    ``mask``, ``col[i]`` holding block i's holders: a binary search, the tiers keeping
    ancestors. One worker at a time: where tiers split prefixes, the points rarely agree."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if col[mid - 1].get(worker_id, 0) & mask:
            lo = mid
        else:
            hi = mid - 1
    return lo


def parse_snapshot(flat: list) -> tuple[str, list[WorkerSnapshot]]:
    """:data:`SNAPSHOT_LUA`'s reply -> (stream position, [per worker snapshot])."""
    pos = as_str(flat[0])
    out = []

    def hx(items: list) -> list[int]:
        return [int(as_str(h), 16) for h in items]

    for i in range(1, len(flat), 5):
        out.append(WorkerSnapshot(as_str(flat[i]), int(flat[i + 1]), hx(flat[i + 2]),
                                  hx(flat[i + 3]), hx(flat[i + 4])))  # fmt: skip
    return pos, out


# ======================================================================================
# Following the stream
# ======================================================================================
@dataclass
class FollowerStats:
    snapshot_loads: int = 0  # whole-index snapshots (start, reconnect after a long gap)
    worker_reloads: int = 0  # one worker reloaded after its batches skipped numbers
    entries: int = 0  # stream entries applied
    lag_s: float = 0.0  # age of the last entry applied when it was applied


class IndexFollower:
    """Keeps one pool's :class:`LocalIndex` in step with the pool's event stream, from a
    task of its own on the caller's event loop. It reads with ``XREAD BLOCK block_ms``:
    entries are applied as soon as they come, and a quiet stream costs one round trip per
    ``block_ms`` (polling every 10 ms, as it once did, kept an idle API process at 5% of a
    core). The read holds a connection of its own (a client on the caller's client's
    settings): :meth:`aclose` cancels the task inside it, and a reply left unread there can
    never reach another command."""

    def __init__(self, client: aioredis.Redis, pool: str, approx_ttl_s: float = 0.0,
                 block_ms: int = 500) -> None:  # fmt: skip
        self._r = client
        self.pool = pool
        self.index = LocalIndex()
        self.stats = FollowerStats()
        self._key = index_keys(pool).events
        self._approx_ttl_s = approx_ttl_s
        self._block_ms = block_ms
        cp = client.connection_pool
        self._reader = aioredis.Redis(connection_pool=cp.__class__(
            connection_class=cp.connection_class, max_connections=1,
            **cp.connection_kwargs))  # fmt: skip
        self._pos = "0-0"
        self._snapshot = client.register_script(SNAPSHOT_LUA)
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def start(self) -> IndexFollower:
        await self.load_snapshot()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-{self.pool}")
        return self

    async def aclose(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()  # inside the blocking read, most likely
            try:
                await asyncio.wait_for(self._task, 5.0)
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
        await self._reader.aclose()

    async def load_snapshot(self) -> None:
        """Every live worker's blocks and the stream position they are current to; in
        approximate mode, the decisions of the last TTL replayed."""
        pos, workers = parse_snapshot(await self._snapshot(args=snapshot_argv(self.pool)))
        index = LocalIndex()
        for w in workers:
            w.load_into(index)
        if self._approx_ttl_s > 0:
            since = int((time.time() - self._approx_ttl_s) * 1000)
            entries = cast(_Entries, await self._r.xrange(self._key, f"{since}-0", pos))
            for entry_id, fields in entries:
                self._apply_entry(index, as_str(entry_id), fields, replay=True)
        self.index = index
        self._pos = pos
        self.stats.snapshot_loads += 1

    async def reload(self, worker_id: str) -> None:
        _, workers = parse_snapshot(await self._snapshot(args=snapshot_argv(self.pool, worker_id)))
        for w in workers:
            if w.seq < 0 and not (w.hashes or w.host or w.disk):
                self.index.drop(w.worker_id)  # gone from Redis: pruned, or cleared on leaving
            else:
                w.load_into(self.index)
        self.stats.worker_reloads += 1

    async def poll(self, block_ms: int | None = None) -> int:
        """Apply what the stream holds past our position, waiting up to ``block_ms`` for
        something to come if nothing has; returns the entries applied."""
        r = self._r if block_ms is None else self._reader
        reply = await r.xread({self._key: self._pos}, count=1000, block=block_ms)
        applied = 0
        for _, entries in cast("list[tuple[bytes, _Entries]] | None", reply) or ():
            for entry_id, fields in entries:
                eid = as_str(entry_id)
                gap = self._apply_entry(self.index, eid, fields)
                self._pos = eid
                applied += 1
                if gap is not None:
                    await self.reload(gap)
        self.stats.entries += applied
        return applied

    # ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        delay = 0.2
        while not self._stop.is_set():
            try:
                await self.poll(self._block_ms)
                delay = 0.2
            except Exception as e:  # noqa: BLE001 - Redis away: try again later
                log.warning("KV index %s: reading events failed (%s); retrying", self.pool, e)
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                except TimeoutError:
                    pass
                delay = min(2.0, delay * 2)

    def _apply_entry(self, index: LocalIndex, entry_id: str, fields: dict,
                     replay: bool = False) -> str | None:  # fmt: skip
        """Apply one stream entry; the worker to reload if it skipped numbers."""
        f = {as_str(k): v for k, v in fields.items()}
        wid = as_str(f.get("w", b""))
        batch = json.loads(f.get("b") or "[]")
        if "a" in f:  # an approximate router's decision, valid for its TTL from then
            sent_ms = int(entry_id.split("-", 1)[0])
            left = sent_ms / 1000 + int(f["a"]) / 1000 - time.time()
            if left > 0:
                index.remember(wid, [int(h, 16) for h in batch], time.monotonic() + left)
            return None
        if replay:
            return None  # the snapshot holds the workers' blocks already
        self.stats.lag_s = max(0.0, time.time() - int(entry_id.split("-", 1)[0]) / 1000)
        return None if index.apply(wid, int(f["s"]), batch) else wid


# ======================================================================================
# A synchronous view, for tools and tests
# ======================================================================================
@dataclass(slots=True)
class ApplyResult:
    status: int  # 1 applied, 0 duplicate (dropped), -1 the index needs a resync
    last_seq: int


class KVIndex:
    """Synchronous access to one pool's index in Redis: apply batches as a worker's
    publisher does, and read what a router starting now would see (live workers only;
    dead ones are pruned first, as routers prune them)."""

    def __init__(self, client: redis.Redis, pool: str) -> None:
        self._r = client
        self.pool = pool
        self._apply = client.register_script(APPLY_LUA)
        self._snapshot = client.register_script(SNAPSHOT_LUA)

    def apply(self, worker_id: str, seq: int,
              events: list[tuple[str, list[int]]] | Batch) -> ApplyResult:  # fmt: skip
        status, last = self._apply(args=apply_argv(self.pool, worker_id, seq, events))
        return ApplyResult(int(status), int(last))

    def prune(self) -> list[str]:
        """Forget the pool's dead workers, as routers do (:func:`cluster.membership.prune`)."""
        return prune(self._r, self.pool)

    def local(self) -> LocalIndex:
        """A :class:`LocalIndex` loaded from a snapshot of the live workers."""
        self.prune()
        _, workers = parse_snapshot(self._snapshot(args=snapshot_argv(self.pool)))
        index = LocalIndex()
        for w in workers:
            w.load_into(index)
        return index

    def overlaps(self, hashes: list[int]) -> dict[str, int]:
        """Each live worker's number of leading blocks of ``hashes`` held."""
        index = self.local()
        return index.overlaps(sorted(index.workers), hashes)

    def tier_overlaps(self, hashes: list[int]) -> dict[str, tuple[int, int, int]]:
        """Each live worker's leading blocks of ``hashes`` held in G1, G1 + G2, any tier."""
        index = self.local()
        return index.tier_overlaps(sorted(index.workers), hashes)

    def holders(self, block_hash: int) -> set[str]:
        return self.local().holders(block_hash)

    def worker_blocks(self, worker_id: str, tier: int = G1) -> set[int]:
        """The blocks Redis says ``worker_id`` holds in ``tier``."""
        key = index_keys(self.pool).tier_blocks(tier) + worker_id
        return {int(as_str(h), 16) for h in self._r.smembers(key)}
