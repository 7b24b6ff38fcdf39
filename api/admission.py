"""Admission control: refuse early and clearly rather than queue without bound.

Two limits, both answered before anything is sent to the broker, both with ``Retry-After``
and counted in ``conveyor_requests_refused_total{reason}``:

* **Per worker** (``CONVEYOR_WORKER_MAX_REQUESTS``, default 2 x ``max_num_seqs``): the
  router's commit script refuses a worker that already holds that many requests (running
  and queued, counted in Redis by every API replica: the cap holds cluster-wide; a request
  of ``n`` choices holds n sequences and counts n, ``tasks.router``). When
  every live worker of a pool is at it the router raises
  :class:`tasks.router.WorkersBusy`; :class:`Admission` then waits, by priority (vLLM's
  ``priority``: lower first) and in arrival order within one, for a slot for up to
  ``CONVEYOR_ADMISSION_WAIT_S``, and past that answers **503** ``server_overloaded``
  (reason ``workers_busy``).
* **Per client** (``CONVEYOR_CLIENT_MAX_REQUESTS``, off by default): requests in flight on
  this API process per client (its API key when keys are set, else its address, as uvicorn
  reports it behind trusted proxies); one more is **429** ``rate_limit_exceeded`` (reason
  ``client_limit``) at once, before its body is read (:class:`ClientLimitMiddleware`).

Nothing accepted is dropped: a request is either admitted (and runs to its end, or to an
error event) or refused with one of these answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import OpenAIError, shaped_error
from api.metrics import ApiMetrics
from api.middleware import presented_key
from tasks.router import WorkersBusy

log = logging.getLogger(__name__)

T = TypeVar("T")

POLL_S = 0.05  # waiters look again this often (slots freed by other API replicas)
# the endpoints that start work (every model request a client could hold open)
WORK_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/pooling",
    "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/invocations",
    "/classify", "/v1/classify", "/v1/messages",
})  # fmt: skip


class Admission:
    """Bounded wait for a worker under its cap (the cap itself is the router's commit).

    :meth:`admit` runs ``attempt`` (the request's plan: route and count every stage); if
    every candidate is at the cap it waits and tries again whenever a slot may have freed
    (:meth:`notify`: this process released a request; else every ``POLL_S``, for the
    other replicas'), for up to ``wait_s``. Waiters try in priority order (lower values
    first), those of one priority in the order they came, and a new request queues behind
    every waiter of its priority or a lower value, so a slot goes to the most urgent,
    longest waiting request. A try that finds every worker still full costs no Redis round
    trip (the router's local view)."""

    def __init__(self, wait_s: float, retry_after_s: int, metrics: ApiMetrics) -> None:
        self.wait_s = wait_s
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self._waiting: list[_Waiter] = []  # by priority, then arrival
        self._ticker: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def admit(self, attempt: Callable[[], Awaitable[T]], priority: int = 0) -> T:
        """``attempt()``'s result once it is not refused by :class:`WorkersBusy`; past
        ``wait_s`` an :class:`OpenAIError` 503 with ``Retry-After``."""
        busy: WorkersBusy | None = None
        if not any(w.priority <= priority for w in self._waiting):  # nobody before us
            try:
                return await attempt()
            except WorkersBusy as e:
                busy = e
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.wait_s
        me = _Waiter(priority)
        # our place in line (behind every waiter of our priority or a lower value), kept
        # until we leave it
        at = next((i for i, w in enumerate(self._waiting) if w.priority > priority),
                  len(self._waiting))  # fmt: skip
        self._waiting.insert(at, me)
        self.metrics.admission_waiting.inc()
        self._tick()
        try:
            while (left := deadline - loop.time()) > 0:
                me.turn = loop.create_future()
                try:
                    await asyncio.wait_for(me.turn, left)
                except TimeoutError:
                    break
                try:
                    result = await attempt()
                except WorkersBusy as e:
                    busy = e
                    continue
                self.metrics.admission_wait.observe(loop.time() - started)
                return result
        finally:
            self._waiting.remove(me)
            self.metrics.admission_waiting.dec()
        self.metrics.admission_wait.observe(loop.time() - started)
        self.metrics.refused.labels("workers_busy").inc()
        what = str(busy) if busy is not None else "the workers are at their request cap"
        raise OpenAIError(
            503,
            f"server overloaded: {what} and none freed within {self.wait_s:g} s; retry "
            f"after {self.retry_after_s} s",
            "server_error",
            None,
            "server_overloaded",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    def notify(self) -> None:
        """A slot may have freed (this process released a request): waiters try again."""
        for w in self._waiting:  # in line: their tries run in this order
            if w.turn is not None and not w.turn.done():
                w.turn.set_result(None)

    def _tick(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._ticks())

    async def _ticks(self) -> None:
        while self._waiting:
            await asyncio.sleep(POLL_S)
            self.notify()


class _Waiter:
    __slots__ = ("priority", "turn")

    def __init__(self, priority: int = 0) -> None:
        self.priority = priority
        self.turn: asyncio.Future[None] | None = None  # resolved when it may try again


def client_id(scope: Scope, by_key: bool) -> str:
    """Who sends a request: ``key:<digest>`` of its API key when ``by_key`` (keys are
    configured, and the auth middleware has checked it; no key is kept in clear), else
    ``addr:<address>`` as uvicorn reports it (behind trusted proxies, the client's)."""
    if by_key and (key := presented_key(scope)):
        return "key:" + hashlib.sha256(key).hexdigest()[:16]
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:?"


class ClientLimitMiddleware:
    """At most ``max_requests`` requests in flight per client on the work endpoints; one
    more is answered 429 with ``Retry-After`` before its body is read. A request holds its
    place until its response ends (a stream: its last event, or the client gone).

    The client is its API key when ``by_key`` (keys are configured, so the key names the
    caller: the auth middleware before this one has checked it), else its address."""

    def __init__(self, app: ASGIApp, max_requests: int, by_key: bool, retry_after_s: int,
                 metrics: ApiMetrics) -> None:  # fmt: skip
        self.app = app
        self.max = max_requests
        self.by_key = by_key
        self.retry_after = str(retry_after_s).encode()
        self.metrics = metrics
        self._in_flight: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in WORK_PATHS:
            await self.app(scope, receive, send)
            return
        who = self._client(scope)
        n = self._in_flight.get(who, 0)
        if n >= self.max:
            self.metrics.refused.labels("client_limit").inc()
            await self._refuse(send, scope)
            return
        self._in_flight[who] = n + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self._in_flight[who] - 1
            if left:
                self._in_flight[who] = left
            else:
                del self._in_flight[who]

    def _client(self, scope: Scope) -> str:
        return client_id(scope, self.by_key)

    async def _refuse(self, send: Send, scope: Scope) -> None:
        body = json.dumps(shaped_error(
            scope, 429, f"too many requests in flight for this client (limit {self.max}); "
            f"retry after {self.retry_after.decode()} s", "requests", None, "rate_limit_exceeded",
        )).encode()  # fmt: skip
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"retry-after", self.retry_after)]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})
