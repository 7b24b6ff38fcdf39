"""A burst of streams larger than the open-files soft limit the API was started with (real
redis-server, a real mock-engine worker, real HTTP, one httpx client as a user's load
generator opens them): the API raises its soft limit to the hard one, and every stream
completes. Left at the soft limit, the burst ran out of descriptors: 503s, and connection
resets where uvloop closes the connections it cannot accept (bench/stream_burst.py)."""

from __future__ import annotations

import asyncio
import json
import resource
import shutil
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import (
    BIN,
    base_env,
    free_port,
    spawn,
    start_redis,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration

SOFT = 256  # the API's soft limit at start
STREAMS = 300  # more sockets than that
TOKENS = 8


def _soft_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            value = line.split()[3]
            return resource.RLIM_INFINITY if value == "unlimited" else int(value)
    raise AssertionError("no open-files line")


async def _burst(url: str, model: str) -> list[int | BaseException]:
    body = {"model": model, "messages": [{"role": "user", "content": "a burst"}],
            "max_tokens": TOKENS, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    async def one(client: httpx.AsyncClient) -> int:
        tokens = -1
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, (r.status_code, await r.aread())
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return tokens
                if line.startswith("data: ") and '"usage":{' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        raise AssertionError("the stream ended without [DONE]")

    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        return await asyncio.gather(*(one(client) for _ in range(STREAMS)),
                                    return_exceptions=True)  # fmt: skip


def test_a_burst_past_the_soft_open_files_limit_completes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("needs prlimit (util-linux) to start the API with a low soft limit")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4 * STREAMS:
        pytest.skip(f"the hard open-files limit ({hard}) leaves no room above {SOFT}")
    if soft < 3 * STREAMS:  # the client's sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * STREAMS), hard))
    rproc, rurl = start_redis(tmp_path)
    env = base_env(rurl, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_WORKER_CONCURRENCY=str(STREAMS + 10),
                   CONVEYOR_MAX_NUM_SEQS=str(STREAMS + 10), CONVEYOR_NUM_KV_BLOCKS="4096",
                   CONVEYOR_WORKER_MAX_REQUESTS="0",
                   CONVEYOR_MOCK__DECODE_STEP_MS="50")  # fmt: skip
    procs = [rproc]
    try:
        with stop_on_error(*procs):
            procs.append(start_worker("nofile-w0", "generate", "nofile-w0", env, tmp_path))
            port = free_port()
            api = spawn("nofile-api", [prlimit, f"--nofile={SOFT}:{hard}", "--",
                                       str(BIN / "conveyor"), "api", "--port", str(port)],
                        env, tmp_path)  # fmt: skip
            procs.append(api)
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: httpx.get(f"{url}/health", timeout=1).json()["workers"]
                     ["generate"] == 1, 60, "the API and a live worker", procs)  # fmt: skip
        # prlimit execs the API: the same process, started at SOFT, raised its own limit
        assert _soft_limit(api.popen.pid) == hard
        got = asyncio.run(_burst(url, tiny_model_dir.name))
        failed = [r for r in got if isinstance(r, BaseException)]
        assert not failed, f"{len(failed)} of {STREAMS} streams failed, first: {failed[0]!r}"
        assert got == [TOKENS] * STREAMS
    finally:
        for p in reversed(procs):
            p.stop()
