"""Image embeddings between workers: an encode worker exports what its vision tower made,
the worker that prefills pulls it. The same backends as KV (``CONVEYOR_KV_TRANSFER``),
never the Celery message: the handle carries where the tensor is, its shape and dtype.

* ``redis``: the tensor's bytes under :func:`kvbm.protocol.embedding_key` with a TTL; the
  puller reads and deletes them.
* ``nixl``: each side registers one arena of host memory with its NIXL agent at start. The
  encode side copies an embedding into a slot of its arena; the puller READs that range
  into a slot of its own arena (process to process on one host, RDMA across hosts) and
  copies it out, then tells the encode side (:func:`kvbm.protocol.embedding_release_channel`)
  that the slot is free again. A slot nobody pulls is freed after ``pin_timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from typing import cast

import redis
import torch

from cluster.stats import TransferTotals
from kvbm.protocol import embedding_key, embedding_release_channel, nixl_agent_key
from workers.transfer.base import TransferError
from workers.transfer.nixl_kv import NIXL_HINT, nixl_missing, tell_backend

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EmbeddingTransfer(ABC):
    """A way to move one tensor per image from an encode worker to a prefill worker."""

    name = "base"

    def __init__(self) -> None:
        self.bytes_moved = 0
        self.seconds = 0.0
        self.transfers = 0

    @abstractmethod
    def export(self, request_id: str, image_hash: str, tensor: torch.Tensor) -> dict:
        """Encode side: make ``tensor`` pullable; JSON metadata for the handle."""

    @abstractmethod
    def pull(self, meta: dict, timeout: float) -> torch.Tensor:
        """The puller's side: the exported tensor, or :class:`TransferError`."""

    def discard(self, meta: dict) -> None:  # noqa: B027 - optional hook
        """Encode side: the tensor was pulled or abandoned; free what holds it."""

    @abstractmethod
    def decline(self, meta: dict) -> None:
        """The puller's side: a tensor it will not pull (it has its own copy); the encode
        side frees it now rather than at its timeout."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release backend resources at shutdown."""

    def stats(self) -> TransferTotals:
        return TransferTotals(self.name, self.bytes_moved, self.seconds, self.transfers)

    def _moved(self, nbytes: int, t0: float) -> None:
        self.bytes_moved += nbytes
        self.seconds += time.perf_counter() - t0
        self.transfers += 1


def _meta(tensor: torch.Tensor) -> dict:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "nbytes": tensor.numel() * tensor.element_size()}  # fmt: skip


def _empty(meta: dict) -> torch.Tensor:
    dtype = _DTYPES.get(meta["dtype"])
    if dtype is None:
        raise TransferError(f"unknown embedding dtype {meta['dtype']!r}")
    return torch.empty(meta["shape"], dtype=dtype)


class RedisEmbeddingTransfer(EmbeddingTransfer):
    name = "redis"

    def __init__(self, client: redis.Redis, ttl_s: float = 120.0) -> None:
        super().__init__()
        self._r = client
        self._ttl_ms = int(ttl_s * 1000)

    def export(self, request_id: str, image_hash: str, tensor: torch.Tensor) -> dict:
        key = embedding_key(request_id, image_hash)
        t = tensor.detach().contiguous().cpu()
        self._r.set(key, t.view(torch.uint8).numpy().tobytes(), px=self._ttl_ms)
        return {"backend": self.name, "key": key, **_meta(t)}

    def pull(self, meta: dict, timeout: float) -> torch.Tensor:
        t0 = time.perf_counter()
        raw = cast("bytes | None", self._r.getdel(meta["key"]))  # a binary client
        if raw is None:
            raise TransferError(f"embedding {meta['key']} is gone from Redis (expired?)")
        if len(raw) != meta["nbytes"]:
            raise TransferError(f"embedding truncated: {len(raw)} of {meta['nbytes']} bytes")
        out = _empty(meta)
        out.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        self._moved(len(raw), t0)
        return out

    def discard(self, meta: dict) -> None:
        self._r.delete(meta["key"])

    def decline(self, meta: dict) -> None:
        self._r.delete(meta["key"])


class _Arena:
    """First-fit slots in one registered byte buffer (sizes rounded up to 4 KiB)."""

    ALIGN = 4096

    def __init__(self, nbytes: int) -> None:
        self.buf = torch.zeros(nbytes, dtype=torch.uint8)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), by offset
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        n = -(-max(n, 1) // self.ALIGN) * self.ALIGN
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size >= n:
                    if size == n:
                        self._free.pop(i)
                    else:
                        self._free[i] = (off + n, size - n)
                    return off
        return None

    def free(self, off: int, n: int) -> None:
        n = -(-max(n, 1) // self.ALIGN) * self.ALIGN
        with self._lock:
            self._free.append((off, n))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for o, s in self._free:  # coalesce neighbours
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((o, s))
            self._free = merged

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(s for _, s in self._free)


class NixlEmbeddingTransfer(EmbeddingTransfer):
    name = "nixl"

    def __init__(self, client: redis.Redis, worker_id: str, arena_mb: int = 256,
                 pin_timeout_s: float = 60.0) -> None:  # fmt: skip
        super().__init__()
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self._r = client
        self.worker_id = worker_id
        self.agent_name = f"conveyor-emb-{worker_id}-{uuid.uuid4().hex[:8]}"
        cfg = nixl_agent_config(backends=[], enable_prog_thread=False,
                                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)  # fmt: skip
        self._agent = nixl_agent(self.agent_name, cfg)
        self._agent.create_backend("UCX", {"num_workers": "1"})
        self._arena = _Arena(arena_mb << 20)
        self._reg = self._agent.register_memory([self._arena.buf])
        self._base = self._arena.buf.data_ptr()
        client.set(nixl_agent_key(self.agent_name), self._agent.get_agent_metadata())
        self._remotes: set[str] = set()
        self._lock = threading.Lock()  # one agent call at a time (pump, pulls)
        self._pinned: dict[str, tuple[int, int, float]] = {}  # slot id -> (off, n, deadline)
        self._pin_timeout_s = pin_timeout_s
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._progress, name="nixl-emb", daemon=True)
        self._pump.start()
        self._releases = threading.Thread(target=self._listen, name="emb-release", daemon=True)
        self._releases.start()

    # --- encode side --------------------------------------------------------------------
    def export(self, request_id: str, image_hash: str, tensor: torch.Tensor) -> dict:
        t = tensor.detach().contiguous().cpu()
        m = _meta(t)
        off = self._arena.alloc(m["nbytes"])
        if off is None:
            self._expire()
            off = self._arena.alloc(m["nbytes"])
        if off is None:
            raise TransferError(f"embedding arena full ({m['nbytes']} bytes wanted)")
        self._arena.buf[off : off + m["nbytes"]].copy_(t.view(-1).view(torch.uint8))
        slot = f"{request_id}/{image_hash}/{off}"
        self._pinned[slot] = (off, m["nbytes"], time.monotonic() + self._pin_timeout_s)
        return {"backend": self.name, "agent": self.agent_name, "worker": self.worker_id,
                "addr": self._base + off, "slot": slot, **m}  # fmt: skip

    def discard(self, meta: dict) -> None:
        pinned = self._pinned.pop(meta["slot"], None)
        if pinned is not None:
            self._arena.free(pinned[0], pinned[1])

    # --- the puller's side ----------------------------------------------------------------
    def decline(self, meta: dict) -> None:
        self._r.publish(embedding_release_channel(meta["worker"]), meta["slot"])

    def pull(self, meta: dict, timeout: float) -> torch.Tensor:
        t0 = time.perf_counter()
        n = meta["nbytes"]
        off = self._arena.alloc(n)
        if off is None:
            raise TransferError("embedding arena full: no room to receive")
        try:
            self._read(meta, off, n, time.monotonic() + timeout)
            out = _empty(meta)
            out.view(-1).view(torch.uint8).copy_(self._arena.buf[off : off + n])
        finally:
            self._arena.free(off, n)
        self._r.publish(embedding_release_channel(meta["worker"]), meta["slot"])
        self._moved(n, t0)
        return out

    def _read(self, meta: dict, off: int, n: int, deadline: float) -> None:
        remote = meta["agent"]
        with self._lock:
            if remote not in self._remotes:
                md = self._r.get(nixl_agent_key(remote))
                if md is None:
                    raise TransferError(f"NIXL agent {remote} is gone (no metadata in Redis)")
                self._agent.add_remote_agent(md)
                self._remotes.add(remote)
            local = self._agent.get_xfer_descs([(self._base + off, n, 0)], "DRAM")
            far = self._agent.get_xfer_descs([(meta["addr"], n, 0)], "DRAM")
            handle = self._agent.initialize_xfer("READ", local, far, remote)
        try:
            with self._lock:
                state = self._agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL read of an embedding from {remote} timed out")
                time.sleep(0.0002)
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise TransferError(f"NIXL read of an embedding from {remote} failed")
        finally:
            with self._lock:
                self._agent.release_xfer_handle(handle)

    # ----------------------------------------------------------------------------------
    def _progress(self) -> None:
        while not self._stop.wait(0.001):
            try:
                with self._lock:
                    self._agent.get_new_notifs()
            except Exception as e:  # noqa: BLE001 - keep pumping
                log.debug("nixl embeddings progress: %s", e)

    def _listen(self) -> None:
        """Encode side: pullers say which slots they have read."""
        pubsub = self._r.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(embedding_release_channel(self.worker_id))
        while not self._stop.is_set():
            try:
                msg = pubsub.get_message(timeout=1.0)
            except Exception as e:  # noqa: BLE001 - reconnect and go on
                log.warning("embedding-release listener: %s", e)
                time.sleep(0.5)
                continue
            if msg and msg.get("type") == "message":
                self.discard({"slot": msg["data"].decode()})
            self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        for slot in [s for s, (_, _, deadline) in list(self._pinned.items()) if deadline <= now]:
            log.warning("embedding %s not pulled in %.0fs: freed", slot, self._pin_timeout_s)
            self.discard({"slot": slot})

    def close(self) -> None:
        self._stop.set()
        self._pump.join(1.0)
        try:
            self._r.delete(nixl_agent_key(self.agent_name))
            for name in list(self._remotes):
                self._agent.remove_remote_agent(name)
            self._agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001, S110 - shutting down anyway
            pass


def make_embedding_transfer(
    kind: str, client: redis.Redis, worker_id: str, arena_mb: int = 256, hold_s: float = 60.0
) -> EmbeddingTransfer:
    """The backend ``kind`` names; ``auto`` takes NIXL when it loads here, else Redis.
    ``hold_s``: how long an embedding nobody pulls is kept (the KV pin timeout)."""
    if kind not in ("auto", "nixl", "redis"):
        raise ValueError(f"unknown transfer backend {kind!r}; choose from auto, nixl, redis")
    if kind == "redis":
        tell_backend("embedding", kind, "redis", "as configured")
    else:
        missing = nixl_missing()
        if missing is None:
            try:
                transfer = NixlEmbeddingTransfer(client, worker_id, arena_mb, hold_s)
            except Exception as e:  # noqa: BLE001
                if kind == "nixl":
                    raise
                tell_backend("embedding", kind, "redis",
                             f"NIXL loaded but its agent failed: {e}", warn=True)  # fmt: skip
            else:
                tell_backend("embedding", kind, "nixl", "NIXL loaded")
                return transfer
        elif kind == "nixl":
            raise RuntimeError(f"CONVEYOR_KV_TRANSFER=nixl but NIXL does not load ({missing}); "
                               f"{NIXL_HINT}")  # fmt: skip
        else:
            tell_backend("embedding", kind, "redis",
                         f"NIXL does not load ({missing}); {NIXL_HINT}")  # fmt: skip
    return RedisEmbeddingTransfer(client, hold_s)
