"""Offload and onboarding between the engine pool (G1), host memory (G2) and disk (G3).

:class:`OffloadManager` is driven from the engine thread, which owns every tier's
bookkeeping; copies run on threads of their own and report back through :meth:`poll`.
Nothing on the engine step's path waits for a copy or a disk write.

* **Offload, write-through.** A block named in G1 (full, hashed) is copied to G2 at once
  (:meth:`offer`); its G1 block is pinned (not reused) until the copy ends. G2 -> G3 admits
  a block only once Dynamo's frequency filter says it was hit often enough
  (:class:`kvbm.tiers.FrequencyFilter`: stored, then hit twice), or at once with the
  filter off. A block goes down only if the tier holds its parent, so every tier keeps
  the ancestors of what it holds (:mod:`kvbm.tiers`).
* **Onboarding.** :meth:`match` continues a new request's G1 prefix hit through G2, then
  G3, block by block; :meth:`start_onboard` pins what it found and returns a job whose
  :meth:`OnboardJob.run` (on a loader thread) copies the blocks into fresh G1 blocks;
  :meth:`finish_onboard` (engine thread) unpins them and says how many arrived intact. A
  G3 block that does not read back intact ends the job there: the rest is recomputed,
  the block (and what it holds below it) leaves G3, and the miss is counted.
* **Warm restart.** With a file store, the disk tier starts with the valid blocks a
  previous worker left in its directory and announces them (``stored`` events, tier G3).

The engine supplies the bytes (:class:`BlockCopier`); the disk tier's files are
:mod:`kvbm.disk`'s. torch-free.

Public part:
    BlockCopier     what the engine provides: copy blocks between G1 and G2, read a block
    OffloadManager  the tiers below G1, their copy threads, counters and KV events
    OnboardJob      one request's blocks on their way up
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvbm.block_pool import BlockPool, KVEvent
from kvbm.disk import BlockStore, BlockUnreadable
from kvbm.protocol import G1, G2, G3, ROOT_PARENT
from kvbm.tiers import FrequencyFilter, TierIndex

log = logging.getLogger(__name__)

# onboard latency histogram buckets, seconds (request admitted -> its blocks in G1)
ONBOARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class BlockCopier(Protocol):
    """The engine's side of tier moves. Called on copy threads, for blocks pinned on both
    ends while the call runs."""

    def g1_to_host(self, pairs: list[tuple[int, int]]) -> None:
        """Copy G1 blocks into host slots: ``(block id, slot)`` pairs."""

    def host_to_g1(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host slots into G1 blocks: ``(slot, block id)`` pairs."""

    def read(self, tier: int, index: int) -> memoryview | None:
        """The bytes of G1 block ``index`` or host slot ``index`` (``tier`` G1 or G2);
        ``None`` where the engine keeps no bytes (the mock engine)."""

    def write_g1(self, block_id: int, data: bytearray | None) -> None:
        """Fill G1 block ``block_id`` with one block's bytes (as :meth:`read` gave)."""


@dataclass(slots=True)
class OnboardJob:
    """One request's blocks coming up from G2 / G3 into G1 blocks it holds."""

    seq_id: str
    hashes: list[int]
    parents: list[int]
    tiers: list[int]  # G2 or G3, per block
    g1_blocks: list[int]
    slots: list[int | None]  # host slot of each G2 block
    started: float = field(default_factory=time.monotonic)
    # set by run(): blocks that arrived intact (a prefix), and why the next one did not
    loaded: int = 0
    failed: str | None = None
    copier: BlockCopier | None = None
    store: BlockStore | None = None

    def run(self) -> int:
        """Copy the blocks up, in order (a loader thread); stops at the first G3 block that
        does not read back intact. Returns the number loaded."""
        assert self.copier is not None
        i, n = 0, len(self.hashes)
        while i < n:
            if self.tiers[i] == G2:
                j = i
                while j < n and self.tiers[j] == G2:
                    j += 1
                self.copier.host_to_g1([(self.slots[k] or 0, self.g1_blocks[k])
                                        for k in range(i, j)])  # fmt: skip
                i = self.loaded = j
                continue
            assert self.store is not None
            try:
                data = self.store.read(self.hashes[i], self.parents[i])
            except BlockUnreadable as e:
                self.failed = str(e)
                break
            self.copier.write_g1(self.g1_blocks[i], data)
            i = self.loaded = i + 1
        return self.loaded


@dataclass(slots=True)
class _Store:
    """Blocks going down into one tier: ``(hash, slot)`` and where each is read from."""

    tier: int
    hashes: list[int]
    slots: list[int]
    sources: list[tuple[int, int]]  # (G1, block id) or (G2, slot)
    parents: list[int]
    ok: list[bool] = field(default_factory=list)


@dataclass(slots=True)
class Stats:
    matched_tokens: dict[int, int] = field(default_factory=lambda: {G1: 0, G2: 0, G3: 0})
    lookup_blocks: int = 0  # prompt blocks looked for below G1 (missed in G1)
    host_hit_blocks: int = 0
    disk_lookup_blocks: int = 0  # looked for in G3 (missed in G1 and G2)
    disk_hit_blocks: int = 0
    offload_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("d2h", "h2d", "d2d"), 0))  # fmt: skip
    onboard_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("h2d", "d2d"), 0))  # fmt: skip
    onboard_failures: int = 0  # G3 blocks that did not read back intact
    disk_write_errors: int = 0
    onboard_latency: list[int] = field(default_factory=lambda: [0] * (len(ONBOARD_BUCKETS) + 1))
    onboard_latency_sum: float = 0.0


class OffloadManager:
    """The tiers below G1 for one engine (see the module's docstring). Every method but
    the copy threads' runs on the engine thread."""

    def __init__(
        self,
        pool: BlockPool,
        copier: BlockCopier,
        block_size: int,
        block_bytes: int,
        host_blocks: int = 0,
        disk: BlockStore | None = None,
        disk_blocks: int = 0,
        disk_filter: bool = True,
        record_events: bool = True,
        filter_decay_s: float = 60.0,
    ) -> None:
        if host_blocks < 0 or disk_blocks < 0:
            raise ValueError("tier sizes must be >= 0 blocks")
        self.pool = pool
        self.copier = copier
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.host = TierIndex(G2, host_blocks, record_events) if host_blocks else None
        self.disk = TierIndex(G3, disk_blocks, record_events) if disk and disk_blocks else None
        self.store = disk if self.disk is not None else None
        self.filter: FrequencyFilter | None = None
        if disk_filter and self.disk is not None:
            entries = max(4 * (disk_blocks + host_blocks), 1024)
            self.filter = FrequencyFilter(decay_s=filter_decay_s, max_entries=entries)
        self.stats = Stats()
        self._events: list[KVEvent] = []
        self._batches: dict[int, _Store] = {}  # stores of this step, by tier (see flush)
        self._done: deque[_Store] = deque()
        self._waker: Callable[[], None] | None = None
        self._copy_q: queue.SimpleQueue = queue.SimpleQueue()  # G1 -> G2
        self._disk_q: queue.SimpleQueue = queue.SimpleQueue()  # writes and deletes, in order
        self._threads = []
        if self.host is not None:
            self._threads.append(self._spawn(self._copy_q, "kv-offload"))
        if self.disk is not None:
            self._threads.append(self._spawn(self._disk_q, "kv-disk"))
            self._warm_start()

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """Called (from a copy thread) when a copy ended: the engine loop has news."""
        self._waker = waker

    def close(self) -> None:
        for q in (self._copy_q, self._disk_q):
            q.put(None)

    # --- offload --------------------------------------------------------------------------
    def offer(self, block_ids: list[int], hashes: list[int], start: int) -> int:
        """Blocks ``hashes[start:]`` of a sequence (held in G1 as ``block_ids[i]``) were just
        named in G1: write them through to G2 (and to G3 when admitted), first any of their
        ancestors G2 lacks. Returns how far down the chain this sequence need not look
        again (``start`` for the next call)."""
        if self.host is None and self.disk is None:
            return len(hashes)
        if self.host is not None:
            start = self._walk_to_first_missing(self.host, hashes, start)
            stored = self._store_chain(self.host, block_ids, hashes, start)
            if stored < len(hashes):
                return stored  # no room (or a missing parent): try again next time
        elif self.disk is not None:
            for i in range(start, len(hashes)):  # no host tier: G1 -> G3 directly
                h = hashes[i]
                if self.filter is not None:
                    self.filter.offer(h)  # stored once: counts toward admission
                    continue
                if not self.disk.has_or_pending(h):
                    self._store_disk(h, self._parent(hashes, i), (G1, block_ids[i]))
            self._flush_drops()
        return len(hashes)

    def on_hit(self, hashes: list[int], g1_blocks: list[int]) -> None:
        """A request reuses blocks ``hashes`` (a prefix: G1 hit first, ``g1_blocks`` of
        them, then blocks found below): they count toward disk admission, go last in
        every tier's eviction order, and those now admitted go down to G3."""
        if self.host is not None:
            self.host.touch(hashes)
        if self.disk is None:
            return
        self.disk.touch(hashes)
        for i, h in enumerate(hashes):
            admitted = self.filter.offer(h) if self.filter is not None else True
            if not admitted or self.disk.has_or_pending(h):
                continue
            slot = self.host.slot(h) if self.host is not None else None
            if slot is not None:
                src = (G2, slot)
            elif i < len(g1_blocks):
                src = (G1, g1_blocks[i])
            else:
                continue
            self._store_disk(h, self._parent(hashes, i), src)
        self._flush_drops()

    # --- onboarding -----------------------------------------------------------------------
    def match(self, hashes: list[int], start: int, limit: int) -> list[int]:
        """The tier (G2 or G3) of each block of ``hashes[start:limit]`` found below G1, as
        long as they follow one another."""
        tiers: list[int] = []
        for i in range(start, limit):
            h = hashes[i]
            if self.host is not None and self.host.slot(h) is not None:
                tiers.append(G2)
            elif self.disk is not None and self.disk.slot(h) is not None:
                tiers.append(G3)
            else:
                break
        return tiers

    def count_lookup(self, g1_blocks: int, limit: int, tiers: list[int]) -> None:
        """A request's prompt matched ``g1_blocks`` blocks in G1 then ``tiers`` below, out
        of ``limit`` it could reuse: the matched tokens per tier and the hit rates."""
        st = self.stats
        bs = self.block_size
        n2 = tiers.count(G2)
        st.matched_tokens[G1] += g1_blocks * bs
        st.matched_tokens[G2] += n2 * bs
        st.matched_tokens[G3] += (len(tiers) - n2) * bs
        below = max(limit - g1_blocks, 0)
        st.lookup_blocks += below
        st.host_hit_blocks += n2
        st.disk_lookup_blocks += below - n2
        st.disk_hit_blocks += len(tiers) - n2

    def start_onboard(self, seq_id: str, hashes: list[int], start: int, tiers: list[int],
                      g1_blocks: list[int]) -> OnboardJob:  # fmt: skip
        """Pin blocks ``hashes[start:start + len(tiers)]`` where :meth:`match` found them,
        to be copied into ``g1_blocks`` by the job's :meth:`OnboardJob.run`."""
        mine = hashes[start : start + len(tiers)]
        parents = [self._parent(hashes, start + i) for i in range(len(mine))]
        slots: list[int | None] = []
        for h, t in zip(mine, tiers, strict=True):
            tier = self.host if t == G2 else self.disk
            assert tier is not None
            slot = tier.pin([h])[0]
            slots.append(slot if t == G2 else None)
        return OnboardJob(seq_id, mine, parents, list(tiers), list(g1_blocks), slots,
                          copier=self.copier, store=self.store)  # fmt: skip

    def finish_onboard(self, job: OnboardJob) -> int:
        """The job's copies ended: unpin its blocks; a G3 block that did not read back
        leaves G3 (with what it holds below it). Returns the blocks loaded intact."""
        for h, t in zip(job.hashes, job.tiers, strict=True):
            tier = self.host if t == G2 else self.disk
            if tier is not None:
                tier.unpin([h])
        st = self.stats
        for t, name in ((G2, "h2d"), (G3, "d2d")):
            st.onboard_blocks[name] += job.tiers[: job.loaded].count(t)
        if job.failed is not None and self.disk is not None:
            bad = job.hashes[job.loaded]
            log.warning("[%s] KV block %016x unreadable on disk (%s): recomputing from there",
                        job.seq_id, bad, job.failed)  # fmt: skip
            st.onboard_failures += 1
            self.disk.remove(bad)
            self._flush_drops()
        took = time.monotonic() - job.started
        st.onboard_latency[_bucket(took)] += 1
        st.onboard_latency_sum += took
        return job.loaded

    # --- completions, events, stats -------------------------------------------------------
    def poll(self) -> None:
        """Complete the copies that ended (engine thread); send what is batched."""
        while self._done:
            self._complete(self._done.popleft())
        self.flush()

    @property
    def busy(self) -> bool:
        """Copies are under way (their completions are still to come)."""
        return any(t.num_pinned for t in (self.host, self.disk) if t is not None)

    @property
    def resettable(self) -> bool:
        """No copy is under way (:meth:`reset` may run)."""
        return not self.busy and not self.num_pending

    def reset(self) -> bool:
        """Drop every block of the lower tiers (vLLM's ``reset_prefix_cache`` with
        ``reset_external``; disk files deleted by the disk thread). False, and nothing
        dropped, while copies are under way."""
        if not self.resettable:
            return False
        for t in (self.host, self.disk):
            if t is not None:
                for h in t.hashes():
                    t.remove(h)
        self._flush_drops()
        return True

    @property
    def num_pending(self) -> int:
        """Stores under way (G1 -> G2 copies, disk writes)."""
        return sum(t.num_pending for t in (self.host, self.disk) if t is not None)

    def take_events(self) -> list[KVEvent]:
        for t in (self.host, self.disk):
            if t is not None:
                self._events += t.take_events()
        events, self._events = self._events, []
        return events

    def cached_by_tier(self) -> dict[int, list[int]]:
        out = {}
        for t in (self.host, self.disk):
            if t is not None:
                out[t.tier] = t.hashes()
        return out

    def occupancy(self) -> dict[str, int]:
        out = {}
        for name, t in (("host", self.host), ("disk", self.disk)):
            out[f"{name}_blocks_used"] = len(t) if t is not None else 0
            out[f"{name}_blocks_total"] = t.capacity if t is not None else 0
            out[f"{name}_blocks_pinned"] = t.num_pinned if t is not None else 0
        return out

    def report(self) -> dict:
        """Counters for the heartbeat: plain JSON (tier numbers as strings)."""
        st = self.stats
        bb = self.block_bytes
        return {
            "matched_tokens": {f"g{t}": n for t, n in st.matched_tokens.items()},
            "lookup_blocks": st.lookup_blocks,
            "host_hit_blocks": st.host_hit_blocks,
            "disk_lookup_blocks": st.disk_lookup_blocks,
            "disk_hit_blocks": st.disk_hit_blocks,
            "offload_blocks": dict(st.offload_blocks),
            "offload_bytes": {k: n * bb for k, n in st.offload_blocks.items()},
            "onboard_blocks": dict(st.onboard_blocks),
            "onboard_bytes": {k: n * bb for k, n in st.onboard_blocks.items()},
            "onboard_failures": st.onboard_failures,
            "disk_write_errors": st.disk_write_errors,
            "onboard_latency_buckets": list(ONBOARD_BUCKETS),
            "onboard_latency_counts": list(st.onboard_latency),
            "onboard_latency_sum": round(st.onboard_latency_sum, 6),
            **self.occupancy(),
        }

    # ----------------------------------------------------------------------------------
    @staticmethod
    def _parent(hashes: list[int], i: int) -> int:
        return hashes[i - 1] if i else ROOT_PARENT

    @staticmethod
    def _walk_to_first_missing(tier: TierIndex, hashes: list[int], start: int) -> int:
        """From ``start``, skip the blocks ``tier`` holds or is storing (touching them);
        where the chain is broken (a block evicted since), go back to its start."""
        if start and not tier.has_or_pending(hashes[start - 1]):
            start = 0
        i = start
        while i < len(hashes) and tier.has_or_pending(hashes[i]):
            i += 1
        if i > start:
            tier.touch(hashes[start:i][::-1])
        return i

    def _store_chain(self, tier: TierIndex, block_ids: list[int], hashes: list[int],
                     start: int) -> int:  # fmt: skip
        """G1 -> G2 for ``hashes[start:]`` (G1 blocks ``block_ids``), in one copy; returns
        the index of the first block it could not take."""
        slots: list[int] = []
        new: list[int] = []  # indices of the blocks this call stores
        i = start
        while i < len(hashes):
            h = hashes[i]
            if not tier.has_or_pending(h):
                slot = tier.prepare_store(h, self._parent(hashes, i))
                if slot is None:
                    break
                slots.append(slot)
                new.append(i)
                if self.filter is not None:
                    self.filter.offer(h)  # stored once: counts toward disk admission
            i += 1
        if new:
            ids = [block_ids[j] for j in new]
            self.pool.pin(ids)
            job = self._batch(G2)
            job.hashes += [hashes[j] for j in new]
            job.slots += slots
            job.sources += [(G1, b) for b in ids]
            job.parents += [self._parent(hashes, j) for j in new]
        return i

    def _batch(self, tier: int) -> _Store:
        """This step's copies into ``tier``, sent as one job by :meth:`flush`."""
        job = self._batches.get(tier)
        if job is None:
            job = self._batches[tier] = _Store(tier, [], [], [], [])
        return job

    def flush(self) -> None:
        """Send this step's stores to the copy threads, one job per tier (the engine calls
        it once per step: one copy for every block named in the step)."""
        for tier, job in self._batches.items():
            (self._copy_q if tier == G2 else self._disk_q).put(job)
        self._batches.clear()

    def _store_disk(self, h: int, parent: int, src: tuple[int, int]) -> None:
        assert self.disk is not None
        slot = self.disk.prepare_store(h, parent)
        if slot is None:
            return
        if src[0] == G1:
            self.pool.pin([src[1]])
        else:
            assert self.host is not None
            self.host.pin([h])
        job = self._batch(G3)
        job.hashes.append(h)
        job.slots.append(slot)
        job.sources.append(src)
        job.parents.append(parent)

    def _complete(self, job: _Store) -> None:
        for h, ok, (src_tier, idx) in zip(job.hashes, job.ok, job.sources, strict=True):
            if src_tier == G1:
                self.pool.unpin([idx])
            elif self.host is not None:
                self.host.unpin([h])
            tier = self.host if job.tier == G2 else self.disk
            assert tier is not None
            held = tier.complete_store(h, ok)
            if job.tier == G2:
                self.stats.offload_blocks["d2h"] += ok
                if held and self.disk is not None and self.filter is None:
                    # no filter: G2 writes through to G3 as well
                    slot = self.host.slot(h) if self.host is not None else None
                    if slot is not None and not self.disk.has_or_pending(h):
                        self._store_disk(h, self._parent_of(h), (G2, slot))
            else:
                self.stats.offload_blocks["d2d" if src_tier == G1 else "h2d"] += ok
                self.stats.disk_write_errors += not ok
        if job.tier == G2 and self.host is not None:
            self.host.touch(job.hashes[::-1])  # parents end up more recent than children
        self._flush_drops()

    def _parent_of(self, h: int) -> int:
        assert self.host is not None
        return self.host.parent(h)

    def _flush_drops(self) -> None:
        if self.disk is not None:
            for h in self.disk.take_dropped():
                self._disk_q.put(("delete", h))
        if self.host is not None:
            self.host.take_dropped()

    def _spawn(self, q: queue.SimpleQueue, name: str) -> threading.Thread:
        t = threading.Thread(target=self._work, args=(q,), name=name, daemon=True)
        t.start()
        return t

    def _work(self, q: queue.SimpleQueue) -> None:
        """A copy thread: runs jobs in order, hands each back to the engine thread."""
        while True:
            job = q.get()
            if job is None:
                return
            if isinstance(job, tuple):  # ("delete", hash): a block left G3
                try:
                    assert self.store is not None
                    self.store.delete(job[1])
                except OSError as e:
                    log.warning("KV disk tier: deleting %016x failed: %s", job[1], e)
                continue
            try:
                if job.tier == G2:
                    self.copier.g1_to_host([(b, s) for (_, b), s in
                                            zip(job.sources, job.slots, strict=True)])  # fmt: skip
                    job.ok = [True] * len(job.hashes)
                else:
                    for h, parent, (t, idx) in zip(job.hashes, job.parents, job.sources,
                                                   strict=True):  # fmt: skip
                        assert self.store is not None
                        try:
                            self.store.write(h, parent, self.copier.read(t, idx))
                            job.ok.append(True)
                        except OSError as e:
                            log.warning("KV disk tier: writing %016x failed: %s", h, e)
                            job.ok.append(False)
            except Exception:  # noqa: BLE001 - a failed copy stores nothing, the engine goes on
                log.exception("KV offload copy failed")
                job.ok = [False] * len(job.hashes)
            self._done.append(job)
            if self._waker is not None:
                self._waker()

    def _warm_start(self) -> None:
        """Take in what the disk directory holds from before, and announce it."""
        assert self.disk is not None and self.store is not None
        t0 = time.monotonic()
        found = self.store.scan()
        kept = self.disk.load(found)
        gone = {h for h, _ in found} - set(kept)
        for h in gone:  # orphans (parent missing) and what exceeds the capacity
            self.store.delete(h)
        if kept:
            self._events.append(KVEvent("stored", kept, G3))
            log.info("KV disk tier: %d blocks from a previous run (%d dropped) in %.2fs",
                     len(kept), len(gone), time.monotonic() - t0)  # fmt: skip


def _bucket(seconds: float) -> int:
    for i, b in enumerate(ONBOARD_BUCKETS):
        if seconds <= b:
            return i
    return len(ONBOARD_BUCKETS)
