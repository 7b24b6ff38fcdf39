"""The offload manager (kvbm.offload) on a real block pool, real copy threads and real
files, with a copier over plain byte buffers standing in for the engine's KV memory:
write-through to G2, disk admission by the frequency filter, onboarding that brings back
exactly the bytes offloaded, corrupt files as counted misses, and a warm restart."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvbm.block_pool import BlockPool
from kvbm.disk import BlockLayout, FileBlockStore
from kvbm.offload import OffloadManager
from kvbm.protocol import G1, G2, G3, ROOT_PARENT

LAYOUT = BlockLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")
BB = LAYOUT.block_bytes


class BytesCopier:
    """G1 and host memory as byte buffers, one block each (what the engine's tensors are
    to the reference engine's copier)."""

    def __init__(self, g1_blocks: int, host_blocks: int) -> None:
        self.g1 = [bytearray(BB) for _ in range(g1_blocks)]
        self.host = [bytearray(BB) for _ in range(host_blocks)]

    def g1_to_host(self, pairs: list[tuple[int, int]]) -> None:
        for b, s in pairs:
            self.host[s][:] = self.g1[b]

    def host_to_g1(self, pairs: list[tuple[int, int]]) -> None:
        for s, b in pairs:
            self.g1[b][:] = self.host[s]

    def read(self, tier: int, index: int) -> memoryview:
        return memoryview(self.g1[index] if tier == G1 else self.host[index])

    def write_g1(self, block_id: int, data: bytearray | None) -> None:
        assert data is not None
        self.g1[block_id][:] = data


def fill(copier: BytesCopier, block: int, seed: int) -> bytes:
    data = bytes((seed * 13 + i) % 256 for i in range(BB))
    copier.g1[block][:] = data
    return data


def settle(off: OffloadManager, timeout: float = 5.0) -> None:
    """Wait for the copy threads, completing what they hand back (the engine thread's job)."""
    deadline = time.monotonic() + timeout
    while True:
        off.poll()
        if not off.busy and off._copy_q.empty() and off._disk_q.empty():
            return
        assert time.monotonic() < deadline, "copies did not end"
        time.sleep(0.005)


def chain(n: int, base: int = 100) -> list[int]:
    return [base + i for i in range(n)]


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    return tmp_path / "g3"


def make(host: int = 8, disk: int = 0, disk_dir: Path | None = None, filt: bool = True,
         g1: int = 8) -> tuple[OffloadManager, BlockPool, BytesCopier]:  # fmt: skip
    pool = BlockPool(g1, record_events=True)
    copier = BytesCopier(g1, host)
    store = FileBlockStore(disk_dir, LAYOUT) if disk else None
    off = OffloadManager(pool, copier, LAYOUT.block_size, BB, host_blocks=host, disk=store,
                         disk_blocks=disk, disk_filter=filt)  # fmt: skip
    return off, pool, copier


def test_write_through_to_host_pins_g1_blocks_until_copied() -> None:
    off, pool, cp = make(host=8)
    ids = pool.allocate(3)
    data = [fill(cp, b, i) for i, b in enumerate(ids)]
    hs = chain(3)
    assert off.offer(ids, hs, 0) == 3
    assert pool.num_pinned == 3  # the copy reads them: not reused meanwhile
    pool.free(ids)
    assert pool.num_free == 5  # free, but pinned: not allocatable yet
    settle(off)
    assert pool.num_pinned == 0 and pool.num_free == 8
    assert [(e.kind, e.block_hashes, e.tier) for e in off.take_events()] == [
        ("stored", [100], G2), ("stored", [101], G2), ("stored", [102], G2),
    ]  # fmt: skip
    assert [bytes(cp.host[off.host.slot(h)]) for h in hs] == data
    assert off.stats.offload_blocks["d2h"] == 3
    # offered again: nothing copied twice
    assert off.offer(ids, hs, 0) == 3 and off._copy_q.empty()


def test_onboarding_brings_back_the_offloaded_bytes() -> None:
    off, pool, cp = make(host=8)
    src = pool.allocate(4)
    data = [fill(cp, b, 7 + i) for i, b in enumerate(src)]
    hs = chain(4)
    off.offer(src, hs, 0)
    settle(off)
    pool.free(src)
    assert off.match(hs, 0, 4) == [G2] * 4
    assert off.match(hs, 1, 3) == [G2] * 2
    dst = pool.allocate(4)
    for b in dst:
        cp.g1[b][:] = bytes(BB)
    job = off.start_onboard("r", hs, 0, [G2] * 4, dst)
    assert off.host.num_pinned == 4  # not evicted while being read
    assert job.run() == 4
    assert off.finish_onboard(job) == 4 and off.host.num_pinned == 0
    assert [bytes(cp.g1[b]) for b in dst] == data
    assert off.stats.onboard_blocks == {"h2d": 4, "d2d": 0}
    assert sum(off.stats.onboard_latency) == 1


def test_disk_admits_a_block_once_stored_and_hit_twice(disk_dir: Path) -> None:
    off, pool, cp = make(host=8, disk=8, disk_dir=disk_dir)
    ids = pool.allocate(2)
    for i, b in enumerate(ids):
        fill(cp, b, i)
    hs = chain(2)
    off.offer(ids, hs, 0)
    settle(off)
    off.on_hit(hs, ids)  # first hit: frequency 2
    settle(off)
    assert len(off.disk) == 0
    off.on_hit(hs, ids)  # second hit: 4, admitted; written from host memory
    settle(off)
    assert set(off.disk.hashes()) == set(hs)
    assert off.stats.offload_blocks == {"d2h": 2, "h2d": 2, "d2d": 0}
    assert sorted(p.name for p in disk_dir.iterdir()) == [f"{h:016x}.kv" for h in hs]


def test_without_the_filter_host_writes_through_to_disk(disk_dir: Path) -> None:
    off, pool, cp = make(host=8, disk=8, disk_dir=disk_dir, filt=False)
    ids = pool.allocate(3)
    for i, b in enumerate(ids):
        fill(cp, b, i)
    off.offer(ids, chain(3), 0)
    settle(off)
    assert len(off.disk) == 3 and off.stats.offload_blocks["h2d"] == 3


def test_without_a_host_tier_blocks_go_from_g1_to_disk(disk_dir: Path) -> None:
    off, pool, cp = make(host=0, disk=8, disk_dir=disk_dir, filt=False)
    ids = pool.allocate(2)
    data = [fill(cp, b, 3 + i) for i, b in enumerate(ids)]
    off.offer(ids, chain(2), 0)
    assert pool.num_pinned == 2
    settle(off)
    assert pool.num_pinned == 0 and off.stats.offload_blocks["d2d"] == 2
    dst = pool.allocate(2)
    job = off.start_onboard("r", chain(2), 0, [G3, G3], dst)
    assert job.run() == 2 and off.finish_onboard(job) == 2
    assert [bytes(cp.g1[b]) for b in dst] == data
    assert off.stats.onboard_blocks["d2d"] == 2


@pytest.mark.parametrize("how", ["corrupt", "deleted"])
def test_an_unreadable_disk_block_ends_the_load_and_leaves_g3_with_its_descendants(
    disk_dir: Path, how: str
) -> None:
    off, pool, cp = make(host=0, disk=8, disk_dir=disk_dir, filt=False)
    ids = pool.allocate(4)
    data = [fill(cp, b, i) for i, b in enumerate(ids)]
    hs = chain(4)
    off.offer(ids, hs, 0)
    settle(off)
    off.take_events()
    path = off.store.path(hs[2])
    if how == "deleted":
        path.unlink()
    else:
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 1
        path.write_bytes(bytes(raw))
    dst = pool.allocate(4)
    job = off.start_onboard("r", hs, 0, [G3] * 4, dst)
    assert job.run() == 2 and job.failed is not None
    assert off.finish_onboard(job) == 2
    assert [bytes(cp.g1[b]) for b in dst[:2]] == data[:2]  # the intact prefix arrived
    assert off.stats.onboard_failures == 1
    assert set(off.disk.hashes()) == set(hs[:2])  # the bad block and its child left
    assert sorted(h for e in off.take_events() for h in e.block_hashes) == hs[2:]
    deadline = time.monotonic() + 5  # the disk thread deletes their files
    while off.store.path(hs[3]).exists() or off.store.path(hs[2]).exists():
        assert time.monotonic() < deadline, "files of blocks gone from G3 were not deleted"
        time.sleep(0.005)


def test_a_new_manager_takes_over_the_disk_blocks_and_announces_them(disk_dir: Path) -> None:
    off, pool, cp = make(host=0, disk=8, disk_dir=disk_dir, filt=False)
    ids = pool.allocate(3)
    data = [fill(cp, b, 9 + i) for i, b in enumerate(ids)]
    hs = chain(3)
    off.offer(ids, hs, 0)
    settle(off)
    off.close()
    (disk_dir / f"{777:016x}.kv").write_bytes(off.store.path(hs[0]).read_bytes())  # renamed
    # a restart: a new pool, copier and manager on the same directory
    off2, pool2, cp2 = make(host=0, disk=8, disk_dir=disk_dir, filt=False)
    assert [(e.kind, sorted(e.block_hashes), e.tier) for e in off2.take_events()] == [
        ("stored", hs, G3)
    ]
    assert off2.match(hs, 0, 3) == [G3] * 3
    dst = pool2.allocate(3)
    job = off2.start_onboard("r", hs, 0, [G3] * 3, dst)
    assert job.run() == 3 and off2.finish_onboard(job) == 3
    assert [bytes(cp2.g1[b]) for b in dst] == data


def test_host_tier_never_exceeds_its_size_and_keeps_ancestors() -> None:
    off, pool, cp = make(host=5, g1=16)
    for k in range(6):  # six 3-block chains through a 5-block host tier
        ids = pool.allocate(3)
        hs = chain(3, base=1000 * (k + 1))
        off.offer(ids, hs, 0)
        settle(off)
        pool.free(ids)
        held = set(off.host.hashes())
        assert len(held) <= 5
        assert all(h % 1000 == 0 or h - 1 in held for h in held)
    assert off.host.num_pinned == 0 and pool.num_pinned == 0


def test_parent_of_first_block_is_the_root() -> None:
    assert OffloadManager._parent([5, 6], 0) == ROOT_PARENT
    assert OffloadManager._parent([5, 6], 1) == 5


def test_reset_drops_both_tiers_once_no_copy_is_under_way(disk_dir: Path) -> None:
    off, pool, cp = make(host=8, disk=8, disk_dir=disk_dir, filt=False)
    ids = pool.allocate(3)
    for i, b in enumerate(ids):
        fill(cp, b, i)
    off.offer(ids, chain(3), 0)
    assert not off.reset()  # the copies are under way: nothing dropped
    settle(off)
    assert len(off.host) == 3 and len(off.disk) == 3
    assert len(list(disk_dir.rglob("*.kv"))) == 3
    off.take_events()
    assert off.reset()
    settle(off)  # the disk thread deletes the files
    assert len(off.host) == 0 and len(off.disk) == 0
    assert off.match(chain(3), 0, 3) == []
    removed = [(e.tier, h) for e in off.take_events() if e.kind == "removed"
               for h in e.block_hashes]  # fmt: skip
    assert sorted(removed) == sorted([(G2, h) for h in chain(3)] + [(G3, h) for h in chain(3)])
    deadline = time.monotonic() + 5  # the files go too (the disk thread's last delete)
    while list(disk_dir.rglob("*.kv")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(disk_dir.rglob("*.kv")) == []
