"""NIXL block pulls between two agents (real UCX, real redis-server for the metadata):
prepared block lists, arbitrary block order, a peer that does not say its block count,
and reconnecting after ``forget``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import redis
import torch

from workers.llama import PagedKVCache
from workers.transfer import nixl_kv
from workers.transfer.base import TransferError
from workers.transfer.nixl_kv import NixlKVTransfer, nixl_available

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not nixl_available(), reason="nixl is not installed here"),
]

LAYOUT = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)


def _cache(fill: bool) -> PagedKVCache:
    kv = PagedKVCache(LAYOUT, 12, 4, torch.float16, "cpu")  # type: ignore[arg-type]
    if fill:  # every block distinct
        for b in range(kv.num_blocks):
            kv.data[b] = torch.arange(kv.data[b].numel()).view(kv.data[b].shape) % 997 + b * 1000
    return kv


def test_pulls_blocks_in_any_order_and_reconnects(fresh_db: str) -> None:
    r = redis.Redis.from_url(fresh_db)
    src_kv, dst_kv = _cache(True), _cache(False)
    pre, dec = NixlKVTransfer(src_kv, r, "pre"), NixlKVTransfer(dst_kv, r, "dec")
    try:
        src, dst = [3, 4, 5, 9, 0], [0, 1, 2, 7, 11]
        meta = pre.export("r1", src)
        assert meta["num_blocks"] == 12
        assert dec.pull(meta, dst, timeout=10) == len(src) * dec.layout.block_bytes
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(dst_kv.data[d], src_kv.data[s]), (s, d)
        assert not dst_kv.data[5].any()  # nothing else written

        # a peer that does not say its block count: its list grows as blocks need it
        dec.forget(meta["agent"])
        old = {k: v for k, v in pre.export("r2", [1]).items() if k != "num_blocks"}
        dst_kv.data.zero_()
        dec.pull(old, [6], timeout=10)
        assert torch.equal(dst_kv.data[6], src_kv.data[1])
        dec.pull({**old, "block_ids": [10, 11]}, [4, 5], timeout=10)
        assert torch.equal(dst_kv.data[4:6], src_kv.data[10:12])
        assert dec.transfers == 3
    finally:
        dec.close()
        pre.close()


@pytest.mark.parametrize("threads", [2, 3])
def test_a_large_pull_is_split_across_threads(
    fresh_db: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nixl_kv, "PARALLEL_MIN_BYTES", 0)  # these blocks are tiny
    r = redis.Redis.from_url(fresh_db)
    src_kv, dst_kv = _cache(True), _cache(False)
    pre = NixlKVTransfer(src_kv, r, "pre", threads=1)
    dec = NixlKVTransfer(dst_kv, r, "dec", threads=threads)
    reads: list[list[int]] = []
    read, fail_on = dec._read, []

    def counting_read(agent, side, src, dst, deadline):  # type: ignore[no-untyped-def]
        reads.append(src)
        if src in fail_on:
            raise TransferError("injected")
        return read(agent, side, src, dst, deadline)

    monkeypatch.setattr(dec, "_read", counting_read)
    try:
        src, dst = [0, 1, 2, 3, 8, 5, 6], [11, 10, 9, 1, 2, 3, 4]
        dec.pull(pre.export("r", src), dst, timeout=10)
        assert len(reads) == threads  # contiguous slices, together the whole list
        assert sorted(b for part in reads for b in part) == sorted(src)
        assert all(part == src[src.index(part[0]) :][: len(part)] for part in reads)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(dst_kv.data[d], src_kv.data[s]), (s, d)
        # a slice that fails fails the pull, once every slice has ended
        reads.clear()
        fail_on.append(src[: len(src) // threads])
        with pytest.raises(TransferError, match="injected"):
            dec.pull(pre.export("r", src), dst, timeout=10)
        assert len(reads) == threads
    finally:
        dec.close()
        pre.close()
