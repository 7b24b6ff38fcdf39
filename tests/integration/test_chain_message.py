"""What the API puts on the broker for a request (real redis-server): the payload whole,
and an argument summary for events, Flower and logs instead of a repr of every token id."""

from __future__ import annotations

import base64
import json
import time

import pytest
import redis
import redis.asyncio as aioredis

from api.errors import OpenAIError
from api.metrics import ApiMetrics
from api.runner import Runner
from tasks.app import app, declare_queues
from tasks.broker import Channel
from tasks.payloads import GeneratePayload
from tasks.pipeline import Plan, build_chain
from tasks.router import Route
from tasks.settings import Settings
from tests.integration.conftest import celery_at, free_port, redis_db


@pytest.mark.parametrize("steps", [["generate"], ["prefill", "decode"]])
def test_the_message_carries_the_payload_and_a_short_argsrepr(
    redis_url: str, steps: list[str]
) -> None:
    url = redis_db(redis_url, 14)
    r = redis.Redis.from_url(url)
    r.flushdb()
    celery_at(url)
    pools = {"generate": "generate", "prefill": "prefill", "decode": "decode"}
    plan = Plan(steps=[(n, Route(pools[n], f"w-{n}", {})) for n in steps])
    declare_queues([route.queue for route in plan.routes])
    ids = list(range(5, 405))
    payload = GeneratePayload(request_id="cmpl-test", model="m", prompt_token_ids=ids,
                              sampling={}, created=0.0)  # fmt: skip
    build_chain(plan, payload).apply_async()
    raw = r.lpop(plan.routes[0].queue)
    assert raw is not None
    msg = json.loads(raw)
    headers = msg["headers"]
    assert headers["id"] == "cmpl-test" and headers["task"] == f"conveyor.{steps[0]}"
    assert headers["argsrepr"] == "(cmpl-test: 400 prompt tokens)"
    assert "5, 6, 7" not in json.dumps(headers)  # no repr of the token ids beside the body
    args, kwargs, embed = json.loads(base64.b64decode(msg["body"]))
    assert args[0]["prompt_token_ids"] == ids
    for link in embed.get("chain") or []:  # the next stage, sent later by the worker
        assert link["options"]["argsrepr"] == "(cmpl-test: 400 prompt tokens)"
    assert len(embed.get("chain") or []) == len(steps) - 1
    r.flushdb()


def test_a_broker_that_is_gone_fails_the_send_fast_with_503(redis_url: str) -> None:
    """The API sends on its event loop: a dead broker must give a clear 503 quickly, not a
    500 or a loop stalled on Celery's default publish retries."""
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    celery_at(dead)
    try:
        client = aioredis.Redis.from_url(dead)  # never used: the router is not asked
        runner = Runner(Settings(redis_url=dead), client, None, ApiMetrics())  # type: ignore[arg-type]
        plan = Plan(steps=[("generate", Route("generate", "w-gone", {}))])
        payload = GeneratePayload(request_id="cmpl-gone", model="m", prompt_token_ids=[1, 2],
                                  sampling={}, created=0.0)  # fmt: skip
        for declared in (False, True):  # the queue declared before, or declared now
            if declared:
                runner._declared.add(plan.routes[0].queue)
            t = time.perf_counter()
            with pytest.raises(OpenAIError) as info:
                runner._send(plan, payload)
            took = time.perf_counter() - t
            assert info.value.status == 503 and info.value.code == "broker_unavailable"
            assert took < 1.0, f"the send held the caller {took:.2f}s"
    finally:
        celery_at(redis_url)


def test_the_broker_channel_keeps_one_redis_client(redis_url: str) -> None:
    """tasks.broker: publishes and acks reuse the channel's client (kombu's own transport
    builds a new one per call); messages still land, and a closed channel lets it go."""
    url = redis_db(redis_url, 13)
    celery_at(url)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        assert isinstance(channel, Channel)
        with channel.conn_or_acquire() as a, channel.conn_or_acquire() as b:
            assert a is b
        q = "generate.w-one-client"
        declare_queues([q])
        producer = conn.Producer()
        for i in range(3):
            producer.publish({"n": i}, exchange=q, routing_key=q, serializer="json")
        assert redis.Redis.from_url(url).llen(q) == 3
        channel.close()
        assert channel._sync_client is None
    redis.Redis.from_url(url).flushdb()
