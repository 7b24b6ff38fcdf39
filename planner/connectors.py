"""Where a planner's decisions go: a connector per orchestrator.

A connector is told how many workers a pool should have (:class:`Decision`) and acts on
it; the planner holds its next action on that pool until the connector says the action
took effect (:meth:`Connector.settled`) and the pool's live members reached the number.
Scaling down always drains: the worker gets SIGTERM and finishes what it holds.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


class ConnectorError(RuntimeError):
    """A connector could not act; its message is one line saying why."""


@dataclass(slots=True)
class Decision:
    """One scaling action: ``pool`` should have ``replicas`` workers."""

    pool: str
    replicas: int
    previous: int
    reason: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    ts: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Connector(Protocol):
    name: str

    def replicas(self, pool: str) -> int | None:
        """Workers the orchestrator runs or is starting for ``pool`` now; ``None`` when it
        cannot tell (the planner counts the pool's live members instead)."""
        ...

    def scale(self, decision: Decision) -> None:
        """Ask for ``decision.replicas`` workers of ``decision.pool``; returns at once.
        Raises :class:`ConnectorError` when it cannot."""
        ...

    def settled(self, decision: Decision) -> bool:
        """Whether the action took effect, as far as the orchestrator knows."""
        ...
