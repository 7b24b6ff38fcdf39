"""KVBM tier settings: sizes from GB or block counts (0 = off), a tier smaller than the one
above it warned about, and a disk dir that cannot be written refused at start in one line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from tasks.cli import _kvbm_tiers
from tasks.settings import GB, Settings


def test_sizes_from_gb_or_blocks_and_zero_is_off() -> None:
    s = Settings(kvbm_cpu_cache_gb=0.5, kvbm_disk_cache_gb=2)
    assert s.kvbm.tier_blocks(65536) == (GB // 2 // 65536, 2 * GB // 65536)
    s = Settings(kvbm_cpu_cache_gb=0.5, kvbm_cpu_cache_blocks=100, kvbm_disk_cache_blocks=0,
                 kvbm_disk_cache_gb=3)  # fmt: skip
    assert s.kvbm.tier_blocks(65536) == (100, 0)  # a block count wins, 0 included
    assert Settings().kvbm.tier_blocks(65536) == (0, 0)  # both off by default


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_KVBM_CPU_CACHE_GB", "1.5")
    monkeypatch.setenv("CONVEYOR_KVBM_DISK_CACHE_BLOCKS", "4096")
    monkeypatch.setenv("CONVEYOR_KVBM_DISK_DIR", "~/kv")
    monkeypatch.setenv("CONVEYOR_KVBM_DISK_OFFLOAD_FILTER", "false")
    monkeypatch.setenv("CONVEYOR_ROUTER_G3_WEIGHT", "0.1")
    s = Settings()
    assert s.kvbm.cpu_cache_gb == 1.5 and s.kvbm.disk_cache_blocks == 4096
    assert s.kvbm.disk_dir == Path("~/kv").expanduser() and not s.kvbm.disk_offload_filter
    assert (s.router.g1_weight, s.router.g2_weight, s.router.g3_weight) == (1.0, 0.75, 0.1)


def test_a_tier_smaller_than_the_one_above_is_a_warning(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Settings(model=tiny_model_dir, num_kv_blocks=512, kvbm_cpu_cache_blocks=256,
                 kvbm_disk_cache_blocks=128, kvbm_disk_dir=tmp_path)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="conveyor"):
        assert _kvbm_tiers(s) == (256, 128)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 2
    assert "G2 (host memory) holds 256 blocks, fewer than the 512 of the engine pool" in lines[0]
    assert "G3 (disk) holds 128 blocks, fewer than the 256 of G2" in lines[1]
    caplog.clear()
    s = Settings(model=tiny_model_dir, num_kv_blocks=512, kvbm_cpu_cache_gb=1)
    with caplog.at_level(logging.WARNING, logger="conveyor"):
        host, disk = _kvbm_tiers(s)
    assert host == GB // (2 * 4 * 16 * 4 * 32 * 4) and disk == 0 and not caplog.records


def test_an_unwritable_disk_dir_is_an_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    s = Settings(model=tiny_model_dir, kvbm_disk_cache_blocks=4096,
                 kvbm_disk_dir=tmp_path / "file" / "kv")  # fmt: skip
    with pytest.raises(click.ClickException, match="is not writable"):
        _kvbm_tiers(s)


def test_conveyor_worker_refuses_an_unwritable_disk_dir_in_one_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("not a directory")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_MODEL=str(tiny_model_dir), CONVEYOR_KVBM_DISK_CACHE_GB="1",
               CONVEYOR_KVBM_DISK_DIR=str(tmp_path / "file" / "kv"),
               CONVEYOR_REDIS_URL="redis://127.0.0.1:9/0")  # fmt: skip
    conveyor = Path(sys.executable).parent / "conveyor"
    p = subprocess.run([str(conveyor), "worker", "--pool", "generate"], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode != 0
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
    assert errors == [f"Error: CONVEYOR_KVBM_DISK_DIR {tmp_path / 'file' / 'kv'} is not "
                      "writable: Not a directory"], p.stderr  # fmt: skip
