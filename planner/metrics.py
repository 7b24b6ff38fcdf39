"""``conveyor_planner_*``: the planner's state as Prometheus metrics.

The planner keeps its state in Redis (``cluster.keys.planner_state_key``, refreshed every
tick, expiring when it stops), so every API replica's ``/metrics`` shows it; a standalone
``conveyor planner --metrics-port`` serves the same families from memory."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_POOL_GAUGES = (
    ("workers", "has", "Live workers of the pool"),
    ("wanted_workers", "wanted", "Workers the planner last asked the pool to have"),
    ("predicted_workers", "predicted", "Workers the throughput loop predicts the pool needs"),
    ("estimated_ttft_seconds", "est_ttft", "Estimated TTFT of a request sent now (workers mean)"),
    ("estimated_itl_seconds", "est_itl", "Estimated ITL at the batch now (workers mean)"),
    ("held", "held", "1 while the pool waits for its last scaling action to take effect"),
    ("ttft_scale", "ttft_scale", "Observed over modelled TTFT quantile, applied to the model"),
    ("itl_scale", "itl_scale", "Observed over modelled ITL quantile, applied to the model"),
)  # fmt: skip


def families(state: dict[str, Any] | None) -> Iterator[Any]:
    """The metric families of one planner state (:meth:`planner.core.Planner.state`)."""
    if not state:
        return
    pools: dict[str, dict[str, Any]] = state.get("pools", {})
    for name, key, doc in _POOL_GAUGES:
        g = GaugeMetricFamily(f"conveyor_planner_{name}", doc, labels=["pool"])
        for pool, p in pools.items():
            if p.get(key) is not None:
                g.add_metric([pool], float(p[key]))
        yield g
    ws = CounterMetricFamily("conveyor_planner_worker_seconds",
                             "Live workers integrated over time", labels=["pool"])  # fmt: skip
    dec = CounterMetricFamily("conveyor_planner_decisions", "Scaling decisions by kind",
                              labels=["pool", "kind"])  # fmt: skip
    for pool, p in pools.items():
        ws.add_metric([pool], float(p.get("worker_seconds", 0.0)))
        for kind, n in p.get("decisions", {}).items():
            dec.add_metric([pool, kind], float(n))
    yield ws
    yield dec
    targets = GaugeMetricFamily("conveyor_planner_target_seconds", "The planner's targets",
                                labels=["metric"])  # fmt: skip
    for k in ("ttft", "itl"):
        if state.get("targets", {}).get(k) is not None:
            targets.add_metric([k], float(state["targets"][k]))
    yield targets
    for group, doc in (("observed", "Observed over the planner's window"),
                       ("forecast", "Forecast for the next throughput interval")):  # fmt: skip
        g = GaugeMetricFamily(f"conveyor_planner_{group}", doc, labels=["quantity"])
        for k, v in state.get(group, {}).items():
            if v is not None:
                g.add_metric([k], float(v))
        yield g


class PlannerCollector(Collector):
    """A prometheus collector of whatever state ``source`` returns at scrape time."""

    def __init__(self, source: Callable[[], dict[str, Any] | None]) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        yield from families(self.source())


def parse_state(raw: bytes | str | None) -> dict[str, Any] | None:
    """The state as Redis holds it (``None``: no planner runs)."""
    if not raw:
        return None
    try:
        state = json.loads(raw)
    except ValueError:
        return None
    return state if isinstance(state, dict) else None
