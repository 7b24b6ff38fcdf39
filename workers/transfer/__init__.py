"""KV transfer backends: NIXL (zero-copy, where it works) and Redis (anywhere)."""

from __future__ import annotations

import logging

import redis

from workers.llama import PagedKVCache
from workers.transfer.base import KVLayout, KVTransfer, TransferError
from workers.transfer.nixl_kv import NixlKVTransfer, nixl_available
from workers.transfer.redis_kv import RedisKVTransfer

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nixl", "redis")

__all__ = ["BACKENDS", "KVLayout", "KVTransfer", "TransferError", "make_transfer"]


def make_transfer(
    kind: str, kv: PagedKVCache, client: redis.Redis, worker_id: str, threads: int = 2
) -> KVTransfer:
    """The backend ``kind`` names; ``auto`` takes NIXL when it loads here, else Redis.
    ``threads``: NIXL pulls a large transfer's blocks from this many threads at once."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {kind!r}; choose from {BACKENDS}")
    if kind in ("auto", "nixl"):
        if nixl_available():
            try:
                return NixlKVTransfer(kv, client, worker_id, threads)
            except Exception as e:  # noqa: BLE001
                if kind == "nixl":
                    raise
                log.warning("NIXL unavailable (%s): falling back to Redis KV transfer", e)
        elif kind == "nixl":
            raise RuntimeError("CONVEYOR_KV_TRANSFER=nixl but the nixl package is not installed")
        else:
            log.info("nixl not installed: KV transfer goes through Redis")
    return RedisKVTransfer(kv, client)
