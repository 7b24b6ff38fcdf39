"""Resumable streams (``CONVEYOR_RESUMABLE_STREAMS``): a client that lost its connection
sends the same request again with ``Last-Event-ID`` and gets the rest of its stream, from
any API replica, with nothing lost or repeated (chat and completions here and in
:mod:`api.choices` for ``n`` > 1, whose ids carry a seq per choice; the Responses API's
streams in :mod:`api.routes_responses`, whose ids are the events' sequence numbers).

The workers log every frame of a stream in a Redis Stream (:func:`kvbm.protocol.frames_key`,
written with the pub/sub frame: :mod:`workers.stream`), so the frames outlive the API
process that relayed them. Each SSE event of a chat or completion stream carries ``id:
<log>:<seq>``: the stream whose log holds the request's first frames and the last frame
the event covers. A resume reads that log from its first frame and feeds every frame
through the same formatter the first relay used (tool parsing and stop handling depend on
all the text before), silently up to ``seq``, then sends what follows, live. When the
relaying API moved the stream to another worker (a migration), it wrote an entry ``m``
into the old log naming the new stream and the seq it goes on from; a resume follows it.

The resuming API only reads: the request's load and cancellation stay with the API that
started it. That API, when its client goes away, keeps the request running for
``CONVEYOR_RESUME_GRACE_S`` and cancels it unless a resume claimed it
(:func:`resumed_key`) meanwhile; if that API process died, the request runs to its end on
its worker and a resume elsewhere reads it all from the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import cast

import redis.asyncio as aioredis

from api.errors import OpenAIError
from api.streams import StreamTimeout, output_dropped
from cluster.keys import KEY_PREFIX
from cluster.resp import as_str
from kvbm.protocol import FRAMES_OPEN_TTL_S, TokenFrame, frames_key

log = logging.getLogger(__name__)

BLOCK_MS = 1000  # one blocking read of a log waits this long at most


def event_id(log_id: str, seqs: Sequence[int]) -> bytes:
    """The SSE ``id:`` line of an event that covers ``log_id``'s frames up to ``seqs`` (one
    seq; or, for ``n`` > 1 choices, one per choice, comma-separated)."""
    return f"id: {log_id}:{','.join(map(str, seqs))}\r\n".encode()


def parse_event_id(value: str, prefixes: tuple[str, ...], n: int = 1) -> tuple[str, list[int]]:
    """``Last-Event-ID`` -> (the log's stream id, the last seq the client has of each of
    the ``n`` streams); a 400 for anything this endpoint never sent."""
    log_id, _, tail = value.strip().rpartition(":")
    seqs = tail.split(",")
    if (not log_id.startswith(prefixes) or len(log_id) > 200 or len(seqs) != n
            or not all(s.lstrip("-").isdigit() for s in seqs)):  # fmt: skip
        raise OpenAIError(400, f"Last-Event-ID {value[:80]!r} is not an event id of this "
                          "endpoint's streams", "invalid_request_error", "Last-Event-ID",
                          "invalid_event_id")  # fmt: skip
    return log_id, [int(s) for s in seqs]


class Tagged:
    """SSE ids for a resumable stream: each write's last event carries ``id:`` with the
    seqs its frames reach, and a resumed stream's writes that reach no further than
    ``skip_until`` (what its client has) are formatted but not sent."""

    def __init__(self, log_id: str, skip_until: Sequence[int] | None = None) -> None:
        self.log_id = log_id
        self.skip_until = skip_until

    def out(self, event: bytes, seqs: Sequence[int]) -> bytes:
        if self.skip_until is not None and all(
            s <= k for s, k in zip(seqs, self.skip_until, strict=True)
        ):
            return b""
        at = event.rfind(b"data: ")  # the write's last event
        return event[:at] + event_id(self.log_id, seqs) + event[at:]


def resumed_key(log_id: str) -> str:
    """Set by an API that resumes the stream: the API that started it does not cancel it
    when its grace period ends."""
    return f"{KEY_PREFIX}resumed:{log_id}"


def moved_commands(old_stream_id: str, new_stream_id: str, next_seq: int) -> list[tuple]:
    """What the relaying API writes into a stream's log when it moves the stream on to
    ``new_stream_id`` (frames from ``next_seq`` on): the pointer a resume follows."""
    key = frames_key(old_stream_id)
    return [("XADD", key, "*", "m", new_stream_id, "s", next_seq),
            ("EXPIRE", key, FRAMES_OPEN_TTL_S)]  # fmt: skip


async def claim(r: aioredis.Redis, log_id: str, first_log: str | None = None) -> bool:
    """Mark the stream resumed; False if its log (``first_log``'s, for a request of ``n``
    choices: its first choice's) is gone (expired, or never written)."""
    pipe = r.pipeline(transaction=False)
    pipe.exists(frames_key(first_log or log_id))
    pipe.set(resumed_key(log_id), 1, ex=FRAMES_OPEN_TTL_S)
    exists, _ = await pipe.execute()
    return bool(exists)


class FrameLogReader:
    """A stream's frames from its log, in seq order from its first, across moves, waiting
    for those not written yet (up to ``timeout_s`` between two)."""

    def __init__(self, r: aioredis.Redis, log_id: str, timeout_s: float,
                 prompt_only: bool = False) -> None:  # fmt: skip
        self._r = r
        self._prompt_only = prompt_only  # each frame without its output (echo alone)
        self._key = frames_key(log_id)
        self._pos = "0-0"
        self._timeout_s = timeout_s
        self._next_seq = 0
        self._ready: list[TokenFrame] = []
        self.done = False

    async def read(self) -> list[TokenFrame]:
        """The next frames (at least one, up to the terminal one); waits for them."""
        deadline = time.monotonic() + self._timeout_s
        while not self._ready:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StreamTimeout(f"no frame in {self._timeout_s:.0f} s")
            block = int(min(left, BLOCK_MS / 1000) * 1000)
            self._ingest(await self._r.xread({self._key: self._pos}, count=256, block=block))
        out, self._ready = self._ready, []
        return out

    async def available(self) -> list[TokenFrame]:
        """The frames written so far, without waiting."""
        while not self.done:
            if not self._ingest(await self._r.xread({self._key: self._pos}, count=1024)):
                break
        out, self._ready = self._ready, []
        return out

    def _ingest(self, reply: object) -> bool:
        """Take a read's entries (up to a move, which switches logs); whether it had any."""
        entries = [e for _, es in cast("list[tuple[bytes, list[tuple[bytes, dict]]]]",
                                       reply or ()) for e in es]  # fmt: skip
        for entry_id, fields in entries:
            f = {as_str(k): v for k, v in fields.items()}
            if "m" in f:  # moved on: the rest is in the new stream's log
                self._key, self._pos = frames_key(as_str(f["m"])), "0-0"
                break
            self._pos = as_str(entry_id)
            self._take(f)
        return bool(entries)

    def _take(self, f: dict) -> None:
        if self.done:
            return
        frame = TokenFrame.decode(f["f"])
        if frame.seq != self._next_seq:
            return  # a lost attempt's late frame, or one seen already
        self._next_seq += 1
        if self._prompt_only:
            output_dropped(frame)
        self._ready.append(frame)
        self.done = frame.done


async def split_at(
    reader: FrameLogReader, after_seq: int
) -> tuple[list[TokenFrame], list[TokenFrame]]:
    """The stream's first frames: those up to ``after_seq`` (what the client has) and
    those after it that one read brought along."""
    have: list[TokenFrame] = []
    while not reader.done and (not have or have[-1].seq < after_seq):
        have += await reader.read()
    i = next((i for i, f in enumerate(have) if f.seq > after_seq), len(have))
    return have[:i], have[i:]


async def resumed_batches(
    reader: FrameLogReader, after_seq: int
) -> AsyncIterator[list[TokenFrame]]:
    """The stream's frames in batches: first every frame up to ``after_seq`` (what the
    client has: to be formatted and not sent), then what follows as it comes."""
    have, rest = await split_at(reader, after_seq)
    if have:
        yield have
    if rest:
        yield rest
    async for batch in frames_of(reader):
        yield batch


async def frames_of(reader: FrameLogReader) -> AsyncIterator[list[TokenFrame]]:
    """The reader's frames as they come, to the stream's end."""
    while not reader.done:
        yield await reader.read()


async def grace_then(grace_s: float, r: aioredis.Redis, log_id: str) -> bool:
    """Wait ``grace_s``; whether a resume claimed the stream meanwhile."""
    await asyncio.sleep(grace_s)
    try:
        return bool(await r.exists(resumed_key(log_id)))
    except Exception as e:  # noqa: BLE001 - Redis away: treat it as not resumed
        log.warning("[%s] could not read the resume claim: %s", log_id, e)
        return False


async def linger(
    grace_s: float, r: aioredis.Redis, log_id: str, drain: Callable[[], Awaitable[None]],
    end: Callable[[], None],
) -> None:  # fmt: skip
    """A stream whose client went away: after ``grace_s``, if a resume claimed it,
    ``drain()`` reads it on here to its end (its load and migrations stay with this API)
    while the resuming API relays its log; then, or at once if unclaimed, ``end()`` (which
    cancels an unfinished request)."""
    try:
        if await grace_then(grace_s, r, log_id):
            await drain()
    except Exception as e:  # noqa: BLE001 - it ends here either way
        log.info("[%s] resumed stream ended on its first API: %s", log_id, e)
    finally:
        end()
