"""api.streams.Subscription's waiting: woken by a frame, by its timer, by cancellation."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from api.streams import StreamGap, StreamInterrupted, StreamTimeout, Subscription, WorkerLost


def _raw(seq: int, done: bool = False) -> bytes:
    return json.dumps({"seq": seq, "text": str(seq), "done": done}).encode()


def _sub() -> Subscription:
    return Subscription(None, "tokens:x")  # type: ignore[arg-type]  # no hub needed here


def test_a_pushed_frame_wakes_the_reader_at_once_and_no_timer_is_left() -> None:
    async def main() -> None:
        sub = _sub()
        reader = asyncio.ensure_future(sub.next_frame(30.0))
        await asyncio.sleep(0.01)
        assert not reader.done()
        t = time.perf_counter()
        sub.push(_raw(0))
        assert (await reader).seq == 0
        assert time.perf_counter() - t < 0.5
        loop = asyncio.get_running_loop()
        assert all(h.cancelled() for h in loop._scheduled)  # type: ignore[attr-defined]
        assert sub._waiter is None

    asyncio.run(main())


def test_silence_times_out_and_a_dead_worker_is_noticed_between_checks() -> None:
    async def main() -> None:
        sub = _sub()
        with pytest.raises(StreamTimeout, match="no first frame within"):
            await sub.next_frame(0.05)
        checks: list[float] = []

        async def alive() -> bool:
            checks.append(time.perf_counter())
            return len(checks) < 3

        t = time.perf_counter()
        with pytest.raises(WorkerLost):
            await sub.next_frame(30.0, alive, check_every=0.02)
        assert len(checks) == 3 and time.perf_counter() - t < 5
        # alive all along: a frame pushed between two checks is still the answer
        checks.clear()
        reader = asyncio.ensure_future(sub.next_frame(30.0, alive, check_every=0.02))
        await asyncio.sleep(0.03)
        sub.push(_raw(0, done=True))
        assert (await reader).done and len(checks) == 1

    asyncio.run(main())


def test_a_cancelled_reader_leaves_nothing_behind_and_frames_keep_their_order() -> None:
    async def main() -> None:
        sub = _sub()
        reader = asyncio.ensure_future(sub.next_frame(30.0))
        await asyncio.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert sub._waiter is None
        for seq in (0, 0, 1):  # a duplicate on the way
            sub.push(_raw(seq))
        assert sub.pending == 3
        assert [(await sub.next_frame(1.0)).seq for _ in range(2)] == [0, 1]
        assert sub.pending == 0

    asyncio.run(main())


def test_an_interrupted_stream_goes_on_when_its_next_frame_comes_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hub's connection dropped and came back: a frame that arrived before the drop
    proves nothing; the first one after it, in order, shows nothing was lost."""
    monkeypatch.setattr("api.streams.INTERRUPT_GRACE_S", 0.05)

    async def main() -> None:
        sub = _sub()
        sub.push(_raw(0))
        sub.interrupt()  # frame 0 came before it
        assert (await sub.next_frame(30.0)).seq == 0
        reader = asyncio.ensure_future(sub.next_frame(30.0))
        await asyncio.sleep(0.01)
        sub.push(_raw(1))  # after it, in order
        assert (await reader).seq == 1
        await asyncio.sleep(0.1)  # past the grace: no longer interrupted
        reader = asyncio.ensure_future(sub.next_frame(30.0))
        await asyncio.sleep(0.1)
        assert not reader.done()
        sub.push(_raw(2, done=True))
        assert (await reader).done

    asyncio.run(main())


def test_an_interrupted_stream_is_broken_by_a_gap_or_by_silence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("api.streams.INTERRUPT_GRACE_S", 0.05)

    async def main() -> None:
        sub = _sub()  # a gap after the interruption: frames lost while Redis was away
        assert sub.poll() is None
        sub.interrupt()
        sub.push(_raw(3))
        with pytest.raises(StreamInterrupted, match="frames 0..2 of tokens:x lost"):
            sub.poll()
        # a gap without an interruption stays a broken stream
        sub = _sub()
        sub.push(_raw(2))
        with pytest.raises(StreamGap):
            sub.poll()
        # silence: a waiting reader is woken by the interruption and, with no frame within
        # the grace, gets StreamInterrupted (a WorkerLost: the runner starts it again)
        sub = _sub()
        reader = asyncio.ensure_future(sub.next_frame(30.0))
        await asyncio.sleep(0.01)
        t = time.perf_counter()
        sub.interrupt()
        with pytest.raises(StreamInterrupted, match="since the API's Redis connection"):
            await reader
        assert 0.04 < time.perf_counter() - t < 1.0
        assert issubclass(StreamInterrupted, WorkerLost)

    asyncio.run(main())


def test_a_failed_stream_raises_to_its_waiting_reader_and_to_the_next_read() -> None:
    """The API's drain ends the streams still open (Subscription.fail); a paused
    deployment restarts a timeout that runs out (``paused``)."""

    async def main() -> None:
        sub = _sub()
        reader = asyncio.ensure_future(sub.next_frame(30.0))
        await asyncio.sleep(0.01)
        sub.fail(RuntimeError("shutting down"))
        with pytest.raises(RuntimeError, match="shutting down"):
            await reader
        sub.push(_raw(0))  # even with a frame there: the stream is over
        with pytest.raises(RuntimeError, match="shutting down"):
            await sub.next_frame(30.0)
        asked: list[int] = []

        async def paused() -> bool:
            asked.append(1)
            return len(asked) < 3  # paused for two timeouts, then not

        with pytest.raises(StreamTimeout):
            await _sub().next_frame(0.02, paused=paused)
        assert len(asked) == 3

    asyncio.run(main())
