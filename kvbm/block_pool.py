"""Paged KV block pool: fixed-size blocks, reference counts, and per-sequence block tables.

The pool only does accounting — which block ids are in use and by whom. The memory the ids
index (the engine's K/V tensors) belongs to the engine; ``kvbm`` never touches tensors here.

Public part:
    BlockPool         — allocate / free block ids with reference counts
    KVCacheManager    — block tables per sequence on top of a pool
    Allocation        — what the engine gets back: the sequence's block ids
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class Allocation:
    """A sequence's view of the pool after an allocation: its whole block table and how
    many of its leading tokens were already cached (0 until prefix caching lands)."""

    block_ids: list[int]
    num_cached_tokens: int = 0


class BlockPool:
    """Fixed set of ``num_blocks`` KV blocks; ids ``0..num_blocks-1``.

    Blocks are reference counted so that later layers (prefix sharing, transfer pins) can
    hold a block beyond its first owner. "No room" is a return value (``None``), never an
    exception.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    # ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (ref count 1 each), or ``None`` if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            assert self._ref_cnt[b] == 0, f"block {b} on the free list has refs"
            self._ref_cnt[b] = 1
        return out

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            assert self._ref_cnt[b] > 0, f"incref on free block {b}"
            self._ref_cnt[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the pool."""
        for b in block_ids:
            assert self._ref_cnt[b] > 0, f"double free of block {b}"
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free.append(b)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]


@dataclass(slots=True)
class _Table:
    block_ids: list[int] = field(default_factory=list)


class KVCacheManager:
    """Block tables per sequence over one :class:`BlockPool`.

    ``allocate_slots(seq, n)`` grows ``seq``'s table so it can hold ``n`` tokens in total;
    ``free(seq)`` returns every block the sequence held.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, _Table] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        have = len(self._tables[seq_id].block_ids) if seq_id in self._tables else 0
        return self.blocks_needed(num_tokens) - have <= self.pool.num_free

    def allocate_slots(self, seq_id: str, num_tokens: int) -> Allocation | None:
        """Make ``seq_id``'s table cover ``num_tokens`` tokens. ``None``: not enough room
        (nothing is allocated in that case)."""
        table = self._tables.get(seq_id)
        if table is None:
            table = self._tables[seq_id] = _Table()
        extra = self.blocks_needed(num_tokens) - len(table.block_ids)
        if extra > 0:
            new = self.pool.allocate(extra)
            if new is None:
                if not table.block_ids:
                    del self._tables[seq_id]
                return None
            table.block_ids.extend(new)
        return Allocation(block_ids=table.block_ids)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id].block_ids

    def free(self, seq_id: str) -> int:
        """Release every block of ``seq_id``; returns how many it held (0 if unknown)."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        self.pool.free(table.block_ids)
        return len(table.block_ids)

    @property
    def num_seqs(self) -> int:
        return len(self._tables)

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks
