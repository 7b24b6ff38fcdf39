"""What one routing decision costs: block hashing + the pick script's Redis round trip.

Starts its own redis-server (or uses --redis-url), registers N live workers, fills the
KV-block index, then times ``Router.pick`` for a prompt of T tokens in three scenarios:

    all-hold   every worker holds the whole prompt (the longest possible index walk)
    some-hold  1 in 8 workers holds it, the others a shared system-prompt prefix
    cold       nobody holds any block (the walk stops at the first block)

Target (issue 4): <= 2 ms p99 for a 4k-token prompt with 64 workers.

    python bench/route_cost.py --workers 64 --tokens 4096 --iters 2000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import free_ports  # noqa: E402

from kvbm.index import KVIndex  # noqa: E402
from kvbm.protocol import (  # noqa: E402
    block_hashes,
    load_key,  # noqa: E402
    namespace_hash,
)
from tasks.router import Router, RouterConfig, RouteRequest  # noqa: E402
from workers.registry import Heartbeat  # noqa: E402

POOL = "generate"


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


def setup(url: str, workers: int, prompt: list[int], scenario: str, bs: int, ns: int) -> None:
    r = redis.Redis.from_url(url)
    r.flushdb()
    ids = [f"w{i:02d}" for i in range(workers)]
    for wid in ids:
        Heartbeat(r, POOL, wid, dict, ttl_s=3600).beat()
    idx = KVIndex(r, POOL)
    full = block_hashes(prompt, bs, ns)
    system = full[: len(full) // 4]
    for i, wid in enumerate(ids):
        if scenario == "all-hold":
            held = full
        elif scenario == "some-hold":
            held = full if i % 8 == 0 else system
        else:
            held = block_hashes(tokens(1000 + i, len(prompt)), bs, ns)  # unrelated content
        idx.apply(wid, 0, [("cleared", []), ("stored", held)])
        r.hset(load_key(POOL), mapping={f"{wid}:blocks": 50 + i % 7, f"{wid}:reqs": 3})


async def measure(url: str, prompt: list[int], iters: int, bs: int, ns: int) -> dict:
    client = aioredis.Redis.from_url(url)
    router = Router(client, RouterConfig(block_size=bs))
    hash_s: list[float] = []
    total_s: list[float] = []
    for i in range(iters + 50):
        t0 = time.perf_counter()
        hs = block_hashes(prompt, bs, ns)
        t1 = time.perf_counter()
        route = await router.pick(POOL, RouteRequest(hs, len(prompt)))
        t2 = time.perf_counter()
        assert route is not None
        await router.release(route)  # keep loads steady (not timed)
        if i >= 50:  # warm-up: script load, connection
            hash_s.append(t1 - t0)
            total_s.append(t2 - t0)
    await client.aclose()
    return {"hash": hash_s, "total": total_s}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--redis-url", help="use this Redis (its database is flushed!)")
    args = ap.parse_args()
    proc = None
    url = args.redis_url
    if url is None:
        proc, url = start_redis()
    ns = namespace_hash("bench-model")
    prompt = tokens(7, args.tokens)
    rows = []
    try:
        for scenario in ("all-hold", "some-hold", "cold"):
            setup(url, args.workers, prompt, scenario, args.block_size, ns)
            m = asyncio.run(measure(url, prompt, args.iters, args.block_size, ns))
            rows.append((scenario, pct(m["hash"], 0.5), pct(m["total"], 0.5),
                         pct(m["total"], 0.99), max(m["total"]) * 1000))  # fmt: skip
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    n_blocks = args.tokens // args.block_size
    print(f"\nrouting decision cost: {args.workers} workers, {args.tokens}-token prompt "
          f"({n_blocks} blocks), {args.iters} picks/scenario, cpus={os.cpu_count()}")  # fmt: skip
    print(f"{'scenario':<11} {'hash p50 ms':>12} {'pick p50 ms':>12} {'pick p99 ms':>12} "
          f"{'max ms':>8}  target p99 <= 2 ms")  # fmt: skip
    for name, h50, t50, t99, tmax in rows:
        verdict = "PASS" if t99 <= 2.0 else "MISS"
        print(f"{name:<11} {h50:>12.3f} {t50:>12.3f} {t99:>12.3f} {tmax:>8.2f}  {verdict}")


if __name__ == "__main__":
    main()
