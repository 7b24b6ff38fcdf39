"""The ``serve`` connector: a planner inside ``conveyor serve`` scales the worker
processes of the supervisor it runs in (``tasks.supervisor``).

The supervisor starts new workers and drains the ones it scales away (SIGTERM: Celery's
warm shutdown, the worker leaves its pool and finishes what it holds). An action has
settled when the pool's workers that serve started are all live in Redis, as many as
wanted, and none it scaled away is still draining.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING

import redis

from cluster.membership import live_workers
from planner.connectors import ConnectorError, Decision

if TYPE_CHECKING:
    from tasks.supervisor import Supervisor

log = logging.getLogger("conveyor.planner.serve")


class ServeConnector:
    name = "serve"

    def __init__(self, supervisor: Supervisor, client: redis.Redis | None = None) -> None:
        self.supervisor = supervisor
        self.client = client or redis.Redis.from_url(
            supervisor.s.effective_redis_url, socket_timeout=2.0
        )
        self._host = socket.gethostname()

    def replicas(self, pool: str) -> int | None:
        return self.supervisor.replicas(pool)

    def scale(self, decision: Decision) -> None:
        try:
            self.supervisor.scale(decision.pool, decision.replicas)
        except ValueError as e:
            raise ConnectorError(str(e)) from None

    def settled(self, decision: Decision) -> bool:
        if self.supervisor.settling(decision.pool):
            return False
        running = [w.pid for w in self.supervisor.workers(decision.pool)
                   if w.state == "running" and w.pid is not None]  # fmt: skip
        if len(running) != decision.replicas:
            return False
        # a worker's id is <host>-<pid> (serve hands its workers no fixed id)
        ours = {f"{self._host}-{pid}" for pid in running}
        try:
            live = {w.worker_id for w in live_workers(self.client, decision.pool)}
        except redis.RedisError as e:
            log.warning("cannot read %s's members: %s", decision.pool, e)
            return False
        return ours <= live
