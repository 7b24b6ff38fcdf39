"""``conveyor model init``: the default checkpoint, a preset, and an unknown preset."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from tasks.cli import main


def test_model_init_preset(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "l15"
    res = runner.invoke(main, ["model", "init", "--preset", "llava-1.5-like", str(out)])
    assert res.exit_code == 0, res.output
    assert "llava-1.5-like" in res.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["image_seq_length"] == 576 and cfg["vision_config"]["image_size"] == 336
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["crop_size"] == {"height": 336, "width": 336}
    # a second run leaves the checkpoint alone unless forced
    again = runner.invoke(main, ["model", "init", str(out)])
    assert again.exit_code == 0 and "already holds a model" in again.output
    assert json.loads((out / "config.json").read_text())["image_seq_length"] == 576


def test_model_init_unknown_preset(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["model", "init", "--preset", "huge", str(tmp_path / "x")])
    assert res.exit_code == 2
    assert "huge" in res.output and "llava-1.5-like" in res.output
    assert not (tmp_path / "x").exists()
