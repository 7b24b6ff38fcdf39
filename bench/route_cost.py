"""What one routing decision costs: the API process's time and Redis's.

Starts its own redis-server (or uses --redis-url), registers N live workers, fills the
KV-block index through the same script the workers' publishers use, then times
``Router.pick`` (block hashing included) for a prompt of T tokens in three scenarios:

    all-hold   every worker holds the whole prompt (the longest possible overlap walk)
    tiered     (--tiered) every worker holds it too, split across its KVBM tiers (G1 engine
               pool, G2 host memory, G3 disk) at points of its own: the router's two tier
               bisections run for every worker (their worst case)
    some-hold  1 in 8 workers holds it, the others a shared system-prompt prefix
    cold       nobody holds any block

and measures Redis's own time per decision from ``INFO commandstats`` over a pass of
picks: every command Redis ran during it (the commit, and the router's background reads
of the event stream and of the pools' load, amortised) divided by the picks. A script's
time already holds the commands it runs, which commandstats also counts under their own
names; a short pass under ``MONITOR`` tells which calls ran inside scripts, and their time
is taken out so each microsecond counts once (before issue 32's last step the figure
counted them twice: the "redis us (2x)" column).

``--throughput S`` instead runs ``--processes`` router processes for S seconds, each
routing prompts (a few shared system prompts, distinct tails) as fast as it can — pick,
first token, release, as the API does per request — while every worker publishes a
batch of KV events every 100 ms, and reports routed requests/s and Redis's CPU.

    python bench/route_cost.py --workers 8,64,256 --tokens 4096
    python bench/route_cost.py --workers 64 --throughput 20 --processes 2

The router commits as the API's does, through the API's own connection (``api.resp``,
CONVEYOR_BROKER_FASTPATH's default); ``--stock`` commits through redis-py's client.

Targets (issue 27): decision p99 <= 1 ms at 256 workers, Redis time <= 50 us per decision.
The script uses only the router's and index's public calls, so it runs against earlier
trees too (docs/performance.md, "Router: local scoring, O(1) commit").
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import free_ports  # noqa: E402

from kvbm.protocol import block_hashes, namespace_hash  # noqa: E402

try:  # the control plane's home since issue 32; earlier trees kept it in kvbm and workers
    from cluster.index import KVIndex
    from cluster.keys import load_key
    from cluster.membership import Heartbeat
except ImportError:
    from kvbm.index import KVIndex  # type: ignore[no-redef]
    from workers.registry import Heartbeat  # type: ignore[no-redef]

    from kvbm.protocol import load_key  # type: ignore[attr-defined,no-redef]
from tasks.router import Router, RouterConfig, RouteRequest  # noqa: E402

try:  # the API's own connection for its hot-path commands (CONVEYOR_BROKER_FASTPATH)
    from api.resp import RespConnection
except ImportError:
    RespConnection = None  # type: ignore[assignment,misc]

POOL = "generate"
TARGET_P99_MS = 1.0
TARGET_REDIS_US = 50.0


def start_redis() -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server not found; pass --redis-url")
    (port,) = free_ports(1)
    d = tempfile.mkdtemp(prefix="route-cost-")
    p = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", d],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            return p, url
        except redis.ConnectionError:
            time.sleep(0.05)
    p.kill()
    sys.exit("redis-server did not start")


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 131) % 30000 + 100 for i in range(n)]


def worker_ids(n: int) -> list[str]:
    return [f"w{i:03d}" for i in range(n)]


def register(r: redis.Redis, ids: list[str]) -> None:
    for wid in ids:
        Heartbeat(r, POOL, wid, ttl_s=3600).beat()


def setup(url: str, workers: int, prompt: list[int], scenario: str, bs: int, ns: int) -> None:
    r = redis.Redis.from_url(url)
    r.flushdb()
    ids = worker_ids(workers)
    register(r, ids)
    idx = KVIndex(r, POOL)
    full = block_hashes(prompt, bs, ns)
    system = full[: len(full) // 4]
    for i, wid in enumerate(ids):
        if scenario == "tiered":
            k1 = (i * 37) % (len(full) + 1)
            k2 = k1 + (i * 53) % (len(full) - k1 + 1)
            idx.apply(wid, 0, [("cleared", []), ("stored", full[:k1]),
                               ("stored", full[k1:k2], 2), ("stored", full[k2:], 3)])  # fmt: skip
            r.hset(load_key(POOL), mapping={f"{wid}:blocks": 50 + i % 7, f"{wid}:reqs": 3})
            continue
        if scenario == "all-hold":
            held = full
        elif scenario == "some-hold":
            held = full if i % 8 == 0 else system
        else:
            held = block_hashes(tokens(1000 + i, len(prompt)), bs, ns)  # unrelated content
        idx.apply(wid, 0, [("cleared", []), ("stored", held)])
        r.hset(load_key(POOL), mapping={f"{wid}:blocks": 50 + i % 7, f"{wid}:reqs": 3})


def inner_calls(url: str, run) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Per command name, the calls per pick that ran inside scripts, from ``MONITOR``
    during ``run()`` (which returns its picks)."""
    seen: dict[str, int] = {}
    ready, stop = threading.Event(), "route-cost-monitor-stop"

    def watch() -> None:
        with redis.Redis.from_url(url).monitor() as m:
            ready.set()
            while True:
                c = m.next_command()
                if c["client_type"] != "lua":
                    if stop in c["command"]:
                        return
                    continue
                name = c["command"].split(" ", 1)[0].lower()
                seen[name] = seen.get(name, 0) + 1

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    ready.wait(10)
    time.sleep(0.1)  # MONITOR is on before the pass starts
    picks = run()
    redis.Redis.from_url(url).echo(stop)
    t.join(30)
    return {k: v / picks for k, v in seen.items()}


def redis_usec(r: redis.Redis) -> dict[str, tuple[int, int]]:
    """command -> (calls, usec) from INFO commandstats."""
    return {k.removeprefix("cmdstat_"): (v["calls"], v["usec"])
            for k, v in r.info("commandstats").items()}  # fmt: skip


async def _close(router: Router) -> None:
    close = getattr(router, "aclose", None)  # routers of earlier trees have nothing to close
    if close is not None:
        await close()


def make_router(client: aioredis.Redis, url: str, bs: int, stock: bool) -> tuple[Router, Any]:
    """A router as the API builds one: its commits go through the API's lean connection
    (the default, CONVEYOR_BROKER_FASTPATH=true) or, ``stock``, redis-py's asyncio client."""
    fast = None if stock or RespConnection is None else RespConnection(url)
    if fast is None:  # without the keyword: earlier trees' routers do not take it
        return Router(client, RouterConfig(block_size=bs)), None
    return Router(client, RouterConfig(block_size=bs), fast=fast), fast


async def measure(url: str, prompt: list[int], iters: int, bs: int, ns: int,
                  stock: bool = False) -> dict:  # fmt: skip
    client = aioredis.Redis.from_url(url)
    router, fast = make_router(client, url, bs, stock)
    hash_s: list[float] = []
    total_s: list[float] = []
    for i in range(iters + 50):
        if i == 50:  # warmed up (script load, connection, the index's snapshot): as the
            gc.collect()  # API does once its router has started, the heap so far is
            gc.freeze()  # frozen out of the collector's scans (tasks.heap)
        t0 = time.perf_counter()
        hs = block_hashes(prompt, bs, ns)
        t1 = time.perf_counter()
        route = await router.pick(POOL, RouteRequest(hs, len(prompt)))
        t2 = time.perf_counter()
        assert route is not None
        await router.release(route)  # keep loads steady (not timed)
        if i >= 50:
            hash_s.append(t1 - t0)
            total_s.append(t2 - t0)
    # Redis's time: a pass of picks alone (no release), every command Redis ran meanwhile
    sync = redis.Redis.from_url(url)
    n = max(iters // 4, 100)
    before, t0 = redis_usec(sync), time.perf_counter()
    for _ in range(n):
        await router.pick(POOL, RouteRequest(block_hashes(prompt, bs, ns), len(prompt)))
    wall = time.perf_counter() - t0
    after = redis_usec(sync)
    spent = {c: (after[c][0] - before.get(c, (0, 0))[0], after[c][1] - before.get(c, (0, 0))[1])
             for c in after if after[c] != before.get(c)}  # fmt: skip
    spent.pop("info", None)
    # which of those calls ran inside scripts: a short pass of picks under MONITOR (run in
    # a thread of its own so this loop's picks go on meanwhile)
    loop = asyncio.get_running_loop()
    m = max(n // 10, 50)

    def calibrate() -> int:
        async def picks() -> None:
            for _ in range(m):
                await router.pick(POOL, RouteRequest(block_hashes(prompt, bs, ns), len(prompt)))

        asyncio.run_coroutine_threadsafe(picks(), loop).result()
        return m

    inner = await asyncio.to_thread(inner_calls, url, calibrate)
    await _close(router)
    if fast is not None:
        fast.close()
    await client.aclose()
    gc.unfreeze()  # the next scenario's router starts afresh
    total = sum(u for _, u in spent.values()) / n
    twice = sum(inner.get(c, 0.0) * u / k for c, (k, u) in spent.items() if k)
    return {"hash": hash_s, "total": total_s, "redis_us": total - twice, "redis_us_2x": total,
            "by_command": spent, "inner_calls": inner, "picks": n, "wall": wall}  # fmt: skip


def per_pick(m: dict) -> dict[str, tuple[float, float]]:
    """Per command: calls and us per pick."""
    return {c: (k / m["picks"], u / m["picks"]) for c, (k, u) in m["by_command"].items()}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


# ---------------------------------------------------------------------------------------
# --throughput: routed requests/s of several router processes while workers churn events
# ---------------------------------------------------------------------------------------
def _router_process(url: str, seconds: float, bs: int, ns: int, seed: int, out: mp.Queue) -> None:
    async def run() -> int:
        rng = random.Random(seed)
        systems = [tokens(50 + i, 1024) for i in range(4)]
        client = aioredis.Redis.from_url(url)
        router = Router(client, RouterConfig(block_size=bs))
        await router.pick(POOL, RouteRequest([], 16))  # warm-up: start the view
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            prompt = rng.choice(systems) + tokens(rng.randrange(10**6), 256)
            route = await router.pick(POOL, RouteRequest(block_hashes(prompt, bs, ns),
                                                         len(prompt)))  # fmt: skip
            assert route is not None
            await router.prefilled(route)
            await router.release(route)
            n += 1
        await _close(router)
        await client.aclose()
        return n

    out.put(asyncio.run(run()))


def _churn(url: str, ids: list[str], bs: int, ns: int, stop: threading.Event) -> None:
    """Every worker publishes a small batch of KV events every 100 ms, as busy engines do."""
    r = redis.Redis.from_url(url)
    idx = KVIndex(r, POOL)
    seq = dict.fromkeys(ids, 0)
    rng = random.Random(1)
    while not stop.wait(0.1):
        for wid in ids:
            seq[wid] += 1
            new = block_hashes(tokens(rng.randrange(10**6), 64), bs, ns)
            idx.apply(wid, seq[wid], [("stored", new), ("removed", new[:2])])


def throughput(url: str, workers: int, seconds: float, processes: int, bs: int,
               ns: int) -> dict:  # fmt: skip
    r = redis.Redis.from_url(url)
    r.flushdb()
    ids = worker_ids(workers)
    register(r, ids)
    idx = KVIndex(r, POOL)
    for i, wid in enumerate(ids):  # each worker holds one of the shared system prompts
        held = block_hashes(tokens(50 + i % 4, 1024), bs, ns)
        idx.apply(wid, 0, [("cleared", []), ("stored", held)])
    stop = threading.Event()
    churn = threading.Thread(target=_churn, args=(url, ids, bs, ns, stop), daemon=True)
    churn.start()
    cpu0 = r.info("cpu")
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_router_process, args=(url, seconds, bs, ns, i, q))
             for i in range(processes)]  # fmt: skip
    for p in procs:
        p.start()
    counts = [q.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    wall = time.monotonic() - t0
    cpu1 = r.info("cpu")
    stop.set()
    churn.join()
    busy = sum(cpu1[k] - cpu0[k] for k in ("used_cpu_sys", "used_cpu_user"))
    return {"requests": sum(counts), "per_s": sum(counts) / seconds,
            "redis_cpu": busy / wall, "wall": wall}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", default="8,64,256", help="comma-separated worker counts")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--throughput", type=float, default=0.0, help="seconds of the routed "
                    "requests/s run (instead of the decision costs)")  # fmt: skip
    ap.add_argument("--processes", type=int, default=2, help="router processes (--throughput)")
    ap.add_argument("--redis-url", help="use this Redis (its database is flushed!)")
    ap.add_argument("--tiered", action="store_true",
                    help="also the tiered scenario (trees with KVBM tiers only)")  # fmt: skip
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--stock", action="store_true", help="commit through redis-py's asyncio "
                    "client (CONVEYOR_BROKER_FASTPATH=false) rather than the API's default "
                    "connection")  # fmt: skip
    args = ap.parse_args()
    proc = None
    url = args.redis_url
    if url is None:
        proc, url = start_redis()
    ns = namespace_hash("bench-model")
    prompt = tokens(7, args.tokens)
    counts = [int(w) for w in args.workers.split(",")]
    results: list[dict] = []
    try:
        if args.throughput:
            for w in counts:
                res = throughput(url, w, args.throughput, args.processes, args.block_size, ns)
                results.append({"workers": w, **res})
        else:
            for w in counts:
                for scenario in ("all-hold", "some-hold", "cold", *["tiered"][: args.tiered]):
                    setup(url, w, prompt, scenario, args.block_size, ns)
                    m = asyncio.run(measure(url, prompt, args.iters, args.block_size, ns,
                                            args.stock))  # fmt: skip
                    results.append({"workers": w, "scenario": scenario,
                                    "hash_p50_ms": pct(m["hash"], 0.5),
                                    "p50_ms": pct(m["total"], 0.5),
                                    "p99_ms": pct(m["total"], 0.99),
                                    "max_ms": max(m["total"]) * 1000,
                                    "redis_us": m["redis_us"],
                                    "redis_us_2x": m["redis_us_2x"],
                                    "inner_calls": m["inner_calls"],
                                    "by_command": per_pick(m)})  # fmt: skip
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.throughput:
        print(f"\nrouted requests/s: {args.processes} router processes for "
              f"{args.throughput:.0f} s, prompts of 1024 shared + 256 own tokens, every "
              "worker publishing a KV event batch every 100 ms; "
              f"cpus={os.cpu_count()}")  # fmt: skip
        print(f"{'workers':>8} {'requests':>9} {'req/s':>8} {'redis cpu':>10}")
        for row in results:
            print(f"{row['workers']:>8} {row['requests']:>9} {row['per_s']:>8.0f} "
                  f"{row['redis_cpu'] * 100:>9.1f}%")  # fmt: skip
        return
    n_blocks = args.tokens // args.block_size
    path = "redis-py (stock)" if args.stock or RespConnection is None else "the API connection"
    print(
        f"\nrouting decision cost: {args.tokens}-token prompt ({n_blocks} blocks), "
        f"{args.iters} picks/scenario, cpus={os.cpu_count()}, commits through {path}"
    )
    print(f"{'workers':>7} {'scenario':<10} {'hash p50':>9} {'pick p50':>9} {'pick p99':>9} "
          f"{'max':>7} {'redis us':>9} {'(2x)':>6}   targets: p99 <= {TARGET_P99_MS} ms at "
          f"256 workers, redis <= {TARGET_REDIS_US:.0f} us")  # fmt: skip
    for row in results:
        ok = row["redis_us"] <= TARGET_REDIS_US and (
            row["workers"] < 256 or row["p99_ms"] <= TARGET_P99_MS
        )
        print(f"{row['workers']:>7} {row['scenario']:<10} {row['hash_p50_ms']:>9.3f} "
              f"{row['p50_ms']:>9.3f} {row['p99_ms']:>9.3f} {row['max_ms']:>7.2f} "
              f"{row['redis_us']:>9.1f} {row['redis_us_2x']:>6.1f}   "
              f"{'PASS' if ok else 'MISS'}")  # fmt: skip
    print(
        "(ms; redis us: Redis's time per decision, every command during a pass of picks, "
        "each counted once; (2x): a script's inner commands counted again, as before)"
    )


if __name__ == "__main__":
    main()
