"""Image embeddings between two workers' transfer backends (real redis-server; real UCX for
NIXL): the tensor arrives whole and equal, the encode side's staging is freed once pulled,
and a gone or expired embedding is a TransferError, never a wrong tensor."""

from __future__ import annotations

import pytest
import redis
import torch

from tests.integration.conftest import wait_for
from workers.transfer.base import TransferError
from workers.transfer.embeddings import (
    NixlEmbeddingTransfer,
    RedisEmbeddingTransfer,
    _Arena,
    make_embedding_transfer,
)
from workers.transfer.nixl_kv import nixl_available

pytestmark = pytest.mark.integration

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="nixl is not installed here")


def _embeds(seed: int, shape: tuple[int, ...] = (16, 128)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_redis_moves_each_embedding_once(fresh_db: str) -> None:
    r = redis.Redis.from_url(fresh_db)
    enc, pd = RedisEmbeddingTransfer(r), RedisEmbeddingTransfer(r)
    a, b = _embeds(1), _embeds(2, (576, 64)).to(torch.bfloat16)
    ma, mb = enc.export("req", "aa", a), enc.export("req", "bb", b)
    assert torch.equal(pd.pull(mb, 5), b) and torch.equal(pd.pull(ma, 5), a)
    assert pd.transfers == 2 and pd.bytes_moved == a.numel() * 4 + b.numel() * 2
    with pytest.raises(TransferError):  # read once: the key is gone
        pd.pull(ma, 5)
    assert not r.exists(ma["key"])


@needs_nixl
def test_nixl_reads_from_the_encode_workers_arena_and_frees_it(fresh_db: str) -> None:
    r = redis.Redis.from_url(fresh_db)
    enc = NixlEmbeddingTransfer(r, "enc-w", arena_mb=4)
    pd = NixlEmbeddingTransfer(r, "pd-w", arena_mb=4)
    try:
        full = enc._arena.free_bytes
        xs = [_embeds(i, (16 + i, 96)) for i in range(3)]
        metas = [enc.export("req", f"h{i}", x) for i, x in enumerate(xs)]
        assert enc._arena.free_bytes < full
        for x, m in zip(reversed(xs), reversed(metas), strict=True):
            assert torch.equal(pd.pull(m, 10), x)
        # the pulls tell the encode side: its slots come back
        wait_for(lambda: enc._arena.free_bytes == full, 10, "the slots released")
        assert pd._arena.free_bytes == pd._arena.buf.numel()  # nothing kept on the pull side
        with pytest.raises(TransferError):
            enc.export("req", "huge", torch.zeros(2 << 20))  # 8 MB into a 4 MB arena
    finally:
        pd.close()
        enc.close()


@needs_nixl
def test_nixl_frees_an_embedding_nobody_pulled(fresh_db: str) -> None:
    r = redis.Redis.from_url(fresh_db)
    enc = NixlEmbeddingTransfer(r, "enc-x", arena_mb=1, pin_timeout_s=0.5)
    try:
        full = enc._arena.free_bytes
        enc.export("req", "lost", _embeds(3))
        assert enc._arena.free_bytes < full  # held for a pull ...
        wait_for(lambda: enc._arena.free_bytes == full, 5, "the abandoned slot freed")
    finally:
        enc.close()


def test_redis_a_declined_embedding_is_deleted(fresh_db: str) -> None:
    r = redis.Redis.from_url(fresh_db)
    enc, pd = RedisEmbeddingTransfer(r), RedisEmbeddingTransfer(r)
    m = enc.export("req", "cc", _embeds(4))
    assert r.exists(m["key"])
    pd.decline(m)  # the puller had its own copy
    assert not r.exists(m["key"])


@needs_nixl
def test_nixl_a_declined_embedding_frees_its_slot_now(fresh_db: str) -> None:
    r = redis.Redis.from_url(fresh_db)
    enc = NixlEmbeddingTransfer(r, "enc-y", arena_mb=1, pin_timeout_s=600)
    pd = NixlEmbeddingTransfer(r, "pd-y", arena_mb=1)
    try:
        full = enc._arena.free_bytes
        m = enc.export("req", "dd", _embeds(5))
        assert enc._arena.free_bytes < full
        pd.decline(m)  # long before the pin timeout
        wait_for(lambda: enc._arena.free_bytes == full, 5, "the declined slot freed")
    finally:
        pd.close()
        enc.close()


def test_arena_slots_coalesce() -> None:
    arena = _Arena(16 * 4096)
    offs = [arena.alloc(4096 * 3) for _ in range(5)]
    assert offs == [0, 12288, 24576, 36864, 49152] and arena.alloc(4096 * 2) is None
    for off in (offs[1], offs[3], offs[2]):
        arena.free(off, 4096 * 3)
    assert arena.alloc(4096 * 9) == 12288  # three neighbours merged back into one run


def test_auto_picks_a_backend(fresh_db: str) -> None:
    t = make_embedding_transfer("auto", redis.Redis.from_url(fresh_db), "w")
    try:
        assert t.name == ("nixl" if nixl_available() else "redis")
    finally:
        t.close()
    with pytest.raises(ValueError):
        make_embedding_transfer("carrier-pigeon", redis.Redis.from_url(fresh_db), "w")


_CHOOSE = """
import logging, sys
from types import SimpleNamespace
if sys.argv[2] == "hide":  # this process cannot import NIXL, as where its wheel is missing
    sys.modules["nixl"] = sys.modules["nixl._api"] = None
import redis, torch
from workers.llama import PagedKVCache
from workers.transfer import make_transfer
from workers.transfer.embeddings import make_embedding_transfer
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
client = redis.Redis.from_url(sys.argv[1])
kv = PagedKVCache(SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=8), 4, 4,
                  torch.float32, "cpu")
made = [make_transfer("auto", kv, client, "w1"), make_transfer("auto", kv, client, "w2"),
        make_embedding_transfer("auto", client, "w3")]
print("CHOSE", " ".join(t.name for t in made))
for t in made:
    t.close()
"""


@pytest.mark.parametrize("nixl", ["hide", "load"])
def test_auto_says_once_which_backend_and_why(fresh_db: str, nixl: str) -> None:
    """CONVEYOR_KV_TRANSFER=auto: NIXL where it loads, else Redis; the log says once per
    process, for KV and for embeddings, which one and why (with the import's error and how
    to install it when NIXL does not load)."""
    import subprocess
    import sys

    if nixl == "load" and not nixl_available():
        pytest.skip("nixl is not installed here")
    out = subprocess.run([sys.executable, "-c", _CHOOSE, fresh_db, nixl],
                         capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    lines = [ln for ln in out.splitlines() if " transfer: " in ln]
    want = "redis" if nixl == "hide" else "nixl"
    assert f"CHOSE {want} {want} {want}" in out, out
    assert len(lines) == 2, lines  # once for KV (two transfers made), once for embeddings
    assert lines[0].startswith(f"INFO KV transfer: {want} (CONVEYOR_KV_TRANSFER=auto: "), lines
    assert lines[1].startswith(f"INFO embedding transfer: {want} (CONVEYOR_KV_TRANSFER=auto"), lines
    if nixl == "hide":
        assert "NIXL does not load (ModuleNotFoundError" in lines[0], lines
        assert "pip install 'conveyor[nixl]'" in lines[0], lines
