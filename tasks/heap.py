"""Keep the startup heap out of Python's cyclic garbage collector.

The API and the Celery worker process import large libraries (FastAPI, pydantic, Celery,
kombu) and build their state before serving: tens of thousands of objects that live as long
as the process. A full (generation-2) collection walks all of them, and for that long the
API relays no frame and answers no request, and the worker takes in none, on every stream
at once. ``gc.freeze()`` moves what exists at that moment to a permanent generation the
collector never walks (as vLLM does for its API server and engine once they are up); the
young generations' collections, which still run as before, do not touch the frozen objects
either (docs/performance.md, "Heap frozen at start"). The engine process needs none of
this: its steps allocate few objects the collector tracks.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from collections.abc import Callable
from typing import Literal

log = logging.getLogger(__name__)


def freeze_startup_heap(who: str) -> int:
    """Collect once, then freeze every object that survived; returns how many are frozen.
    Call it when the process is ready to serve (imports done, clients connected)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d startup objects frozen out of the garbage collector's scans", who, frozen)
    return frozen


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``); False where
    there is no glibc. Python frees its own small-object arenas when they empty, but the C
    allocator keeps what it freed (socket buffers, parser state, large strings) mapped."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim is False:
        return False
    _malloc_trim(0)
    return True


# glibc's malloc_trim once looked up; False where there is none
_malloc_trim: Callable[[int], int] | Literal[False] | None = None
