"""Priorities and tenant budgets with real processes and the official openai client.

* Under overload (one mock worker of two sequences, capped at four requests, the rest
  waiting in the API), a class of high-priority requests (vLLM's ``priority``: lower
  first) sent after a class of low-priority ones gets its first tokens in at most half
  the low class's time (TTFT p50), and every request of both completes.
* A tenant's token budget per minute is kept in Redis: once one API process has counted
  a key's minute spent, another API process refuses that key with 429
  ``rate_limit_exceeded`` and ``Retry-After``, while another key is served; /metrics
  counts each key's tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import statistics
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.conftest import (
    BIN,
    Proc,
    base_env,
    free_port,
    spawn,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration


def test_the_high_priority_class_gets_its_first_tokens_first(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_ENGINE="mock", CONVEYOR_MAX_NUM_SEQS="2",
                   CONVEYOR_WORKER_MAX_REQUESTS="4", CONVEYOR_ADMISSION_WAIT_S="60",
                   CONVEYOR_MOCK__DECODE_STEP_MS="8", CONVEYOR_MOCK__SPEEDUP="1")  # fmt: skip
    worker = start_worker("prio-worker", "generate", "prio-w", env, tmp_path)
    with stop_on_error(worker):
        api, url = start_api("prio-api", env, tmp_path)
    try:
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "a live worker",
                 [worker, api])  # fmt: skip

        async def one(c: openai.AsyncOpenAI, priority: int, i: int) -> tuple[int, float, int]:
            t0 = time.perf_counter()
            stream = await c.completions.create(
                model=tiny_model_dir.name, prompt=f"request {i}", max_tokens=16, stream=True,
                extra_body={"priority": priority, "ignore_eos": True},
                stream_options={"include_usage": True},
            )  # fmt: skip
            ttft, tokens = 0.0, 0
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text and not ttft:
                    ttft = time.perf_counter() - t0
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return priority, ttft, tokens

        async def burst() -> list[tuple[int, float, int]]:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                          timeout=120) as c:  # fmt: skip
                low = [asyncio.create_task(one(c, 10, i)) for i in range(16)]
                await asyncio.sleep(0.05)  # the low class is queued first
                high = [asyncio.create_task(one(c, 0, 100 + i)) for i in range(8)]
                return await asyncio.gather(*low, *high)

        results = asyncio.run(burst())
        assert all(tokens == 16 for _, _, tokens in results), results
        low = statistics.median(t for p, t, _ in results if p == 10)
        high = statistics.median(t for p, t, _ in results if p == 0)
        print(f"TTFT p50: high {high * 1000:.0f} ms, low {low * 1000:.0f} ms")
        assert high <= 0.5 * low, (high, low)
    finally:
        api.stop()
        worker.stop()


def _tenant_tokens(url: str, key: str, kind: str) -> float:
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    m = re.search(rf'^conveyor_tenant_tokens_total\{{kind="{kind}",tenant="key:{digest}"\}} '
                  r"(\S+)$", text, re.M)  # fmt: skip
    return float(m[1]) if m else 0.0


def test_a_tenant_s_minute_is_counted_across_api_processes(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-alice\nsk-bob\n")
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_MOCK__SPEEDUP="50", CONVEYOR_API_KEYS=f"@{keys}",
                   CONVEYOR_TENANT_TOKENS_PER_MIN="60")  # fmt: skip
    auth = {"Authorization": "Bearer sk-alice"}

    def api(name: str) -> tuple[Proc, str]:  # start_api's check needs no key
        port = free_port()
        p = spawn(name, [str(BIN / "conveyor"), "api", "--port", str(port)], env, tmp_path)
        return p, f"http://127.0.0.1:{port}"

    worker = start_worker("tenant-worker", "generate", "tenant-w", env, tmp_path)
    with stop_on_error(worker):
        api1, url1 = api("tenant-api1")
    with stop_on_error(worker, api1):
        api2, url2 = api("tenant-api2")
    try:
        for u in (url1, url2):
            wait_for(lambda u=u: httpx.get(f"{u}/health", headers=auth).status_code == 200,
                     90, "the API and a live worker", [worker, api1, api2])  # fmt: skip
        alice1 = openai.OpenAI(base_url=f"{url1}/v1", api_key="sk-alice", max_retries=0)
        alice2 = openai.OpenAI(base_url=f"{url2}/v1", api_key="sk-alice", max_retries=0)
        bob2 = openai.OpenAI(base_url=f"{url2}/v1", api_key="sk-bob", max_retries=0)
        if time.time() % 60 > 40:  # the budget's minute must not turn over mid-test
            time.sleep(61 - time.time() % 60)
        minute = int(time.time() // 60)
        used = 0
        served = 0
        for _ in range(20):  # through the first process until alice's minute is spent
            try:
                out = alice1.completions.create(model=tiny_model_dir.name, prompt="hello there",
                                                max_tokens=8)  # fmt: skip
            except openai.RateLimitError:
                break
            used += out.usage.prompt_tokens + out.usage.completion_tokens
            served += 1
        else:
            pytest.fail("alice's budget of 60 tokens a minute never ran out")
        assert served >= 1 and used >= 60 - 20, (served, used)
        assert int(time.time() // 60) == minute, "the test ran past its minute (too slow)"
        # the second process counts the same minute: alice is refused there too
        with pytest.raises(openai.RateLimitError) as refused:
            alice2.completions.create(model=tiny_model_dir.name, prompt="hi", max_tokens=2)
        r = refused.value.response
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "tokens"
        assert "60 tokens per minute" in err["message"]
        # bob's minute is his own
        assert bob2.completions.create(model=tiny_model_dir.name, prompt="hi",
                                       max_tokens=2).usage.completion_tokens == 2  # fmt: skip
        # /metrics counts each key's tokens (alice's all on the first process)
        wait_for(lambda: _tenant_tokens(url1, "sk-alice", "completion") == 8 * served, 10,
                 "alice's completion tokens counted")  # fmt: skip
        assert _tenant_tokens(url1, "sk-alice", "prompt") + 8 * served == used
        assert _tenant_tokens(url2, "sk-bob", "completion") == 2
    finally:
        for p in (api2, api1, worker):
            p.stop()
