"""An API process's graceful shutdown: on SIGTERM or SIGINT it takes no new connection
(uvicorn closes its socket, so a load balancer's health checks fail over) and lets the
requests it serves run to their end, for up to ``CONVEYOR_SHUTDOWN_DRAIN_S``; a stream
still open then ends with a 503 ``server_shutting_down`` error event, so every client gets
a terminal event, and the process exits.

uvicorn's own signal handler stays in charge (a second signal exits at once): ours is
chained in front of it. sse-starlette, which would otherwise cut every stream the moment
the signal comes, is told not to (its public ``disable_automatic_graceful_drain``)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from types import FrameType

from sse_starlette.sse import AppStatus

from api.errors import OpenAIError
from api.streams import StreamHub

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def shutting_down() -> OpenAIError:
    """The error a stream still open at the end of the drain ends with."""
    return OpenAIError(503, "the server is shutting down; send the request again",
                       "server_error", None, "server_shutting_down")  # fmt: skip


class Drain:
    """Installed at the app's start (inside uvicorn's signal capture): the first signal
    starts the drain, whose end fails every stream still open on ``hub``."""

    def __init__(self, hub: StreamHub, drain_s: float) -> None:
        self.hub = hub
        self.drain_s = drain_s
        self.started = False
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[None] | None = None
        self._chained: dict[int, Callable | int | None] = {}

    def install(self) -> Drain:
        AppStatus.disable_automatic_graceful_drain()
        for sig in SIGNALS:
            self._chained[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, prev in self._chained.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prev)
        if self._task is not None:
            self._task.cancel()

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if not self.started:
            self.started = True
            log.info("%s: draining (up to %g s) before exiting",
                     signal.Signals(sig).name, self.drain_s)  # fmt: skip
            self._loop.call_soon_threadsafe(self._start)
        prev = self._chained.get(sig)
        if callable(prev):
            prev(sig, frame)

    def _start(self) -> None:
        self._task = self._loop.create_task(self._end_after())

    async def _end_after(self) -> None:
        await asyncio.sleep(self.drain_s)
        n = self.hub.fail_all(shutting_down())
        if n:
            log.warning("drain over: %d streams still open end with server_shutting_down", n)
