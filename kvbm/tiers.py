"""The bookkeeping of a lower KV tier (G2 host memory, G3 disk), and the disk admission filter.

A :class:`TierIndex` knows which block hashes a tier holds, in which of its fixed slots,
and in what order to evict them; it never touches block contents (the engine's copier and
:mod:`kvbm.disk` do). Moves are two-phase, as in vLLM's ``kv_offload``: ``prepare_store``
reserves a slot (``None``: no room) and pins it, the copy runs on another thread,
``complete_store`` makes the block visible (or drops it); ``prepare_load`` pins blocks a
copy reads, ``complete_load`` unpins them. Everything here runs on the engine thread.

Ancestors always stay (the KV router's bisection relies on it, :mod:`cluster.index`): a tier
takes a block only if it holds the block's parent already (or is taking it in the same
batch), and evicts only leaves (blocks none of whose children it holds), least recently
used first. A sequence's tail therefore goes before its prefix, and every tier, on its
own, holds a set closed under "parent of" — so do the engine pool (G1, see
:class:`kvbm.block_pool.BlockPool`) and any union of tiers.

Public part:
    TierIndex        one lower tier's blocks: slots, LRU-of-leaves eviction, pins, events
    FrequencyFilter  Dynamo's disk offload filter: a block's count starts at 1, doubles
                     on each hit and decays by 1 per period; admitted at DISK_MIN_FREQUENCY
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvbm.block_pool import KVEvent
from kvbm.protocol import ROOT_PARENT

# A block reaches G3 once stored and hit twice (1 -> 2 -> 4), as Dynamo's filter admits
DISK_MIN_FREQUENCY = 4


@dataclass(slots=True)
class _Entry:
    slot: int
    parent: int
    kids: set[int] = field(default_factory=set)  # its children held or being stored here
    pins: int = 0  # copies reading it (a load, or a store to the tier below)
    used: int = 0  # logical time of its last use (LRU)
    doomed: bool = False  # removed while pinned or parent of a pending store: goes later


class TierIndex:
    """One lower tier: ``capacity`` slots, block hash -> slot, parents, pins, LRU."""

    def __init__(self, tier: int, capacity: int, record_events: bool = True) -> None:
        if capacity < 1:
            raise ValueError(f"a tier needs at least one block, got {capacity}")
        self.tier = tier
        self.capacity = capacity
        self._entries: dict[int, _Entry] = {}
        self._pending: dict[int, tuple[int, int]] = {}  # hash -> (slot, parent): storing
        self._pending_kids: dict[int, set[int]] = {}  # pending hash -> its pending children
        self._free_slots = list(range(capacity - 1, -1, -1))  # pop() gives slot 0 first
        self._leaves: list[tuple[int, int]] = []  # heap of (used, hash), stale ones skipped
        self._clock = 0
        self._pinned = 0  # held blocks with pins
        self._record = record_events
        self._events: list[KVEvent] = []
        self._dropped: list[int] = []  # hashes that left the tier (a disk deletes files)
        self.evicted = 0

    # --- reading ------------------------------------------------------------------------
    def __contains__(self, h: int) -> bool:
        return h in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_used(self) -> int:
        """Slots taken: blocks held plus blocks being stored."""
        return self.capacity - len(self._free_slots)

    @property
    def num_pinned(self) -> int:
        """Blocks a copy reads or writes now (held and pinned, or being stored)."""
        return self._pinned + len(self._pending)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def slot(self, h: int) -> int | None:
        e = self._entries.get(h)
        return None if e is None or e.doomed else e.slot

    def has_or_pending(self, h: int) -> bool:
        return h in self._entries or h in self._pending

    def hashes(self) -> list[int]:
        return list(self._entries)

    def parent(self, h: int) -> int:
        return self._entries[h].parent

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def take_dropped(self) -> list[int]:
        """Hashes that left the tier since the last call (evicted or removed)."""
        out, self._dropped = self._dropped, []
        return out

    # --- use ----------------------------------------------------------------------------
    def touch(self, hashes: list[int]) -> None:
        """``hashes`` were just used (a hit, a store): they go last in eviction order."""
        for h in hashes:
            e = self._entries.get(h)
            if e is not None:
                self._clock += 1
                e.used = self._clock
                if not e.kids:
                    heapq.heappush(self._leaves, (e.used, h))
        if len(self._leaves) > 4 * len(self._entries) + 64:
            self._rebuild_leaves()

    # --- two-phase store ----------------------------------------------------------------
    def prepare_store(self, h: int, parent: int) -> int | None:
        """A slot to copy block ``h`` into, pinned until :meth:`complete_store`; ``None``
        when the tier holds or is storing it already, its parent is neither held nor
        being stored, or no slot can be freed (everything left is pinned or a parent)."""
        if h in self._entries or h in self._pending:
            return None
        pe = self._entries.get(parent)
        if parent != ROOT_PARENT and (pe is None or pe.doomed) and parent not in self._pending:
            return None
        if not self._free_slots and self._evict_one(keep=parent) is None:
            return None
        slot = self._free_slots.pop()
        self._pending[h] = (slot, parent)
        if pe is not None:
            pe.kids.add(h)  # a parent stays while a child is on its way in
        elif parent != ROOT_PARENT:
            self._pending_kids.setdefault(parent, set()).add(h)
        return slot

    def complete_store(self, h: int, ok: bool = True) -> bool:
        """The copy into ``h``'s slot ended; the block is held from now on if it succeeded
        and its parent is still here. Returns whether it is held."""
        slot, parent = self._pending.pop(h)
        kids = self._pending_kids.pop(h, set())
        pe = self._entries.get(parent)
        if not ok or (parent != ROOT_PARENT and (pe is None or pe.doomed)):
            self._free_slots.append(slot)
            if pe is not None:
                pe.kids.discard(h)
                self._maybe_leaf(parent, pe)
            return False  # its own pending children fail at their end: no parent
        self._clock += 1
        e = self._entries[h] = _Entry(slot, parent, kids, used=self._clock)
        if not kids:
            heapq.heappush(self._leaves, (e.used, h))
        if self._record:
            self._events.append(KVEvent("stored", [h], self.tier))
        return True

    # --- two-phase load (or a read by the tier below) ------------------------------------
    def pin(self, hashes: list[int]) -> list[int]:
        """Pin held blocks a copy is about to read; their slots, in order."""
        out = []
        for h in hashes:
            e = self._entries[h]
            self._pinned += e.pins == 0
            e.pins += 1
            out.append(e.slot)
        return out

    def unpin(self, hashes: list[int]) -> None:
        for h in hashes:
            e = self._entries.get(h)
            if e is not None:
                e.pins -= 1
                self._pinned -= e.pins == 0
                self._maybe_leaf(h, e)

    # --- removal ------------------------------------------------------------------------
    def remove(self, h: int) -> None:
        """Drop ``h`` and every descendant it holds (a corrupt or missing block: they would
        be unreachable). Pinned ones, and parents of blocks being stored, go as soon as
        their copies end."""
        e = self._entries.get(h)
        if e is None or e.doomed:
            return
        e.doomed = True
        for child in list(e.kids):
            self.remove(child)
        if self._entries.get(h) is e:  # not dropped already, with its last child
            self._maybe_leaf(h, e)

    def evict_for(self, n: int) -> list[int]:
        """Evict until ``n`` slots are free (or nothing more can go); the hashes evicted."""
        out: list[int] = []
        while len(self._free_slots) < n:
            h = self._evict_one()
            if h is None:
                break
            out.append(h)
        return out

    def load(self, blocks: list[tuple[int, int]]) -> list[int]:
        """Fill an empty tier with what it held before (a disk scan): ``(hash, parent)``
        pairs, least recently used first. A block whose parent is not among them, and
        blocks past the capacity (the least recently used go), are left out; returns
        the hashes taken. No events (the caller announces them)."""
        assert not self._entries and not self._pending, "loading a tier that holds blocks"
        present = {h for h, _ in blocks}
        parent_of = dict(blocks)
        ok: dict[int, bool] = {}

        def rooted(h: int) -> bool:  # iterative: chains may be long
            path = []
            while h not in ok:
                p = parent_of.get(h)
                if p is None or (p != ROOT_PARENT and p not in present):
                    ok[h] = False
                    break
                path.append(h)
                if p == ROOT_PARENT:
                    ok[h] = True
                    break
                h = p
            verdict = ok[h]
            for x in path:
                ok[x] = verdict
            return verdict

        kept = [(h, p) for h, p in blocks if rooted(h)]
        if len(kept) > self.capacity:  # too many: drop least recently used leaves first
            rank = {h: i for i, (h, _) in enumerate(kept)}
            kids: dict[int, int] = {}
            for _, p in kept:
                kids[p] = kids.get(p, 0) + 1
            heap = [(rank[h], h) for h, _ in kept if not kids.get(h)]
            heapq.heapify(heap)
            dropped: set[int] = set()
            for _ in range(len(kept) - self.capacity):
                _, h = heapq.heappop(heap)
                dropped.add(h)
                p = parent_of[h]
                kids[p] -= 1
                if p != ROOT_PARENT and kids[p] == 0:
                    heapq.heappush(heap, (rank[p], p))
            kept = [(h, p) for h, p in kept if h not in dropped]
        depth: dict[int, int] = {ROOT_PARENT: -1}

        def depth_of(h: int) -> int:
            path = []
            while h not in depth:
                path.append(h)
                h = parent_of[h]
            d = depth[h]
            for x in reversed(path):
                d += 1
                depth[x] = d
            return d

        for h, p in sorted(kept, key=lambda hp: depth_of(hp[0])):  # parents first
            self._entries[h] = _Entry(self._free_slots.pop(), p)
            if p != ROOT_PARENT:
                self._entries[p].kids.add(h)
        for i, (h, _) in enumerate(kept):
            self._entries[h].used = i + 1
        self._clock = len(kept)
        self._rebuild_leaves()
        return [h for h, _ in kept]

    # ----------------------------------------------------------------------------------
    def _maybe_leaf(self, h: int, e: _Entry) -> None:
        """``e`` may have become a leaf: evictable again, or gone if it was doomed."""
        if e.kids or e.pins:
            return
        if e.doomed:
            self._drop(h, e)
        else:
            heapq.heappush(self._leaves, (e.used, h))

    def _evict_one(self, keep: int = ROOT_PARENT) -> int | None:
        """Evict the least recently used unpinned leaf (not ``keep``); its hash, or
        ``None`` if there is none."""
        skipped = []
        victim = None
        while self._leaves:
            used, h = heapq.heappop(self._leaves)
            e = self._entries.get(h)
            if e is None or e.used != used or e.kids:
                continue  # stale: touched since, a parent now, or gone
            if e.pins or h == keep:
                skipped.append((used, h))
                continue
            victim = h
            break
        for item in skipped:
            heapq.heappush(self._leaves, item)
        if victim is None:
            return None
        self._drop(victim, self._entries[victim])
        self.evicted += 1
        return victim

    def _drop(self, h: int, e: _Entry) -> None:
        del self._entries[h]
        self._free_slots.append(e.slot)
        self._dropped.append(h)
        if self._record:
            self._events.append(KVEvent("removed", [h], self.tier))
        pe = self._entries.get(e.parent)
        if pe is not None:
            pe.kids.discard(h)
            self._maybe_leaf(e.parent, pe)

    def _rebuild_leaves(self) -> None:
        self._leaves = [(e.used, h) for h, e in self._entries.items() if not e.kids]
        heapq.heapify(self._leaves)


class FrequencyFilter:
    """Which blocks deserve the disk (Dynamo's ``FrequencyFilter``): ``offer(h)`` counts a
    use of block ``h`` — 1 the first time, doubled each time after — and says whether it
    reached ``threshold``. Every ``decay_s`` each count drops by 1 (applied lazily, when
    the block is next offered), so a block hit long ago starts over. At most
    ``max_entries`` are remembered, the least recently offered forgotten first."""

    def __init__(self, threshold: int = DISK_MIN_FREQUENCY, decay_s: float = 60.0,
                 max_entries: int = 100_000) -> None:  # fmt: skip
        if threshold < 1 or decay_s <= 0 or max_entries < 1:
            raise ValueError("threshold and max_entries must be >= 1, decay_s > 0")
        self.threshold = threshold
        self.decay_s = decay_s
        self.max_entries = max_entries
        self._counts: OrderedDict[int, tuple[int, int]] = OrderedDict()  # h -> (count, epoch)

    def offer(self, h: int, now: float | None = None) -> bool:
        """Count a use of ``h`` at ``now`` (``time.monotonic()``); whether it is admitted."""
        epoch = int((time.monotonic() if now is None else now) / self.decay_s)
        old = self._counts.pop(h, None)
        count = 1
        if old is not None:
            left = old[0] - (epoch - old[1])
            count = left * 2 if left > 0 else 1
        self._counts[h] = (count, epoch)
        if len(self._counts) > self.max_entries:
            self._counts.popitem(last=False)
        return count >= self.threshold

    def count(self, h: int) -> int:
        c = self._counts.get(h)
        return 0 if c is None else c[0]
