"""BlockPool / KVCacheManager accounting: exact ids, ref counts, FIFO reuse."""

from __future__ import annotations

import pytest

from kvbm.block_pool import BlockPool, KVCacheManager

# ---------------------------------------------------------------------------- BlockPool


def test_pool_rejects_empty() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_takes_lowest_ids_first_and_sets_refcount() -> None:
    pool = BlockPool(8)
    assert (pool.num_free, pool.num_used) == (8, 0)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert (pool.num_free, pool.num_used) == (3, 5)
    assert [pool.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_allocate_zero_and_negative() -> None:
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free == 2
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_allocate_out_of_room_returns_none_and_takes_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert (pool.num_free, pool.num_used) == (1, 3)
    assert pool.ref_count(3) == 0
    assert pool.allocate(1) == [3]  # the one left is still allocatable
    assert pool.allocate(1) is None


def test_exact_fit_then_exhausted() -> None:
    pool = BlockPool(3)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free == 0
    assert pool.allocate(1) is None


def test_free_returns_blocks_in_fifo_order() -> None:
    pool = BlockPool(6)
    a = pool.allocate(4)
    assert a == [0, 1, 2, 3]
    pool.free([2, 0])
    # free list was [4, 5]; freed blocks are appended in the order given
    assert pool.allocate(4) == [4, 5, 2, 0]
    pool.free([3])
    pool.free([1])
    assert pool.allocate(2) == [3, 1]
    assert pool.num_free == 0


def test_refcount_keeps_block_until_last_reference() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.incref([b])
    assert pool.ref_count(b) == 3
    pool.free([b])
    pool.free([b])
    assert pool.ref_count(b) == 1
    assert pool.num_free == 2  # still held
    pool.free([b])
    assert pool.ref_count(b) == 0
    assert pool.num_free == 3
    assert pool.allocate(3) == [1, 2, 0]


def test_double_free_asserts() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks)
    assert pool.num_free == 2


def test_free_of_never_allocated_block_asserts() -> None:
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.free([1])


def test_incref_on_free_block_takes_it_off_the_free_list() -> None:
    """A free block that is still cached can be referenced again (a prefix-cache hit)."""
    pool = BlockPool(3)
    pool.incref([1])
    assert pool.ref_count(1) == 1 and pool.num_free == 2
    assert pool.allocate(2) == [0, 2]


# ----------------------------------------------------------------------- KVCacheManager


def test_manager_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)


def test_blocks_needed_rounds_up() -> None:
    m = KVCacheManager(8, 16)
    assert [m.blocks_needed(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_slots_grows_across_block_boundaries() -> None:
    m = KVCacheManager(8, 4)
    a = m.allocate_slots("s", 1)
    assert a is not None and a.block_ids == [0]
    assert m.allocate_slots("s", 4).block_ids == [0]  # same block still covers 4 tokens
    assert m.pool.num_used == 1
    assert m.allocate_slots("s", 5).block_ids == [0, 1]
    assert m.allocate_slots("s", 8).block_ids == [0, 1]
    assert m.allocate_slots("s", 13).block_ids == [0, 1, 2, 3]
    assert m.block_table("s") == [0, 1, 2, 3]
    assert m.allocate_slots("s", 2).block_ids == [0, 1, 2, 3]  # never shrinks
    assert m.pool.num_used == 4
    assert m.num_seqs == 1
    assert m.usage == 0.5


def test_interleaved_sequences_get_distinct_blocks() -> None:
    m = KVCacheManager(6, 2)
    m.allocate_slots("a", 2)
    m.allocate_slots("b", 3)
    m.allocate_slots("a", 3)
    assert m.block_table("a") == [0, 3]
    assert m.block_table("b") == [1, 2]
    assert m.num_seqs == 2


def test_allocate_slots_failure_allocates_nothing() -> None:
    m = KVCacheManager(4, 4)
    assert m.allocate_slots("a", 12).block_ids == [0, 1, 2]
    # new sequence that does not fit: no table left behind, pool untouched
    assert m.allocate_slots("b", 8) is None
    assert m.num_seqs == 1
    assert m.pool.num_free == 1
    with pytest.raises(KeyError):
        m.block_table("b")
    # existing sequence growing past the pool: its table is unchanged
    assert m.allocate_slots("a", 20) is None
    assert m.block_table("a") == [0, 1, 2]
    assert m.pool.num_free == 1
    assert m.allocate_slots("a", 16).block_ids == [0, 1, 2, 3]


def test_can_allocate() -> None:
    m = KVCacheManager(4, 4)
    m.allocate_slots("a", 8)
    assert m.can_allocate("a", 16)
    assert not m.can_allocate("a", 17)
    assert m.can_allocate("new", 8)
    assert not m.can_allocate("new", 9)


def test_free_returns_count_and_tail_blocks_go_back_first() -> None:
    m = KVCacheManager(5, 4)
    m.allocate_slots("a", 9)  # [0, 1, 2]
    m.allocate_slots("b", 4)  # [3]
    assert m.free("a") == 3
    assert m.free("a") == 0  # unknown now
    assert m.free("never") == 0
    assert m.num_seqs == 1
    assert m.pool.num_used == 1
    # free list: [4, 2, 1, 0] — a sequence is freed tail first, so its prefix blocks
    # (the most reusable) are the last to be evicted
    assert m.allocate_slots("c", 16).block_ids == [4, 2, 1, 0]
    assert m.free("b") == 1
    assert m.free("c") == 4
    assert m.pool.num_used == 0
    assert m.usage == 0.0
    assert [m.pool.ref_count(b) for b in range(5)] == [0] * 5


def test_reset_forgets_every_free_block_and_refuses_while_any_is_held() -> None:
    pool = BlockPool(6, record_events=True)
    a, b, c = pool.allocate(3)  # type: ignore[misc]
    pool.cache(a, 11)
    pool.cache(b, 12, parent=11)
    pool.cache(c, 21)
    pool.take_events()
    pool.free([a, b])
    assert not pool.resettable and not pool.reset()  # c is held: nothing forgotten
    assert pool.num_cached == 3 and pool.take_events() == []
    pool.free([c])
    assert pool.reset() and pool.num_cached == 0 and pool.lookup([11, 12]) == []
    removed = sorted(h for e in pool.take_events() if e.kind == "removed" for h in e.block_hashes)
    assert removed == [11, 12, 21]
    assert pool.num_free == 6 and pool.reset()  # nothing cached: a no-op that succeeds
    # a free block a copy still reads (pinned) holds the reset back too
    (d,) = pool.allocate(1)  # type: ignore[misc]
    pool.cache(d, 31)
    pool.pin([d])
    pool.free([d])
    assert not pool.reset() and pool.num_cached == 1
    pool.unpin([d])
    assert pool.reset() and pool.num_cached == 0
