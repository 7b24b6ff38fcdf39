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
