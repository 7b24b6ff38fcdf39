"""The API's token-stream hub against a real redis-server: the pattern subscription that
covers the hub's own request ids, ordering, gaps, and catching up several frames at once."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis.asyncio as aioredis

from api.metrics import ApiMetrics
from api.runner import Runner, RunningRequest
from api.streams import StreamGap, StreamHub
from kvbm.protocol import tokens_channel
from tasks.pipeline import Plan
from tasks.settings import Settings
from tests.integration.conftest import async_wait_for

pytestmark = pytest.mark.integration


def _frame(seq: int, text: str, done: bool = False) -> str:
    f: dict = {"seq": seq, "token_ids": [seq], "text": text}
    if done:
        f.update(done=True, finish_reason="length", usage={"completion_tokens": seq + 1})
    return json.dumps(f)


def _run(url: str, body, **hub_kw) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        client = aioredis.Redis.from_url(url)
        hub = StreamHub(url, **hub_kw)
        await hub.start()
        try:
            await body(client, hub)
        finally:
            await hub.close()
            await client.aclose()

    asyncio.run(main())


def test_own_request_ids_need_no_subscribe_of_their_own(fresh_db: str) -> None:
    async def body(client: aioredis.Redis, hub: StreamHub) -> None:
        rid = hub.new_request_id("chatcmpl")
        assert rid.startswith(f"chatcmpl-{hub.tag}") and len(rid) == len("chatcmpl-") + 32
        assert hub.new_request_id("chatcmpl") != rid
        channel = tokens_channel(rid)
        assert hub.covers(channel) and hub.covers(tokens_channel(f"{rid}.r1"))
        assert not hub.covers(tokens_channel(hub.new_request_id("x").replace(hub.tag, "0" * 8)))
        sub = await hub.subscribe(channel)
        # listening already: the hub's pattern delivers it, no SUBSCRIBE was sent
        assert await client.pubsub_numsub(channel) == [(channel.encode(), 0)]
        assert await client.pubsub_numpat() >= 1
        assert await client.publish(channel, _frame(0, "a")) == 1
        assert await client.publish(channel, _frame(1, "b", done=True)) == 1
        got = [await sub.next_frame(5.0), await sub.next_frame(5.0)]
        assert [(f.seq, f.text) for f in got] == [(0, "a"), (1, "b")]
        await sub.close()
        await client.publish(channel, _frame(2, "late"))  # nobody listens: dropped
        assert sub.pending == 0

    _run(fresh_db, body)


def test_a_foreign_channel_is_subscribed_and_confirmed(fresh_db: str) -> None:
    async def body(client: aioredis.Redis, hub: StreamHub) -> None:
        channel = tokens_channel("made-elsewhere-1")
        assert not hub.covers(channel)
        sub = await hub.subscribe(channel)
        assert await client.pubsub_numsub(channel) == [(channel.encode(), 1)]
        await client.publish(channel, _frame(0, "x", done=True))
        assert (await sub.next_frame(5.0)).text == "x"
        await sub.close()

        async def unsubscribed() -> bool:
            return await client.pubsub_numsub(channel) == [(channel.encode(), 0)]

        await async_wait_for(unsubscribed, 5, "the foreign channel unsubscribed")

    _run(fresh_db, body)


@pytest.mark.parametrize("fast", [True, False])
def test_a_declared_death_makes_waiting_streams_check_their_workers_at_once(
    fresh_db: str, fast: bool
) -> None:
    """declare_dead publishes the worker's id; the hub wakes every reader waiting for a
    frame to ask its alive() now: the dead worker's stream raises WorkerLost within
    moments though its poll is 30 s apart, the live worker's stream keeps waiting."""
    import redis as sync_redis

    from api.streams import WorkerLost
    from cluster.membership import Heartbeat, declare_dead, live_workers

    async def body(client: aioredis.Redis, hub: StreamHub) -> None:
        r = sync_redis.Redis.from_url(fresh_db)
        for wid in ("w-dead", "w-live"):
            Heartbeat(r, "generate", wid, ttl_s=60.0).beat()
        checks: dict[str, int] = {"w-dead": 0, "w-live": 0}

        def alive_of(wid: str):  # type: ignore[no-untyped-def]
            async def alive() -> bool:
                checks[wid] += 1
                return wid in {w.worker_id for w in live_workers(r, "generate")}

            return alive

        subs = {w: await hub.subscribe(tokens_channel(hub.new_request_id(w))) for w in checks}
        waits = {w: asyncio.ensure_future(subs[w].next_frame(60.0, alive_of(w), check_every=30.0))
                 for w in checks}  # fmt: skip
        await asyncio.sleep(0.2)  # a quiet while: nothing may wake the streams in it
        assert checks == {"w-dead": 0, "w-live": 0} and not any(t.done() for t in waits.values())
        t0 = time.monotonic()
        await asyncio.to_thread(declare_dead, r, "generate", "w-dead")
        with pytest.raises(WorkerLost):
            await asyncio.wait_for(waits["w-dead"], 5.0)
        assert time.monotonic() - t0 < 1.0, "the death notice did not wake the stream"
        await async_wait_for(lambda: checks["w-live"] >= 1, 5, "the live stream checked")
        assert hub.deaths_heard == 1 and not waits["w-live"].done()
        waits["w-live"].cancel()
        r.close()

    _run(fresh_db, body, fast=fast)


def test_poll_takes_what_arrived_in_order_and_drops_duplicates(fresh_db: str) -> None:
    async def body(client: aioredis.Redis, hub: StreamHub) -> None:
        channel = tokens_channel(hub.new_request_id("cmpl"))
        sub = await hub.subscribe(channel)
        assert sub.poll() is None  # nothing yet, and it does not wait
        for raw in (_frame(0, "a"), _frame(0, "a"), _frame(1, "b"), _frame(3, "d")):
            await client.publish(channel, raw)
        await async_wait_for(lambda: sub.pending == 4, 5, "4 frames pending")
        assert (await sub.next_frame(1.0)).seq == 0
        assert sub.poll().seq == 1  # type: ignore[union-attr]  # the duplicate 0 is dropped
        with pytest.raises(StreamGap, match="frames 2..2 were lost"):
            sub.poll()

    _run(fresh_db, body)


def test_a_stream_that_fell_behind_catches_up_in_one_batch(fresh_db: str) -> None:
    """Runner.batches: frames that arrived while the API was busy come as one batch (one
    SSE chunk); a frame that is waited for comes alone; the terminal frame ends it."""

    async def body(client: aioredis.Redis, hub: StreamHub) -> None:
        runner = Runner(Settings(), client, hub, ApiMetrics())
        rid = hub.new_request_id("cmpl")
        channel = tokens_channel(rid)
        sub = await hub.subscribe(channel)
        run = RunningRequest(rid, sub, Plan(steps=[]), time.perf_counter())
        for i, t in enumerate("abcd"):
            await client.publish(channel, _frame(i, t))
        await async_wait_for(lambda: sub.pending == 4, 5, "4 frames pending")
        run.first_frame = await runner._next(run)
        batches = runner.batches(run)
        first = await anext(batches)
        assert [f.text for f in first] == ["a", "b", "c", "d"]
        assert run.last_frame_at is not None and not run.finished
        later = asyncio.ensure_future(anext(batches))
        await asyncio.sleep(0.05)  # a while with no frame: the batch must still be waiting
        assert not later.done()  # waits for the next frame, not for a timeout
        await client.publish(channel, _frame(4, "e"))
        assert [f.text for f in await later] == ["e"]
        await client.publish(channel, _frame(5, "f"))
        await client.publish(channel, _frame(6, "g", done=True))
        await client.publish(channel, _frame(7, "never"))  # after the terminal frame
        await async_wait_for(lambda: sub.pending == 3, 5, "3 frames pending")
        last = await anext(batches)
        assert [f.text for f in last] == ["f", "g"] and last[-1].done
        assert run.finished and run.usage is not None and run.usage.completion_tokens == 7
        with pytest.raises(StopAsyncIteration):
            await anext(batches)

    _run(fresh_db, body)


async def _both_subscribed(client: aioredis.Redis, hub: StreamHub, foreign: str) -> None:
    async def both() -> bool:
        return await client.pubsub_numpat() >= 1 and await client.pubsub_numsub(foreign) == [
            (foreign.encode(), 1)
        ]

    await async_wait_for(both, 5, "the pattern and the foreign channel subscribed again")


async def _frames_flow(client: aioredis.Redis, subs: list, channels: list[str], seq: int) -> None:
    for sub, channel in zip(subs, channels, strict=True):
        await client.publish(channel, _frame(seq, f"after-{seq}"))
        assert (await sub.next_frame(5.0)).text == f"after-{seq}"


def test_the_hub_reconnects_and_resubscribes_after_a_drop(own_redis: str) -> None:
    """Redis closes the hub's connection: it is reopened, the pattern and the foreign
    channel subscribed again, and frames flow to the same subscriptions."""

    async def body(client: aioredis.Redis, hub: StreamHub) -> None:
        own = tokens_channel(hub.new_request_id("cmpl"))
        foreign = tokens_channel("made-elsewhere-2")
        subs = [await hub.subscribe(own), await hub.subscribe(foreign)]
        await _frames_flow(client, subs, [own, foreign], 0)
        assert await client.client_kill_filter(_type="pubsub") >= 1
        await async_wait_for(lambda: hub.reconnects >= 1, 5, "the hub reconnected")
        await _both_subscribed(client, hub, foreign)
        await _frames_flow(client, subs, [own, foreign], 1)

    _run(own_redis, body)  # it kills every pub/sub client


def test_a_connection_gone_silent_is_reopened_by_the_health_check(own_redis: str) -> None:
    """Nothing comes back (Redis paused, as a dead peer would look): after three missed
    PINGs the hub reconnects on its own, and streams go on."""

    async def body(client: aioredis.Redis, hub: StreamHub) -> None:
        own = tokens_channel(hub.new_request_id("cmpl"))
        foreign = tokens_channel("made-elsewhere-3")
        subs = [await hub.subscribe(own), await hub.subscribe(foreign)]
        await client.execute_command("CLIENT", "PAUSE", 800, "ALL")
        await async_wait_for(lambda: hub.reconnects >= 1, 3, "the hub reconnected")
        assert await client.ping()  # answered once the pause is over
        await _both_subscribed(client, hub, foreign)
        await _frames_flow(client, subs, [own, foreign], 0)

    _run(own_redis, body, health_s=0.1)  # it pauses every client
