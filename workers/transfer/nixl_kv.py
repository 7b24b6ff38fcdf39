"""KV blocks over NIXL (UCX): the decode worker READs the prefill worker's pool memory
directly — host-to-host over RDMA where it exists, process-to-process on one machine
(UCX picks cma / shared memory), GPU memory on GPU machines.

Each engine process creates one agent, registers its whole KV cache once at start
(memory registered and touched up front, so the first transfer is not slow) and publishes
the agent's metadata in Redis under its name. Export only names the blocks. The cache is
block-major, so a block is one region: each side's cache is prepared once as a NIXL
descriptor list with one descriptor per block (ours at start, a peer's on its first pull),
and a pull is one READ made from block indices into those lists (NIXL merges runs of
consecutive blocks). Nothing per pull builds descriptors or validates memory again. A pull
of 16 MiB or more is split into ``threads`` contiguous slices read side by side, each by its
own UCX worker (over cma each copy runs in the thread that posts it, so one thread alone
stops well short of the memory bandwidth; docs/performance.md, "KV transfer: pulls split
over threads").
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import redis

from kvbm.protocol import nixl_agent_key
from workers.llama import PagedKVCache
from workers.transfer.base import KVTransfer, TransferError

# below this a transfer is one READ from one thread: splitting would cost more than it saves
PARALLEL_MIN_BYTES = 16 << 20
log = logging.getLogger(__name__)


def split_pull(
    src: list[int], dst: list[int], threads: int, nbytes: int
) -> list[tuple[list[int], list[int]]]:
    """The (src, dst) block slices a pull of ``nbytes`` is read in: ``threads`` contiguous
    slices from ``PARALLEL_MIN_BYTES`` up (runs of consecutive blocks stay whole), else one."""
    k = min(threads, len(src)) if nbytes >= PARALLEL_MIN_BYTES else 1
    cut = [len(src) * i // k for i in range(k + 1)] if k > 1 else [0, len(src)]
    return [(src[a:b], dst[a:b]) for a, b in zip(cut, cut[1:], strict=False)]


def nixl_available() -> bool:
    return nixl_missing() is None


def nixl_missing() -> str | None:
    """Why NIXL cannot load in this process (the import's error), or None if it can."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        return f"{type(e).__name__}: {e}"
    return None


NIXL_HINT = "pip install 'conveyor[nixl]' after CPU torch (make install does)"
_told: set[str] = set()


def tell_backend(what: str, kind: str, chosen: str, why: str, warn: bool = False) -> None:
    """Log once per process (per ``what``: KV, embeddings) which transfer backend was
    chosen for ``CONVEYOR_KV_TRANSFER=kind`` and why."""
    if what in _told:
        return
    _told.add(what)
    level = logging.WARNING if warn else logging.INFO
    log.log(level, "%s transfer: %s (CONVEYOR_KV_TRANSFER=%s: %s)", what, chosen, kind, why)


class NixlKVTransfer(KVTransfer):
    name = "nixl"

    def __init__(
        self, kv: PagedKVCache, client: redis.Redis, worker_id: str, threads: int = 2
    ) -> None:
        super().__init__(kv)
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self._r = client
        self.agent_name = f"conveyor-{worker_id}-{uuid.uuid4().hex[:8]}"
        self.threads = max(1, threads)
        # Several threads use the agent at once (a pull's helper threads, the pump): NIXL's
        # reader-writer locking lets transfers run side by side and serialises the rest;
        # each pull is serialised on our side as well. NIXL's own progress thread polls
        # without pause (a full core per idle worker); a light pump of ours replaces it.
        cfg = nixl_agent_config(
            backends=[],
            enable_prog_thread=False,
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        self._agent = nixl_agent(self.agent_name, cfg)
        # one UCX worker per pulling thread: each posts (and, over cma, copies) on its own
        self._agent.create_backend("UCX", {"num_workers": str(self.threads)})
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="nixl-pull")
            if self.threads > 1
            else None
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._devid = (kv.data.device.index or 0) if kv.data.is_cuda else 0
        self._mem_type = "VRAM" if kv.data.is_cuda else "DRAM"
        self._reg = self._agent.register_memory([kv.data])
        self._local_side = self._prep("NIXL_INIT_AGENT", kv.data.data_ptr(), kv.num_blocks,
                                      self._devid)  # fmt: skip
        client.set(nixl_agent_key(self.agent_name), self._agent.get_agent_metadata())
        self._remotes: dict[str, str] = {}
        # per peer agent: (its prepared block list, its cache base, blocks in the list)
        self._sides: dict[str, tuple[object, int, int]] = {}
        self._pump.start()

    # ----------------------------------------------------------------------------------
    def export(self, request_id: str, block_ids: list[int]) -> dict:
        return {
            "backend": self.name,
            "layout": self.layout.to_dict(),
            "agent": self.agent_name,
            "base": self.kv.data.data_ptr(),
            "num_blocks": self.kv.num_blocks,
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
        side = self._remote_side(meta, remote, max(src, default=-1) + 1)  # keyed by agent
        nbytes = len(src) * self.layout.block_bytes
        deadline = time.monotonic() + timeout
        parts = split_pull(src, dst_block_ids, self.threads, nbytes)
        assert self._pool is not None or len(parts) == 1
        futs = [self._pool.submit(self._read, meta["agent"], side, s_, d_, deadline)
                for s_, d_ in parts[1:]] if self._pool else []  # fmt: skip
        try:
            self._read(meta["agent"], side, *parts[0], deadline)  # the first slice here
        finally:
            errors = [f.exception() for f in futs]  # waits for every slice
        for e in errors:
            if e is not None:
                raise e
        self.bytes_moved += nbytes
        self.seconds += time.perf_counter() - t0
        self.transfers += 1
        return nbytes

    def _read(self, agent: str, side: object, src: list[int], dst: list[int],
              deadline: float) -> None:  # fmt: skip
        """One READ of ``src`` (the peer's block indices) into our ``dst``."""
        handle = self._agent.make_prepped_xfer("READ", self._local_side, dst, side, src)
        try:
            state = self._agent.transfer(handle)
            spin_until = time.monotonic() + 0.001
            while state not in ("DONE", "ERR"):
                now = time.monotonic()
                if now > deadline:
                    raise TransferError(f"NIXL read from {agent} timed out")
                if now > spin_until:  # spin briefly, then yield the core to the engine
                    time.sleep(0.0002)
                state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise TransferError(f"NIXL read from {agent} failed")
        finally:
            self._agent.release_xfer_handle(handle)

    def close(self) -> None:
        self._stop.set()
        self._pump.join(1.0)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        try:
            self._r.delete(nixl_agent_key(self.agent_name))
            for name in list(self._remotes):
                self.forget(name)
            self._agent.release_dlist_handle(self._local_side)
            self._agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001, S110 - shutting down anyway
            pass

    # ----------------------------------------------------------------------------------
    def _progress(self, period_s: float = 0.001) -> None:
        """Drive the agent's communication (peers' connection setup and reads of our
        memory) every millisecond: near-zero CPU when idle."""
        while not self._stop.wait(period_s):
            try:
                with self._lock:  # never inside the agent at the same time as a pull
                    self._agent.get_new_notifs()
            except Exception as e:  # noqa: BLE001 - keep pumping; log once in a while
                log.debug("nixl progress: %s", e)

    def _remote(self, name: str) -> str:
        if name not in self._remotes:
            md = self._r.get(nixl_agent_key(name))
            if md is None:
                raise TransferError(f"NIXL agent {name} is gone (no metadata in Redis)")
            try:
                self._remotes[name] = self._agent.add_remote_agent(md)
            except Exception as e:  # noqa: BLE001
                raise TransferError(f"cannot connect to NIXL agent {name}: {e}") from e
        return self._remotes[name]

    def _prep(self, agent: str, base: int, num_blocks: int, devid: int) -> object:
        """A prepared descriptor list of ``num_blocks`` whole blocks from ``base``."""
        bb = self.layout.block_bytes
        rows = np.array([[base, bb, devid, bb, num_blocks]], dtype=np.uint64)  # strided form
        return self._agent.prep_xfer_dlist(agent, rows, self._mem_type)

    def _remote_side(self, meta: dict, remote: str, need: int) -> object:
        """The peer's prepared block list, made on its first pull (again if its cache moved
        or a block lies past the list: a peer that did not say its block count)."""
        side = self._sides.get(meta["agent"])
        if side is None or side[1] != meta["base"] or side[2] < need:
            if side is not None:
                self._release(side[0])
            n = max(need, int(meta.get("num_blocks") or 0))
            try:
                side = (self._prep(remote, meta["base"], n, meta["devid"]), meta["base"], n)
            except Exception as e:  # noqa: BLE001
                raise TransferError(f"cannot prepare {remote}'s blocks: {e}") from e
            self._sides[meta["agent"]] = side
        return side[0]

    def _release(self, handle: object) -> None:
        try:
            self._agent.release_dlist_handle(handle)
        except Exception:  # noqa: BLE001, S110 - gone with the peer anyway
            pass

    def forget(self, name: str) -> None:
        """Drop a peer whose transfers failed, so the next attempt reconnects."""
        side = self._sides.pop(name, None)
        if side is not None:
            self._release(side[0])
        if self._remotes.pop(name, None) is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001, S110
                pass
