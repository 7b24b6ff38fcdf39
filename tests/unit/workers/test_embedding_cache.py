"""The embedding cache: LRU by content hash within a byte budget, exact eviction order."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tasks.settings import Settings
from workers.embedding_cache import EmbeddingCache, EmbeddingCacheStats

ROW = 100  # bytes of one float32 embedding row of 25 values


def emb(rows: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((rows, 25), fill, dtype=torch.float32)


def test_hit_miss_and_recency() -> None:
    c = EmbeddingCache(max_bytes=3 * ROW)
    assert c.get("a") is None
    a, b, d = emb(1, 1.0), emb(1, 2.0), emb(1, 3.0)
    assert c.put("a", a) and c.put("b", b) and c.put("d", d)
    assert c.keys() == ["a", "b", "d"]
    assert c.get("a") is a  # the same object back, now most recent
    assert c.keys() == ["b", "d", "a"]
    assert c.stats() == EmbeddingCacheStats(hits=1, misses=1, evictions=0, entries=3,
                                            bytes=3 * ROW, max_bytes=3 * ROW)  # fmt: skip


def test_exact_eviction_order() -> None:
    c = EmbeddingCache(max_bytes=10 * ROW)
    for key, rows in [("a", 3), ("b", 2), ("c", 4)]:  # 9 rows
        assert c.put(key, emb(rows))
    c.get("a")  # order now b, c, a
    assert c.put("d", emb(3))  # 9 + 3 > 10: b (least recent) goes; 7 + 3 fits
    assert c.keys() == ["c", "a", "d"]
    assert c.stats().evictions == 1 and c.stats().bytes == 10 * ROW
    assert c.put("e", emb(5))  # 10 + 5: evict c (4 rows) -> 11 > 10, evict a -> 8 fits
    assert c.keys() == ["d", "e"]
    assert c.stats().evictions == 3 and c.stats().bytes == 8 * ROW
    assert c.get("b") is None and c.get("c") is None and c.get("a") is None
    assert c.get("d") is not None
    assert c.stats().hits == 2 and c.stats().misses == 3


def test_replace_and_oversize() -> None:
    c = EmbeddingCache(max_bytes=4 * ROW)
    c.put("a", emb(2, 1.0))
    c.put("b", emb(1))
    assert c.put("a", emb(3, 7.0))  # replaced: 3 + 1 = 4 fits, nothing evicted
    assert c.keys() == ["b", "a"] and c.stats().bytes == 4 * ROW
    assert c.stats().evictions == 0
    assert float(c.get("a")[0, 0]) == 7.0
    assert not c.put("big", emb(5))  # larger than the budget: not kept, nothing evicted
    assert c.keys() == ["b", "a"] and "big" not in c
    assert not c.put("a", emb(5))  # an oversize replacement drops the old value
    assert c.keys() == ["b"] and c.stats().bytes == ROW


def test_disabled_and_numpy() -> None:
    off = EmbeddingCache(max_bytes=0)
    assert not off.put("a", emb(1)) and off.get("a") is None
    assert off.stats().entries == 0 and off.stats().misses == 1
    c = EmbeddingCache(max_bytes=ROW)
    assert c.put("n", np.zeros(25, dtype=np.float32))  # anything with nbytes
    assert c.stats().bytes == ROW
    c.clear()
    assert c.stats().entries == 0 and c.stats().bytes == 0
    with pytest.raises(ValueError, match=">= 0"):
        EmbeddingCache(-1)


def test_threads_keep_the_budget() -> None:
    c = EmbeddingCache(max_bytes=16 * ROW)

    def work(t: int) -> None:
        for i in range(200):
            c.put(f"{t}-{i % 40}", emb(1 + i % 3))
            c.get(f"{(t + 1) % 4}-{i % 40}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    s = c.stats()
    assert s.bytes <= 16 * ROW
    assert s.hits + s.misses == 4 * 200
    assert 0 < s.evictions and s.entries + s.evictions <= 4 * 200  # each from a put
    assert s.bytes == sum(int(c.get(k).nbytes) for k in c.keys())


def test_setting_default_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().multimodal.encoder_cache_mb == 256
    monkeypatch.setenv("CONVEYOR_ENCODER_CACHE_MB", "8")
    assert Settings().multimodal.encoder_cache_mb == 8
