"""KV-aware routing end to end: real workers publish KV events, the API routes by them.

Mock-engine workers (real scheduler, block pool and events; simulated time) let several
workers run cheaply; the reference-engine cluster checks that a routed prefix hit gives
the same tokens as a cold run.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from cluster.index import KVIndex
from cluster.keys import load_key, worker_key
from kvbm.protocol import block_hashes, model_namespace
from tests.integration.conftest import (
    Cluster,
    Proc,
    RedisDbs,
    async_wait_for,
    base_env,
    start_api,
    start_worker,
    stop_on_error,
    wait_for,
)

pytestmark = pytest.mark.integration

N_WORKERS = 3


@pytest.fixture(scope="module")
def mock_cluster(
    redis_dbs: RedisDbs, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    logdir = tmp_path_factory.mktemp("kv-routing")
    url = redis_dbs.take(__name__)
    env = base_env(url, tiny_model_dir, CONVEYOR_ENGINE="mock", CONVEYOR_MOCK__SPEEDUP="20")
    workers = [
        start_worker(f"mock{i}", "generate", f"mock-w{i}", env, logdir) for i in range(N_WORKERS)
    ]
    with stop_on_error(*workers):
        api, api_url = start_api("api-kv", env, logdir)
    c = Cluster(api_url, url, tiny_model_dir, tiny_model_dir.name, workers, api)
    with stop_on_error(*workers, api):
        wait_for(
            lambda: (
                httpx.get(f"{api_url}/health", timeout=1).json()["workers"]["generate"] == N_WORKERS
            ),
            90,
            f"{N_WORKERS} live mock workers",
            [*workers, api],
        )
    yield c
    for p in [api, *workers]:
        p.stop()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 400 + 50 for i in range(n)]


def complete(c: Cluster, ids: list[int], **kw: object) -> openai.types.Completion:
    return c.client().completions.create(
        model=c.model_name, prompt=ids, max_tokens=4, temperature=0, **kw
    )  # type: ignore[call-overload]


def cached(r: openai.types.Completion) -> int:
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens_details.cached_tokens or 0


def index(c: Cluster) -> KVIndex:
    return KVIndex(redis.Redis.from_url(c.redis_url), "generate")


def test_requests_follow_the_prefix_to_the_worker_that_cached_it(mock_cluster: Cluster) -> None:
    c = mock_cluster
    ns = model_namespace(c.model_name)
    for i in range(6):
        holder = f"mock-w{i % N_WORKERS}"
        p = prompt(100 + i, 160)
        first = complete(c, p, extra_body={"worker_id": holder})
        assert cached(first) == 0
        # the holder's stored events reach the index
        hashes = block_hashes(p, 16, ns)
        wait_for(lambda h=hashes, w=holder: index(c).overlaps(h)[w] == 10, 10, "KV events")
        assert {w: n for w, n in index(c).overlaps(hashes).items() if n} == {holder: 10}
        # the same prefix, unpinned, goes to the holder and reuses its blocks
        again = complete(c, p + prompt(900 + i, 20))
        assert cached(again) == 160, f"request {i} missed the holder {holder}"


def test_a_cache_salt_shares_a_prefix_only_with_the_same_salt(mock_cluster: Cluster) -> None:
    """vLLM's cache_salt: a salted request's blocks are named in a namespace of their own,
    in the workers' block pools and in the router's index alike, so a prefix cached under
    one salt serves that salt alone (and the unsalted one only the unsalted)."""
    c = mock_cluster
    p = prompt(4242, 160)
    first = complete(c, p, extra_body={"cache_salt": "tenant-a"})
    assert cached(first) == 0
    salted = block_hashes(p, 16, model_namespace(c.model_name, None, "tenant-a"))
    wait_for(lambda: max(index(c).overlaps(salted).values(), default=0) == 10, 10,
             "the salted blocks in the index")  # fmt: skip
    holder = next(w for w, n in index(c).overlaps(salted).items() if n == 10)
    # nothing under the plain namespace: the unsalted prompt is not found anywhere
    assert not any(index(c).overlaps(block_hashes(p, 16, model_namespace(c.model_name)))
                   .values())  # fmt: skip
    # on the very worker that holds it: another salt and no salt miss, the same salt hits
    pin, longer = {"worker_id": holder}, p + prompt(77, 20)
    assert cached(complete(c, longer, extra_body={"cache_salt": "tenant-b", **pin})) == 0
    assert cached(complete(c, longer, extra_body=pin)) == 0
    assert cached(complete(c, longer, extra_body={"cache_salt": "tenant-a", **pin})) == 160
    # unpinned, the router finds the salted prefix's holder
    again = complete(c, p + prompt(78, 20), extra_body={"cache_salt": "tenant-a"})
    assert cached(again) == 160
    with pytest.raises(openai.BadRequestError) as e:
        complete(c, p, extra_body={"cache_salt": ""})
    assert e.value.body["param"] == "cache_salt"  # type: ignore[index]


def test_beam_search_on_an_engine_without_logprobs_is_a_400(mock_cluster: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        complete(mock_cluster, prompt(3, 20), n=2, extra_body={"use_beam_search": True})
    body = e.value.body
    assert body["param"] == "use_beam_search" and "logprobs" in body["message"]  # type: ignore[index]


def test_pinning_by_header_and_unknown_worker(mock_cluster: Cluster) -> None:
    c = mock_cluster
    p = prompt(7, 64)
    complete(c, p, extra_headers={"x-conveyor-worker-id": "mock-w2"})
    wait_for(lambda: index(c).overlaps(block_hashes(p, 16, model_namespace(c.model_name)))
             ["mock-w2"] == 4, 10, "pinned worker's KV events")  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:
        complete(c, p, extra_body={"worker_id": "no-such-worker"})
    err = e.value.body
    assert isinstance(err, dict)
    assert err["param"] == "worker_id" and err["code"] == "worker_not_found"
    assert "no-such-worker" in err["message"]


def test_routing_metrics_are_exported(mock_cluster: Cluster) -> None:
    c = mock_cluster
    complete(c, prompt(8, 48))
    # the per-worker hit rate comes from a heartbeat after the request: wait for one
    hit_rate = 'conveyor_worker_prefix_cache_hit_rate{pool="generate",worker='
    wait_for(lambda: hit_rate in httpx.get(f"{c.url}/metrics", timeout=5).text, 10,
             "a heartbeat with the worker's prefix cache counters")  # fmt: skip
    text = httpx.get(f"{c.url}/metrics", timeout=5).text
    assert 'conveyor_routing_decisions_total{pool="generate",reason="kv"}' in text
    assert "conveyor_routing_overlap_ratio_bucket" in text
    assert 'conveyor_router_active_blocks{pool="generate",worker="mock-w0"}' in text
    assert "conveyor_prompt_tokens_cached_total" in text
    assert hit_rate in text


def test_a_killed_worker_leaves_the_index_and_its_prefix_is_served_elsewhere(
    mock_cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    c = mock_cluster
    env = base_env(c.redis_url, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_MOCK__SPEEDUP="20")  # fmt: skip
    doomed: Proc = start_worker("doomed", "generate", "mock-doomed", env, tmp_path)
    try:
        wait_for(lambda: httpx.get(f"{c.url}/health", timeout=1).json()["workers"]["generate"]
                 == N_WORKERS + 1, 60, "the extra worker", [doomed])  # fmt: skip
        p = prompt(9, 128)
        hashes = block_hashes(p, 16, model_namespace(c.model_name))
        complete(c, p, extra_body={"worker_id": "mock-doomed"})
        wait_for(lambda: index(c).overlaps(hashes).get("mock-doomed") == 8, 10, "its events")
        doomed.stop(signal.SIGKILL)
        # its heartbeat lapses (TTL 3 s in tests): it stops counting and its entries go
        wait_for(lambda: "mock-doomed" not in index(c).overlaps(hashes), 15, "expiry")
        assert index(c).worker_blocks("mock-doomed") == set()
        assert all("mock-doomed" not in index(c).holders(h) for h in hashes)
        r = complete(c, p)
        assert r.choices[0].finish_reason == "length" and cached(r) == 0
    finally:
        doomed.stop(signal.SIGKILL)


def test_a_routed_prefix_hit_gives_the_cold_tokens(cluster: Cluster) -> None:
    """Reference engine: a cold run on one worker, then the same prompt routed by the KV
    router (to the worker that cached it) gives the same greedy tokens."""
    p = prompt(11, 150)
    cold = cluster.client().completions.create(
        model=cluster.model_name, prompt=p, max_tokens=16, temperature=0,
        extra_body={"worker_id": "itest-w1", "ignore_eos": True},
    )  # fmt: skip
    assert cached(cold) == 0
    hashes = block_hashes(p, 16, model_namespace(cluster.model_name))
    idx = KVIndex(redis.Redis.from_url(cluster.redis_url), "generate")
    wait_for(lambda: idx.overlaps(hashes).get("itest-w1") == 9, 10, "KV events")
    warm = cluster.client().completions.create(
        model=cluster.model_name, prompt=p, max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cached(warm) == 144  # routed to itest-w1: 9 cached blocks
    assert warm.choices[0].text == cold.choices[0].text


def test_mock_workers_never_load_torch(mock_cluster: Cluster) -> None:
    """A mock worker (Celery process and engine process) stays torch-free while serving,
    which is what lets one machine run dozens of them."""
    c = mock_cluster
    complete(c, prompt(12, 40))
    r = redis.Redis.from_url(c.redis_url)
    pids = [p.popen.pid for p in c.workers]
    for wid in (f"mock-w{i}" for i in range(N_WORKERS)):
        info = json.loads(r.get(worker_key("generate", wid)) or "{}")
        pids.append(int(info["engine_pid"]))
    for pid in pids:
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps, f"process {pid} loaded torch"


def test_two_api_processes_share_load_through_redis(
    fresh_db: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two API replicas route at the same time over real HTTP: each sees the requests the
    other placed, so 8 long requests (4 per replica) land 4 and 4 on the two workers (or
    5 and 3, when two commits race)."""
    import asyncio

    env = base_env(fresh_db, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_MOCK__DECODE_STEP_MS="40")  # fmt: skip
    workers = [start_worker(f"w{i}", "generate", f"pair-w{i}", env, tmp_path) for i in range(2)]
    procs: list[Proc] = list(workers)
    try:
        apis = [start_api(f"api{i}", env, tmp_path) for i in range(2)]
        procs += [p for p, _ in apis]
        wait_for(lambda: httpx.get(f"{apis[0][1]}/health", timeout=1).json()["workers"]
                 ["generate"] == 2, 60, "2 workers", procs)  # fmt: skip

        async def fire() -> list[int]:
            clients = [openai.AsyncOpenAI(base_url=f"{u}/v1", api_key="x") for _, u in apis]
            calls = [
                clients[i % 2].completions.create(
                    model=tiny_model_dir.name, prompt=prompt(200 + i, 64), max_tokens=40,
                    temperature=0, extra_body={"ignore_eos": True},
                )
                for i in range(8)
            ]  # fmt: skip
            tasks = [asyncio.create_task(c) for c in calls]
            r = redis.Redis.from_url(fresh_db)

            def counted() -> list[int]:
                return [int(r.hget(load_key("generate"), f"pair-w{i}:reqs") or 0)
                        for i in range(2)]  # fmt: skip

            # all picked, none finished (40 steps x 40 ms)
            await async_wait_for(lambda: sum(counted()) == 8, 10, "8 requests counted")
            assert not any(t.done() for t in tasks)
            reqs = counted()
            done = await asyncio.gather(*tasks)
            assert all(d.usage is not None and d.usage.completion_tokens == 40 for d in done)
            return reqs

        # the replicas' commits race: one request may see the other replica's last pick a
        # moment late and land beside it (1 in ~8 runs, before and after issue 32's router
        # cuts); never more than one
        assert sorted(asyncio.run(fire())) in ([4, 4], [3, 5])
        r = redis.Redis.from_url(fresh_db)
        # each API gives a request's load back in its clean-up, a task of its own that
        # may still be running when the client has read the last byte
        wait_for(lambda: [int(r.hget(load_key("generate"), f"pair-w{i}:reqs") or 0)
                          for i in range(2)] == [0, 0], 5, "loads back to 0", procs)  # fmt: skip
    finally:
        for p in procs:
            p.stop()


def test_approximate_mode_routes_a_repeat_to_the_same_worker(
    mock_cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An API with ``CONVEYOR_ROUTER_KV_EVENTS=false`` ignores the workers' events and
    trusts its own past decisions: the second request with a prefix goes where the first
    went, and hits that worker's cache."""
    c = mock_cluster
    env = base_env(c.redis_url, tiny_model_dir, CONVEYOR_ENGINE="mock",
                   CONVEYOR_ROUTER_KV_EVENTS="false")  # fmt: skip
    api, url = start_api("api-approx", env, tmp_path)
    try:
        approx = Cluster(url, c.redis_url, c.model_dir, c.model_name, c.workers, api)
        for i in range(3):
            p = prompt(300 + i, 96)
            assert cached(complete(approx, p)) == 0
            again = complete(approx, p + prompt(400 + i, 10))
            assert cached(again) == 96, f"repeat {i} went elsewhere"
        text = httpx.get(f"{url}/metrics", timeout=5).text
        assert 'conveyor_routing_decisions_total{pool="generate",reason="kv"} 6.0' in text
    finally:
        api.stop()


def test_reset_prefix_cache_empties_every_worker_and_the_index(mock_cluster: Cluster) -> None:
    """vLLM's /reset_prefix_cache (Dynamo's /clear_kv_blocks): every worker answers, its
    cached blocks go (removed events empty the router's index), and the same prompt is
    computed again; a worker with a request running resets nothing and says so."""
    c = mock_cluster
    ns = model_namespace(c.model_name)
    p = prompt(5150, 160)
    complete(c, p, extra_body={"worker_id": "mock-w0"})
    hashes = block_hashes(p, 16, ns)
    wait_for(lambda: index(c).overlaps(hashes)["mock-w0"] == 10, 10, "KV events")
    r = httpx.post(f"{c.url}/reset_prefix_cache", timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True
    assert sorted(body["workers"]) == [f"mock-w{i}" for i in range(N_WORKERS)]
    assert all(w == {"success": True, "pool": "generate"} for w in body["workers"].values())
    wait_for(lambda: not any(index(c).overlaps(hashes).values()), 10, "removed events")
    assert cached(complete(c, p + prompt(1, 20), extra_body={"worker_id": "mock-w0"})) == 0
    # a request holding blocks on mock-w1 (~0.5 s of decoding): that worker refuses, the
    # others reset (tried again should the request end before the reset reaches it)
    for _ in range(3):
        stream = c.client().completions.create(
            model=c.model_name,
            prompt=prompt(6, 40),
            max_tokens=2000,
            stream=True,
            extra_body={"worker_id": "mock-w1", "ignore_eos": True},
        )  # type: ignore[call-overload]
        next(iter(stream))
        busy = httpx.post(f"{c.url}/clear_kv_blocks", timeout=60).json()
        stream.close()
        if not busy["success"]:
            break
    assert busy["success"] is False
    assert busy["workers"]["mock-w1"]["success"] is False
    assert "retry when idle" in busy["workers"]["mock-w1"]["message"]
    assert busy["workers"]["mock-w0"]["success"] is True
    r = httpx.post(f"{c.url}/reset_prefix_cache?reset_running_requests=true", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reset_running_requests"
