"""The C decode-attention kernel: its numbers, its build and its fallback."""

from __future__ import annotations

import math
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbm.protocol import Sampling
from tasks.settings import Settings, engine_config
from workers import paged_kernel
from workers.engine import Engine
from workers.engine_api import EngineRequest
from workers.llama import AttentionMetadata, PagedKVCache
from workers.paged_kernel import KernelUnavailable


@pytest.fixture(scope="module")
def kernel() -> paged_kernel.PagedDecodeKernel:
    try:
        return paged_kernel.load(Path(engine_config().kernel_dir))
    except KernelUnavailable as e:
        pytest.skip(f"the C decode-attention kernel cannot be built here: {e}")


def _case(layers: int, block_size: int, kv_heads: int, groups: int, head_dim: int,
          ctx_lens: list[int], seed: int):  # fmt: skip
    """A random cache, each sequence on shuffled blocks, and one query per sequence."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 7
    cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=g)
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = []
    for c in ctx_lens:
        n = -(-c // block_size)
        tables.append(ids[:n])
        ids = ids[n:]
    q = torch.randn(len(ctx_lens), kv_heads * groups, head_dim, generator=g)
    return cache, tables, q


def _reference(cache, tables, ctx_lens, q, layer, scale):  # float64, one sequence at a time
    kv_heads, groups = cache.shape[4], q.shape[1] // cache.shape[4]
    outs = []
    for table, ctx, qs in zip(tables, ctx_lens, q, strict=True):
        k = cache[table, layer, 0].reshape(-1, kv_heads, cache.shape[5])[:ctx].double()
        v = cache[table, layer, 1].reshape(-1, kv_heads, cache.shape[5])[:ctx].double()
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        w = (torch.einsum("hd,thd->ht", qs.double(), k) * scale).softmax(-1)
        outs.append(torch.einsum("ht,thd->hd", w, v))
    return torch.stack(outs)


def _padded(tables: list[list[int]]) -> torch.Tensor:
    nb = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=torch.long)


@pytest.mark.parametrize(
    "layers,block_size,kv_heads,groups,head_dim,ctx_lens",
    [
        (4, 16, 4, 1, 32, [1, 15, 16, 17, 33, 200, 129, 64]),  # the default model's shape
        (3, 16, 2, 4, 16, [5, 300, 48, 49]),  # grouped-query attention
        (2, 8, 1, 8, 64, [7, 8, 9, 100]),  # one kv head, another block size
        (1, 32, 3, 2, 8, [1]),
    ],
)
def test_kernel_matches_float64_attention(
    kernel, layers, block_size, kv_heads, groups, head_dim, ctx_lens
) -> None:
    cache, tables, q = _case(layers, block_size, kv_heads, groups, head_dim, ctx_lens, seed=3)
    scale = 1 / math.sqrt(head_dim)
    lens = torch.tensor(ctx_lens, dtype=torch.long)
    for layer in range(layers):
        out = torch.full_like(q, float("nan"))
        kernel(cache, layer, q, _padded(tables), lens, max(ctx_lens), scale, out)
        want = _reference(cache, tables, ctx_lens, q, layer, scale)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def test_kernel_and_torch_path_agree_through_the_model(kernel, tiny_model_dir: Path) -> None:
    """One decode step's attention output, through ``LlamaModel._attention``'s two paths on
    the same cache: equal to float32 rounding."""
    engine = Engine.from_model_dir(tiny_model_dir, engine_config(decode_attention="torch"))
    model, cfg, bs = engine.model, engine.model.cfg, engine.config.block_size
    kv = PagedKVCache(cfg, 64, bs, torch.float32, "cpu")
    g = torch.Generator().manual_seed(5)
    kv.data.copy_(torch.randn(kv.data.shape, generator=g))
    ctx_lens = [1, 16, 17, 100, 250]
    ids = list(range(64))
    random.Random(1).shuffle(ids)
    decodes, slots = [], []
    for row, ctx in enumerate(ctx_lens):
        n = -(-ctx // bs)
        table, ids = ids[:n], ids[n:]
        decodes.append((row, ctx, table))
        slots.append(table[(ctx - 1) // bs] * bs + (ctx - 1) % bs)
    x = torch.randn(len(ctx_lens), cfg.hidden_size, generator=g)
    positions = torch.tensor([c - 1 for c in ctx_lens])
    cos, sin = model._rope(positions)
    outs = {}
    for name, k in (("torch", None), ("kernel", kernel)):
        meta = AttentionMetadata.build(torch.tensor(slots), [], decodes, bs, cfg.num_layers,
                                       kernel=k)  # fmt: skip
        assert (meta.decode_kernel is None) == (k is None)
        outs[name] = model._attention(x, "model.layers.1.", 1, cos, sin, meta, kv)
    torch.testing.assert_close(outs["kernel"], outs["torch"], rtol=1e-5, atol=1e-5)


def test_loading_the_kernel_keeps_subnormals(kernel) -> None:
    """Built with -ffast-math but linked without it: loading it must not switch the process
    to flush-to-zero, which would change every float op torch and Python do after."""
    tiny = 1e-310  # a float64 subnormal
    assert tiny * 1.0 != 0.0
    assert (torch.tensor([1e-40], dtype=torch.float32) * 1.0).item() != 0.0
    # and in a fresh process that loads nothing else first
    code = (
        "from pathlib import Path; from tasks.settings import engine_config; "
        "from workers import paged_kernel; paged_kernel.load(Path(engine_config().kernel_dir)); "
        "import sys; sys.exit(0 if 1e-310 * 1.0 != 0.0 else 3)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[3], timeout=120)
    assert r.returncode == 0


@pytest.fixture
def fresh_build(tmp_path: Path):
    """An empty kernel directory and no cached load, restored afterwards."""
    paged_kernel.load.cache_clear()
    yield tmp_path / "kernels"
    paged_kernel.load.cache_clear()


def test_kernel_is_built_once_into_its_hashed_file(kernel, fresh_build: Path) -> None:
    k = paged_kernel.load(fresh_build)
    built = list(fresh_build.glob("paged_attention-*.so"))
    assert len(built) == 1
    assert list(fresh_build.iterdir()) == built  # the temporary build directory is gone
    assert built[0] == paged_kernel.library_path(paged_kernel._compiler(), fresh_build)
    mtime = built[0].stat().st_mtime_ns
    paged_kernel.load.cache_clear()
    assert paged_kernel.load(fresh_build) is not k  # loaded again, from the file already there
    assert built[0].stat().st_mtime_ns == mtime


def test_no_compiler_falls_back_or_refuses(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(KernelUnavailable, match="no C compiler: 'no-such-compiler-here'"):
        paged_kernel.load(fresh_build)
    paged_kernel.load.cache_clear()
    cfg = engine_config(num_kv_blocks=64, max_model_len=512, kernel_dir=str(fresh_build))
    auto = Engine.from_model_dir(tiny_model_dir, cfg)
    assert auto.decode_attention == "torch" and auto.decode_kernel is None
    auto.add_request(EngineRequest("a", [1, 5, 6, 7], Sampling(temperature=0, max_tokens=4)))
    while auto.has_unfinished:
        auto.step()
    paged_kernel.load.cache_clear()
    with pytest.raises(KernelUnavailable, match="decode_attention=kernel: no C compiler"):
        Engine.from_model_dir(
            tiny_model_dir, engine_config(decode_attention="kernel", kernel_dir=str(fresh_build))
        )


def test_a_failing_build_says_why(fresh_build: Path, tmp_path: Path, monkeypatch) -> None:
    cc = tmp_path / "broken-cc"
    cc.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "broken 1.0"; exit 0; }\n'
                  'echo "paged_attention.c:1: error: out of cheese" >&2; exit 1\n')  # fmt: skip
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(KernelUnavailable, match="out of cheese"):
        paged_kernel.load(fresh_build)
    assert not list(fresh_build.glob("*.so"))  # nothing half-built left to load next time
    assert not [p for p in fresh_build.iterdir() if p.name.startswith(".build-")]


def test_kernel_needs_float32_on_cpu(tiny_model_dir: Path) -> None:
    bf16 = engine_config(dtype="bfloat16", num_kv_blocks=64, max_model_len=512)
    assert Engine.from_model_dir(tiny_model_dir, bf16).decode_attention == "torch"
    with pytest.raises(KernelUnavailable, match="float32 on CPU only"):
        Engine.from_model_dir(
            tiny_model_dir, engine_config(dtype="bfloat16", decode_attention="kernel")
        )
    with pytest.raises(ValueError, match="auto, kernel or torch"):
        Engine.from_model_dir(tiny_model_dir, engine_config(decode_attention="sdpa"))


def test_the_kernel_directory_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    # CONVEYOR_KERNEL_DIR (the container image's) is the engine area's kernel_dir, which
    # the engine's configuration carries to the engine
    monkeypatch.setenv("CONVEYOR_KERNEL_DIR", str(tmp_path / "k"))
    assert engine_config(Settings()).kernel_dir == str(tmp_path / "k")
    monkeypatch.delenv("CONVEYOR_KERNEL_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert engine_config(Settings()).kernel_dir == str(tmp_path / "xdg" / "conveyor" / "kernels")
    assert os.fspath(paged_kernel.SOURCE).endswith("paged_attention.c")
