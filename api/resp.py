"""A lean asyncio Redis connection for the API's hot path: commands leave at once.

redis-py's asyncio client yields to the event loop before it writes a command (its
connection pool's checks), so a command sent from a busy loop waits behind every callback
already queued (docs/performance.md, "API: commands leave before the first await").
:meth:`send` writes the commands to the socket before it returns and hands back a future for
their replies, matched in order (Redis answers a connection's commands in the order they
came), parsed by hiredis. One connection serves every caller; it connects on first use and
again after a drop. :class:`PubSubConnection` is the same connection in subscriber mode:
every message Redis pushes is handed to a callback as it is parsed, with no task or queue of
its own.

URLs as redis-py reads them: ``redis://``, ``rediss://`` (TLS: ``ssl_cert_reqs``,
``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` in the query) and ``unix://``, with
user, password and db. No redis-py internals: replies are parsed by hiredis (its public
``Reader``), written by :func:`cluster.resp.encode`. :class:`RedisPyPubSub` is the stock
alternative of :class:`PubSubConnection` (``CONVEYOR_BROKER_FASTPATH=false``), on
redis-py's asyncio ``PubSub``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from cluster.resp import encode

log = logging.getLogger(__name__)

Command = tuple[Any, ...]


def parse_redis_url(url: str) -> dict[str, Any]:
    """``redis://[[user]:password@]host[:port][/db][?query]``, ``rediss://...`` and
    ``unix://[[user]:password@]/path[?db=N]`` -> host, port, path, username, password, db
    and the query's ``ssl_*`` options. ``ValueError`` for another scheme."""
    u = urlsplit(url)
    if u.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://: {url!r}")
    query = {k: v[-1] for k, v in parse_qs(u.query).items()}
    out: dict[str, Any] = {k: v for k, v in query.items() if k.startswith("ssl_")}
    if u.username:
        out["username"] = unquote(u.username)
    if u.password is not None:
        out["password"] = unquote(u.password)
    db = query.get("db")
    if u.scheme == "unix":
        out["path"] = unquote(u.path)
    else:
        out["host"] = u.hostname or "localhost"
        out["port"] = u.port or 6379
        db = u.path.lstrip("/") or db
    if db:
        out["db"] = int(db)
    return out


def _ssl_context(kw: dict[str, Any]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=kw.get("ssl_ca_certs"))
    if kw.get("ssl_certfile"):
        ctx.load_cert_chain(kw["ssl_certfile"], kw.get("ssl_keyfile"))
    reqs = kw.get("ssl_cert_reqs", "required")
    if reqs in ("none", ssl.CERT_NONE):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif reqs in ("optional", ssl.CERT_OPTIONAL):
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


class _Protocol(asyncio.Protocol):
    def __init__(self, conn: RespConnection) -> None:
        self.conn = conn
        self.reader = hiredis.Reader()

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            self.conn._reply(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn._lost(self, exc)


Push = list[Any]  # [b"message", channel, data], [b"pmessage", pattern, channel, data], ...


class RespConnection:
    def __init__(self, url: str, connect_timeout: float = 5.0) -> None:
        kw = parse_redis_url(url)  # ValueError for a scheme it does not know
        self._path: str | None = kw.get("path")
        self._host = kw.get("host", "localhost")
        self._port = int(kw.get("port", 6379))
        self._where = self._path or f"{self._host}:{self._port}"
        self._ssl = _ssl_context(kw) if url.startswith("rediss://") else None
        self._setup: list[Command] = []  # AUTH and SELECT, answered before anything else
        if kw.get("password") is not None:
            user = kw.get("username")
            self._setup.append(("AUTH", user, kw["password"]) if user else ("AUTH", kw["password"]))
        if kw.get("db"):
            self._setup.append(("SELECT", int(kw["db"])))
        self._connect_timeout = connect_timeout
        self._transport: asyncio.Transport | None = None
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Task[None] | None = None
        # per send: the future, how many replies it takes, and those seen so far
        self._waiting: deque[tuple[asyncio.Future[list[Any]], int, list[Any]]] = deque()

    @property
    def connected(self) -> bool:
        return self._transport is not None

    async def connect(self) -> None:
        """Connect if not connected (callers that arrive together share one attempt)."""
        if self._transport is not None:
            return
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
        task = self._connecting
        try:
            await asyncio.shield(task)
        finally:
            if task.done() and self._connecting is task:
                self._connecting = None

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        if self._path is not None:
            opening = loop.create_unix_connection(lambda: _Protocol(self), self._path)
        else:
            opening = loop.create_connection(
                lambda: _Protocol(self), self._host, self._port, ssl=self._ssl
            )
        try:
            transport, protocol = await asyncio.wait_for(opening, self._connect_timeout)
        except (OSError, TimeoutError) as e:
            raise RedisConnectionError(f"cannot connect to {self._where}: {e}") from e
        self._transport, self._protocol = transport, protocol
        if self._setup:
            try:
                await asyncio.wait_for(self.send(*self._setup), self._connect_timeout)
            except BaseException:
                self.close()
                raise

    def send(self, *commands: Command) -> asyncio.Future[list[Any]]:
        """Write ``commands`` now; the future gets their replies in order, or the first
        error reply as :class:`redis.exceptions.ResponseError`. Raises
        :class:`redis.exceptions.ConnectionError` when not connected (see :meth:`connect`)."""
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        if not commands:  # nothing to write, no reply to wait for
            fut.set_result([])
            return fut
        self._write(commands)
        self._waiting.append((fut, len(commands), []))
        return fut

    def _write(self, commands: tuple[Command, ...]) -> None:
        if self._transport is None or self._transport.is_closing():
            raise RedisConnectionError(f"not connected to {self._where}")
        self._transport.write(encode(commands))

    async def execute(self, *commands: Command) -> list[Any]:
        """:meth:`connect` if needed, then :meth:`send` and wait for the replies."""
        if self._transport is None:
            await self.connect()
        return await self.send(*commands)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()  # connection_lost fails whatever still waits

    def _reply(self, reply: Any) -> None:
        fut, n, replies = self._waiting[0]
        replies.append(reply)
        if len(replies) < n:
            return
        self._waiting.popleft()
        if fut.done():  # its caller gave up waiting (a timeout)
            return
        error = next((r for r in replies if isinstance(r, hiredis.ReplyError)), None)
        if error is not None:
            fut.set_exception(ResponseError(str(error)))
        else:
            fut.set_result(replies)

    def _lost(self, protocol: _Protocol, exc: Exception | None) -> None:
        if protocol is not self._protocol:
            return
        self._transport = self._protocol = None
        waiting, self._waiting = self._waiting, deque()
        for fut, _, _ in waiting:
            if not fut.done():
                fut.set_exception(
                    RedisConnectionError(f"connection to {self._where} lost: {exc or 'closed'}")
                )
        self.on_lost(exc)

    def on_lost(self, exc: Exception | None) -> None:
        """Called once the connection is gone (a subclass may reconnect)."""


class PubSubConnection(RespConnection):
    """A subscriber connection: once connected, whatever Redis sends (messages,
    subscribe confirmations, PING's pong) goes to ``on_push`` as it is parsed, in the
    order it came; ``on_lost`` hears of a drop (nothing resubscribes by itself)."""

    def __init__(
        self,
        url: str,
        on_push: Callable[[Push], None],
        on_lost: Callable[[Exception | None], None] = lambda exc: None,
        connect_timeout: float = 5.0,
    ) -> None:
        super().__init__(url, connect_timeout)
        self._on_push = on_push
        self._on_lost = on_lost

    def write(self, *commands: Command) -> None:
        """Write ``commands`` now (SUBSCRIBE, PSUBSCRIBE, UNSUBSCRIBE, PING: their answers
        come as pushes). Raises :class:`redis.exceptions.ConnectionError` when not
        connected."""
        self._write(commands)

    def _reply(self, reply: Any) -> None:
        if self._waiting:  # AUTH and SELECT while connecting
            super()._reply(reply)
        else:
            self._on_push(reply)

    def on_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)


class RedisPyPubSub:
    """:class:`PubSubConnection`'s interface over redis-py's asyncio ``PubSub`` (the stock
    path): a reader task hands every message on as the same list a RESP push is, and
    commands are sent in the order they were written."""

    def __init__(
        self,
        url: str,
        on_push: Callable[[Push], None],
        on_lost: Callable[[Exception | None], None] = lambda exc: None,
        connect_timeout: float = 5.0,
    ) -> None:
        self._url = url
        self._on_push = on_push
        self._on_lost = on_lost
        self._timeout = connect_timeout
        self._client: aioredis.Redis | None = None
        self._ps: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # commands leave in the order they were written

    @property
    def connected(self) -> bool:
        return self._ps is not None

    async def connect(self) -> None:
        if self._ps is not None:
            return
        client = aioredis.Redis.from_url(self._url, socket_connect_timeout=self._timeout)
        try:
            await client.ping()
        except RedisError as e:
            await client.aclose()
            raise RedisConnectionError(f"cannot connect to {self._url}: {e}") from e
        # the reader starts with the first subscription (redis-py reads only once subscribed)
        self._client, self._ps = client, client.pubsub()

    def write(self, *commands: Command) -> None:
        if self._ps is None:
            raise RedisConnectionError(f"not connected to {self._url}")
        asyncio.get_running_loop().create_task(self._send(self._ps, commands))

    def close(self) -> None:
        ps, client, self._ps, self._client = self._ps, self._client, None, None
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if client is not None:
            asyncio.get_running_loop().create_task(self._aclose(ps, client))

    # ----------------------------------------------------------------------------------
    async def _send(self, ps: Any, commands: tuple[Command, ...]) -> None:
        methods = {"SUBSCRIBE": ps.subscribe, "PSUBSCRIBE": ps.psubscribe,
                   "UNSUBSCRIBE": ps.unsubscribe, "PUNSUBSCRIBE": ps.punsubscribe,
                   "PING": ps.ping}  # fmt: skip
        async with self._lock:
            try:
                for name, *args in commands:
                    await methods[name.upper()](*args)
            except RedisError as e:
                self._lost(ps, e)
                return
            if self._reader is None and ps is self._ps and ps.subscribed:
                self._reader = asyncio.get_running_loop().create_task(self._read(ps))

    async def _read(self, ps: Any) -> None:
        while True:
            try:
                msg = await ps.get_message(ignore_subscribe_messages=False, timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the connection is gone
                self._lost(ps, e)
                return
            if msg is None:
                continue
            kind = msg["type"].encode() if isinstance(msg["type"], str) else msg["type"]
            if kind == b"pmessage":
                self._on_push([kind, msg["pattern"], msg["channel"], msg["data"]])
            elif kind == b"pong":
                self._on_push([kind, msg["data"]])
            else:
                self._on_push([kind, msg["channel"], msg["data"]])

    def _lost(self, ps: Any, exc: Exception | None) -> None:
        if ps is not self._ps:
            return
        self._ps = None
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._reader = None
        client, self._client = self._client, None
        if client is not None:
            asyncio.get_running_loop().create_task(self._aclose(ps, client))
        self._on_lost(exc)

    @staticmethod
    async def _aclose(ps: Any, client: aioredis.Redis) -> None:
        try:
            await ps.aclose()
            await client.aclose()
        except Exception as e:  # noqa: BLE001 - closing anyway
            log.debug("closing the pub/sub connection: %s", e)
