"""Token streams from Redis pub/sub, for many requests over one connection.

``StreamHub`` keeps one pub/sub connection and one reader task; each request subscribes to
``tokens:{request_id}`` and gets its own queue. ``subscribe`` returns only once Redis has
confirmed the subscription, so the API can send the task chain knowing no frame can be
published before it listens. ``Subscription.frames`` yields frames in ``seq`` order, drops
duplicates, raises on a gap (pub/sub lost a frame) and on silence past a timeout, and ends
after the terminal frame.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import redis.asyncio as aioredis

log = logging.getLogger(__name__)

_IDLE_CHANNEL = "conveyor:api:hub"


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

    async def frames(
        self,
        first_timeout: float,
        frame_timeout: float,
        alive: Callable[[], Awaitable[bool]] | None = None,
        check_every: float = 1.0,
    ) -> AsyncIterator[dict]:
        """Frames in order up to the terminal one. While waiting, ``alive()`` is asked
        every ``check_every`` seconds; ``False`` raises :class:`WorkerLost` at once rather
        than letting the client wait out the whole timeout."""
        loop = asyncio.get_running_loop()
        expected = 0
        timeout = first_timeout
        while True:
            deadline = loop.time() + timeout
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    which = "first " if expected == 0 else ""
                    raise StreamTimeout(f"no {which}frame within {timeout:.0f}s")
                wait = min(remaining, check_every) if alive is not None else remaining
                try:
                    raw = await asyncio.wait_for(self.queue.get(), wait)
                    break
                except TimeoutError:
                    if alive is not None and not await alive():
                        raise WorkerLost(f"worker stopped heartbeating ({self.channel})") from None
            frame = orjson.loads(raw)
            seq = frame.get("seq", -1)
            if seq < expected:
                log.warning("%s: duplicate frame %d dropped", self.channel, seq)
                continue
            if seq > expected:
                raise StreamGap(f"frames {expected}..{seq - 1} were lost")
            expected += 1
            timeout = frame_timeout
            yield frame
            if frame.get("done"):
                return

    async def close(self) -> None:
        await self.hub.unsubscribe(self.channel)


class StreamHub:
    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._pubsub = client.pubsub()
        self._subs: dict[str, Subscription] = {}
        self._confirm: dict[str, asyncio.Future[None]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        await self._pubsub.subscribe(_IDLE_CHANNEL)  # keeps the connection in pub/sub mode
        self._reader = asyncio.create_task(self._read(), name="stream-hub-reader")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        await self._pubsub.aclose()

    async def subscribe(self, channel: str, timeout: float = 5.0) -> Subscription:
        sub = Subscription(self, channel)
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
        if self._subs.pop(channel, None) is None:
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
            if kind == "message":
                sub = self._subs.get(ch)
                if sub is not None:
                    sub.queue.put_nowait(msg["data"])
            elif kind == "subscribe":
                fut = self._confirm.pop(ch, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
