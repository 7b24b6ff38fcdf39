"""Paged KV block pool: fixed-size blocks, reference counts, and per-sequence block tables.

The pool only does accounting — which block ids are in use and by whom. The memory the ids
index (the engine's K/V tensors) belongs to the engine; ``kvbm`` never touches tensors here.

Public part:
    BlockPool         — allocate / free block ids with reference counts; cached blocks by
                        content hash, evicted least recently used first
    KVCacheManager    — block tables per sequence on top of a pool, with prefix caching
    Allocation        — what the engine gets back: the sequence's block ids
    PrefixMatch       — a new sequence's cached prefix in G1 and its prompt's block hashes
    KVEvent           — stored / removed notices (per tier) for the router's index

The lower tiers (G2 host memory, G3 disk) live in :mod:`kvbm.tiers` and
:mod:`kvbm.offload`; a block being copied out of this pool is pinned here (``pin``), so
it is not reused while the copy reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvbm.protocol import G1, ROOT_PARENT, ExtraKeys, block_hashes


@dataclass(slots=True)
class Allocation:
    """A sequence's view of the pool after an allocation: its whole block table."""

    block_ids: list[int]


@dataclass(slots=True)
class PrefixMatch:
    """What :meth:`KVCacheManager.match_prefix` found for a new sequence."""

    tokens: int  # prompt tokens covered by its cached blocks in this pool (G1)
    hashes: list[int]  # every full block of its tokens, chained (for the lower tiers)


@dataclass(slots=True)
class KVEvent:
    """A change to the set of cached blocks of one tier, for the KV-aware router's index."""

    kind: str  # "stored" | "removed" | "cleared"
    block_hashes: list[int]
    tier: int = G1  # kvbm.protocol.G1 / G2 / G3 ("cleared" covers every tier)


class BlockPool:
    """Fixed set of ``num_blocks`` KV blocks; ids ``0..num_blocks-1``.

    Blocks are reference counted. With prefix caching a full block carries the hash of its
    content; when its last reference goes it stays cached (reusable by hash) on the free
    list until it is needed again, least recently used first. "No room" is a return value
    (``None``), never an exception.
    """

    def __init__(self, num_blocks: int, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # free blocks in eviction order: the first is the least recently used
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._parent: dict[int, int] = {}  # cached block hash -> its parent's hash
        self._children: dict[int, set[int]] = {}  # hash -> cached children's hashes
        self._dups: dict[int, set[int]] = {}  # hash -> unnamed blocks with that content
        self._dup_of: dict[int, int] = {}  # such a block -> the hash of its content
        self._record = record_events
        self._events: list[KVEvent] = []
        self.num_evicted = 0
        # blocks a copy reads (offload to a lower tier): never reused while pinned, even
        # when free; pins do not move a block in the eviction order
        self._pins: dict[int, int] = {}
        self._free_pinned = 0  # free blocks that are pinned (not allocatable now)

    # ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take now (free and not pinned)."""
        return len(self._free) - self._free_pinned

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds (free blocks pinned by a copy are not counted)."""
        return self.num_blocks - len(self._free)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    @property
    def records_events(self) -> bool:
        return self._record

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (ref count 1 each), evicting cached content LRU-first;
        ``None`` if fewer than ``n`` are free (nothing is taken then)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free) - self._free_pinned:
            return None
        if self._free_pinned:  # few: skip them in eviction order
            out = []
            for b in self._free:
                if b not in self._pins:
                    out.append(b)
                    if len(out) == n:
                        break
            for b in out:
                del self._free[b]
        else:
            out = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            assert self._ref_cnt[b] == 0, f"block {b} on the free list has refs"
            self._evict(b)
            self._ref_cnt[b] = 1
        return out

    def incref(self, block_ids: list[int]) -> None:
        """Take another reference; a cached free block leaves the free list (a hit)."""
        for b in block_ids:
            if self._ref_cnt[b] == 0:
                del self._free[b]
                if b in self._pins:
                    self._free_pinned -= 1
            self._ref_cnt[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become free (most
        recently used last), keeping their cached content until evicted."""
        for b in block_ids:
            assert self._ref_cnt[b] > 0, f"double free of block {b}"
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free[b] = None
                if b in self._pins:
                    self._free_pinned += 1

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def pin(self, block_ids: list[int]) -> None:
        """Keep ``block_ids`` (held, full) from being reused until :meth:`unpin`: a copy
        to a lower tier reads them. Their place in the eviction order is kept."""
        for b in block_ids:
            assert self._ref_cnt[b] > 0 or b in self._pins, f"pinning free block {b}"
            n = self._pins.get(b, 0)
            self._pins[b] = n + 1

    def unpin(self, block_ids: list[int]) -> None:
        for b in block_ids:
            n = self._pins[b] - 1
            if n:
                self._pins[b] = n
                continue
            del self._pins[b]
            if self._ref_cnt[b] == 0:
                self._free_pinned -= 1

    # ----------------------------------------------------------------------------------
    def lookup(self, hashes: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes`` (not yet referenced)."""
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def cache(self, block_id: int, block_hash: int, parent: int = ROOT_PARENT) -> None:
        """Record that ``block_id`` (in use, full) holds the content named ``block_hash``,
        whose previous block is named ``parent`` (``ROOT_PARENT`` for a first block).

        Cached blocks always include their ancestors (the router's index relies on it):
        a block whose parent is not cached is unreachable by a prefix lookup, so it is not
        named; a block with content another block already holds is remembered as that
        block's duplicate and inherits the name if the other one is evicted first."""
        assert self._ref_cnt[block_id] > 0, f"caching free block {block_id}"
        if self._hash[block_id] is not None or block_id in self._dup_of:
            return
        if parent != ROOT_PARENT and parent not in self._cached:
            return
        if block_hash in self._cached:
            self._dup_of[block_id] = block_hash
            self._dups.setdefault(block_hash, set()).add(block_id)
            return
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        self._parent[block_hash] = parent
        self._children.setdefault(parent, set()).add(block_hash)
        if self._record:
            self._events.append(KVEvent("stored", [block_hash]))

    def cached_hashes(self) -> list[int]:
        """Every block hash currently cached (a snapshot for resyncing the index)."""
        return list(self._cached)

    @property
    def resettable(self) -> bool:
        """No block is held by a sequence or pinned by a copy (:meth:`reset` may run)."""
        return not self.num_used and not self._pins

    def reset(self) -> bool:
        """Forget every free block's content (vLLM's ``reset_prefix_cache``): each name
        goes, with a removed event. All or nothing: False, and nothing forgotten, while
        any block is held or pinned."""
        if not self.resettable:
            return False
        for b in list(self._free):
            self._evict(b)
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def hash_of(self, block_id: int) -> int | None:
        """The name of the content ``block_id`` holds (``None``: unnamed)."""
        return self._hash[block_id]

    def _evict(self, b: int) -> None:
        """Block ``b`` is about to be reused: its content goes."""
        d = self._dup_of.pop(b, None)
        if d is not None:
            self._drop_dup(d, b)
            return
        h = self._hash[b]
        if h is None:
            return
        heirs = self._dups.get(h)
        if heirs:  # the same content lives on in another block: it keeps the name
            heir = heirs.pop()
            self._drop_dup(h, heir, already_popped=True)
            self._hash[b] = None
            self._hash[heir] = h
            self._cached[h] = heir
            return
        self._unname(h)

    def _unname(self, h: int) -> None:
        """Forget the name ``h`` and, since they become unreachable, its descendants'."""
        b = self._cached.pop(h)
        self._hash[b] = None
        parent = self._parent.pop(h)
        siblings = self._children.get(parent)
        if siblings is not None:
            siblings.discard(h)
            if not siblings:
                del self._children[parent]
        for dup in self._dups.pop(h, ()):
            del self._dup_of[dup]
        self.num_evicted += 1
        if self._record:
            self._events.append(KVEvent("removed", [h]))
        for child in list(self._children.pop(h, ())):
            self._unname(child)

    def _drop_dup(self, h: int, b: int, already_popped: bool = False) -> None:
        if already_popped:
            del self._dup_of[b]
        else:
            self._dups[h].discard(b)
        if not self._dups[h]:
            del self._dups[h]


@dataclass(slots=True)
class _Table:
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # of the first len(hashes) blocks
    extra_keys: list[ExtraKeys] | None = None  # per block (images), if any
    namespace: int = 0  # what names its blocks apart: the model's, or a LoRA adapter's


class KVCacheManager:
    """Block tables per sequence over one :class:`BlockPool`, with prefix caching.

    ``allocate_slots(seq, n)`` grows ``seq``'s table so it can hold ``n`` tokens in total;
    ``find_prefix(seq, tokens)`` starts a new sequence on the cached blocks of its longest
    cached prefix; ``cache_blocks`` names the blocks a sequence has filled; ``fork`` starts
    a sequence on another's computed prompt (a request's later choices, ``n > 1``);
    ``free(seq)`` returns every block the sequence held (its last blocks become the first
    to evict).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        namespace: int = 0, record_events: bool = False,
    ) -> None:  # fmt: skip
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, record_events)
        self.caching = enable_prefix_caching
        self.namespace = namespace
        self._tables: dict[str, _Table] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        have = len(self._tables[seq_id].block_ids) if seq_id in self._tables else 0
        return self.blocks_needed(num_tokens) - have <= self.pool.num_free

    def find_prefix(
        self, seq_id: str, token_ids: list[int], extra_keys: list[ExtraKeys] | None = None,
        namespace: int | None = None,
    ) -> int:  # fmt: skip
        """Start ``seq_id`` on the cached blocks of its longest cached prefix; returns the
        number of tokens they cover (0 without a hit). At least one token is always left
        to compute, since the step that computes it also yields the next token.
        ``extra_keys``: per block, what else its content depends on (an image's hash);
        they name the sequence's blocks from now on, in ``namespace`` (default: the
        pool's; a LoRA adapter's request has its own: kvbm.protocol.model_namespace)."""
        return self.match_prefix(seq_id, token_ids, extra_keys, namespace).tokens

    def match_prefix(
        self, seq_id: str, token_ids: list[int], extra_keys: list[ExtraKeys] | None = None,
        namespace: int | None = None,
    ) -> PrefixMatch:  # fmt: skip
        """:meth:`find_prefix`, also returning the hashes of every full block of
        ``token_ids`` (where a lower tier may continue the match)."""
        assert seq_id not in self._tables, f"{seq_id} already has blocks"
        if not self.caching:
            return PrefixMatch(0, [])
        ns = self.namespace if namespace is None else namespace
        hashes = block_hashes(token_ids, self.block_size, ns, extra_keys)
        hits = self.pool.lookup(hashes)
        if hits and len(hits) * self.block_size >= len(token_ids):
            hits = hits[:-1]
        if not hits:
            self._tables[seq_id] = _Table(extra_keys=extra_keys, namespace=ns)
            return PrefixMatch(0, hashes)
        self.pool.incref(hits)
        self._tables[seq_id] = _Table(list(hits), hashes[: len(hits)], extra_keys, ns)
        return PrefixMatch(len(hits) * self.block_size, hashes)

    def allocate_slots(
        self, seq_id: str, num_tokens: int, extra_keys: list[ExtraKeys] | None = None,
        namespace: int | None = None,
    ) -> Allocation | None:  # fmt: skip
        """Make ``seq_id``'s table cover ``num_tokens`` tokens. ``None``: not enough room
        (nothing is allocated in that case). ``extra_keys`` and ``namespace`` name the
        blocks of a new table (a sequence whose KV is imported, not found by
        :meth:`find_prefix`)."""
        table = self._tables.get(seq_id)
        if table is None:
            ns = self.namespace if namespace is None else namespace
            table = self._tables[seq_id] = _Table(extra_keys=extra_keys, namespace=ns)
        extra = self.blocks_needed(num_tokens) - len(table.block_ids)
        if extra > 0:
            new = self.pool.allocate(extra)
            if new is None:
                if not table.block_ids:
                    del self._tables[seq_id]
                return None
            table.block_ids.extend(new)
        return Allocation(block_ids=table.block_ids)

    def cache_blocks(self, seq_id: str, token_ids: list[int], num_computed: int) -> int:
        """Name (hash) every block of ``seq_id`` that is full of computed tokens; returns
        how many of its blocks are named now."""
        if not self.caching:
            return 0
        table = self._tables[seq_id]
        full = min(num_computed // self.block_size, len(table.block_ids))
        done = len(table.hashes)
        if full <= done:
            return done
        parent = table.hashes[-1] if table.hashes else ROOT_PARENT
        new = block_hashes(token_ids[: full * self.block_size], self.block_size,
                           table.namespace, table.extra_keys, start=done,
                           parent=parent)  # fmt: skip
        for i, h in enumerate(new, start=done):
            self.pool.cache(table.block_ids[i], h, parent)
            parent = h
        table.hashes.extend(new)
        return full

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Start ``child_id`` on ``parent_id``'s first ``num_tokens`` tokens, computed: it
        shares their full blocks (one more reference each, their names with them) and gets
        a fresh block for a partial last one, whose KV the caller copies: the returned
        (parent's block, child's block); ``None`` when the last block is full. The caller
        checked that a block is free (:meth:`fork_blocks`)."""
        src = self._tables[parent_id]
        assert child_id not in self._tables, f"{child_id} already has blocks"
        full, partial = divmod(num_tokens, self.block_size)
        shared = src.block_ids[:full]
        new = self.pool.allocate(1) if partial else []
        assert new is not None, "forked without a free block for the partial last one"
        self.pool.incref(shared)
        self._tables[child_id] = _Table(shared + new, src.hashes[:full], src.extra_keys,
                                        src.namespace)  # fmt: skip
        return (src.block_ids[full], new[0]) if partial else None

    def fork_blocks(self, num_tokens: int) -> int:
        """The fresh blocks :meth:`fork` takes for a sequence of ``num_tokens`` tokens."""
        return 1 if num_tokens % self.block_size else 0

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id].block_ids

    def block_hashes(self, seq_id: str) -> list[int]:
        """The hashes of ``seq_id``'s named blocks, its first ones (read-only)."""
        return self._tables[seq_id].hashes

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def free(self, seq_id: str) -> int:
        """Release every block of ``seq_id``; returns how many it held (0 if unknown).
        Freed last-block-first, so a sequence's tail is evicted before its prefix."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        self.pool.free(list(reversed(table.block_ids)))
        return len(table.block_ids)

    @property
    def num_seqs(self) -> int:
        return len(self._tables)

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks
