"""api.streams.Subscription's waiting: woken by a frame, by its timer, by cancellation."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from api.streams import StreamTimeout, Subscription, WorkerLost


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
