"""``conveyor serve --planner``: the planner grows the generate pool while every worker is
over its targets and drains it back when the load is gone, and no request is lost on the
way. Real processes: the supervisor, mock-engine workers whose steps take GPU-like time,
the API over HTTP, the official openai client as the caller; the planner reads the
workers' heartbeats and the API's traffic counters from the real Redis."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import Streams, wait_for
from tests.integration.test_serve_supervision import serving

pytestmark = pytest.mark.integration

OSL = 24


def _metric(url: str, name: str, **labels: str) -> float | None:
    """The sample of ``name`` with exactly ``labels`` (in any order) on the API's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == labels:
            return float(m.group(2))
    return None


def _live(url: str) -> int:
    return int(httpx.get(f"{url}/health", timeout=5).json().get("workers", {}).get("generate", 0))


def test_planner_scales_up_under_load_and_drains_after(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    with serving(tmp_path, tiny_model_dir, "--planner", "--workers", "1", "--no-flower",
                 CONVEYOR_MOCK__DECODE_STEP_MS="40", CONVEYOR_MOCK__PREFILL_US_PER_TOKEN="1500",
                 CONVEYOR_MAX_NUM_SEQS="4", CONVEYOR_WORKER_MAX_REQUESTS="0",
                 CONVEYOR_PLANNER_TTFT_MS="1000", CONVEYOR_PLANNER_ITL_MS="400",
                 CONVEYOR_PLANNER_LOAD_INTERVAL_S="1", CONVEYOR_PLANNER_WINDOW_S="5",
                 CONVEYOR_PLANNER_THROUGHPUT_INTERVAL_S="10",
                 CONVEYOR_PLANNER_FORECASTER="constant",
                 CONVEYOR_PLANNER_MAX_WORKERS="3", CONVEYOR_PLANNER_GPU_BUDGET="3",
                 CONVEYOR_PLANNER_HOLD_TIMEOUT_S="60") as s:  # fmt: skip
        wait_for(lambda: s.complete().status_code == 200, 60, "a served request", [s.proc])
        # 18 streams at once: 4.5 batches queue on one worker
        with Streams(s.url, s.model, 18, "tell me more " * 40, OSL, timeout=120) as traffic:
            wait_for(lambda: _live(s.url) >= 3, 120, "the planner growing the pool to 3",
                     [s.proc])  # fmt: skip
            # grown by the load loop (every worker over, one at a time) or, as the traffic
            # began, by the throughput loop's floor from the rate since then (which may add
            # two at once): the planner asked for the three
            ups = [_metric(s.url, "conveyor_planner_decisions_total", pool="generate",
                           kind=kind) or 0.0 for kind in ("load-up", "throughput-up")]  # fmt: skip
            assert sum(ups) >= 1, ups
            wanted = _metric(s.url, "conveyor_planner_wanted_workers", pool="generate")
            assert wanted is not None and wanted >= 3, wanted
            assert _metric(s.url, "conveyor_planner_workers", pool="generate") is not None
            time.sleep(3)  # requests on all three workers when the load stops
        # idle now: the throughput loop's next tick lowers its floor to the idle rate's,
        # and every worker is under target with one fewer fitting: drained one a tick
        wait_for(lambda: _live(s.url) == 1, 120, "the planner draining back to 1", [s.proc])
        downs = _metric(s.url, "conveyor_planner_decisions_total", pool="generate",
                        kind="load-down")  # fmt: skip
        assert downs is not None and downs >= 2, downs
        errors = [o.error for o in traffic.out if o.error]
        assert not errors, errors[:3]
        assert len(traffic.out) >= 18
        bad = [(o.tokens, o.finish) for o in traffic.out if (o.tokens, o.finish) != (OSL, "length")]
        assert not bad, f"{len(bad)} of {len(traffic.out)} requests cut short: {bad[:5]}"
        table = s.table()
        drained = [n for n, p in table.items() if n.startswith("worker-")]
        assert sum(table[n]["state"] == "running" for n in drained) == 1, table
        assert s.complete().status_code == 200
