"""Token streams from Redis pub/sub, for many requests over one connection.

``StreamHub`` keeps one pub/sub connection and one reader task; each request gets its own
queue for ``tokens:{request_id}``. The hub is subscribed, from its start, to one pattern
that covers every request id it hands out (``new_request_id``: ``cmpl-<tag>...``, where
``<tag>`` is this hub's random 8 hex digits): ``PSUBSCRIBE tokens:*-<tag>*``. So a request
of ours needs no ``SUBSCRIBE`` of its own: registering its queue is enough, and it is
listening before the API sends its chain, with no round trip and no wait for a
confirmation that would queue behind every other stream's frames. A channel the pattern
does not cover is subscribed to on its own, and ``subscribe`` returns only once Redis has
confirmed it. ``Subscription.frames`` yields frames in ``seq`` order, drops duplicates,
raises on a gap (pub/sub lost a frame) and on silence past a timeout, and ends after the
terminal frame.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import redis.asyncio as aioredis

from tasks.channels import tokens_channel

log = logging.getLogger(__name__)

_IDLE_CHANNEL = "conveyor:api:hub"
_TOKENS_PREFIX = tokens_channel("")


class StreamTimeout(Exception):
    """No frame arrived in time."""


class StreamGap(Exception):
    """Frames were lost between the worker and the API."""


class WorkerLost(Exception):
    """The worker serving the stream stopped heartbeating while the API waited on it."""


class Subscription:
    def __init__(self, hub: StreamHub, channel: str) -> None:
        self.hub = hub
        self.channel = channel
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._expected = 0  # seq of the next frame

    def poll(self) -> dict | None:
        """The next frame if it has already arrived; never waits."""
        while not self.queue.empty():
            frame = self._accept(self.queue.get_nowait())
            if frame is not None:
                return frame
        return None

    async def next_frame(
        self,
        timeout: float,
        alive: Callable[[], Awaitable[bool]] | None = None,
        check_every: float = 1.0,
    ) -> dict:
        """The next frame in order, waiting up to ``timeout``. While waiting, ``alive()`` is
        asked every ``check_every`` seconds; ``False`` raises :class:`WorkerLost` at once
        rather than letting the client wait out the whole timeout."""
        frame = self.poll()  # the common case under load: no timer, no task switch
        if frame is not None:
            return frame
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                which = "first " if self._expected == 0 else ""
                raise StreamTimeout(f"no {which}frame within {timeout:.0f}s")
            wait = min(remaining, check_every) if alive is not None else remaining
            try:
                raw = await asyncio.wait_for(self.queue.get(), wait)
            except TimeoutError:
                if alive is not None and not await alive():
                    raise WorkerLost(f"worker stopped heartbeating ({self.channel})") from None
                continue
            frame = self._accept(raw)
            if frame is not None:
                return frame

    async def frames(
        self,
        first_timeout: float,
        frame_timeout: float,
        alive: Callable[[], Awaitable[bool]] | None = None,
        check_every: float = 1.0,
    ) -> AsyncIterator[dict]:
        """Frames in order up to the terminal one (see :meth:`next_frame`)."""
        timeout = first_timeout
        while True:
            frame = await self.next_frame(timeout, alive, check_every)
            timeout = frame_timeout
            yield frame
            if frame.get("done"):
                return

    def _accept(self, raw: bytes) -> dict | None:
        """The frame if it is the next in order; ``None`` for a duplicate; a gap raises."""
        frame = orjson.loads(raw)
        seq = frame.get("seq", -1)
        if seq < self._expected:
            log.warning("%s: duplicate frame %d dropped", self.channel, seq)
            return None
        if seq > self._expected:
            raise StreamGap(f"frames {self._expected}..{seq - 1} were lost")
        self._expected += 1
        return frame

    async def close(self) -> None:
        await self.hub.unsubscribe(self.channel)


class StreamHub:
    def __init__(self, client: aioredis.Redis, tag: str | None = None) -> None:
        self._client = client
        self._pubsub = client.pubsub()
        self.tag = tag or secrets.token_hex(4)
        self._pattern = f"{_TOKENS_PREFIX}*-{self.tag}*"
        self._pattern_ready = asyncio.Event()
        self._subs: dict[str, Subscription] = {}
        self._confirm: dict[str, asyncio.Future[None]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def start(self, timeout: float = 10.0) -> None:
        await self._pubsub.subscribe(_IDLE_CHANNEL)  # keeps the connection in pub/sub mode
        await self._pubsub.psubscribe(self._pattern)
        self._reader = asyncio.create_task(self._read(), name="stream-hub-reader")
        await asyncio.wait_for(self._pattern_ready.wait(), timeout)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        await self._pubsub.aclose()

    def new_request_id(self, prefix: str) -> str:
        """``<prefix>-`` and 32 hex digits, the first 8 this hub's tag (96 random bits)."""
        return f"{prefix}-{self.tag}{uuid.uuid4().hex[len(self.tag) :]}"

    def covers(self, channel: str) -> bool:
        """Whether the hub's pattern subscription already delivers ``channel``."""
        return channel.startswith(_TOKENS_PREFIX) and f"-{self.tag}" in channel

    async def subscribe(self, channel: str, timeout: float = 5.0) -> Subscription:
        sub = Subscription(self, channel)
        if self.covers(channel):
            self._subs[channel] = sub
            return sub
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._subs[channel] = sub
        self._confirm[channel] = fut
        try:
            async with self._lock:
                await self._pubsub.subscribe(channel)
            await asyncio.wait_for(fut, timeout)
        except BaseException:
            self._subs.pop(channel, None)
            self._confirm.pop(channel, None)
            raise
        return sub

    async def unsubscribe(self, channel: str) -> None:
        if self._subs.pop(channel, None) is None or self.covers(channel):
            return
        try:
            async with self._lock:
                await self._pubsub.unsubscribe(channel)
        except Exception as e:  # noqa: BLE001 - the reader reconnects; nothing to undo
            log.warning("unsubscribe %s failed: %s", channel, e)

    async def _read(self) -> None:
        while True:
            try:
                msg = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - redis-py reconnects and resubscribes
                log.warning("pub/sub reader error: %s", e)
                await asyncio.sleep(0.2)
                continue
            if msg is None:
                continue
            kind = msg["type"]
            ch = msg["channel"]
            ch = ch.decode() if isinstance(ch, bytes) else ch
            if kind in ("pmessage", "message"):
                sub = self._subs.get(ch)
                if sub is not None:
                    sub.queue.put_nowait(msg["data"])
            elif kind == "psubscribe":
                self._pattern_ready.set()
            elif kind == "subscribe":
                fut = self._confirm.pop(ch, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
