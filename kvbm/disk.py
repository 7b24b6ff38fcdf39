"""Where G3 blocks live: one file per block under a worker's disk directory. torch-free.

Each file is a fixed header and the block's bytes (every layer, K and V, as the engine
lays out one block). The header names the block (its hash and its parent's), the layout
it was written with (layers, kv heads, head dim, block size, dtype) and an xxh3-64
checksum of the payload. A read checks all of it: a missing, truncated, renamed or
corrupt file, or one written for another layout, raises :class:`BlockUnreadable` — the
caller treats it as a miss (the block is recomputed), never as data.

A file is written to a temporary name and renamed into place, so a crash mid-write
leaves a stray temporary (removed by the next :meth:`FileBlockStore.scan`), not a
half-written block under a valid name. No fsync: this is a cache, and the checksum
catches what a power loss may tear.

Directories: ``<disk dir>/<model namespace>/slot-<k>/``. A worker takes the first slot
no live process holds (an exclusive ``flock`` on its ``.lock``), so workers sharing a
disk dir never evict each other's files, and a worker restarted on the same host takes a
slot its predecessor filled: its :meth:`FileBlockStore.scan` re-indexes the valid blocks
there (a warm restart).

Public part:
    BlockLayout          what one block is made of (and its size in bytes)
    BlockStore           ABC: write / read / delete / scan of whole blocks
    FileBlockStore       the files described above
    SimulatedBlockStore  no files; reads and writes take a set time (the mock engine)
    claim_dir, ensure_writable
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

MAGIC = b"CVKV"
VERSION = 1
# magic, version, reserved, hash, parent, layers, kv heads, head dim, block size, dtype,
# payload bytes, payload checksum
_HEADER = struct.Struct("<4sHHQQIIII16sQQ")
HEADER_BYTES = _HEADER.size
SUFFIX = ".kv"
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class BlockLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # float32 | float16 | bfloat16

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {self.dtype!r}; known: {list(_DTYPE_BYTES)}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: every layer, K and V."""
        per = self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]
        return 2 * self.num_layers * self.block_size * per


class BlockUnreadable(Exception):
    """A stored block cannot be used: missing, truncated, corrupt, or another layout."""


class BlockStore(ABC):
    """Whole blocks by hash. Writes and reads run on copy threads; one block is never
    written and read at once (the tier pins a block while it is read, and a block is
    readable only once its write completed)."""

    @abstractmethod
    def write(self, block_hash: int, parent: int, data: memoryview | bytes | None) -> None:
        """Store one block (raises ``OSError`` when it cannot)."""

    @abstractmethod
    def read(self, block_hash: int, parent: int) -> bytearray | None:
        """One block's bytes (``None`` where the store keeps none); raises
        :class:`BlockUnreadable` if it is not there intact."""

    @abstractmethod
    def delete(self, block_hash: int) -> None: ...

    @abstractmethod
    def scan(self) -> list[tuple[int, int]]:
        """``(hash, parent)`` of every intact block stored before, least recently used
        first (a warm restart); anything unusable is removed."""


class FileBlockStore(BlockStore):
    def __init__(self, directory: Path, layout: BlockLayout) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self._dtype = layout.dtype.encode().ljust(16, b"\0")
        self.removed_at_scan = 0

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    def write(self, block_hash: int, parent: int, data: memoryview | bytes | None) -> None:
        assert data is not None, "a file store needs the block's bytes"
        payload = memoryview(data).cast("B")
        if payload.nbytes != self.layout.block_bytes:
            raise ValueError(f"block of {payload.nbytes} bytes, layout says "
                             f"{self.layout.block_bytes}")  # fmt: skip
        lay = self.layout
        header = _HEADER.pack(MAGIC, VERSION, 0, block_hash, parent, lay.num_layers,
                              lay.num_kv_heads, lay.head_dim, lay.block_size, self._dtype,
                              payload.nbytes, xxhash.xxh3_64_intdigest(payload))  # fmt: skip
        final = self.path(block_hash)
        tmp = final.with_name(f".tmp-{final.name}")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, final)

    def read(self, block_hash: int, parent: int) -> bytearray:
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                raw = bytearray(f.read())
        except OSError as e:
            raise BlockUnreadable(f"{path.name}: {e.strerror or e}") from e
        payload = self._check(raw, path.name, block_hash, parent)
        try:
            os.utime(path)  # recency survives a restart (scan orders by it)
        except OSError:
            pass
        return payload

    def delete(self, block_hash: int) -> None:
        try:
            self.path(block_hash).unlink()
        except FileNotFoundError:
            pass

    def scan(self) -> list[tuple[int, int]]:
        found: list[tuple[float, int, int]] = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.startswith(".tmp-"):
                self._discard(entry.path, "an interrupted write")
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                want = int(name.removesuffix(SUFFIX), 16)
                st = entry.stat()
                with open(entry.path, "rb") as f:
                    head = f.read(HEADER_BYTES)
                h, parent = self._check_header(head, want, st.st_size)
            except (ValueError, OSError, BlockUnreadable) as e:
                self._discard(entry.path, str(e))
                continue
            found.append((st.st_mtime, h, parent))
        found.sort()
        return [(h, p) for _, h, p in found]

    # ----------------------------------------------------------------------------------
    def _check_header(self, head: bytes | bytearray, want: int, size: int) -> tuple[int, int]:
        if len(head) < HEADER_BYTES:
            raise BlockUnreadable(f"header truncated ({len(head)} bytes)")
        magic, version, _, h, parent, layers, heads, dim, bs, dtype, n, _ = _HEADER.unpack_from(
            head
        )
        lay = self.layout
        if magic != MAGIC or version != VERSION:
            raise BlockUnreadable("not a Conveyor KV block file (or another version)")
        if h != want:
            raise BlockUnreadable(f"holds block {h:016x}, not {want:016x}")
        if (layers, heads, dim, bs, dtype) != (
            lay.num_layers,
            lay.num_kv_heads,
            lay.head_dim,
            lay.block_size,
            self._dtype,
        ):
            raise BlockUnreadable("written for another KV layout")  # fmt: skip
        if n != lay.block_bytes or size != HEADER_BYTES + n:
            raise BlockUnreadable(f"truncated or padded ({size} bytes, want {HEADER_BYTES + n})")
        return h, parent

    def _check(self, raw: bytearray, name: str, block_hash: int, parent: int) -> bytearray:
        h, p = self._check_header(raw[:HEADER_BYTES], block_hash, len(raw))
        if p != parent:
            raise BlockUnreadable(f"{name}: parent {p:016x}, expected {parent:016x}")
        checksum = _HEADER.unpack_from(raw)[-1]
        with memoryview(raw) as view:
            intact = xxhash.xxh3_64_intdigest(view[HEADER_BYTES:]) == checksum
        if not intact:
            raise BlockUnreadable(f"{name}: checksum mismatch (corrupt)")
        del raw[:HEADER_BYTES]
        return raw

    def _discard(self, path: str, why: str) -> None:
        log.warning("KV disk tier: removing %s (%s)", path, why)
        self.removed_at_scan += 1
        try:
            os.unlink(path)
        except OSError:
            pass


class SimulatedBlockStore(BlockStore):
    """No bytes: a write or a read takes ``write_us`` / ``read_us`` (the mock engine's
    disk tier, whose blocks carry no data). Nothing survives the process."""

    def __init__(self, write_us: float, read_us: float) -> None:
        self.write_s = write_us / 1e6
        self.read_s = read_us / 1e6

    def write(self, block_hash: int, parent: int, data: memoryview | bytes | None) -> None:
        if self.write_s:
            time.sleep(self.write_s)

    def read(self, block_hash: int, parent: int) -> None:
        if self.read_s:
            time.sleep(self.read_s)
        return None

    def delete(self, block_hash: int) -> None:
        pass

    def scan(self) -> list[tuple[int, int]]:
        return []


# ======================================================================================
# Directories
# ======================================================================================
def ensure_writable(directory: Path) -> None:
    """Create ``directory`` if needed and check a file can be written there; raises
    ``OSError`` naming what failed."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".probe-{os.getpid()}"
    with open(probe, "wb") as f:
        f.write(b"ok")
    probe.unlink()


def claim_dir(base: Path, namespace: int, max_slots: int = 1024) -> tuple[Path, int]:
    """The first ``<base>/<namespace>/slot-<k>`` no live process holds, now held by this
    one (an exclusive ``flock`` on its ``.lock``, released when the process ends);
    returns it and the lock's descriptor (keep it open)."""
    root = Path(base) / f"{namespace:016x}"
    root.mkdir(parents=True, exist_ok=True)
    for k in range(max_slots):
        d = root / f"slot-{k}"
        d.mkdir(exist_ok=True)
        fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                continue
            raise
        return d, fd
    raise OSError(f"all {max_slots} disk slots under {root} are held by live processes")
