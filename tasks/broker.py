"""Kombu's Redis transport, keeping one client per channel and able to defer publishes.

Kombu's Redis channel builds a new ``redis.Redis`` for every publish, ack and event it
sends (``Channel.conn_or_acquire``), and redis-py fills a fresh table of some 200 response
callbacks each time: ~0.1 ms of CPU per call, several calls per request on both the API
(send, task-sent event) and the worker (task-received/started/succeeded events, ack). A
profile of a worker at 4 concurrent streams put 17% of its CPU there. The client only wraps
the channel's connection pool, which is thread-safe, so one per channel serves them all.

:func:`deferred_publishes` lets an asyncio caller send a Celery message without blocking
its event loop on the broker. Inside the block Celery and kombu build the message exactly
as always, but the Redis writes a publish ends in (``LPUSH`` onto the queue, ``PUBLISH`` of
the task-sent event) are recorded instead of sent; the caller then sends the recorded
commands with its asyncio client. Reads (a binding lookup) still go to Redis at once.
Measured in the API at 16 concurrent streams, the synchronous send held the event loop
3.1 ms (p50) per request, two round trips to a Redis on the same busy core.

In a worker, acknowledgements are written in batches (:class:`QoS`): an ack is a
``MULTI``/``ZREM``/``HDEL``/``EXEC`` round trip per request, a sixth of the worker's CPU
per request at 16 streams; written together at most every ``ACK_FLUSH_S`` they cost one.

Used for ``redis://`` brokers (``tasks.app.configure``); other schemes (``rediss://``,
whose TLS set-up kombu keys on the scheme, and ``sentinel://``) keep kombu's own transport,
which ignores :func:`deferred_publishes` and sends at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

log = logging.getLogger(__name__)

Command = tuple[Any, ...]  # ("LPUSH", key, value), ("PUBLISH", channel, message), ...

_deferred: ContextVar[list[Command] | None] = ContextVar("conveyor_deferred", default=None)


@contextmanager
def deferred_publishes() -> Iterator[list[Command]]:
    """Record, rather than send, the Redis writes of the publishes made inside the block
    (in this thread or task). Yields the list they are appended to, in order: send them
    in one pipeline, e.g. ``for c in cmds: pipe.execute_command(*c)``. An empty list after
    a publish means the transport sent it itself (a broker that is not ``redis://``)."""
    out: list[Command] = []
    token = _deferred.set(out)
    try:
        yield out
    finally:
        _deferred.reset(token)


class _Recorder:
    """Stands in for the channel's client (or a pipeline of it) while publishes are
    deferred: the writes that kombu's publish path ends in are recorded, everything else
    (a declaration's reads on a fresh channel, say) goes to the real client at once."""

    _WRITES = frozenset({"lpush", "rpush", "publish", "pexpire"})

    def __init__(self, target: Any, out: list[Command]) -> None:
        self._target = target
        self._out = out

    def __getattr__(self, name: str) -> Any:
        if name in self._WRITES:

            def record(*args: Any) -> _Recorder:
                self._out.append((name.upper(), *args))
                return self  # as a pipeline's commands chain

            return record
        return getattr(self._target, name)

    def pipeline(self, *args: Any, **kwargs: Any) -> _Recorder:
        return _Recorder(self._target.pipeline(*args, **kwargs), self._out)

    def __enter__(self) -> _Recorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        exit_ = getattr(self._target, "__exit__", None)  # a pipeline resets itself
        if exit_ is not None:
            exit_(*exc)


ACK_FLUSH_S = 0.05  # the longest an ack waits to be written with others


class QoS(kombu_redis.QoS):
    """Kombu's Redis ack emulation, with acks written in batches on the worker's event loop.

    An ack frees its prefetch slot at once (the in-memory bookkeeping); the Redis side,
    dropping the message from the unacked hash and index, waits up to ``ACK_FLUSH_S`` for
    the acks after it and goes in one transaction with them. A worker that dies before
    writing them leaves those messages in the unacked hash, where the broker redelivers
    them after the visibility timeout, as it would any task the worker held: the API's
    cancelled key (set for every request that ended) makes such a copy skip the work.
    Closing the channel writes them first. Without an event loop (any process but a
    worker's consumer) an ack is written at once, as kombu does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acks: list[str] = []
        self._acks_lock = threading.Lock()

    def ack(self, delivery_tag: str) -> None:
        hub = getattr(self.channel.connection, "conveyor_hub", None)
        if hub is None:
            super().ack(delivery_tag)
            return
        with self._acks_lock:
            self._acks.append(delivery_tag)
            first = len(self._acks) == 1
        virtual.QoS.ack(self, delivery_tag)
        if first:
            hub.call_later(ACK_FLUSH_S, self.flush_acks)

    def flush_acks(self) -> None:
        """Write the acks held back so far, in one transaction."""
        with self._acks_lock:
            tags, self._acks = self._acks, []
        if tags:
            with self.pipe_or_acquire() as pipe:
                for tag in tags:
                    self._remove_from_indices(tag, pipe)
                pipe.execute()


class Channel(kombu_redis.Channel):
    QoS = QoS
    _sync_client = None

    def _create_client(self, asynchronous: bool = False):  # type: ignore[no-untyped-def]
        if asynchronous:  # the consumer's BRPOP client: kombu keeps that one itself
            return super()._create_client(asynchronous=True)
        if self._sync_client is None:
            self._sync_client = super()._create_client()
        return self._sync_client

    @contextmanager
    def conn_or_acquire(self, client=None):  # type: ignore[no-untyped-def]
        out = _deferred.get()
        if client is not None or out is None:
            yield client or self._create_client()
        else:
            yield _Recorder(self._create_client(), out)

    def close(self) -> None:
        if self._qos is not None and not self.closed:
            try:
                self._qos.flush_acks()
            except Exception as e:  # noqa: BLE001 - redelivered later, then skipped
                log.warning("acks not written before closing the channel: %s", e)
        self._sync_client = None
        super().close()


class Transport(kombu_redis.Transport):
    Channel = Channel
    conveyor_hub = None  # the worker's event loop, once the consumer registers with it

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self.conveyor_hub = loop
        super().register_with_event_loop(connection, loop)
