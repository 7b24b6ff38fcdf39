"""G3 block files (kvbm.disk): what is read back is exactly what was written, and a missing,
truncated, corrupt, renamed or foreign file is refused, never returned; a scan finds the
intact blocks a previous process left, oldest first; slot directories are per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbm.disk import (
    HEADER_BYTES,
    BlockLayout,
    BlockUnreadable,
    FileBlockStore,
    claim_dir,
    ensure_writable,
)
from kvbm.protocol import ROOT_PARENT

LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")


def payload(seed: int) -> bytes:
    n = LAYOUT.block_bytes
    return bytes((seed * 31 + i * 7) % 251 for i in range(n))


@pytest.fixture
def store(tmp_path: Path) -> FileBlockStore:
    return FileBlockStore(tmp_path / "blocks", LAYOUT)


def test_block_bytes() -> None:
    assert LAYOUT.block_bytes == 2 * 2 * 4 * 2 * 4 * 4
    assert BlockLayout(32, 8, 128, 16, "bfloat16").block_bytes == 2 * 32 * 16 * 8 * 128 * 2
    with pytest.raises(ValueError):
        BlockLayout(1, 1, 1, 1, "int8")


def test_write_then_read_returns_the_same_bytes(store: FileBlockStore) -> None:
    store.write(0xABC, ROOT_PARENT, payload(1))
    store.write(0xDEF, 0xABC, memoryview(payload(2)))
    assert bytes(store.read(0xABC, ROOT_PARENT)) == payload(1)
    assert bytes(store.read(0xDEF, 0xABC)) == payload(2)
    assert store.path(0xABC).stat().st_size == HEADER_BYTES + LAYOUT.block_bytes
    assert not [p for p in store.dir.iterdir() if p.name.startswith(".tmp-")]


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "corrupt":
        raw[HEADER_BYTES + 17] ^= 0xFF
    elif how == "truncated":
        raw = raw[: len(raw) - 5]
    elif how == "header":
        raw[0:4] = b"XXXX"
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["corrupt", "truncated", "header", "deleted"])
def test_a_damaged_or_missing_block_is_refused(store: FileBlockStore, how: str) -> None:
    store.write(5, ROOT_PARENT, payload(5))
    if how == "deleted":
        store.path(5).unlink()
    else:
        _damage(store.path(5), how)
    with pytest.raises(BlockUnreadable):
        store.read(5, ROOT_PARENT)


def test_a_renamed_file_or_another_parent_is_refused(store: FileBlockStore) -> None:
    store.write(5, 1, payload(5))
    with pytest.raises(BlockUnreadable, match="parent"):
        store.read(5, 2)
    os.rename(store.path(5), store.path(6))
    with pytest.raises(BlockUnreadable, match="holds block"):
        store.read(6, 1)


def test_a_block_of_another_layout_is_refused(tmp_path: Path) -> None:
    FileBlockStore(tmp_path, LAYOUT).write(5, ROOT_PARENT, payload(5))
    other = FileBlockStore(tmp_path, BlockLayout(2, 2, 4, 4, "float16"))
    with pytest.raises(BlockUnreadable, match="layout"):
        other.read(5, ROOT_PARENT)
    assert other.scan() == []  # and a scan removes it
    assert not other.path(5).exists()


def test_scan_lists_intact_blocks_oldest_first_and_removes_the_rest(
    store: FileBlockStore,
) -> None:
    for i, h in enumerate((3, 1, 2)):
        store.write(h, ROOT_PARENT if h == 1 else h - 1, payload(h))
        os.utime(store.path(h), (1000 + i, 1000 + i))
    store.write(9, ROOT_PARENT, payload(9))
    _damage(store.path(9), "truncated")
    (store.dir / ".tmp-0000000000000004.kv").write_bytes(b"half a block")
    (store.dir / "junk.kv").write_bytes(b"")
    assert store.scan() == [(3, 2), (1, ROOT_PARENT), (2, 1)]
    assert sorted(p.name for p in store.dir.iterdir()) == [
        f"{h:016x}.kv" for h in (1, 2, 3)
    ]  # fmt: skip
    assert store.removed_at_scan == 3
    store.read(3, 2)  # a read makes it the most recent
    assert [h for h, _ in store.scan()] == [1, 2, 3]


def test_claim_dir_gives_each_live_process_its_own_slot(tmp_path: Path) -> None:
    a, fd_a = claim_dir(tmp_path, 0x1234)
    b, fd_b = claim_dir(tmp_path, 0x1234)
    assert a != b and a.parent == b.parent == tmp_path / f"{0x1234:016x}"
    os.close(fd_a)  # the process holding slot 0 is gone: the next one takes it over
    c, fd_c = claim_dir(tmp_path, 0x1234)
    assert c == a
    # another process cannot take a held slot
    code = (f"from kvbm.disk import claim_dir; from pathlib import Path; "
            f"print(claim_dir(Path({str(tmp_path)!r}), 0x1234)[0].name)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "slot-2"
    os.close(fd_b)
    os.close(fd_c)


def test_ensure_writable(tmp_path: Path) -> None:
    ensure_writable(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        ensure_writable(tmp_path / "file" / "sub")
