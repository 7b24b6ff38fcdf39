"""An LRU cache of image embeddings, keyed by the image's content hash, bounded in bytes.

An encode worker looks an image up before running the vision tower and stores what it
computed after; an image seen before (the same bytes, hence the same hash) skips the tower.
The budget counts the embeddings' own bytes (``value.nbytes``: a torch tensor or a numpy
array); the least recently used entries go first when a new one needs room, and an entry
larger than the whole budget is not kept. Thread-safe (an encode worker's task threads
share one). torch-free.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class EmbeddingCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # entries dropped to make room
    entries: int = 0
    bytes: int = 0  # bytes held now
    max_bytes: int = 0


class EmbeddingCache:
    """``get`` / ``put`` by content hash; least recently used out first."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 disables the cache), got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # oldest first
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Any | None:
        """The embeddings stored under ``key`` (now the most recently used), or ``None``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry[0]

    def put(self, key: str, value: Any) -> bool:
        """Store ``value`` under ``key`` (replacing what was there), evicting the least
        recently used entries until it fits. False if it is larger than the whole budget
        (nothing is evicted for it then)."""
        size = int(value.nbytes)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.max_bytes:
                return False
            while self._bytes + size > self.max_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self._bytes -= freed
                self._evictions += 1
            self._entries[key] = (value, size)
            self._bytes += size
            return True

    def __contains__(self, key: str) -> bool:
        """Whether ``key`` is cached (no effect on recency or the counters)."""
        with self._lock:
            return key in self._entries

    def keys(self) -> list[str]:
        """Cached keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> EmbeddingCacheStats:
        with self._lock:
            return EmbeddingCacheStats(self._hits, self._misses, self._evictions,
                                       len(self._entries), self._bytes, self.max_bytes)  # fmt: skip
