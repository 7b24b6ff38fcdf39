"""KV blocks through Redis: the portable fallback (slow, no extra dependency).

Export copies the blocks' bytes into Redis keys (chunked below Redis' 512 MB string limit,
with a TTL so abandoned data cannot pile up); pull reads them and scatters them into the
destination blocks, then deletes the keys.
"""

from __future__ import annotations

import time
from typing import cast

import redis
import torch

from kvbm.protocol import kv_data_key
from workers.llama import PagedKVCache
from workers.transfer.base import KVTransfer, TransferError

CHUNK_BYTES = 64 * 1024 * 1024


class RedisKVTransfer(KVTransfer):
    name = "redis"

    def __init__(self, kv: PagedKVCache, client: redis.Redis, ttl_s: float = 120.0) -> None:
        super().__init__(kv)
        self._r = client
        self._ttl_ms = int(ttl_s * 1000)

    def export(self, request_id: str, block_ids: list[int]) -> dict:
        idx = torch.tensor(block_ids, dtype=torch.long)
        data = self.kv.data[idx]  # whole blocks, in the order given
        raw = data.view(torch.uint8).numpy().tobytes()
        pipe = self._r.pipeline(transaction=False)
        n_chunks = 0
        for i, off in enumerate(range(0, len(raw), CHUNK_BYTES)):
            pipe.set(kv_data_key(request_id, i), raw[off : off + CHUNK_BYTES], px=self._ttl_ms)
            n_chunks += 1
        pipe.execute()
        return {
            "backend": self.name,
            "layout": self.layout.to_dict(),
            "request_id": request_id,
            "chunks": n_chunks,
            "nbytes": len(raw),
            "num_blocks": len(block_ids),
        }

    def pull(self, meta: dict, dst_block_ids: list[int], timeout: float) -> int:
        self.check_layout(meta)
        if meta["num_blocks"] != len(dst_block_ids):
            raise TransferError(f"{meta['num_blocks']} blocks exported, {len(dst_block_ids)} given")
        t0 = time.perf_counter()
        keys = [kv_data_key(meta["request_id"], i) for i in range(meta["chunks"])]
        parts = cast("list[bytes | None]", self._r.mget(keys))  # a binary client
        present = [p for p in parts if p is not None]
        if len(present) < len(parts):
            raise TransferError(f"KV data of {meta['request_id']} missing from Redis (expired?)")
        raw = b"".join(present)
        if len(raw) != meta["nbytes"]:
            raise TransferError(f"KV data truncated: {len(raw)} of {meta['nbytes']} bytes")
        shape = (len(dst_block_ids), *self.kv.data.shape[1:])
        data = torch.frombuffer(bytearray(raw), dtype=self.kv.data.dtype).view(shape)
        self.kv.data[torch.tensor(dst_block_ids, dtype=torch.long)] = data
        self._r.delete(*keys)
        self.bytes_moved += len(raw)
        self.seconds += time.perf_counter() - t0
        self.transfers += 1
        return len(raw)

    def discard(self, request_id: str, meta: dict) -> None:
        keys = [kv_data_key(request_id, i) for i in range(meta.get("chunks", 0))]
        if keys:
            self._r.delete(*keys)
