"""Block hashing and prefix caching: stable hashes, longest-prefix hits, LRU eviction."""

from __future__ import annotations

import subprocess
import sys

from kvbm.block_pool import BlockPool, KVCacheManager
from kvbm.protocol import block_hash, block_hashes, namespace_hash


def test_hashes_are_stable_across_processes() -> None:
    tokens = list(range(100, 164))
    here = block_hashes(tokens, 16, namespace_hash("tiny-llava"))
    code = (
        "from kvbm.protocol import block_hashes, namespace_hash;"
        "print(block_hashes(list(range(100, 164)), 16, namespace_hash('tiny-llava')))"
    )
    # a fresh interpreter with a different hash seed: Python's hash() would differ
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONHASHSEED": "123"},
        check=True,
    )
    assert out.stdout.strip() == str(here)
    assert len(here) == 4 and len(set(here)) == 4


def test_hashes_chain_and_namespace() -> None:
    a = block_hashes([1] * 32, 16)
    assert a[1] == block_hash(a[0], [1] * 16)  # same tokens, different parent: different
    assert a[0] != a[1]
    assert block_hashes([1] * 32, 16, namespace_hash("other")) != a
    assert block_hashes([1] * 31, 16) == a[:1]  # only full blocks


def test_lookup_returns_longest_cached_prefix() -> None:
    m = KVCacheManager(8, 4)
    toks = list(range(12))
    m.allocate_slots("a", 12)
    m.cache_blocks("a", toks, 12)
    assert m.pool.num_cached == 3
    m.free("a")
    # same first 2 blocks, different third: hit of 8 tokens
    assert m.find_prefix("b", toks[:8] + [99, 98, 97, 96, 5]) == 8
    assert m.block_table("b") == [0, 1]
    # the whole prompt cached: the last block is recomputed (one token must be computed)
    assert m.find_prefix("c", toks) == 8
    assert m.pool.ref_count(0) == 2 and m.pool.ref_count(2) == 0


def test_eviction_is_least_recently_used_tail_first() -> None:
    m = KVCacheManager(4, 2)
    m.allocate_slots("a", 4)  # blocks 0, 1
    m.cache_blocks("a", [1, 2, 3, 4], 4)
    m.allocate_slots("b", 4)  # blocks 2, 3
    m.cache_blocks("b", [5, 6, 7, 8], 4)
    m.free("a")  # free list: 1, 0
    m.free("b")  # free list: 1, 0, 3, 2
    assert m.allocate_slots("c", 2).block_ids == [1]  # evicts a's tail first
    assert m.pool.num_evicted == 1
    assert m.find_prefix("d", [1, 2, 3, 4, 9]) == 2  # a's first block survived
    assert m.find_prefix("e", [5, 6, 7, 8, 9]) == 4


def test_events_recorded_when_asked() -> None:
    pool = BlockPool(2, record_events=True)
    [b] = pool.allocate(1)
    pool.cache(b, 42)
    pool.free([b])
    pool.allocate(2)  # evicts it
    assert [(e.kind, e.block_hashes) for e in pool.take_events()] == [
        ("stored", [42]),
        ("removed", [42]),
    ]
    assert pool.take_events() == []


def _events(pool: BlockPool) -> list[tuple[str, list[int]]]:
    return [(e.kind, e.block_hashes) for e in pool.take_events()]


def test_a_duplicate_block_inherits_the_name_of_an_evicted_copy() -> None:
    """BlockPool.cache: a block computed with content another block already holds is
    not named, but remembered; when the named copy is evicted first the duplicate takes
    the name over, so the content stays cached, with no event (the index's view does not
    change) and children can still hang off it."""
    pool = BlockPool(4, record_events=True)
    assert pool.allocate(2) == [0, 1]  # a sequence: blocks 10 -> 11
    pool.cache(0, 10)
    pool.cache(1, 11, parent=10)
    assert pool.allocate(1) == [2]  # another sequence computes block 10 again
    pool.cache(2, 10)
    assert _events(pool) == [("stored", [10]), ("stored", [11])]
    assert pool.lookup([10, 11]) == [0, 1] and pool.num_cached == 2
    pool.free([1, 0])  # the first sequence ends, tail first: free list 3, 1, 0
    assert pool.allocate(2) == [3, 1]  # evicts 11
    assert _events(pool) == [("removed", [11])]
    assert pool.allocate(1) == [0]  # evicts block 0: its content lives on in block 2
    assert _events(pool) == []
    assert pool.lookup([10, 11]) == [2] and pool.num_cached == 1 and pool.num_evicted == 1
    pool.cache(3, 12, parent=10)  # a child of the inherited name is reachable, so named
    assert _events(pool) == [("stored", [12])] and pool.lookup([10, 12]) == [2, 3]
    pool.free([2])
    assert pool.allocate(1) == [2]  # now the last copy goes, and its child with it
    assert _events(pool) == [("removed", [10]), ("removed", [12])]
    assert pool.lookup([10]) == [] and pool.num_cached == 0 and pool.num_evicted == 3


def test_an_evicted_duplicate_leaves_the_named_copy_alone() -> None:
    pool = BlockPool(3, record_events=True)
    assert pool.allocate(2) == [0, 1]
    pool.cache(0, 10)
    pool.cache(1, 10)  # same content, not named
    pool.free([1])
    assert pool.allocate(2) == [2, 1]  # block 1 reused: nothing was named there
    assert _events(pool) == [("stored", [10])]
    pool.free([0])
    assert pool.allocate(1) == [0]  # the named copy goes: no heir left to inherit
    assert _events(pool) == [("removed", [10])] and pool.lookup([10]) == []
