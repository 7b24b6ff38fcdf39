"""Token streams from Redis pub/sub, for many requests over one connection.

``StreamHub`` keeps one subscriber connection, whose frames go straight from the parser to
each request's own queue for ``tokens:{request_id}``. The hub is subscribed, from its
start, to one pattern that covers every request id it hands out (``new_request_id``:
``cmpl-<tag>...``, where ``<tag>`` is this hub's random 8 hex digits):
``PSUBSCRIBE tokens:*-<tag>*``. So a request of ours needs no ``SUBSCRIBE`` of its own:
registering its queue is enough, and it is listening before the API sends its chain, with
no round trip and no wait for a confirmation that would queue behind every other stream's
frames (docs/performance.md, "API: one pattern subscription per process"). A channel the
pattern does not cover is subscribed to on its own, and ``subscribe`` returns only once
Redis has confirmed it. ``Subscription.next_frame`` and ``poll`` hand out frames in ``seq``
order, drop duplicates, and raise on a gap (pub/sub lost a frame) and on silence past a
timeout. The hub also listens on ``WORKER_DEATHS_CHANNEL``: a worker declared dead wakes
every waiting reader to check its workers' liveness at once (a migration starts within
milliseconds of the death, not at the next once-a-second poll), and on ``ABORTS_CHANNEL``
(vLLM's /abort_requests, sent to whichever API process serves the request).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable

from api.resp import PubSubConnection, RedisPyPubSub
from cluster.keys import ABORTS_CHANNEL, WORKER_DEATHS_CHANNEL
from kvbm.protocol import TOKENS_PREFIX, TokenFrame, Usage

log = logging.getLogger(__name__)


class StreamTimeout(Exception):
    """No frame arrived in time."""


class StreamGap(Exception):
    """Frames were lost between the worker and the API."""


class WorkerLost(Exception):
    """The worker serving the stream stopped heartbeating while the API waited on it."""


class StreamInterrupted(WorkerLost):
    """The API's pub/sub connection dropped while the stream was open (Redis restarted,
    say): frames published meanwhile are lost, and the stream cannot tell which. The
    runner starts it again from what the client has, as it does for a lost worker."""


# After the hub's connection is back, an interrupted stream waits this long for a frame in
# order (none was lost) before it counts as broken: a lost terminal frame would leave it
# waiting for frame_timeout_s otherwise.
INTERRUPT_GRACE_S = 2.0


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Subscription:
    """One stream's frames, as the hub hands them over (:meth:`push`), read in order.

    Waiting costs one future and one timer: a frame wakes the reader's future directly
    (no ``asyncio.Queue`` getter, no ``wait_for`` task per frame; docs/performance.md,
    "API: frames wake their reader directly")."""

    __slots__ = ("hub", "channel", "_raw", "_waiter", "_expected", "_interrupted", "_resumed_at",
                 "_failed")  # fmt: skip

    def __init__(self, hub: StreamHub, channel: str, start_seq: int = 0) -> None:
        self.hub = hub
        self.channel = channel
        self._raw: deque[bytes] = deque()  # arrived, not read yet
        self._waiter: asyncio.Future[None] | None = None
        self._expected = start_seq  # seq of the next frame (a migrated stream's goes on)
        # after an interruption (:meth:`interrupt`): how many of the frames not read yet
        # came before it; None once a frame after it came in order (nothing was lost)
        self._interrupted: int | None = None
        self._resumed_at = 0.0  # loop time of the last interruption's reconnect
        self._failed: BaseException | None = None  # raised to its reader (:meth:`fail`)

    @property
    def pending(self) -> int:
        """Frames that arrived and were not read yet (duplicates included)."""
        return len(self._raw)

    def push(self, raw: bytes) -> None:
        """A frame arrived (the hub, from its connection's parser)."""
        self._raw.append(raw)
        if self._waiter is not None:
            _wake(self._waiter)

    def check_alive(self) -> None:
        """A worker was declared dead somewhere: a reader waiting for a frame asks its
        ``alive()`` now, as its timer would have done later."""
        if self._waiter is not None:
            _wake(self._waiter)

    def interrupt(self) -> None:
        """The hub's connection dropped and is back: frames published in between are lost.
        The next frame to arrive tells: in order, nothing was; past a gap, or none within
        ``INTERRUPT_GRACE_S``, the reader gets :class:`StreamInterrupted`."""
        self._interrupted = len(self._raw)
        self._resumed_at = asyncio.get_running_loop().time()
        if self._waiter is not None:
            _wake(self._waiter)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``: its reader gets it at its next wait for a frame
        (the API shutting down with the stream still open)."""
        self._failed = error
        if self._waiter is not None:
            _wake(self._waiter)

    def poll(self) -> TokenFrame | None:
        """The next frame if it has already arrived; never waits."""
        while self._raw:
            frame = self._accept(self._raw.popleft())
            if self._interrupted is not None:
                if self._interrupted > 0:  # it arrived before the interruption
                    self._interrupted -= 1
                elif frame is not None:  # the first after it, in order: none was lost
                    self._interrupted = None
            if frame is not None:
                return frame
        return None

    async def next_frame(
        self,
        timeout: float,
        alive: Callable[[], Awaitable[bool]] | None = None,
        check_every: float = 1.0,
        paused: Callable[[], Awaitable[bool]] | None = None,
    ) -> TokenFrame:
        """The next frame in order, waiting up to ``timeout``. While waiting, ``alive()`` is
        asked every ``check_every`` seconds; ``False`` raises :class:`WorkerLost` at once
        rather than letting the client wait out the whole timeout. A timeout that runs out
        while ``paused()`` (the deployment is) starts again: a paused worker holds it."""
        if self._failed is not None:
            raise self._failed
        frame = self.poll()  # the common case under load: no timer, no task switch
        if frame is not None:
            return frame
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self._failed is not None:
                raise self._failed
            now = loop.time()
            remaining = deadline - now
            if remaining <= 0:
                if paused is not None and await paused():
                    deadline = loop.time() + timeout
                    continue
                which = "first " if self._expected == 0 else ""
                raise StreamTimeout(f"no {which}frame within {timeout:.0f}s")
            if self._interrupted is not None:  # none of its frames since the reconnect
                grace = self._resumed_at + INTERRUPT_GRACE_S - now
                if grace <= 0:
                    raise StreamInterrupted(f"no frame of {self.channel} since the API's "
                                            "Redis connection came back")  # fmt: skip
                remaining = min(remaining, grace)
            wait = min(remaining, check_every) if alive is not None else remaining
            self._waiter = fut = loop.create_future()
            timer = loop.call_later(wait, _wake, fut)
            try:
                await fut
            finally:
                timer.cancel()
                self._waiter = None
            if not self._raw:  # the timer woke us
                if alive is not None and not await alive():
                    raise WorkerLost(f"worker stopped heartbeating ({self.channel})")
                continue
            frame = self.poll()
            if frame is not None:
                return frame

    def _accept(self, raw: bytes) -> TokenFrame | None:
        """The frame if it is the next in order; ``None`` for a duplicate; a gap raises."""
        frame = TokenFrame.decode(raw)
        seq = frame.seq
        if seq < self._expected:
            log.warning("%s: duplicate frame %d dropped", self.channel, seq)
            return None
        if seq > self._expected:
            if self._interrupted is not None:  # lost while the hub's connection was down
                raise StreamInterrupted(f"frames {self._expected}..{seq - 1} of "
                                        f"{self.channel} lost while Redis was away")  # fmt: skip
            raise StreamGap(f"frames {self._expected}..{seq - 1} were lost")
        self._expected += 1
        return frame

    async def close(self) -> None:
        await self.hub.unsubscribe(self.channel)


class StreamHub:
    """Every token stream of this API over one subscriber connection: with ``fast``,
    :class:`api.resp.PubSubConnection`, whose frames are parsed by hiredis and put on their
    request's queue as they arrive, with no reader task and no per-message await
    (docs/performance.md, "API: pub/sub without redis-py"); else redis-py's own
    (:class:`api.resp.RedisPyPubSub`).

    A dropped connection is reopened in the background (``reconnect_s`` apart at first,
    backing off to 2 s) and subscribed again: the pattern and every foreign channel. Frames
    published meanwhile are lost; their streams notice the gap. A ``PING`` every
    ``health_s`` seconds, and a reconnect when nothing at all came back for three of them,
    catches a connection that died silently."""

    def __init__(
        self, url: str, tag: str | None = None, health_s: float = 5.0,
        reconnect_s: float = 0.2, fast: bool = True,
    ) -> None:  # fmt: skip
        conn = PubSubConnection if fast else RedisPyPubSub
        self._conn = conn(url, self._on_push, self._on_lost)
        self.tag = tag or secrets.token_hex(4)
        self._pattern = f"{TOKENS_PREFIX}*-{self.tag}*"
        self._pattern_ready = asyncio.Event()
        self._subs: dict[str, Subscription] = {}
        self._confirm: dict[str, asyncio.Future[None]] = {}
        self._health_s = health_s
        self._reconnect_s = reconnect_s
        self._last_heard = 0.0
        self._keeper: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # the keeper: the connection dropped
        self.reconnects = 0
        self.restored_at = float("-inf")  # monotonic time of the last reconnect
        self.deaths_heard = 0  # worker deaths announced (WORKER_DEATHS_CHANNEL)
        # what to do with each message on ABORTS_CHANNEL (its JSON payload): the app's
        self.on_abort: Callable[[bytes], None] | None = None

    async def start(self, timeout: float = 10.0) -> None:
        await self._conn.connect()
        self._resubscribe()
        self._keeper = asyncio.create_task(self._keep(), name="stream-hub-keeper")
        await asyncio.wait_for(self._pattern_ready.wait(), timeout)

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            try:
                await self._keeper
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._conn.close()

    @property
    def up(self) -> bool:
        """Whether the pattern subscription stands (the connection is up)."""
        return self._pattern_ready.is_set()

    async def ready(self, timeout: float) -> bool:
        """Wait (up to ``timeout``) until the pattern subscription stands: after a lost
        connection, frames published before it is back would reach nobody."""
        if self._pattern_ready.is_set():
            return True
        try:
            await asyncio.wait_for(self._pattern_ready.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def fail_all(self, error: BaseException) -> int:
        """End every open stream with ``error`` (:meth:`Subscription.fail`); how many."""
        subs = list(self._subs.values())
        for sub in subs:
            sub.fail(error)
        return len(subs)

    def new_request_id(self, prefix: str) -> str:
        """``<prefix>-`` and 32 hex digits, the first 8 this hub's tag (96 random bits)."""
        return f"{prefix}-{self.tag}{uuid.uuid4().hex[len(self.tag) :]}"

    def covers(self, channel: str) -> bool:
        """Whether the hub's pattern subscription already delivers ``channel``."""
        return channel.startswith(TOKENS_PREFIX) and f"-{self.tag}" in channel

    async def subscribe(self, channel: str, timeout: float = 5.0,
                        start_seq: int = 0) -> Subscription:  # fmt: skip
        sub = Subscription(self, channel, start_seq)
        if self.covers(channel):
            self._subs[channel] = sub
            return sub
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._subs[channel] = sub
        self._confirm[channel] = fut
        try:
            if self._conn.connected:  # else the reconnect subscribes it
                self._conn.write(("SUBSCRIBE", channel))
            await asyncio.wait_for(fut, timeout)
        except BaseException:
            self._subs.pop(channel, None)
            self._confirm.pop(channel, None)
            raise
        return sub

    async def unsubscribe(self, channel: str) -> None:
        if self._subs.pop(channel, None) is None or self.covers(channel):
            return
        if self._conn.connected:  # else the reconnect leaves it out
            self._conn.write(("UNSUBSCRIBE", channel))

    # ----------------------------------------------------------------------------------
    def _on_push(self, push: list) -> None:
        kind = push[0]
        if kind == b"pmessage":
            sub = self._subs.get(push[2].decode())
            if sub is not None:
                sub.push(push[3])
        elif kind == b"message":
            channel = push[1].decode()
            if channel == WORKER_DEATHS_CHANNEL:
                self.deaths_heard += 1
                for s in list(self._subs.values()):
                    s.check_alive()
            elif channel == ABORTS_CHANNEL:
                if self.on_abort is not None:
                    self.on_abort(push[2])
            else:
                sub = self._subs.get(channel)
                if sub is not None:
                    sub.push(push[2])
        elif kind == b"psubscribe":
            self._pattern_ready.set()
        elif kind == b"subscribe":
            fut = self._confirm.pop(push[1].decode(), None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        self._last_heard = time.monotonic()

    def _on_lost(self, exc: Exception | None) -> None:
        self._pattern_ready.clear()
        self._wake.set()
        log.warning("stream hub: pub/sub connection lost (%s); reconnecting", exc or "closed")

    def _resubscribe(self) -> None:
        """On a fresh connection: the pattern, and every foreign channel still wanted."""
        self._last_heard = time.monotonic()
        foreign = [WORKER_DEATHS_CHANNEL, ABORTS_CHANNEL,
                   *(ch for ch in self._subs if not self.covers(ch))]  # fmt: skip
        self._conn.write(("PSUBSCRIBE", self._pattern),
                         *(("SUBSCRIBE", ch) for ch in foreign))  # fmt: skip

    async def _keep(self) -> None:
        delay = self._reconnect_s
        while True:
            if not self._conn.connected:
                try:
                    await self._conn.connect()
                    self._resubscribe()
                    for sub in list(self._subs.values()):  # frames may have been lost
                        sub.interrupt()
                    self.reconnects += 1
                    self.restored_at = time.monotonic()
                    delay = self._reconnect_s
                    log.info("stream hub: pub/sub connection restored")
                    continue
                except Exception as e:  # noqa: BLE001 - Redis away: try again later
                    log.warning("stream hub: reconnect failed: %s", e)
                    await asyncio.sleep(delay)
                    delay = min(2.0, delay * 2)
                    continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self._health_s)
                continue  # the connection dropped
            except TimeoutError:
                pass
            if time.monotonic() - self._last_heard > 3 * self._health_s:
                log.warning("stream hub: nothing from Redis in %.0fs; reconnecting",
                            3 * self._health_s)  # fmt: skip
                self._conn.close()
            elif self._conn.connected:
                self._conn.write(("PING",))


def output_dropped(frame: TokenFrame) -> None:
    """A prompt-only request's frame without its output (counted for the metrics and
    migration before this): no token, text or logprob; no completion tokens in its usage;
    it ends for its length (0), whatever the token it ran would have ended for."""
    frame.token_ids, frame.text, frame.logprobs, frame.stop_reason = [], "", None, None
    if frame.done and frame.error is None:
        frame.finish_reason = "length"
    if frame.usage is not None:
        frame.usage = Usage(frame.usage.prompt_tokens, 0, frame.usage.cached_tokens)
