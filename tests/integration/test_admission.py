"""Admission control under overload (real redis-server, real mock-engine workers, two real
API processes, real HTTP): 3x the configured capacity offered at once.

Every response is either a complete stream or a refusal (503 ``server_overloaded`` /
429 ``rate_limit_exceeded``) in OpenAI's shape with ``Retry-After``; none hangs; the cap
holds across both API replicas (no more streams open at once than the workers' caps
allow); requests that wait get served in turn; refusals are counted in
``conveyor_requests_refused_total``; the APIs' memory returns to its baseline.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import (
    BIN,
    Proc,
    base_env,
    free_port,
    spawn,
    start_redis,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration

CAP = 4  # requests per worker
WORKERS = 2
CAPACITY = CAP * WORKERS
OFFERED = 3 * CAPACITY
TOKENS = 60  # x ~10 ms a step (mock engine): each accepted stream lasts ~0.6-1 s
TIMEOUT_S = 60.0


@dataclass
class Outcome:
    status: int
    retry_after: str | None = None
    error: dict | None = None
    done: bool = False  # [DONE] after a finish_reason
    tokens: int = 0
    opened: float = 0.0  # the 200 arrived
    closed: float = 0.0  # [DONE] arrived
    took: float = 0.0  # the whole call


async def _one(client: httpx.AsyncClient, url: str, model: str, key: str = "x") -> Outcome:
    body = {"model": model, "prompt": "admission", "max_tokens": TOKENS, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        out = Outcome(r.status_code, r.headers.get("retry-after"))
        if r.status_code != 200:
            out.error = (await r.aread()) and r.json().get("error")
            out.took = time.monotonic() - t0
            return out
        out.opened = time.monotonic()
        finished = False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out.done = finished
                break
            if line.startswith("data: ") and '"finish_reason":"length"' in line:
                finished = True
            if line.startswith("data: ") and '"usage":{' in line:
                out.tokens = int(re.search(r'"completion_tokens":(\d+)', line)[1])  # type: ignore[index]
        out.closed = time.monotonic()
    out.took = time.monotonic() - t0
    return out


async def _offer(urls: list[str], model: str, n: int, keys: list[str] | None = None
                 ) -> list[Outcome]:  # fmt: skip
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits, trust_env=False) as client:
        return await asyncio.wait_for(
            asyncio.gather(
                *(
                    _one(client, urls[i % len(urls)], model, keys[i % len(keys)] if keys else "x")
                    for i in range(n)
                )
            ),  # fmt: skip
            TIMEOUT_S + 30,  # none hangs
        )


def _max_open(outcomes: list[Outcome]) -> int:
    """The most streams the clients held open at one moment."""
    edges = sorted([(o.opened, 1) for o in outcomes if o.status == 200]
                   + [(o.closed, -1) for o in outcomes if o.status == 200])  # fmt: skip
    most = n = 0
    for _, d in edges:
        n += d
        most = max(most, n)
    return most


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pat = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" ([0-9.e+]+)"
    m = re.search(pat, text)
    return float(m[1]) if m else 0.0


def _settle(dep: Deployment, redis_url: str) -> None:
    """Wait until the round is over everywhere (the RSS is compared in this state): no
    request in flight or waiting in any API, every slot given back to the workers."""
    import redis

    from cluster.keys import load_key

    r = redis.Redis.from_url(redis_url)

    def idle() -> bool:
        loads = r.hgetall(load_key("generate"))
        return all(int(v) == 0 for k, v in loads.items() if k.endswith(b":reqs")) and all(
            _metric(u, "conveyor_requests_in_flight") == 0
            and _metric(u, "conveyor_admission_waiting") == 0
            for u in dep.urls
        )

    wait_for(idle, 30, "the round's requests all ended and given back", dep.apis)


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@dataclass
class Deployment:
    urls: list[str]
    apis: list[Proc]
    model: str


@pytest.fixture(scope="module")
def redis_for_admission(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    p, url = start_redis(tmp_path_factory.mktemp("admission-redis"))
    yield url
    p.stop()


def _deploy(redis_url: str, model_dir: Path, logdir: Path, apis: int = 2,
            **extra: str) -> tuple[Deployment, list[Proc]]:  # fmt: skip
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    env = base_env(redis_url, model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_MOCK__DECODE_STEP_MS="10", CONVEYOR_WORKER_MAX_REQUESTS=str(CAP),
                   **extra)  # fmt: skip
    workers = [start_worker(f"adm-w{i}", "generate", f"adm-w{i}", env, logdir)
               for i in range(WORKERS)]  # fmt: skip
    procs: list[Proc] = list(workers)
    with stop_on_error(*procs):
        urls = []
        for i in range(apis):
            port = free_port()
            procs.append(spawn(f"adm-api{i}", [str(BIN / "conveyor"), "api", "--port",
                                               str(port)], env, logdir))  # fmt: skip
            urls.append(f"http://127.0.0.1:{port}")
        wait_for(lambda: httpx.get(f"{urls[0]}/health", timeout=1).json()["workers"]
                 ["generate"] == WORKERS, 60, "live workers", procs)  # fmt: skip
        for url in urls[1:]:
            wait_for(lambda u=url: httpx.get(f"{u}/health", timeout=1).status_code == 200, 60,
                     "the other API", procs)  # fmt: skip
    return Deployment(urls, procs[WORKERS:], model_dir.name), procs


def _check_shapes(outcomes: list[Outcome]) -> None:
    for o in outcomes:
        if o.status == 200:
            assert o.done and o.tokens == TOKENS, o
            continue
        assert o.status in (429, 503), o
        assert o.retry_after is not None and int(o.retry_after) >= 1, o
        assert o.error is not None and set(o.error) == {"message", "type", "param", "code"}, o
        assert o.error["code"] == ("server_overloaded" if o.status == 503
                                   else "rate_limit_exceeded"), o  # fmt: skip


def test_three_times_capacity_is_served_or_refused_with_retry_after_and_memory_returns(
    redis_for_admission: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A short admission wait (0.3 s): of 3x capacity offered at once through two API
    replicas, the requests that find a slot run to the end and the rest get 503 with
    Retry-After within about the wait; no more streams are open at once than the caps
    allow, cluster-wide; each API counts its refusals; after five such rounds the APIs'
    RSS is back within 20% of what it was after the first."""
    dep, procs = _deploy(redis_for_admission, tiny_model_dir, tmp_path,
                         CONVEYOR_ADMISSION_WAIT_S="0.3")  # fmt: skip
    try:
        rounds = []
        baseline: list[int] = []
        for i in range(5):
            outcomes = asyncio.run(_offer(dep.urls, dep.model, OFFERED))
            rounds.append(outcomes)
            _check_shapes(outcomes)
            ok = [o for o in outcomes if o.status == 200]
            refused = [o for o in outcomes if o.status == 503]
            assert len(ok) + len(refused) == OFFERED
            assert len(ok) >= CAPACITY and refused, [o.status for o in outcomes]
            assert _max_open(outcomes) <= CAPACITY, _max_open(outcomes)
            # refused after the wait, well before an accepted stream would have ended
            assert max(o.took for o in refused) < 5.0, [o.took for o in refused]
            if i == 0:
                _settle(dep, redis_for_admission)
                baseline = [_rss_kb(p.popen.pid) for p in dep.apis]
        _settle(dep, redis_for_admission)
        after = [_rss_kb(p.popen.pid) for p in dep.apis]
        print(f"\nAPI RSS after round 1: {baseline} kB, after round 5: {after} kB")
        for b, a in zip(baseline, after, strict=True):
            assert a <= 1.2 * b, (baseline, after)
        refused_total = sum(o.status == 503 for r in rounds for o in r)
        counted = sum(_metric(u, "conveyor_requests_refused_total", reason="workers_busy")
                      for u in dep.urls)  # fmt: skip
        assert counted == refused_total
        assert sum(_metric(u, "conveyor_admission_waiting") for u in dep.urls) == 0
        # every slot was given back: nothing is counted on the workers any more
        import redis

        from cluster.keys import load_key

        loads = redis.Redis.from_url(redis_for_admission).hgetall(load_key("generate"))
        assert all(int(v) == 0 for k, v in loads.items() if k.endswith(b":reqs")), loads
    finally:
        for p in procs:
            p.stop()


def test_waiting_requests_are_served_in_turn_within_the_caps(
    redis_for_admission: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With a wait longer than the backlog takes, 3x capacity offered at once through two
    replicas all complete: the requests beyond the caps wait in the APIs (not on the
    workers' queues), and still no more than the caps run at once."""
    dep, procs = _deploy(redis_for_admission, tiny_model_dir, tmp_path,
                         CONVEYOR_ADMISSION_WAIT_S="30")  # fmt: skip
    try:
        outcomes = asyncio.run(_offer(dep.urls, dep.model, OFFERED))
        _check_shapes(outcomes)
        assert [o.status for o in outcomes] == [200] * OFFERED
        assert _max_open(outcomes) <= CAPACITY
        waited = sum(_metric(u, "conveyor_admission_wait_seconds_count") for u in dep.urls)
        assert waited >= OFFERED - CAPACITY, waited
        assert sum(_metric(u, "conveyor_requests_refused_total", reason="workers_busy")
                   for u in dep.urls) == 0  # fmt: skip
    finally:
        for p in procs:
            p.stop()


def test_a_client_over_its_own_cap_gets_429_at_once_and_others_are_served(
    redis_for_admission: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """CONVEYOR_CLIENT_MAX_REQUESTS=2 with API keys: one key's 6 concurrent requests get 2
    streams and 4 immediate 429s (with Retry-After, counted as client_limit); another
    key's 2 requests at the same time are served."""
    keys = ["sk-greedy", "sk-modest"]
    dep, procs = _deploy(redis_for_admission, tiny_model_dir, tmp_path, apis=1,
                         CONVEYOR_CLIENT_MAX_REQUESTS="2", CONVEYOR_API_KEYS=",".join(keys),
                         CONVEYOR_ADMISSION_WAIT_S="30")  # fmt: skip
    try:

        async def both() -> tuple[list[Outcome], list[Outcome]]:
            greedy = _offer(dep.urls, dep.model, 6, ["sk-greedy"])
            modest = _offer(dep.urls, dep.model, 2, ["sk-modest"])
            return await asyncio.gather(greedy, modest)

        greedy, modest = asyncio.run(both())
        _check_shapes(greedy + modest)
        assert sorted(o.status for o in greedy) == [200, 200, 429, 429, 429, 429]
        assert all(o.took < 2.0 for o in greedy if o.status == 429), greedy
        assert [o.status for o in modest] == [200, 200]
        url = dep.urls[0]
        assert _metric(url, "conveyor_requests_refused_total", reason="client_limit") == 4
        # the slots are given back when the streams end: the same key is served again
        again = asyncio.run(_offer(dep.urls, dep.model, 2, ["sk-greedy"]))
        assert [o.status for o in again] == [200, 200]
    finally:
        for p in procs:
            p.stop()
