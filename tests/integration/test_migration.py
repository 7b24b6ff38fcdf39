"""Migration (real redis-server, real worker processes, real HTTP, the official openai
client): 16 streams run on two workers of a pool; one worker is SIGKILLed mid-stream (its
Celery process, whose engine process then says it died; or only its engine process, after
which the worker exits). Every stream completes, token for token the output it gives
uninterrupted (greedy, and seeded sampling), with exact usage and the same logprobs; the
streams the dead worker held moved on to the other worker (counted), whose blocks are all
free afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from cluster.keys import worker_key
from tests.integration.conftest import (
    Proc,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration

MAX_TOKENS = 160
PROMPTS = [f"Stream {i}: " + " ".join(["tell", "me", "a", "story", "about"][: 1 + i % 5]) +
           f" number {i * 37 % 101}" for i in range(16)]  # fmt: skip


def _sampling(i: int) -> dict:
    """Greedy for most; two seeded samplers (their per-index seeds must carry over); the
    even ones with logprobs (the new worker's must go on as the lost one's would)."""
    kw: dict = {"logprobs": 2} if i % 2 == 0 else {}
    if i in (3, 11):
        return {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i, **kw}
    return {"temperature": 0, **kw}


def _lps(lp: Any) -> list:
    """(token, logprob, top tokens) per token of a choice's logprobs (none: [])."""
    if lp is None:
        return []
    rows = zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
    return [(t, x, list(top)) for t, x, top in rows]


async def _stream(url: str, model: str, i: int, progress: list[int]) -> tuple[str, dict, str, list]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        stream = await client.completions.create(
            model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            **_sampling(i),
        )  # fmt: skip
        text, usage, reason, lps = [], None, None, []
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
                lps += _lps(chunk.choices[0].logprobs)
                progress[i] += 1
            usage = chunk.usage or usage
        assert usage is not None
        return "".join(text), usage.model_dump(), reason or "", lps
    finally:
        await client.close()


def _once(url: str, model: str, i: int) -> tuple[str, dict, list]:
    out = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).completions.create(
        model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True},
        **_sampling(i),
    )  # fmt: skip
    return out.choices[0].text, out.usage.model_dump(), _lps(out.choices[0].logprobs)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize(("mode", "kill"), [("agg", "worker"), ("agg", "engine"),
                                            ("agg", "hang"), ("ep-d", "worker")])  # fmt: skip
def test_streams_of_a_killed_worker_finish_on_the_other_one(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path, mode: str, kill: str
) -> None:
    """``hang``: the engine process is stopped (SIGSTOP), not killed: its worker's
    watchdog finds it silent past CONVEYOR_ENGINE_HANG_TIMEOUT_S (3 s here), kills it,
    and the worker ends as on an engine death."""
    r = redis.Redis.from_url(fresh_db)
    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_MODE=mode, CONVEYOR_KV_TRANSFER="redis",
                   CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0",
                   CONVEYOR_ENGINE_HANG_TIMEOUT_S="3" if kill == "hang" else "60")  # fmt: skip
    pool = "generate" if mode == "agg" else "decode"
    workers = [start_worker(f"mig-{pool}{i}", pool, f"mig-{pool}{i}", env, tmp_path)
               for i in range(2)]  # fmt: skip
    if mode != "agg":
        workers.append(start_worker("mig-prefill", "prefill", "mig-prefill", env, tmp_path))
    procs: list[Proc] = list(workers)
    model = tiny_model_dir.name
    try:
        with stop_on_error(*workers):
            api, url = start_api(f"mig-api-{mode}-{kill}", env, tmp_path)
        procs.append(api)
        wait_for(lambda: httpx.get(f"{url}/health").json()["workers"][pool] == 2, 90,
                 "two workers", procs)  # fmt: skip
        want = [_once(url, model, i) for i in range(len(PROMPTS))]  # uninterrupted
        progress = [0] * len(PROMPTS)

        def reports() -> list[dict]:
            return [json.loads(r.get(worker_key(pool, f"mig-{pool}{i}")) or "{}")
                    for i in range(2)]  # fmt: skip

        async def run() -> tuple[int, list[tuple[str, dict, str, list]]]:
            tasks = [asyncio.create_task(_stream(url, model, i, progress))
                     for i in range(len(PROMPTS))]  # fmt: skip
            deadline = time.monotonic() + 60
            while min(progress) < 3:  # every stream under way, none near its end
                assert time.monotonic() < deadline, progress
                await asyncio.sleep(0.01)
            # the victim: the worker holding the most streams now (KV-aware routing may
            # have sent them all to one; its heartbeat says, every 0.5 s)
            while not any(rep.get("active") for rep in reports()):
                assert time.monotonic() < deadline, reports()
                await asyncio.sleep(0.05)
            reps = reports()
            v = max((0, 1), key=lambda i: reps[i].get("active", 0))
            target = reps[v]["engine_pid"] if kill in ("engine", "hang") else workers[v].popen.pid
            os.kill(int(target), signal.SIGSTOP if kill == "hang" else signal.SIGKILL)
            return v, await asyncio.gather(*tasks)

        v, got = asyncio.run(run())
        victim = workers[v]
        victim.popen.wait(30)  # the worker is gone (an engine killed alone takes it along)
        for i, ((text, usage, reason, lps), (want_text, want_usage, want_lps)) in enumerate(
            zip(got, want, strict=True)
        ):
            assert text == want_text, (i, text, want_text)
            # logprobs carry on across the move (the same tokens, values within 1e-3)
            assert len(lps) == len(want_lps) == (MAX_TOKENS if i % 2 == 0 else 0)
            for (t, x, top), (wt, wx, wtop) in zip(lps, want_lps, strict=True):
                assert (t, top) == (wt, wtop) and abs(x - wx) < 1e-3, (i, t, x, wx)
            assert reason == "length"
            assert usage["completion_tokens"] == MAX_TOKENS == want_usage["completion_tokens"]
            assert usage["prompt_tokens"] == want_usage["prompt_tokens"], (i, usage, want_usage)
        moved = _metric(url, f'conveyor_migrations_total{{outcome="moved",pool="{pool}"}}')
        assert 1 <= moved <= len(PROMPTS), moved
        assert _metric(url, "conveyor_requests_cancelled_total") == 0  # no client left
        survivor = f"mig-{pool}{1 - v}"
        alive = [p for p in procs if p is not victim]
        wait_for(lambda: json.loads(r.get(worker_key(pool, survivor)))["blocks_used"] == 0,
                 15, "the survivor's blocks freed", alive)  # fmt: skip
        log = api.log.read_text()
        assert "moved to " + survivor in log, log[-3000:]
        if kill == "hang":
            assert "is hung (no word from it for" in victim.log.read_text()
    finally:
        for p in procs:
            p.stop()
        r.flushdb()


def test_no_worker_left_ends_the_stream_with_worker_lost(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With the pool's only worker dead there is nowhere to move: the stream ends with a
    worker_lost error event after the text it had (never a hang)."""
    r = redis.Redis.from_url(fresh_db)
    env = base_env(fresh_db, tiny_model_dir)
    worker = start_worker("mig-lone", "generate", "mig-lone", env, tmp_path)
    procs = [worker]
    try:
        with stop_on_error(worker):
            api, url = start_api("mig-api-lone", env, tmp_path)
        procs.append(api)
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 90, "worker", procs)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(model=tiny_model_dir.name, prompt="hello",
                                           max_tokens=2000, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        n = 0
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                n += 1
                if n == 3:
                    os.kill(worker.popen.pid, signal.SIGKILL)
        assert "worker" in str(e.value) and n < 2000, (n, e.value)
        no_worker = 'conveyor_migrations_total{outcome="no_worker",pool="generate"}'
        assert _metric(url, no_worker) == 1
    finally:
        for p in procs:
            p.stop()
        r.flushdb()
