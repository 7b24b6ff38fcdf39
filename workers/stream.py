"""Token frames on Redis pub/sub (:class:`kvbm.protocol.TokenFrame` on
:func:`kvbm.protocol.tokens_channel`), written from the engine process.

One step's frames for all requests go out in one write (pipelined ``PUBLISH`` commands,
between ``CLIENT REPLY OFF`` and ``ON`` where the server takes them). With a frame log
(``log_ttl_s`` > 0: ``CONVEYOR_RESUMABLE_STREAMS``) each frame is also appended to its
stream's log (:func:`kvbm.protocol.frames_key`, an ``XADD`` in the same write), which
expires ``FRAMES_OPEN_TTL_S`` after its first frame and ``log_ttl_s`` after its last.

:class:`FramePublisher` drives a redis-py connection below its client API
(``connection_pool.make_connection``, ``register_connect_callback``,
``send_packed_command``, ``can_read``, ``read_response``); tested with redis-py 8.1.x
(``pyproject.toml`` pins ``redis<8.2``). :class:`StockFramePublisher` is the same on
redis-py's pipeline (``CONVEYOR_BROKER_FASTPATH=false``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis

from cluster.resp import bulk, command_head, encode
from kvbm.protocol import (
    FRAMES_MAXLEN,
    FRAMES_OPEN_TTL_S,
    TokenFrame,
    Usage,
    frames_key,
    tokens_channel,
)
from workers.stream_interval import IntervalBuffer

if TYPE_CHECKING:  # keep this module torch-free
    from workers.engine_api import RequestOutput

log = logging.getLogger(__name__)


def output_frame(out: RequestOutput, seq: int) -> TokenFrame:
    """The frame numbered ``seq`` that carries one step's output for one request."""
    if not out.finished:
        return TokenFrame(seq, out.token_ids, out.text, logprobs=out.logprobs,
                          prompt_logprobs=out.prompt_logprobs)  # fmt: skip
    usage = Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
    if out.prediction is not None:
        usage.accepted_prediction_tokens, usage.rejected_prediction_tokens = out.prediction
    if out.finish_reason == "error":
        frame = TokenFrame.failure(seq, out.error or "generation failed",
                                   out.error_code or "engine_error", usage,
                                   out.error_param)  # fmt: skip
        frame.token_ids, frame.text = out.token_ids, out.text
        return frame
    return TokenFrame(seq, out.token_ids, out.text, True, out.finish_reason, out.stop_reason,
                      usage, logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs,
                      embedding=out.embedding)  # fmt: skip


def publish_error_frame(
    client: redis.Redis, request_id: str, message: str, code: str, seq: int = 0,
    log_ttl_s: float = 0.0,
) -> None:  # fmt: skip
    """A terminal error frame from outside the engine (e.g. a stage task that failed); in
    the stream's frame log too with ``log_ttl_s``."""
    frame = TokenFrame.failure(seq, message, code).encode()
    if not log_ttl_s:
        client.publish(tokens_channel(request_id), frame)
        return
    pipe = client.pipeline(transaction=False)
    pipe.publish(tokens_channel(request_id), frame)
    for command in log_commands(request_id, frame, True, True, log_ttl_s):
        pipe.execute_command(*command)
    pipe.execute()


def log_commands(request_id: str, frame: bytes, first: bool, last: bool,
                 ttl_s: float) -> list[tuple]:  # fmt: skip
    """The commands that append ``frame`` to its stream's log (and set the log's TTL: an
    hour from its first frame, ``ttl_s`` from its last)."""
    key = frames_key(request_id)
    out: list[tuple] = [("XADD", key, "MAXLEN", "~", FRAMES_MAXLEN, "*", "f", frame)]
    if last:
        out.append(("EXPIRE", key, max(1, int(ttl_s))))
    elif first:
        out.append(("EXPIRE", key, FRAMES_OPEN_TTL_S))
    return out


def _publish_head(request_id: str) -> bytes:
    """``PUBLISH tokens:{request_id}``, less the message (kept per stream: a cached head
    and one ``bulk`` per frame cost less than packing the whole command; docs/performance.md,
    "RESP: one encoder")."""
    return command_head(3, "PUBLISH", tokens_channel(request_id))


# Replies owed before a write reads those that have come. Looking costs several system
# calls (redis-py polls the socket, peeks whether it closed, reads, polls again), nearly as
# much as the write; reading 16 at a time costs the same once (docs/performance.md,
# "Worker: replies read 16 at a time").
DRAIN_AFTER = 16

# A write after this long a silence first checks that the connection still stands. A
# Redis that closed it meanwhile (restarted, say) would swallow that write without an
# error: the socket takes the bytes, only the write after it fails. One poll per write
# after a silence, none while frames flow.
IDLE_CHECK_S = 1.0

_REPLY_OFF = encode([("CLIENT", "REPLY", "OFF")])
_REPLY_ON = encode([("CLIENT", "REPLY", "ON")])


class FramePublisher:
    """Numbers frames per request and writes them to Redis from the caller's thread.

    ``publish_outputs`` runs on the engine loop's thread, once per step: it encodes the
    step's frames as pipelined ``PUBLISH`` commands and writes them on a connection of its
    own in one send, without waiting for the replies (a later write reads those that have
    come, once ``DRAIN_AFTER`` are owed). No thread is woken and no round trip is awaited
    per step, so the engine does not trade its core and its GIL with a publisher thread
    (docs/performance.md, "Worker: frames written from the engine thread"). It then calls
    ``on_published`` with the outputs — so whoever waits for a request learns it finished
    only once its terminal frame is on its way. A write that fails drops those frames (the
    API sees the gap or times out) and the next write reconnects.

    Where the server takes ``CLIENT REPLY`` (asked on every new connection), a step's
    ``PUBLISH`` commands go between ``CLIENT REPLY OFF`` and ``ON``: one reply per step
    to read instead of one per frame (the receiver counts they carry are not used; a
    ``PUBLISH`` refused in between, say by an ACL, goes unseen here and the API sees the
    gap, where without it the refusal is logged and counted in ``publish_errors``). Each
    stream keeps its frame's command head (docs/performance.md, "Worker: frames between
    CLIENT REPLY OFF and ON").
    ``send_command`` puts other commands on the same connection the same way (the KV
    event batches: :class:`kvbm.events.KVEventPublisher`), their replies handed to a
    callback. Thread-safe: ``start_at``, ``publish_error`` and ``send_command`` may come
    from other threads. With ``stream_interval`` > 1 a request's outputs are held and sent
    N tokens to a frame (:mod:`workers.stream_interval`); ``stop`` sends what is held.
    """

    def __init__(
        self,
        client: redis.Redis,
        on_published: Callable[[list[RequestOutput]], None] | None = None,
        log_ttl_s: float = 0.0,
        stream_interval: int = 1,
    ) -> None:
        # a dedicated connection (auth, TLS, unix sockets as the client's pool has them)
        self._conn = client.connection_pool.make_connection()
        self._on_published = on_published
        self.log_ttl_s = log_ttl_s  # > 0: frames also go into their stream's log
        # > 1: a frame per that many tokens of a request (workers.stream_interval)
        self._interval = IntervalBuffer(stream_interval) if stream_interval != 1 else None
        # per open stream: [its next frame's seq, its PUBLISH command's head]
        self._streams: dict[str, list] = {}
        self._lock = threading.Lock()
        # per command written and not answered yet, in order: its reply callback (None for
        # a frame's PUBLISH)
        self._owed: deque[Callable[[object], None] | None] = deque()
        # whether the server takes CLIENT REPLY (checked on every new connection): then a
        # step's PUBLISH commands go between CLIENT REPLY OFF and ON, one reply to read
        self.quiet = False
        self._connected = False
        self._last_write = 0.0  # monotonic
        self._conn.register_connect_callback(self._on_connect)
        self.frames_published = 0
        self.publish_errors = 0
        # while Redis is away: since when, the frames dropped, the next try and its spacing
        self._down_since: float | None = None
        self._dropped = 0
        self._retry_at = 0.0
        self._retry_s = 0.0

    def publish_outputs(self, outputs: list[RequestOutput]) -> None:
        try:
            with self._lock:
                if self._interval is None:
                    self._publish(outputs)
                else:  # held back, or merged with what was (workers.stream_interval)
                    self._publish(self._interval.due(outputs, self._streams))
        finally:
            if self._on_published is not None:
                try:
                    self._on_published(outputs)
                except Exception:  # noqa: BLE001
                    log.exception("on_published callback failed")

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Number, encode and write ``outputs``' frames (under the lock)."""
        if not outputs:
            return
        items = []
        logs: list[tuple] = []
        for out in outputs:
            # a prefill worker's part of a stream ends with its first frame
            ends = out.finished or out.prefilled
            first = out.request_id not in self._streams
            seq, head = self._next(out.request_id, ends)
            frame = output_frame(out, seq).encode()
            items.append((head, frame))
            if self.log_ttl_s:
                logs += log_commands(out.request_id, frame, first, out.finished,
                                     self.log_ttl_s)  # fmt: skip
        if self._send_frames(items, logs):
            self.frames_published += len(items)

    def _flush_held(self) -> None:
        """Send what the stream interval holds (the publisher stops: the API gets every
        token computed here, and a migration resumes after them)."""
        if self._interval is not None:
            self._publish(self._interval.flush())

    def _send_frames(
        self, items: list[tuple[bytes, bytes]], logs: list[tuple] | None = None
    ) -> bool:
        """Write one step's frames (each its stream's PUBLISH head and its JSON) and the
        commands that log them; False if they were dropped (the API notices the gap or
        times out)."""
        parts = [head + bulk(frame) for head, frame in items]
        if logs:
            parts += [encode([c]) for c in logs]
        self._check_idle()
        if not self._connected and not self._connect(len(parts)):
            return False
        if self.quiet and len(parts) > 1:  # the PUBLISH replies (receiver counts) are not
            # needed; one frame owes one reply either way, so it goes without OFF and ON
            parts.insert(0, _REPLY_OFF)
            parts.append(_REPLY_ON)
            owed: list[Callable[[object], None] | None] = [None]
        else:
            owed = [None] * len(parts)
        return self._write(b"".join(parts), owed)

    def send_command(self, args: tuple, on_reply: Callable[[object], None]) -> None:
        """Write one command on this connection without waiting; ``on_reply`` gets its
        reply, or the exception that stands for it (an error reply, a lost connection),
        when a later write (once ``DRAIN_AFTER`` replies are owed) or :meth:`wait_replies`
        reads it."""
        with self._lock:
            self._check_idle()
            self._write(encode([args]), [on_reply])

    def wait_replies(self, timeout: float) -> bool:
        """Read every reply still owed, waiting up to ``timeout`` s; False if some are not."""
        end = time.monotonic() + timeout
        with self._lock:
            try:
                while self._owed:
                    left = end - time.monotonic()
                    if left <= 0 or not self._conn.can_read(timeout=left):
                        return False
                    self._read_one()
            except (redis.RedisError, OSError) as e:
                self._lost(e)
            return not self._owed

    def start_at(self, request_id: str, seq: int) -> None:
        """Number ``request_id``'s next frame ``seq`` (a decode worker continues the stream
        a prefill worker began)."""
        with self._lock:
            self._streams[request_id] = [seq, self._head(request_id)]

    def publish_error(self, request_id: str, message: str, code: str = "") -> None:
        """End ``request_id``'s stream with an error frame (numbered after its others)."""
        from workers.engine_api import RequestOutput

        out = RequestOutput(request_id, [], "", finished=True, finish_reason="error")
        out.error = message
        out.error_code = code
        self.publish_outputs([out])

    def stop(self) -> None:
        with self._lock:
            try:
                self._flush_held()
                self._drain()
            except (redis.RedisError, OSError):
                pass  # closing anyway
            finally:
                self._connected = False
                self._conn.disconnect()

    # ----------------------------------------------------------------------------------
    def _next(self, request_id: str, finished: bool) -> tuple[int, bytes]:
        """The seq of ``request_id``'s next frame and its PUBLISH head."""
        stream = self._streams.get(request_id)
        if stream is None:
            stream = [0, self._head(request_id)]
            if not finished:
                self._streams[request_id] = stream
        elif finished:
            del self._streams[request_id]
        seq = stream[0]
        stream[0] = seq + 1
        return seq, stream[1]

    def _head(self, request_id: str) -> bytes:
        return _publish_head(request_id)

    def _connect(self, frames: int) -> bool:
        """Connect for a write of ``frames`` frames. While Redis is away, tries are spaced
        (0.1 s doubling to 2 s: the engine steps every few ms) and the frames in between
        are dropped; the log says when it went and, once back, what was lost."""
        now = time.monotonic()
        if now < self._retry_at:
            self._dropped += frames
            return False
        try:
            self._conn.connect()  # runs _on_connect
        except (redis.RedisError, OSError) as e:
            if self._down_since is None:
                log.error("connecting to Redis failed, dropping frames until it answers: %s", e)
                self._down_since = now
            self._dropped += frames
            self._retry_s = min(2.0, self._retry_s * 2 if self._retry_s else 0.1)
            self._retry_at = now + self._retry_s
            self._lost(e)
            return False
        if self._down_since is not None:
            log.warning("Redis answers again after %.1f s; %d frames were dropped meanwhile",
                        now - self._down_since, self._dropped)  # fmt: skip
        self._down_since, self._dropped, self._retry_s, self._retry_at = None, 0, 0.0, 0.0
        return True

    def _on_connect(self, conn: redis.connection.AbstractConnection) -> None:
        """On every new connection: does the server take CLIENT REPLY (Redis >= 3.2 does;
        some proxies and look-alikes do not)?"""
        try:
            conn.send_command("CLIENT", "REPLY", "ON", check_health=False)
            self.quiet = conn.read_response() in (b"OK", "OK", True)
        except redis.ResponseError as e:
            log.info("frames: the server refuses CLIENT REPLY (%s); reading every reply", e)
            self.quiet = False
        self._connected = True

    def _write(self, payload: bytes, callbacks: list[Callable[[object], None] | None]) -> bool:
        try:
            self._conn.send_packed_command([payload], check_health=False)
        except (redis.RedisError, OSError) as e:  # the API notices the gap or times out
            log.error("writing %d commands failed: %s", len(callbacks), e)
            self._owed.extend(callbacks)
            self._lost(e)
            return False
        self._owed.extend(callbacks)
        self._last_write = time.monotonic()
        if len(self._owed) >= DRAIN_AFTER:
            try:
                self._drain()
            except (redis.RedisError, OSError) as e:  # written, but the connection broke
                self._lost(e)
        return True

    def _check_idle(self) -> None:
        """After ``IDLE_CHECK_S`` of silence, read what came meanwhile; a connection the
        server closed is dropped here, so the write goes out on a new one."""
        if not self._connected or time.monotonic() - self._last_write < IDLE_CHECK_S:
            return
        try:
            self._drain()
            if self._conn.can_read(timeout=0):  # readable with no reply owed: closed
                raise redis.ConnectionError("closed by the server")
        except (redis.RedisError, OSError) as e:
            log.warning("frame connection lost while idle (%s): reconnecting", e)
            self._lost(e, count=False)

    def _drain(self) -> None:
        """Read the replies that have arrived, without waiting for the others (the caller
        handles a broken connection)."""
        while self._owed and self._conn.can_read(timeout=0):
            self._read_one()

    def _read_one(self) -> None:
        on_reply = self._owed.popleft()
        try:
            reply: object = self._conn.read_response()
        except redis.ResponseError as e:
            if on_reply is None:
                self.publish_errors += 1
                log.error("a frame was refused: %s", e)
                return
            reply = e
        if on_reply is not None:
            on_reply(reply)

    def _lost(self, e: BaseException, count: bool = True) -> None:
        """The connection broke: no owed reply will come; the next write reconnects.
        ``count``: a write failed (``publish_errors``), not only a connection."""
        self.publish_errors += count
        self._connected = False
        self._conn.disconnect()
        owed, self._owed = self._owed, deque()
        for on_reply in owed:
            if on_reply is not None:
                on_reply(e)


class StockFramePublisher(FramePublisher):
    """:class:`FramePublisher` on redis-py's stock client (``CONVEYOR_BROKER_FASTPATH=
    false``): a step's frames go out as one pipeline of ``PUBLISH`` commands whose replies
    are awaited, and ``send_command`` runs its command at once."""

    def __init__(
        self,
        client: redis.Redis,
        on_published: Callable[[list[RequestOutput]], None] | None = None,
        log_ttl_s: float = 0.0,
        stream_interval: int = 1,
    ) -> None:
        self._r = client
        self._on_published = on_published
        self.log_ttl_s = log_ttl_s
        self._interval = IntervalBuffer(stream_interval) if stream_interval != 1 else None
        self._streams = {}
        self._lock = threading.Lock()
        self._owed = deque()
        self.quiet = False
        self.frames_published = 0
        self.publish_errors = 0

    def _head(self, request_id: str) -> bytes:
        return tokens_channel(request_id).encode()

    def _send_frames(
        self, items: list[tuple[bytes, bytes]], logs: list[tuple] | None = None
    ) -> bool:
        pipe = self._r.pipeline(transaction=False)
        for channel, frame in items:
            pipe.publish(channel, frame)
        for command in logs or ():
            pipe.execute_command(*command)
        try:
            pipe.execute()
        except redis.RedisError as e:
            self.publish_errors += 1
            log.error("publishing %d frames failed: %s", len(items), e)
            return False
        return True

    def send_command(self, args: tuple, on_reply: Callable[[object], None]) -> None:
        try:
            reply: object = self._r.execute_command(*args)
        except redis.RedisError as e:
            reply = e
        on_reply(reply)

    def wait_replies(self, timeout: float) -> bool:
        return True

    def stop(self) -> None:
        with self._lock:
            self._flush_held()
        self._r.close()
