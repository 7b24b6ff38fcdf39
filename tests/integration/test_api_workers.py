"""Several API processes on one port (``conveyor api --workers 2``, real processes, the
official openai client): requests land on both processes, each relays its own streams
(a request id carries its process's hub tag), ``/metrics`` from either sums both
processes' counters, and with per-request logs off (the default) neither the API nor the
worker writes a line per request."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.conftest import (
    BIN,
    base_env,
    free_port,
    spawn,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration


def _requests_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(
        r'^conveyor_requests_total\{endpoint="/v1/chat/completions",status="200"\} (\S+)$',
        text, re.M))  # fmt: skip


def test_two_api_processes_share_the_port_and_the_metrics(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_MOCK__SPEEDUP="50", CONVEYOR_LOG_REQUESTS="false")  # fmt: skip
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    worker = start_worker("apiw-worker", "generate", "apiw-w", env, tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with stop_on_error(worker):
        api = spawn("apiw-api", [str(BIN / "conveyor"), "api", "--port", str(port),
                                 "--workers", "2"], env, tmp_path)  # fmt: skip
    try:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 90,
                 "the API and a live worker", [worker, api])  # fmt: skip

        async def batch() -> list[str]:
            # a client (connection) per request: the two processes accept in turn
            async def one(i: int) -> str:
                async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x",
                                              max_retries=0) as c:  # fmt: skip
                    stream = await c.chat.completions.create(
                        model=tiny_model_dir.name, max_tokens=6, stream=True,
                        messages=[{"role": "user", "content": f"hello {i}"}],
                        stream_options={"include_usage": True},
                    )  # fmt: skip
                    rid, usage = "", None
                    async for chunk in stream:
                        rid = chunk.id
                        usage = chunk.usage or usage
                    assert usage is not None and usage.completion_tokens == 6
                    return rid

            return await asyncio.gather(*(one(i) for i in range(16)))

        ids: list[str] = []
        tags: set[str] = set()
        for _ in range(6):  # until both processes have served some
            ids += asyncio.run(batch())
            tags = {rid.split("-", 1)[1][:8] for rid in ids}
            if len(tags) >= 2:
                break
        assert len(tags) == 2, f"one process served all {len(ids)} requests: {tags}"
        # either process answers /metrics with both processes' counts
        wait_for(lambda: _requests_total(url) == len(ids), 10, "the summed request count")
        assert all(_requests_total(url) == len(ids) for _ in range(6))
        # and vLLM's names for the same summed counters
        text = httpx.get(f"{url}/metrics", timeout=5).text
        gen = re.findall(r'^vllm:generation_tokens_total\{model_name="[^"]+"\} (\S+)$', text, re.M)
        assert [float(v) for v in gen] == [6.0 * len(ids)], gen
        # per-request lines are off by default: none in the API's or the worker's log
        assert not re.search(r"\] sent generate", api.log.read_text())
        worker_log = worker.log.read_text()
        assert "output tokens in" not in worker_log and "Task conveyor.generate" not in worker_log
        assert "2 processes on port" in api.log.read_text()
    finally:
        api.stop()
        worker.stop()
