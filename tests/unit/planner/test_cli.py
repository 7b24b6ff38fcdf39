"""``conveyor planner --dry-run`` on the recorded ramp, the planner's settings, and the
``conveyor_planner_*`` families rendered from its state."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest

from planner.connectors import AdvisoryConnector
from planner.core import Planner, PlannerConfig
from planner.inputs import read_recording
from planner.metrics import PlannerCollector, parse_state
from tasks.cli import main
from tasks.planning import planner_config
from tasks.settings import Settings

REC = Path(__file__).parent / "data" / "recorded.jsonl"


def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k.startswith("CONVEYOR_"):
            monkeypatch.delenv(k)


def test_dry_run_prints_each_decision_and_the_worker_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _clean(monkeypatch)
    args = ["planner", "--dry-run", str(REC), "--ttft-ms", "4000", "--itl-ms", "600",
            "--max-workers", "8", "--gpu-budget", "8"]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.output.splitlines() if re.match(r"\s*\+\d+\.\ds  generate: ", ln)]
    assert lines, r.output
    moves = [tuple(map(int, re.search(r"(\d+) -> (\d+)", ln).groups())) for ln in lines]  # type: ignore[union-attr]
    assert moves[0] == (1, 2) and all(b > a for a, b in moves[:3])  # grows first
    assert re.search(r"generate: \d+ worker-seconds observed", r.output)
    # the same replay through the API: the same decisions
    cfg = PlannerConfig(ttft_target_s=4.0, itl_target_s=0.6, max_workers=8, gpu_budget=8)
    p = Planner(cfg, AdvisoryConnector(), dry_run=True)
    got = [(d.previous, d.replicas) for o in read_recording(REC) for d in p.step(o)]
    assert got == moves


def test_dry_run_refuses_a_file_that_is_not_a_recording(tmp_path: Path) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"hello": 1}\n')
    r = CliRunner().invoke(main, ["planner", "--dry-run", str(bad)])
    assert r.exit_code == 2 and "not a recorded observation" in r.output


def test_settings_become_the_planner_config(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean(monkeypatch)
    monkeypatch.setenv("CONVEYOR_PLANNER_TTFT_MS", "250")
    monkeypatch.setenv("CONVEYOR_PLANNER_GPUS_PER_WORKER", "prefill=2,decode=1")
    monkeypatch.setenv("CONVEYOR_MODE", "disagg")
    cfg = planner_config(Settings())
    assert cfg.ttft_target_s == 0.25 and cfg.itl_target_s == 0.05
    assert cfg.gpus("prefill") == 2 and cfg.gpus("generate") == 1
    assert set(cfg.pools) == {"prefill", "decode"}
    monkeypatch.setenv("CONVEYOR_PLANNER_POOLS", "decode")
    assert planner_config(Settings()).pools == ("decode",)


def test_metrics_render_the_state_any_replica_reads() -> None:
    p = Planner(PlannerConfig(ttft_target_s=4.0, itl_target_s=0.6, max_workers=8,
                              gpu_budget=8), AdvisoryConnector(), dry_run=True)  # fmt: skip
    for o in read_recording(REC):
        p.step(o)
    state = parse_state(json.dumps(p.state()))  # as Redis holds it
    assert state is not None
    reg = CollectorRegistry()
    reg.register(PlannerCollector(lambda: state))
    text = generate_latest(reg).decode()
    plan = p.plans["generate"]
    assert f'conveyor_planner_workers{{pool="generate"}} {float(plan.has)}' in text
    assert f'conveyor_planner_wanted_workers{{pool="generate"}} {float(plan.wanted)}' in text
    m = re.search(r'conveyor_planner_worker_seconds_total\{pool="generate"\} (\S+)', text)
    assert m and float(m.group(1)) == pytest.approx(plan.worker_seconds)
    assert re.search(
        r'conveyor_planner_decisions_total\{kind="load-up",pool="generate"\} [1-9]', text
    )
    assert 'conveyor_planner_target_seconds{metric="ttft"} 4.0' in text
    assert parse_state(None) is None and parse_state(b"not json") is None
    empty = CollectorRegistry()
    empty.register(PlannerCollector(lambda: None))
    assert "conveyor_planner" not in generate_latest(empty).decode()
