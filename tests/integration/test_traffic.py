"""The API's traffic counters in a real Redis (cluster.traffic): a flush lands in the
current bucket and a window's read sums the buckets it covers; a real API process with a
mock-engine worker counts what the official openai client sent and got."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis

from cluster.keys import traffic_key
from cluster.traffic import BUCKET_S, TTL_S, TrafficCounter, read_traffic
from tests.integration.conftest import base_env, start_api, start_worker, stop_on_error, wait_for

pytestmark = pytest.mark.integration


def test_flushes_add_up_in_their_buckets(fresh_db: str) -> None:
    c = TrafficCounter()
    now = 1_700_000_002.0  # bucket 340000000
    b = int(now // BUCKET_S)

    async def flush(at: float) -> int:
        client = aioredis.Redis.from_url(fresh_db)
        try:
            return await c.flush(client, now=at)
        finally:
            await client.aclose()

    c.started(10)
    c.first_token(0.25)
    assert asyncio.run(flush(now)) == 4  # requests, isl_sum, ttft_sum, one ttft bucket
    c.started(30)  # a second API process's flush, or this one's next second
    c.token_gap(0.05)
    c.finished(6)
    asyncio.run(flush(now + 1))
    c.started(5)
    asyncio.run(flush(now + BUCKET_S))  # the next bucket
    assert asyncio.run(flush(now + BUCKET_S)) == 0  # nothing new: nothing written
    r = redis.Redis.from_url(fresh_db)
    assert 0 < r.ttl(traffic_key(b)) <= TTL_S
    t = read_traffic(r, 5, now=now + 1)  # bucket b only (and the empty one before)
    assert (t.requests, t.finished, t.isl_sum, t.osl_sum) == (2, 1, 40, 6)
    assert (t.ttft_count, t.itl_count) == (1, 1) and list(t.per_bucket) == [b]
    assert t.span_s == pytest.approx(now + 1 - (b - 1) * BUCKET_S)
    ttft = t.ttft_quantile(0.9)
    assert ttft is not None and 0.25 / 1.21 <= ttft <= 0.25 * 1.21  # its bucket's range
    both = read_traffic(r, 10, now=now + BUCKET_S)
    assert both.requests == 3 and sorted(both.per_bucket) == [b, b + 1]
    assert read_traffic(r, 60, now=now + 3600).requests == 0  # out of the window


def test_the_api_counts_what_the_client_saw(fresh_db: str, tiny_model_dir: Path,
                                            tmp_path: Path) -> None:  # fmt: skip
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_MOCK__SPEEDUP="5")  # fmt: skip
    worker = start_worker("traffic-worker", "generate", "traffic-w", env, tmp_path)
    with stop_on_error(worker):
        api, url = start_api("traffic-api", env, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, 60,
                 "a live worker", [worker, api])  # fmt: skip
        r = redis.Redis.from_url(fresh_db)
        started = time.time()
        isl = osl = 0
        for i, n in enumerate((3, 5, 8)):
            done = client.completions.create(model=tiny_model_dir.name, prompt=f"hello {i}",
                                             max_tokens=n, temperature=0)  # fmt: skip
            assert done.usage is not None
            isl += done.usage.prompt_tokens
            osl += done.usage.completion_tokens
        stream = client.chat.completions.create(
            model=tiny_model_dir.name, messages=[{"role": "user", "content": "hi"}],
            max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        usage = [ch.usage for ch in stream if ch.usage is not None][-1]
        isl += usage.prompt_tokens
        osl += usage.completion_tokens

        def counted() -> bool:
            return read_traffic(r, time.time() - started + BUCKET_S).finished >= 4

        wait_for(counted, 10, "the counts flushed", [worker, api])
        t = read_traffic(r, time.time() - started + BUCKET_S)
        assert (t.requests, t.finished, t.ttft_count) == (4, 4, 4)
        assert (t.isl_sum, t.osl_sum) == (isl, osl)
        assert t.itl_count > 0  # the stream's frames came one gap after another
        p90 = t.ttft_quantile(0.9)
        assert p90 is not None and 0 < p90 < 30
    finally:
        api.stop()
        worker.stop()
