"""Test doubles shared by unit and integration tests."""

from __future__ import annotations

from collections.abc import Callable


class FakeHub:
    """Stands in for kombu's event loop (a Celery worker's hub): records what is scheduled
    on it, for the test to run when it chooses."""

    def __init__(self) -> None:
        self.soon: list[Callable[[], object]] = []
        self.timers: list[tuple[float, Callable[[], object]]] = []

    def call_soon(self, fn: Callable[[], object]) -> None:
        self.soon.append(fn)

    def call_later(self, delay: float, fn: Callable[[], object]) -> None:
        self.timers.append((delay, fn))
