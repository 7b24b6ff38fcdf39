"""Flower's broker view and /metrics show every stage queue with its depth: a real disagg
deployment (prefill + decode ``conveyor worker`` processes on the reference engine, the
API), a real ``conveyor flower`` process read over its HTTP API with the credentials set
here, LLEN on the same redis-server as the reference."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from cluster.membership import live_workers
from cluster.queues import queue_lists
from tests.integration.conftest import (
    BIN,
    Proc,
    RedisDbs,
    base_env,
    free_port,
    spawn,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration

AUTH = ("ops", "s3cret")
PRE, DEC = "fq-p1", "fq-d1"
IDLE = {"prefill": 0, f"prefill.{PRE}": 0, "decode": 0, f"decode.{DEC}": 0}


@dataclass
class Deployment:
    url: str
    redis_url: str
    env: dict[str, str]
    logdir: Path
    prefill: Proc
    decode: Proc
    api: Proc
    flower: Proc
    flower_url: str
    model: str


def start_flower(name: str, env: dict[str, str], logdir: Path) -> tuple[Proc, str]:
    port = free_port()
    p = spawn(name, [str(BIN / "conveyor"), "flower", "--port", str(port)], env, logdir)
    url = f"http://127.0.0.1:{port}"
    with stop_on_error(p):
        wait_for(
            lambda: httpx.get(f"{url}/api/queues/length", auth=AUTH, timeout=2).status_code
            == 200,
            60, f"{name} up", [p],
        )  # fmt: skip
    return p, url


def flower_queues(url: str) -> dict[str, int]:
    """Flower's broker data: queue name -> messages (its HTTP API, with credentials)."""
    r = httpx.get(f"{url}/api/queues/length", auth=AUTH, timeout=10)
    r.raise_for_status()
    return {q["name"]: q["messages"] for q in r.json()["active_queues"]}


@pytest.fixture(scope="module")
def dep(
    redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    url = redis_dbs.take(__name__)
    logdir = tmp_path_factory.mktemp("flower")
    env = base_env(
        url, tiny_model_dir,
        CONVEYOR_MODE="disagg",
        CONVEYOR_KV_TRANSFER="redis",
        CONVEYOR_DISAGG_MIN_PROMPT_TOKENS="0",  # every request goes prefill -> decode
        # a decode worker held still (SIGSTOP) for a few seconds stays a live member with
        # its requests waiting, rather than being declared dead and routed around
        CONVEYOR_WORKER_TTL_S="60",
        CONVEYOR_FRAME_TIMEOUT_S="120",
        CONVEYOR_FLOWER_BASIC_AUTH=f"{AUTH[0]}:{AUTH[1]}",
    )  # fmt: skip
    pre = start_worker("fq-prefill", "prefill", PRE, env, logdir)
    # one task slot: a running request keeps every later one waiting in the queue
    dec = start_worker("fq-decode", "decode", DEC, {**env, "CONVEYOR_WORKER_CONCURRENCY": "1"},
                       logdir)  # fmt: skip
    with stop_on_error(pre, dec):
        api, api_url = start_api("fq-api", env, logdir)
    with stop_on_error(pre, dec, api):
        wait_for(
            lambda: httpx.get(f"{api_url}/health").json()["workers"]
            == {"prefill": 1, "decode": 1},
            120, "prefill and decode workers", [pre, dec, api],
        )  # fmt: skip
        fl, fl_url = start_flower("fq-flower", env, logdir)
    d = Deployment(api_url, url, env, logdir, pre, dec, api, fl, fl_url, tiny_model_dir.name)
    yield d
    for p in (fl, api, pre, dec):
        p.stop()


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _llen(r: redis.Redis, queue: str) -> int:
    return sum(r.llen(q) for q in queue_lists(queue))


# ----------------------------------------------------------------------------------------


def test_queued_requests_show_on_exactly_their_queue_then_drain(dep: Deployment) -> None:
    r = redis.Redis.from_url(dep.redis_url)
    assert flower_queues(dep.flower_url) == IDLE
    # Flower keeps its credentials: no broker data without them
    assert httpx.get(f"{dep.flower_url}/api/queues/length", timeout=10).status_code == 401

    n = 3
    client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="x", max_retries=0, timeout=180)

    def complete(i: int) -> int:
        out = client.completions.create(
            model=dep.model, prompt=[1, 40 + i, 41, 42, 43], max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return out.usage.completion_tokens

    # A long request occupies the decode worker's one task slot (concurrency 1): it takes
    # no further message while it runs. The worker is then held still (SIGSTOP), so the
    # run outlasts this test's checks on a machine of any speed: each later request is
    # prefilled, then its decode task waits in the decode worker's own queue.
    long = client.completions.create(
        model=dep.model, prompt=[1, 30, 31, 32, 33], max_tokens=1500, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(long)
    for _ in range(3):  # frame 0 from the prefill worker, then the decode worker's
        next(chunks)
    os.killpg(dep.decode.popen.pid, signal.SIGSTOP)
    pool = ThreadPoolExecutor(n)
    try:
        futures = [pool.submit(complete, i) for i in range(n)]
        queued = {**IDLE, f"decode.{DEC}": n}
        wait_for(lambda: flower_queues(dep.flower_url) == queued, 90,
                 "decode tasks waiting in Flower", [dep.prefill, dep.api, dep.flower])  # fmt: skip
        assert all(_llen(r, q) == m for q, m in queued.items())
        page = httpx.get(f"{dep.flower_url}/broker", auth=AUTH, timeout=10).text
        assert all(f"<td>{q}</td>" in page for q in queued), "Flower's broker page"

        # /metrics: per queue, per pool (shared + workers' own), per worker, as LLEN says
        m = _metrics(dep.url)
        for q in queued:
            assert m[("conveyor_queue_depth", (("queue", q),))] == _llen(r, q)
        for pool_name, wid in (("prefill", PRE), ("decode", DEC)):
            own = _llen(r, f"{pool_name}.{wid}")
            key = ("conveyor_queue_depth_worker", (("pool", pool_name), ("worker", wid)))
            assert m[key] == own
            total = m[("conveyor_queue_depth_pool", (("pool", pool_name),))]
            assert total == _llen(r, pool_name) + own
        assert m[("conveyor_queue_depth_pool", (("pool", "decode"),))] == n

        # the terminal view reads the same
        out = subprocess.run([str(BIN / "conveyor"), "queues", "--json"], env=dep.env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {
            "prefill": {"total": 0, "queues": {"prefill": 0, f"prefill.{PRE}": 0}, "live": [PRE]},
            "decode": {"total": n, "queues": {"decode": 0, f"decode.{DEC}": n}, "live": [DEC]},
        }
    finally:
        os.killpg(dep.decode.popen.pid, signal.SIGCONT)
        pool.shutdown(wait=False)
    assert sum(1 for _ in chunks) > 0  # the long request runs to its end
    assert [f.result(timeout=180) for f in futures] == [4] * n
    wait_for(lambda: flower_queues(dep.flower_url) == IDLE, 30, "queues drained in Flower")
    m = _metrics(dep.url)
    assert m[("conveyor_queue_depth_pool", (("pool", "decode"),))] == 0
    assert m[("conveyor_queue_depth_worker", (("pool", "decode"), ("worker", DEC)))] == 0


def test_a_worker_started_later_is_listed_at_once_and_its_queue_goes_when_it_leaves(
    dep: Deployment,
) -> None:
    r = redis.Redis.from_url(dep.redis_url)
    d2 = start_worker("fq-decode2", "decode", "fq-d2", dep.env, dep.logdir)
    try:
        wait_for(lambda: "fq-d2" in {w.worker_id for w in live_workers(r, "decode")}, 120,
                 "fq-d2 live in the registry", [d2])  # fmt: skip
        # Flower reads the registry per request: the first answer after the worker's first
        # heartbeat already lists its queue (well within one heartbeat period)
        assert flower_queues(dep.flower_url) == {**IDLE, "decode.fq-d2": 0}
        key = ("conveyor_queue_depth_worker", (("pool", "decode"), ("worker", "fq-d2")))
        assert _metrics(dep.url)[key] == 0
    finally:
        d2.stop()  # SIGTERM: the worker leaves its pool at once, its queue empty
    assert d2.popen.returncode == 0, d2.tail()
    assert flower_queues(dep.flower_url) == IDLE
    assert ("conveyor_queue_depth_worker", (("pool", "decode"), ("worker", "fq-d2"))) not in (
        _metrics(dep.url)
    )


def test_stock_flower_path_lists_the_queues_the_workers_report(dep: Deployment) -> None:
    """CONVEYOR_FLOWER_REGISTRY_QUEUES=false: Flower's own list, from Conveyor's app (the
    pool queues) and the workers' remote-control answers (their own queues)."""
    env = {**dep.env, "CONVEYOR_FLOWER_REGISTRY_QUEUES": "false"}
    fl, url = start_flower("fq-flower-stock", env, dep.logdir)
    try:

        def refreshed() -> dict[str, int]:
            # Flower inspects the workers at its start and when asked to refresh them
            httpx.get(f"{url}/api/workers", params={"refresh": 1}, auth=AUTH, timeout=30)
            return flower_queues(url)

        wait_for(lambda: refreshed() == IDLE, 60, "stock Flower lists the queues", [fl])
    finally:
        fl.stop()
