"""tasks.heap: the startup heap is frozen out of the collector's scans."""

from __future__ import annotations

import gc
import weakref

from tasks.heap import freeze_startup_heap


class _Node:
    me: object = None


def _scanned(obj: object) -> bool:
    """Whether a collection of some generation would walk ``obj``."""
    return any(o is obj for o in gc.get_objects())


def test_objects_alive_at_startup_are_frozen_and_garbage_is_collected_first() -> None:
    gc.unfreeze()
    try:
        keep = [{"n": i} for i in range(1000)]  # tracked containers that stay alive
        cycle = _Node()
        cycle.me = cycle  # garbage only the collector can free
        dead = weakref.ref(cycle)
        del cycle
        assert _scanned(keep) and dead() is not None
        frozen = freeze_startup_heap("test")
        # frozen objects can still die (other threads drop them), so the count only falls
        assert frozen >= gc.get_freeze_count() >= len(keep)
        assert not _scanned(keep) and not _scanned(keep[0])
        assert dead() is None  # collected first, not frozen with what lives
        fresh: list = []
        assert _scanned(fresh)  # what comes later is collected as before
    finally:
        gc.unfreeze()
