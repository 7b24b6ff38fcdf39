"""What the API puts on the broker for a request (real redis-server): the payload whole,
and an argument summary for events, Flower and logs instead of a repr of every token id
(what Flower shows: real workers' task events)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis
from kombu import Consumer

from api.errors import OpenAIError
from api.metrics import ApiMetrics
from api.runner import Runner
from kvbm.protocol import StagePayload
from tasks.app import app, declare_queues, queue
from tasks.broker import ACK_FLUSH_S, Channel, deferred_publishes
from tasks.modes import MODES
from tasks.pipeline import Plan, build_chain
from tasks.router import Route, RouteRequest
from tasks.settings import Settings
from tests.fakes import FakeHub
from tests.integration.conftest import (
    async_wait_for,
    base_env,
    celery_at,
    celery_events,
    free_port,
    needs_redis,
    start_api,
    start_redis,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("steps", [["generate"], ["prefill", "decode"]])
def test_the_message_carries_the_payload_and_no_repr_of_the_token_ids(
    fresh_db: str, steps: list[str]
) -> None:
    r = redis.Redis.from_url(fresh_db)
    celery_at(fresh_db)
    pools = {"generate": "generate", "prefill": "prefill", "decode": "decode"}
    plan = Plan(steps=[(n, Route(pools[n], f"w-{n}", {})) for n in steps])
    declare_queues([route.queue for route in plan.routes])
    ids = list(range(5, 405))
    payload = StagePayload(request_id="cmpl-test", model="m", prompt_token_ids=ids,
                              sampling={}, created=0.0)  # fmt: skip
    build_chain(plan, payload).apply_async()
    raw = r.lpop(plan.routes[0].queue)
    assert raw is not None
    msg = json.loads(raw)
    headers = msg["headers"]
    assert headers["id"] == "cmpl-test" and headers["task"] == f"conveyor.{steps[0]}"
    assert "5, 6, 7" not in json.dumps(headers)  # no repr of the token ids beside the body
    args, kwargs, embed = json.loads(base64.b64decode(msg["body"]))
    assert args[0]["prompt_token_ids"] == ids
    for link in embed.get("chain") or []:  # the next stage, sent later by the worker
        assert "5, 6, 7" not in json.dumps(link["options"])
    assert len(embed.get("chain") or []) == len(steps) - 1
    r.flushdb()


def _png_url() -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 90)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_flower_shows_a_stage_task_by_its_request_not_its_token_ids(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path, mode: str
) -> None:
    """What Flower shows as a task's arguments: the ``args`` of the task-received event
    each stage's worker emits. For a 400-token prompt they name the request and its
    prompt length, not a repr of 400 token ids, for the task the API sends and for the
    ones a worker sends on down the chain (an image request where the mode encodes, so
    that every stage runs)."""
    r = redis.Redis.from_url(fresh_db)
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_MODE=mode, CONVEYOR_KV_TRANSFER="redis",
                   CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0")  # fmt: skip
    procs = [start_worker(f"w-{pool}", pool, f"events-{pool}", env, tmp_path)
             for pool in MODES[mode].pools]  # fmt: skip
    events = r.pubsub()
    try:
        with stop_on_error(*procs):
            api, http = start_api("api-events", env, tmp_path)
        procs.append(api)
        pools = MODES[mode].pools
        wait_for(lambda: all(httpx.get(f"{http}/health").json()["workers"][p] >= 1
                             for p in pools), 90, "workers", procs)  # fmt: skip
        events.psubscribe(celery_events(fresh_db))
        assert events.get_message(timeout=2)["type"] == "psubscribe"
        client = openai.OpenAI(base_url=f"{http}/v1", api_key="x", max_retries=0)
        if any(stage.encodes for stage in MODES[mode].stages):
            content = [{"type": "image_url", "image_url": {"url": _png_url()}},
                       {"type": "text", "text": " ".join(["seven"] * 380)}]  # fmt: skip
            out = client.chat.completions.create(
                model=tiny_model_dir.name, max_tokens=4,
                messages=[{"role": "user", "content": content}],  # type: ignore[misc, list-item]
            )  # fmt: skip
        else:
            prompt = [1] + [5 + i % 400 for i in range(399)]
            out = client.completions.create(model=tiny_model_dir.name, prompt=prompt, max_tokens=4)
        n = out.usage.prompt_tokens
        assert n >= 400
        shown: dict[str, str] = {}  # task name -> the args its task-received event shows
        wanted = {f"conveyor.{stage.task}" for stage in MODES[mode].stages}
        deadline = time.monotonic() + 10
        while set(shown) != wanted and time.monotonic() < deadline:
            msg = events.get_message(timeout=0.2)
            if msg is None or msg["type"] != "pmessage":
                continue
            body = json.loads(base64.b64decode(json.loads(msg["data"])["body"]))
            for ev in body if isinstance(body, list) else [body]:
                if ev.get("type") == "task-received":
                    shown[ev["name"]] = ev["args"]
        assert set(shown) == wanted
        for name, args in shown.items():
            assert out.id in args and str(n) in args, (name, args)
            assert len(args) < 100 and "5, 6, 7" not in args, (name, args)
    finally:
        events.close()
        for p in procs:
            p.stop()
        r.flushdb()


def test_the_api_declares_a_queue_once_then_sends_without_declaring(
    redis_url: str, fresh_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runner._send declares each queue the first time it sends there and never again per
    message (kombu's own check per publish was a third of a send's CPU); the messages
    still land on the queue, whole."""
    import kombu.messaging

    r = redis.Redis.from_url(fresh_db)
    celery_at(fresh_db)
    checks: list[object] = []
    real = kombu.messaging.maybe_declare

    def spy(entity, *args, **kwargs):  # type: ignore[no-untyped-def]
        checks.append(getattr(entity, "name", None))
        return real(entity, *args, **kwargs)

    monkeypatch.setattr(kombu.messaging, "maybe_declare", spy)

    async def main() -> None:
        client = aioredis.Redis.from_url(fresh_db)
        runner = Runner(Settings(redis_url=fresh_db), client, None, ApiMetrics())  # type: ignore[arg-type]
        plan = Plan(steps=[("generate", Route("generate", "w-once", {}))])
        try:
            for i in range(3):
                payload = StagePayload(request_id=f"cmpl-once-{i}", model="m",
                                          prompt_token_ids=[i, 7], sampling={},
                                          created=0.0)  # fmt: skip
                await runner._send(plan, payload)
            # the sends return before their writes' round trip: wait for the messages
            await async_wait_for(lambda: r.llen("generate.w-once") == 3, 5, "3 messages queued")
        finally:
            await runner.aclose()
            await client.aclose()

    try:
        asyncio.run(main())
        q = "generate.w-once"
        assert q not in checks  # declared by declare_queues, not per message
        assert r.smembers(f"_kombu.binding.{q}")  # the binding exists
        sent = [json.loads(m) for m in r.lrange(q, 0, -1)][::-1]
        assert [m["headers"]["id"] for m in sent] == [f"cmpl-once-{i}" for i in range(3)]
        assert [json.loads(base64.b64decode(m["body"]))[0][0]["prompt_token_ids"]
                for m in sent] == [[i, 7] for i in range(3)]  # fmt: skip
    finally:
        celery_at(redis_url)
        r.flushdb()


def _gone_plan() -> tuple[Plan, StagePayload]:
    plan = Plan(steps=[("generate", Route("generate", "w-gone", {}))])
    payload = StagePayload(request_id="cmpl-gone", model="m", prompt_token_ids=[1, 2],
                              sampling={}, created=0.0)  # fmt: skip
    return plan, payload


async def _send_fails_fast(runner: Runner, plan: Plan, payload: StagePayload) -> None:
    t = time.perf_counter()
    with pytest.raises(OpenAIError) as info:
        await runner._send(plan, payload)
    took = time.perf_counter() - t
    assert info.value.status == 503 and info.value.code == "broker_unavailable"
    assert took < 1.0, f"the send held the caller {took:.2f}s"


def test_a_broker_that_is_gone_fails_the_send_fast_with_503(redis_url: str) -> None:
    """A dead broker must give a clear 503 quickly, not a 500 or a request (or the event
    loop, for the part of a send that is synchronous) held by default publish retries."""
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    celery_at(dead)

    async def main() -> None:
        client = aioredis.Redis.from_url(dead)  # never used: the router is not asked
        runner = Runner(Settings(redis_url=dead), client, None, ApiMetrics())  # type: ignore[arg-type]
        plan, payload = _gone_plan()
        try:
            await _send_fails_fast(runner, plan, payload)  # the queue declared now
            runner._declared.add(plan.routes[0].queue)
            await _send_fails_fast(runner, plan, payload)  # declared before
        finally:
            await runner.aclose()

    try:
        asyncio.run(main())
    finally:
        celery_at(redis_url)


def test_redis_gone_before_routing_gives_503_redis_unavailable() -> None:
    """The router's pick is the first thing a request asks of Redis: no Redis there is a
    clear 503, not a 500."""
    dead = f"redis://127.0.0.1:{free_port()}/0"

    async def main() -> None:
        client = aioredis.Redis.from_url(dead)
        runner = Runner(Settings(redis_url=dead), client, None, ApiMetrics())  # type: ignore[arg-type]
        try:
            with pytest.raises(OpenAIError) as info:
                await runner._dispatch("cmpl-x", [1, 2], {}, 0.0, RouteRequest([], 2))
            assert info.value.status == 503 and info.value.code == "redis_unavailable"
        finally:
            await runner.aclose()
            await client.aclose()

    asyncio.run(main())


def test_a_broker_that_dies_after_connecting_fails_the_send_fast_with_503(
    redis_url: str, tmp_path: Path
) -> None:
    """Once Celery's producer is connected, the send's Redis writes go through the API's
    asyncio client: a broker gone by then gives the same quick 503."""
    proc, url = start_redis(tmp_path)
    celery_at(url)

    async def main() -> None:
        client = aioredis.Redis.from_url(url)
        runner = Runner(Settings(redis_url=url), client, None, ApiMetrics())  # type: ignore[arg-type]
        plan, payload = _gone_plan()
        try:
            await runner._send(plan, payload)  # alive: the message lands
            assert redis.Redis.from_url(url).llen(plan.routes[0].queue) == 1
            proc.stop()
            await _send_fails_fast(runner, plan, payload)
        finally:
            await runner.aclose()
            await client.aclose()

    try:
        asyncio.run(main())
    finally:
        proc.stop()
        celery_at(redis_url)


@pytest.mark.parametrize("transport", ["tasks.broker:Transport", "redis"])
def test_deferred_publishes_record_the_writes_and_send_nothing(
    redis_url: str, fresh_db: str, transport: str
) -> None:
    """tasks.broker.deferred_publishes: inside the block a chain's send reaches Redis not
    at all, and the recorded writes, sent later, put the same message on the queue and
    the task-sent event on its channel. Kombu's own transport (for rediss://, sentinel://)
    ignores the block and sends at once."""
    r = redis.Redis.from_url(fresh_db)
    celery_at(fresh_db)
    app.conf.broker_transport = transport
    try:
        plan = Plan(steps=[("generate", Route("generate", "w-deferred", {}))])
        q = plan.routes[0].queue
        declare_queues([q])
        payload = StagePayload(request_id="cmpl-deferred", model="m",
                                  prompt_token_ids=[7, 8, 9], sampling={}, created=0.0)  # fmt: skip
        events = r.pubsub()
        events.psubscribe(celery_events(fresh_db))
        assert events.get_message(timeout=1)["type"] == "psubscribe"
        with deferred_publishes() as writes:
            build_chain(plan, payload).apply_async()
        if transport == "redis":
            assert writes == [] and r.llen(q) == 1
        else:
            assert [w[0] for w in writes] == ["LPUSH", "PUBLISH"]
            assert writes[0][1] == q
            assert r.llen(q) == 0  # nothing sent yet
            pipe = r.pipeline(transaction=False)
            for w in writes:
                pipe.execute_command(*w)
            pipe.execute()
        msg = json.loads(r.lpop(q))
        assert msg["headers"]["id"] == "cmpl-deferred"
        assert json.loads(base64.b64decode(msg["body"]))[0][0]["prompt_token_ids"] == [7, 8, 9]
        event = events.get_message(timeout=2)
        assert event is not None and event["channel"].endswith(b"task.sent")
        body = json.loads(base64.b64decode(json.loads(event["data"])["body"]))
        assert body["type"] == "task-sent" and body["uuid"] == "cmpl-deferred"
        events.close()
    finally:
        celery_at(redis_url)
        r.flushdb()


def test_the_broker_channel_keeps_one_redis_client(fresh_db: str) -> None:
    """tasks.broker: publishes and acks reuse the channel's client (kombu's own transport
    builds a new one per call); messages still land, and a closed channel lets it go."""
    celery_at(fresh_db)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        assert isinstance(channel, Channel)
        with channel.conn_or_acquire() as a, channel.conn_or_acquire() as b:
            assert a is b
        q = "generate.w-one-client"
        declare_queues([q])
        _publish(conn, q, range(3))
        assert redis.Redis.from_url(fresh_db).llen(q) == 3
        channel.close()
        assert channel._sync_client is None


def test_a_worker_batches_its_unacked_bookkeeping_and_writes_it_before_closing(
    redis_url: str,
    fresh_db: str,
) -> None:
    """tasks.broker.QoS on a worker's event loop: a message received is handed on before
    its record reaches the unacked hash (written when the loop turn ends); an ack frees
    its prefetch slot at once but leaves the message in the hash until the batch is
    written (ACK_FLUSH_S), one transaction for everything pending; closing the channel
    writes what is held back. Without an event loop both are written at once."""
    r = redis.Redis.from_url(fresh_db)
    celery_at(fresh_db)
    q = "generate.w-acks"
    declare_queues([q])
    try:
        with app.connection_for_write() as conn:
            _publish(conn, q, range(6))
            channel = conn.channel()
            consumer_q = queue(q)(channel)
            msgs = [consumer_q.get(no_ack=False) for _ in range(5)]
            assert r.hlen("unacked") == 5  # no event loop: recorded at once, as kombu does
            qos = channel.qos
            qos.prefetch_count = 4
            assert not qos.can_consume()  # 5 unacked
            msgs[0].ack()  # no event loop: written at once
            assert r.hlen("unacked") == 4

            hub = FakeHub()
            conn.transport.conveyor_hub = hub
            msgs.append(consumer_q.get(no_ack=False))  # received on the loop
            assert r.hlen("unacked") == 4 and len(hub.soon) == 1  # recorded after the turn
            msgs[1].ack()
            msgs[2].ack()
            assert r.hlen("unacked") == 4  # held back ...
            assert qos.can_consume()  # ... but their prefetch slots are free (3 unacked)
            assert len(hub.timers) == 1 and hub.timers[0][0] == ACK_FLUSH_S
            hub.soon[0]()  # the turn ends: the record and both acks, one transaction
            assert r.hlen("unacked") == 3 and r.zcard("unacked_index") == 3
            hub.timers[0][1]()  # the ack timer finds nothing left
            assert r.hlen("unacked") == 3

            msgs[3].ack()
            channel.close()  # the held-back ack is written; the unacked two are restored
            assert r.hlen("unacked") == 0
            left = sorted(_n(m) for m in r.lrange(q, 0, -1))
            assert left == [4, 5]
    finally:
        celery_at(redis_url)
        r.flushdb()


def _publish(conn: object, q: str, ns: range) -> None:
    """Messages ``{"n": n}`` for each n of ``ns``, onto queue ``q`` by its exchange."""
    producer = conn.Producer()  # type: ignore[attr-defined]
    for n in ns:
        producer.publish({"n": n}, exchange=q, routing_key=q, serializer="json")


def _n(raw: bytes) -> int:
    return json.loads(base64.b64decode(json.loads(raw)["body"]))["n"]


@pytest.mark.parametrize("many", [True, False])
def test_a_consumer_takes_a_burst_of_messages_in_one_round_trip(
    redis_url: str, tmp_path: Path, many: bool
) -> None:
    """tasks.broker.Channel: a consumer waiting on its queues takes every message waiting
    in one of them, up to its prefetch credit, with one BLMPOP (Redis >= 7), oldest first;
    the rest wait for the credit an ack gives back. Where BLMPOP is not to be had (set
    off here) it takes one per BRPOP, as kombu does. A message whose delivery raises
    puts those behind it back in the queue, in order."""
    proc, url = start_redis(tmp_path)  # its own: the test counts the server's commands
    if many:
        with stop_on_error(proc):
            needs_redis(url, 7, "BLMPOP")
    celery_at(url)
    r = redis.Redis.from_url(url)
    q = "generate.w-burst"
    declare_queues([q])
    try:
        with app.connection_for_write() as conn:
            _publish(conn, q, range(5))
            channel = conn.channel()
            channel._multi_pop = None if many else False
            channel.basic_qos(0, 3, False)
            got: list = []
            fail_on: set[int] = set()

            def on_message(body: dict, message: object) -> None:
                got.append((body["n"], message))
                if body["n"] in fail_on:
                    raise RuntimeError("delivery failed")

            consumer = Consumer(channel, [queue(q)], callbacks=[on_message], accept=["json"])
            consumer.consume()
            r.config_resetstat()
            conn.drain_events(timeout=2)
            if many:  # one round trip, as much as the credit allows
                assert [n for n, _ in got] == [0, 1, 2]
                assert _calls(r, "blmpop") == 1 and _calls(r, "brpop") == 0
            else:
                while len(got) < 3:
                    conn.drain_events(timeout=2)
                assert [n for n, _ in got] == [0, 1, 2] and _calls(r, "brpop") == 3
            assert [_n(m) for m in reversed(r.lrange(q, 0, -1))] == [3, 4]
            assert not channel.qos.can_consume()
            got[0][1].ack()  # one slot back: one more message
            conn.drain_events(timeout=2)
            assert [n for n, _ in got] == [0, 1, 2, 3]

            for _, m in got[1:]:
                m.ack()
            _publish(conn, q, range(5, 9))
            fail_on.add(5)
            with pytest.raises(RuntimeError):
                while True:
                    conn.drain_events(timeout=2)
            # 4 was taken with 5 (or before it, one at a time); 6..8 wait in order
            assert [n for n, _ in got][4:] == [4, 5]
            assert [_n(m) for m in reversed(r.lrange(q, 0, -1))] == [6, 7, 8]
    finally:
        proc.stop()
        celery_at(redis_url)


def _calls(r: redis.Redis, command: str) -> int:
    return r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)
