"""Kombu's Redis transport: one client per channel, deferred publishes, batched consuming.

Every use of kombu's internals lives here: the subclassed ``Channel`` / ``QoS`` /
``Transport`` of ``kombu.transport.redis`` and the private members they override or read
(``_brpop_start``, ``_brpop_read``, ``_create_client``, ``_queue_cycle``, ``_q_for_pri``,
``_in_poll``, ``_flush_brpop_reauth``, ``QoS._delivered``/``_dirty``,
``_remove_from_indices``, ``Message._raw``, ``connection._deliver``). Tested with kombu
5.7.x (``pyproject.toml`` pins ``kombu<5.8``). ``CONVEYOR_BROKER_FASTPATH=false`` uses
kombu's stock transport instead (:func:`tasks.app.configure`), and the suite runs the
OpenAI checks through it too.

Kombu's Redis channel builds a new ``redis.Redis`` for every publish, ack and event it
sends (``Channel.conn_or_acquire``), and redis-py fills a fresh table of some 200 response
callbacks each time, several times per request on both the API (send, task-sent event) and
the worker (task-received/started/succeeded events, ack). The client only wraps the
channel's connection pool, which is thread-safe, so one per channel serves them all
(docs/performance.md, "Broker: one client per channel").

:func:`deferred_publishes` lets an asyncio caller send a Celery message without blocking
its event loop on the broker. Inside the block Celery and kombu build the message exactly
as always, but the Redis writes a publish ends in (``LPUSH`` onto the queue, ``PUBLISH`` of
the task-sent event) are recorded instead of sent; the caller then sends the recorded
commands with its asyncio client. Reads (a binding lookup) still go to Redis at once. A
synchronous send holds the event loop for two round trips to Redis (docs/performance.md,
"API: deferred sends").

In a worker, the unacked bookkeeping is written in batches (:class:`QoS`): kombu makes a
``MULTI``...``EXEC`` round trip for every message received, before the task reaches its
thread, and another for every ack; here a task is handed over first, and the writes of a
loop turn (acks: of up to ``ACK_FLUSH_S``) go in one transaction (docs/performance.md,
"Broker: batched acks").

A worker's consumer waits with ``BLMPOP`` (Redis >= 7) instead of kombu's ``BRPOP``: one
round trip takes every message waiting in a queue, up to the prefetch credit
(:meth:`Channel._brpop_start`; docs/performance.md, "Broker: BLMPOP").

Used for ``redis://`` and ``rediss://`` brokers (``tasks.app.configure``: for TLS kombu
reads the ``ssl_*`` options of the URL, or ``broker_use_ssl``, and its channel connects
with redis-py's ``SSLConnection``); other schemes (``sentinel://``) keep kombu's own
transport, which ignores :func:`deferred_publishes` and sends at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from queue import Empty
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps as json_dumps
from kombu.utils.json import loads as json_loads

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
    """Kombu's Redis ack emulation, its writes batched on the worker's event loop.

    A message received is recorded in the unacked hash and index, and removed from them
    when acked. Kombu writes each as a transaction of its own and waits for it: a task
    reached its thread only after a round trip to Redis (on a worker whose Celery side
    runs niced on a busy core, a wait for the CPU after the answer too), and each ack was
    another. On a worker's event loop:

    * the record of a message received is written once the loop's current callback is
      done, that is once Celery has handed the task to a thread, not before;
    * an ack frees its prefetch slot at once, and its write waits up to ``ACK_FLUSH_S``
      for the next batch;
    * whatever is pending goes in one transaction, records before acks.

    A worker that dies before writing its acks leaves those messages in the unacked hash,
    where the broker redelivers them after the visibility timeout, as it would any task
    the worker held: the API's cancelled key (set for every request that ended) makes
    such a copy skip the work. Closing the channel writes what is pending. Without an
    event loop (any process but a worker's consumer) both are written at once, as kombu
    does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._received: list[tuple[Any, float]] = []  # (message, when)
        self._acks: list[str] = []
        self._pending_lock = threading.Lock()

    def _hub(self) -> Any:
        return getattr(self.channel.connection, "conveyor_hub", None)

    def append(self, message: Any, delivery_tag: str) -> None:
        hub = self._hub()
        if hub is None:
            super().append(message, delivery_tag)
            return
        virtual.QoS.append(self, message, delivery_tag)
        with self._pending_lock:
            self._received.append((message, time.time()))
            first = len(self._received) == 1
        if first:
            hub.call_soon(self.flush)

    def ack(self, delivery_tag: str) -> None:
        if self.channel.connection is None:
            # The channel closed (its connection was lost) while this task ran. Its close
            # put every message it had delivered and not seen acked back on its queue
            # (kombu's restore_unacked_once); that copy, redelivered, is the one acked.
            # kombu would try to write this ack through the closed channel and stop the
            # worker with an AttributeError.
            log.info("broker: ack of %s after its channel closed: its redelivery is acked",
                     delivery_tag)  # fmt: skip
            virtual.QoS.ack(self, delivery_tag)
            return
        hub = self._hub()
        if hub is None:
            super().ack(delivery_tag)
            return
        with self._pending_lock:
            self._acks.append(delivery_tag)
            first = len(self._acks) == 1
        virtual.QoS.ack(self, delivery_tag)
        if first:
            hub.call_later(ACK_FLUSH_S, self.flush)

    def flush(self) -> None:
        """Write the pending records and acks, in one transaction."""
        with self._pending_lock:
            received, self._received = self._received, []
            acks, self._acks = self._acks, []
        if not received and not acks:
            return
        with self.pipe_or_acquire() as pipe:
            for message, when in received:  # as kombu's append writes them
                info = message.delivery_info
                raw = json_dumps([message._raw, info["exchange"], info["routing_key"]])
                pipe.zadd(self.unacked_index_key, {message.delivery_tag: when})
                pipe.hset(self.unacked_key, message.delivery_tag, raw)
            for tag in acks:
                self._remove_from_indices(tag, pipe)
            pipe.execute()


MULTI_POP_MAX = 16  # the most messages one BLMPOP takes (the prefetch credit bounds it too)


class Channel(kombu_redis.Channel):
    QoS = QoS
    _sync_client = None
    _multi_pop: bool | None = None  # BLMPOP in place of BRPOP (decided on first use)
    _popping_many = False  # the command in flight on the consumer's connection is BLMPOP
    # kombu's class defaults type these as bool and None; its own code stores the
    # connection being polled (or None) and a monotonic time in them
    _in_poll: Any = False
    _brpop_sent_at: float | None = None  # type: ignore[assignment]  # kombu's None default

    def _brpop_start(self, timeout: int | None = None) -> None:
        """Wait for the next messages: kombu sends ``BRPOP`` on every queue, one message per
        round trip; here (Redis >= 7) ``BLMPOP`` on the same keys in the same order takes up
        to as many of the first non-empty queue's messages as the prefetch credit allows.

        Requests reach a worker in bursts (streams that started together end together, and
        their clients come back together), and with ``BRPOP`` its event loop took them one
        per turn, so most waited behind others of their burst (docs/performance.md,
        "Broker: BLMPOP")."""
        if not self._can_pop_many():
            self._popping_many = False
            super()._brpop_start(timeout)
            return
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        keys = [self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues]
        qos = self.qos
        credit = MULTI_POP_MAX
        if qos.prefetch_count:
            credit = min(credit, qos.prefetch_count - (len(qos._delivered) - len(qos._dirty)))
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()
        self._popping_many = True
        self.client.connection.send_command(
            "BLMPOP", timeout or 0, len(keys), *keys, "RIGHT", "COUNT", max(credit, 1)
        )

    def _brpop_read(self, **options: Any) -> bool:
        if not self._popping_many:
            return super()._brpop_read(**options)
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "BLMPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # the next turn reconnects
                raise
            if not reply:
                raise Empty()
            key, items = reply
            dest = bytes_to_str(key).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            for i, item in enumerate(items):
                try:
                    self.connection._deliver(json_loads(bytes_to_str(item)), dest)
                except BaseException:
                    if rest := items[i + 1 :]:  # back where they were, first out first again
                        self.client.rpush(key, *reversed(rest))
                    raise
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def _can_pop_many(self) -> bool:
        if self._multi_pop is None:
            self._multi_pop = False
            if not self.global_keyprefix:  # kombu would not prefix BLMPOP's keys
                pool = self.client.connection_pool
                conn = pool.get_connection()
                try:  # read raw: redis-py's parser for COMMAND fails on an unknown one
                    conn.send_command("COMMAND", "INFO", "BLMPOP")
                    info = conn.read_response()
                    self._multi_pop = bool(info and info[0])
                except Exception as e:  # noqa: BLE001 - a server or proxy without it
                    log.info("broker: no COMMAND INFO (%s); one message per BRPOP", e)
                    conn.disconnect()
                finally:
                    pool.release(conn)
        return self._multi_pop

    def _create_client(self, asynchronous: bool = False):
        if asynchronous:  # the consumer's BRPOP client: kombu keeps that one itself
            return super()._create_client(asynchronous=True)
        if self._sync_client is None:
            self._sync_client = super()._create_client()
        return self._sync_client

    @contextmanager
    def conn_or_acquire(self, client=None):
        out = _deferred.get()
        if client is not None or out is None:
            yield client or self._create_client()
        else:
            yield _Recorder(self._create_client(), out)

    def close(self) -> None:
        if self._qos is not None and not self.closed:
            try:
                self._qos.flush()
            except Exception as e:  # noqa: BLE001 - redelivered later, then skipped
                log.warning("unacked bookkeeping not written before closing: %s", e)
        # kombu's close first reads the answer of a BRPOP in flight; with the broker gone
        # that read raises, the close stops half done (pools dropped, the channel not
        # marked closed), and Celery's next close of it fails with an AttributeError that
        # stops the worker (kombu 5.7, the stock transport too). Nothing can come from a
        # dead connection: let the close go on, as it would for an empty answer.
        if self._in_poll:
            try:
                self._brpop_read()
            except Empty:
                pass
            except self.connection_errors as e:
                log.info("broker: the pending read died with the connection (%s)", e)
            finally:
                self._in_poll = None
        # kombu's close then restores the unacked messages through conn_or_acquire: our
        # client must still be there (a Redis that is away is a ConnectionError then, which
        # Celery recovers from)
        try:
            super().close()
        finally:
            self._sync_client = None


class Transport(kombu_redis.Transport):
    Channel = Channel
    conveyor_hub = None  # the worker's event loop, once the consumer registers with it

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self.conveyor_hub = loop
        super().register_with_event_loop(connection, loop)
