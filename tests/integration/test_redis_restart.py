"""Redis goes away for 5 s and comes back on the same port, with and without persistence
(real redis-server, real workers and API, the official openai client): streams in flight
complete (finish reason ``length``: the API starts each again from what its client has,
its frames published meanwhile being lost), never hang; /health says 503 while Redis is
away; a request succeeds within 15 s of its return (1 to 3 s on a quiet machine: Celery's
reconnect backoff and the stream hub's), while those streams go on, and the next 20 after
them, with no process restarted; KV-aware routing finds the prefix cached before the outage
on its worker again, and sends a prefix first seen after it to the worker that cached
it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tasks.supervisor import redis_server_binary
from tests.integration.conftest import (
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

RECOVERY_S = 15  # Redis back -> a request answered, at most (a loaded CI host included)
PREFIX = "The cache holds blocks of sixteen tokens; a prefix that is shared is computed once. " * 3


def _redis(d: Path, port: int, persist: bool) -> Proc:
    argv = [redis_server_binary() or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
            "--dir", str(d), "--save", "",
            *(["--appendonly", "yes", "--appendfsync", "always"] if persist else
              ["--appendonly", "no"])]  # fmt: skip
    p = spawn(f"redis-{time.monotonic_ns()}", argv, dict(os.environ), d)
    wait_for(lambda: redis.Redis(port=port).ping(), 10, "redis-server", [p])
    return p


async def _stream(url: str, model: str, prompt: str, n: int) -> tuple[str, str, str | None]:
    """(text, finish reason, error) of one streamed completion; an error event ends it with
    its message. A stream that hangs (the client's timeout) or drops raises: it had no
    terminal frame."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    text: list[str] = []
    reason = ""
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=n, stream=True, extra_body={"ignore_eos": True}
        )
        async for chunk in stream:
            text += [c.text for c in chunk.choices]
            reason = next((c.finish_reason for c in chunk.choices if c.finish_reason), reason)
        return "".join(text), reason, None
    except openai.APIConnectionError:  # a timeout, a reset: not an error event
        raise
    except openai.APIError as e:
        return "".join(text), reason, str(e)
    finally:
        await client.close()


def _first_success(c: openai.OpenAI, model: str, deadline: float) -> float:
    """When the first of a run of tries (until ``deadline``) succeeded; inf if none did."""
    while time.monotonic() < deadline:
        try:
            out = c.completions.create(model=model, prompt="back?", max_tokens=3, timeout=10)
            assert out.usage.completion_tokens == 3
            return time.monotonic()
        except openai.APIError:
            time.sleep(0.2)
    return float("inf")


def _index_blocks(url: str) -> float:
    """The API's router: blocks in its local KV index of the generate pool."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith('conveyor_router_index_blocks{pool="generate"}'):
            return float(line.split()[-1])
    return 0.0


def _cached(c: openai.OpenAI, model: str, prompt: str) -> int:
    out = c.completions.create(model=model, prompt=prompt, max_tokens=2)
    return out.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("persist", [False, True])
def test_everything_survives_a_redis_restart(
    tiny_model_dir: Path, tmp_path: Path, persist: bool
) -> None:
    port = free_port()
    url_r = f"redis://127.0.0.1:{port}/0"
    rd = _redis(tmp_path, port, persist)
    env = base_env(url_r, tiny_model_dir, CONVEYOR_ENGINE="mock")  # 5 ms a step
    workers = [start_worker(f"rr-w{i}", "generate", f"rr-w{i}", env, tmp_path) for i in range(2)]
    procs = [*workers]
    try:
        with stop_on_error(*workers):
            api, url = start_api("rr-api", env, tmp_path)
        procs.append(api)
        wait_for(lambda: httpx.get(f"{url}/health").json()["workers"]["generate"] == 2, 60,
                 "2 workers", procs)  # fmt: skip
        model = tiny_model_dir.name
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        first = c.completions.create(model=model, prompt=PREFIX + "one", max_tokens=4)
        assert first.usage.completion_tokens == 4

        async def outage() -> tuple[list[tuple[str, str, str | None]], float]:
            # 800 tokens (~4 s): the streams and their copies started again after the
            # outage leave the prefix cached before it in the workers' pools (512 blocks)
            streams = [asyncio.ensure_future(_stream(url, model, f"long {i}", 800))
                       for i in range(4)]  # fmt: skip
            await asyncio.sleep(1.0)  # they are streaming
            rd.stop(signal.SIGKILL)
            await asyncio.sleep(1.0)
            async with httpx.AsyncClient() as h:  # Redis away: unhealthy, said at once
                health = await h.get(f"{url}/health", timeout=5)
            assert health.status_code == 503, health.text
            await asyncio.sleep(4.0)  # away for 5 s, then back on the same port
            back = time.monotonic()
            await asyncio.to_thread(_redis, tmp_path, port, persist)
            first_ok = await asyncio.to_thread(_first_success, c, model, back + RECOVERY_S)
            return await asyncio.wait_for(asyncio.gather(*streams), 120), first_ok - back

        loop = asyncio.new_event_loop()
        try:
            streams, recovery_s = loop.run_until_complete(outage())
        finally:
            loop.close()
        assert recovery_s <= RECOVERY_S, f"no request succeeded in {RECOVERY_S} s of Redis's return"
        # every stream in flight ended whole, with no error event
        for text, reason, err in streams:
            assert err is None and reason == "length", (text[-80:], reason, err)
        for i in range(20):  # Redis back and serving: none fails
            out = c.completions.create(model=model, prompt=f"after {i}", max_tokens=3)
            assert out.usage.completion_tokens == 3
        assert all(p.popen.poll() is None for p in procs), "a process died or was restarted"
        # KV routing hits come back: the router's index is rebuilt from the workers'
        # snapshots (the prefix cached before the outage is found on the worker holding it:
        # one request in two would miss it routed blind), and follows their new events (a
        # new prefix: every request after the first lands where it was cached)
        wait_for(lambda: _index_blocks(url) > 0, 30, "the router's index rebuilt", procs)
        old_hits = [_cached(c, model, PREFIX + f"again {i}") for i in range(6)]
        assert min(old_hits) > 0, old_hits
        fresh = "A prefix first seen after the restart, long enough for a few blocks. " * 3
        held = _index_blocks(url)
        new_hits = [_cached(c, model, fresh + "turn 0")]
        # its blocks reach the index through the pool's event stream, restarted with Redis
        wait_for(lambda: _index_blocks(url) > held, 15, "the new prefix's KV events", procs)
        new_hits += [_cached(c, model, fresh + f"turn {i}") for i in range(1, 6)]
        assert new_hits[0] == 0 and min(new_hits[1:]) > 0, new_hits
    finally:
        for p in procs:
            p.stop()
        subprocess.run(["pkill", "-f", f"--port {port}"], check=False)
