"""The planner from the settings: its config, its connector, its run, its dry run.

``conveyor planner`` (a process of its own, any connector) and ``conveyor serve
--planner`` (a thread of the supervisor, the serve connector) both build it here."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import redis

from planner.connectors import (
    AdvisoryConnector,
    Connector,
    ConnectorError,
    ConnectorOptions,
    Decision,
    build_connector,
    parse_pool_map,
)
from planner.core import Planner, PlannerConfig
from planner.inputs import Observation, read_recording
from tasks.settings import Settings

log = logging.getLogger("conveyor.planner")


def planner_config(s: Settings) -> PlannerConfig:
    p = s.planner
    pools = tuple(x.strip() for x in p.pools.split(",") if x.strip()) if p.pools else s.pools
    gpus = {k: int(v) for k, v in parse_pool_map(p.gpus_per_worker or "").items()}
    return PlannerConfig(
        pools=pools,
        ttft_target_s=p.ttft_ms / 1000,
        itl_target_s=p.itl_ms / 1000,
        load_interval_s=p.load_interval_s,
        throughput_interval_s=p.throughput_interval_s,
        window_s=p.window_s,
        min_workers=p.min_workers,
        max_workers=p.max_workers,
        gpu_budget=p.gpu_budget,
        gpus_per_worker=gpus,
        sensitivity=p.sensitivity,
        forecaster=p.forecaster,
        hold_timeout_s=p.hold_timeout_s,
    )


def connector_options(s: Settings) -> ConnectorOptions:
    p = s.planner
    return ConnectorOptions(
        compose_services=parse_pool_map(p.compose_services or ""),
        compose_project=p.compose_project,
        docker_host=p.docker_host,
        k8s_api=p.k8s_api,
        k8s_namespace=p.k8s_namespace,
        k8s_token_file=p.k8s_token_file,
        k8s_ca_file=p.k8s_ca_file,
        k8s_deployments=parse_pool_map(p.k8s_deployments or ""),
    )


def planner_factory(s: Settings) -> Callable[[Connector], Planner]:
    """What ``Supervisor(planner=...)`` takes: a planner for the connector it builds."""
    cfg = planner_config(s)

    def make(connector: Connector) -> Planner:
        out = s.planner.record.open("a") if s.planner.record else None  # kept while serve runs
        return Planner(cfg, connector, redis.Redis.from_url(s.effective_redis_url),
                       record=_recorder(out) if out else None)  # fmt: skip

    return make


def run_planner(s: Settings, record: Path | None = None) -> None:
    """``conveyor planner``: observe and decide until SIGINT/SIGTERM. A connector that
    cannot be built from the settings raises ValueError saying which setting."""
    import signal

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per orchestrator call
    client = redis.Redis.from_url(s.effective_redis_url)
    try:
        connector = build_connector(s.planner.connector, client, connector_options(s))
    except ConnectorError as e:
        raise ValueError(str(e)) from None
    record = record or s.planner.record
    out = record.open("a") if record is not None else None
    planner = Planner(planner_config(s), connector, client,
                      record=_recorder(out) if out else None)  # fmt: skip
    if s.planner.metrics_port:
        from prometheus_client import CollectorRegistry, start_http_server

        from planner.metrics import PlannerCollector

        reg = CollectorRegistry()
        reg.register(PlannerCollector(planner.state))
        start_http_server(s.planner.metrics_port, addr=s.api.host, registry=reg)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        planner.run(stop)
    finally:
        if out is not None:
            out.close()


def _recorder(out: TextIO) -> Callable[[Observation], None]:
    def write(obs: Observation) -> None:
        out.write(obs.to_json() + "\n")
        out.flush()

    return write


def dry_run(s: Settings, path: Path, echo: Callable[[str], None]) -> list[Decision]:
    """The decisions the planner would make on a recorded run (each action taken to have
    effect by the next observation), one line each, then each pool's worker-seconds."""
    for name in ("conveyor.planner", "planner"):  # the decisions are printed below
        logging.getLogger(name).setLevel(logging.WARNING)
    planner = Planner(planner_config(s), AdvisoryConnector(), dry_run=True)
    start: float | None = None
    out: list[Decision] = []
    n = 0
    for obs in read_recording(path):
        n += 1
        start = obs.ts if start is None else start
        for d in planner.step(obs):
            out.append(d)
            echo(f"{obs.ts - start:+8.1f}s  {d.pool}: {d.previous} -> {d.replicas}  {d.reason}")
    if not n:
        raise ValueError(f"{path}: no observations")
    for plan in planner.plans.values():
        echo(f"{plan.pool}: {plan.worker_seconds:.0f} worker-seconds observed, "
             f"{sum(plan.decisions.values())} decisions {plan.decisions or ''}")  # fmt: skip
    return out
