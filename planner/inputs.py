"""What the planner reads, once a tick, into one :class:`Observation`.

* Each pool's live workers and their heartbeat reports (``cluster.membership``): requests
  running and waiting, KV blocks in use, the engine's last steps (``step_samples``).
* Each pool's Celery queue depth (``cluster.queues``): requests no worker has taken yet.
* The API's traffic over the last window (``cluster.traffic``): request rate, mean prompt
  and output lengths, TTFT and ITL quantiles, summed over every API replica.

An observation is plain data: ``conveyor planner --record FILE`` writes one JSON line per
tick, and ``--dry-run FILE`` replays them through the same loops.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from cluster.membership import live_workers
from cluster.queues import queue_depths
from cluster.traffic import read_traffic


@dataclass(slots=True)
class WorkerView:
    worker_id: str
    running: int = 0
    waiting: int = 0
    kv_use: float = 0.0  # blocks in use / blocks
    samples: list[list[float]] = field(default_factory=list)  # EngineStats.step_samples

    @property
    def kv_tokens(self) -> float:
        """KV tokens its decode batch read in its last reported step."""
        return self.samples[-1][4] if self.samples else 0.0


@dataclass(slots=True)
class PoolView:
    pool: str
    workers: list[WorkerView] = field(default_factory=list)
    queued: int = 0  # on the pool's queues, taken by no worker yet


@dataclass(slots=True)
class TrafficView:
    """The API's traffic over the observation's window (all replicas)."""

    window_s: float = 0.0
    requests: int = 0  # began
    finished: int = 0
    rate: float = 0.0  # requests begun per second
    isl: float = 0.0  # mean prompt tokens
    osl: float = 0.0  # mean output tokens
    ttft: float | None = None  # the quantile the planner targets (p90), seconds
    itl: float | None = None


@dataclass(slots=True)
class Observation:
    ts: float
    pools: dict[str, PoolView]
    traffic: TrafficView

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Observation:
        d: dict[str, Any] = json.loads(line)
        pools = {
            name: PoolView(p["pool"], [WorkerView(**w) for w in p["workers"]], p["queued"])
            for name, p in d["pools"].items()
        }
        return cls(d["ts"], pools, TrafficView(**d["traffic"]))


def observe(client: redis.Redis, pools: tuple[str, ...], window_s: float,
            quantile: float = 0.9, now: float | None = None) -> Observation:  # fmt: skip
    """The cluster as Redis shows it now."""
    now = time.time() if now is None else now
    views: dict[str, PoolView] = {}
    for pool in pools:
        workers = []
        for w in live_workers(client, pool):
            st = w.report.stats
            workers.append(WorkerView(
                w.worker_id, st.running, st.waiting,
                st.blocks_used / st.blocks_total if st.blocks_total else 0.0,
                [list(s) for s in st.step_samples],
            ))  # fmt: skip
        views[pool] = PoolView(pool, workers)
    for q in queue_depths(client, pools):
        views[q.pool].queued = q.total
    t = read_traffic(client, window_s, now=now)
    traffic = TrafficView(window_s, t.requests, t.finished, t.rate, t.isl_mean or 0.0,
                          t.osl_mean or 0.0,
                          t.ttft_quantile(quantile), t.itl_quantile(quantile))  # fmt: skip
    return Observation(now, views, traffic)


def read_recording(path: Path) -> Iterator[Observation]:
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield Observation.from_json(line)
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: not a recorded observation ({e})") from e
