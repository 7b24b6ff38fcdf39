"""KV blocks over NIXL (UCX): the decode worker READs the prefill worker's pool memory
directly — host-to-host over RDMA where it exists, process-to-process on one machine
(UCX picks cma / shared memory), GPU memory on GPU machines.

Each engine process creates one agent, registers its whole KV cache once at start
(memory registered and touched up front, so the first transfer is not slow) and publishes
the agent's metadata in Redis under its name. Export only names the blocks; the decode side
computes both sides' addresses from the two caches' bases (the cache is block-major, so a
block is one region), merges runs of consecutive blocks into single descriptors, and
issues one READ.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import numpy as np
import redis

from workers.llama import PagedKVCache
from workers.transfer.base import KVTransfer, TransferError

AGENT_KEY = "conveyor:nixl:agent:{}"
log = logging.getLogger(__name__)


def nixl_available() -> bool:
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


class NixlKVTransfer(KVTransfer):
    name = "nixl"

    def __init__(self, kv: PagedKVCache, client: redis.Redis, worker_id: str) -> None:
        super().__init__(kv)
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self._r = client
        self.agent_name = f"conveyor-{worker_id}-{uuid.uuid4().hex[:8]}"
        # Several threads use the agent at once: ask NIXL for strict locking, and serialise
        # each pull's setup/poll on our side as well. NIXL's own progress thread polls
        # without pause (a full core per idle worker); a light pump of ours replaces it.
        cfg = nixl_agent_config(
            backends=["UCX"],
            enable_prog_thread=False,
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = nixl_agent(self.agent_name, cfg)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._devid = (kv.data.device.index or 0) if kv.data.is_cuda else 0
        self._mem_type = "VRAM" if kv.data.is_cuda else "DRAM"
        self._reg = self._agent.register_memory([kv.data])
        client.set(AGENT_KEY.format(self.agent_name), self._agent.get_agent_metadata())
        self._remotes: dict[str, str] = {}
        self._pump.start()

    # ----------------------------------------------------------------------------------
    def export(self, request_id: str, block_ids: list[int]) -> dict:
        return {
            "backend": self.name,
            "layout": self.layout.to_dict(),
            "agent": self.agent_name,
            "base": self.kv.data.data_ptr(),
            "devid": self._devid,
            "block_ids": list(block_ids),
        }

    def pull(self, meta: dict, dst_block_ids: list[int], timeout: float) -> int:
        self.check_layout(meta)
        src = meta["block_ids"]
        if len(src) != len(dst_block_ids):
            raise TransferError(f"{len(src)} blocks exported, {len(dst_block_ids)} given")
        with self._lock:
            try:
                return self._pull(meta, src, dst_block_ids, timeout)
            except TransferError:
                self.forget(meta["agent"])  # reconnect next time (the peer may be new)
                raise

    def _pull(self, meta: dict, src: list[int], dst_block_ids: list[int], timeout: float) -> int:
        t0 = time.perf_counter()
        remote = self._remote(meta["agent"])
        bb = self.layout.block_bytes  # one whole block is one contiguous region
        here, there = self.kv.data.data_ptr(), meta["base"]
        local_rows, remote_rows = [], []
        for s, d, n in _runs(src, dst_block_ids):
            remote_rows.append((there + s * bb, n * bb, meta["devid"]))
            local_rows.append((here + d * bb, n * bb, self._devid))
        local = self._agent.get_xfer_descs(np.array(local_rows, dtype=np.uint64), self._mem_type)
        rdescs = self._agent.get_xfer_descs(np.array(remote_rows, dtype=np.uint64),
                                            self._mem_type)  # fmt: skip
        handle = self._agent.initialize_xfer("READ", local, rdescs, remote)
        try:
            state = self._agent.transfer(handle)
            start = time.monotonic()
            while state not in ("DONE", "ERR"):
                waited = time.monotonic() - start
                if waited > timeout:
                    raise TransferError(f"NIXL read from {meta['agent']} timed out")
                if waited > 0.001:  # spin briefly, then yield the core to the engine
                    time.sleep(0.0002)
                state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise TransferError(f"NIXL read from {meta['agent']} failed")
        finally:
            self._agent.release_xfer_handle(handle)
        nbytes = sum(r[1] for r in local_rows)
        self.bytes_moved += nbytes
        self.seconds += time.perf_counter() - t0
        self.transfers += 1
        return nbytes

    def close(self) -> None:
        self._stop.set()
        self._pump.join(1.0)
        try:
            self._r.delete(AGENT_KEY.format(self.agent_name))
            self._agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001, S110 - shutting down anyway
            pass

    # ----------------------------------------------------------------------------------
    def _progress(self, period_s: float = 0.001) -> None:
        """Drive the agent's communication (peers' connection setup and reads of our
        memory) every millisecond: near-zero CPU when idle."""
        while not self._stop.wait(period_s):
            try:
                self._agent.get_new_notifs()
            except Exception as e:  # noqa: BLE001 - keep pumping; log once in a while
                log.debug("nixl progress: %s", e)

    def _remote(self, name: str) -> str:
        if name not in self._remotes:
            md = self._r.get(AGENT_KEY.format(name))
            if md is None:
                raise TransferError(f"NIXL agent {name} is gone (no metadata in Redis)")
            try:
                self._remotes[name] = self._agent.add_remote_agent(md)
            except Exception as e:  # noqa: BLE001
                raise TransferError(f"cannot connect to NIXL agent {name}: {e}") from e
        return self._remotes[name]

    def forget(self, name: str) -> None:
        """Drop a peer whose transfers failed, so the next attempt reconnects."""
        if self._remotes.pop(name, None) is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001, S110
                pass


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) for runs where both block lists go up by one."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out
