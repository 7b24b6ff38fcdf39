"""KV transfer backends: NIXL (zero-copy, where it works) and Redis (anywhere)."""

from __future__ import annotations

import logging

import redis

from workers.llama import PagedKVCache
from workers.transfer.base import KVLayout, KVTransfer, TransferError
from workers.transfer.nixl_kv import NIXL_HINT, NixlKVTransfer, nixl_missing, tell_backend
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
    if kind == "redis":
        tell_backend("KV", kind, "redis", "as configured")
    else:
        missing = nixl_missing()
        if missing is None:
            try:
                transfer = NixlKVTransfer(kv, client, worker_id, threads)
            except Exception as e:  # noqa: BLE001
                if kind == "nixl":
                    raise
                tell_backend("KV", kind, "redis", f"NIXL loaded but its agent failed: {e}",
                             warn=True)  # fmt: skip
            else:
                tell_backend("KV", kind, "nixl", "NIXL loaded")
                return transfer
        elif kind == "nixl":
            raise RuntimeError(f"CONVEYOR_KV_TRANSFER=nixl but NIXL does not load ({missing}); "
                               f"{NIXL_HINT}")  # fmt: skip
        else:
            tell_backend("KV", kind, "redis", f"NIXL does not load ({missing}); {NIXL_HINT}")
    return RedisKVTransfer(kv, client)
