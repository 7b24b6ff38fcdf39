"""Faults and overload: what a client sees when the deployment is pushed past its
capacity, or loses a piece, with the mock engine and real processes (``conveyor serve``
with its embedded Redis, no Flower).

    python bench/faults.py                       # every part
    python bench/faults.py --parts overload --workers 2 --cap 8

``overload``  ``--workers`` mock workers, each capped at ``--cap`` requests
              (``CONVEYOR_WORKER_MAX_REQUESTS``), an admission wait of ``--wait-s``;
              ``--rounds`` bursts of 3x the capacity (workers x cap) streamed requests
              sent at once. Accepted / refused split, how fast a refusal comes back
              (p50 / p99 of the 503's latency), the accepted requests' TTFT, and the
              API's RSS before the first burst and after the last (once idle).
``redis``     One mock worker; ``--restarts`` times: SIGKILL the embedded Redis (serve
              restarts it, with its backoff) and time how long it is away, and from its
              return (its first PING) to the first request that succeeds: the recovery.

Each part starts its own server and stops it; ``PARTS`` maps a name to its function
``part(args, log_dir, out)``, which prints its table and puts its raw numbers under
``out[name]`` (``--json PATH`` writes them), so another part (a worker killed
mid-stream: kill-to-next-token, tokens lost or duplicated) can be added beside these.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import redis  # noqa: E402
from common import conveyor_serve  # noqa: E402

from tasks.serve_state import ServeState  # noqa: E402


# --- helpers ----------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def serve_pid(state_dir: Path, url: str, name: str) -> int:
    """The pid of ``name`` (``api``, ``redis``, ...) in the table of the serve at ``url``."""
    state = ServeState.read(state_dir / f"{url.rsplit(':', 1)[1]}.json")
    assert state is not None, f"no serve state in {state_dir}"
    pid = next(p.pid for p in state.processes if p.name == name)
    assert pid is not None, f"{name} has no pid"
    return pid


def serve_env(state_dir: Path, **extra: str) -> dict[str, str]:
    return {"CONVEYOR_ENGINE": "mock", "CONVEYOR_SERVE_STATE_DIR": str(state_dir), **extra}


async def one_stream(http: aiohttp.ClientSession, model: str, tokens: int, tag: str) -> dict:
    """One streamed completion: its status, when its answer began, its TTFT (200) and
    whether it ran to ``[DONE]``."""
    body = {"model": model, "prompt": f"fault bench {tag}", "max_tokens": tokens,
            "stream": True, "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    rec: dict = {"status": 0, "answer_s": None, "ttft_s": None, "done": False}
    try:
        async with http.post("/v1/completions", json=body) as r:
            rec["status"] = r.status
            rec["answer_s"] = time.perf_counter() - t0
            rec["retry_after"] = r.headers.get("Retry-After")
            if r.status != 200:
                await r.read()
                return rec
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    rec["done"] = True
                    break
                if rec["ttft_s"] is None and b'"text":"' in line and b'"text":""' not in line:
                    rec["ttft_s"] = time.perf_counter() - t0
    except (aiohttp.ClientError, TimeoutError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["total_s"] = time.perf_counter() - t0
    return rec


async def burst(url: str, model: str, n: int, tokens: int, timeout_s: float) -> list[dict]:
    conn = aiohttp.TCPConnector(limit=n + 8)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(url, connector=conn, timeout=timeout) as http:
        return await asyncio.gather(*(one_stream(http, model, tokens, f"{i}") for i in range(n)))


# --- parts ------------------------------------------------------------------------------
def part_overload(args: argparse.Namespace, log_dir: Path, out: dict) -> None:
    capacity = args.workers * args.cap
    offered = 3 * capacity
    state_dir = log_dir / "state-overload"
    env = serve_env(state_dir, CONVEYOR_WORKER_MAX_REQUESTS=str(args.cap),
                    CONVEYOR_ADMISSION_WAIT_S=str(args.wait_s),
                    CONVEYOR_MOCK__DECODE_STEP_MS=str(args.step_ms))  # fmt: skip
    rounds: list[list[dict]] = []
    with conveyor_serve(["--workers", str(args.workers)], log_dir / "overload.log",
                        {"generate": args.workers}, env) as (url, _):  # fmt: skip
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        api = serve_pid(state_dir, url, "api")
        asyncio.run(burst(url, model, capacity, 4, 60))  # warm-up, within capacity
        time.sleep(3.0)  # the API's idle trim
        rss_before = rss_mib(api)
        for _ in range(args.rounds):
            rounds.append(asyncio.run(burst(url, model, offered, args.tokens, 120)))
            time.sleep(0.5)
        time.sleep(3.0)
        rss_after = rss_mib(api)
        refused_metric = httpx.get(f"{url}/metrics", timeout=10).text
    recs = [r for rnd in rounds for r in rnd]
    ok = [r for r in recs if r["status"] == 200]
    refused = [r for r in recs if r["status"] in (429, 503)]
    other = [r for r in recs if r not in ok and r not in refused]
    complete = sum(r["done"] for r in ok)
    with_retry_after = sum(r.get("retry_after") is not None for r in refused)
    counted = sum(float(line.split()[-1]) for line in refused_metric.splitlines()
                  if line.startswith("conveyor_requests_refused_total{"))  # fmt: skip
    out["overload"] = {"capacity": capacity, "offered_per_round": offered, "rounds": rounds,
                       "rss_mib": [rss_before, rss_after]}  # fmt: skip
    ref_ms = [r["answer_s"] * 1e3 for r in refused]
    ttft_ms = [r["ttft_s"] * 1e3 for r in ok if r["ttft_s"] is not None]
    print(f"\nOverload: {args.workers} mock workers x cap {args.cap} = capacity {capacity}; "
          f"{args.rounds} bursts of {offered} streamed requests ({args.tokens} tokens, "
          f"{args.step_ms:g} ms steps), admission wait {args.wait_s:g} s")  # fmt: skip
    print(
        "| offered | accepted (complete) | refused (Retry-After) | other | refusal p50 / p99 "
        "ms | accepted TTFT p50 / p99 ms | API RSS before -> after MiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {len(recs)} | {len(ok)} ({complete}) | {len(refused)} ({with_retry_after}) | "
          f"{len(other)} | {pct(ref_ms, 50):.0f} / {pct(ref_ms, 99):.0f} | "
          f"{pct(ttft_ms, 50):.0f} / {pct(ttft_ms, 99):.0f} | {rss_before:.0f} -> "
          f"{rss_after:.0f} |")  # fmt: skip
    print(f"conveyor_requests_refused_total: {counted:.0f}")
    if other:
        print(f"unexpected answers: {other[:3]}")


def part_redis(args: argparse.Namespace, log_dir: Path, out: dict) -> None:
    state_dir = log_dir / "state-redis"
    rows = []
    with conveyor_serve(["--workers", "1"], log_dir / "redis.log", {"generate": 1},
                        serve_env(state_dir)) as (url, rurl):  # fmt: skip
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "after the restart", "max_tokens": 4}
        with httpx.Client(base_url=url, timeout=10, trust_env=False) as http:
            for i in range(args.restarts):
                assert http.post("/v1/completions", json=body).status_code == 200
                pid = serve_pid(state_dir, url, "redis")
                t_kill = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                client = redis.Redis.from_url(rurl, socket_timeout=0.5,
                                              socket_connect_timeout=0.5)  # fmt: skip
                while True:  # away until the restarted one answers
                    try:
                        if client.info("server")["process_id"] != pid:
                            break
                    except redis.RedisError:
                        pass
                    time.sleep(0.02)
                t_back = time.monotonic()
                failed = 0
                while True:
                    try:
                        if http.post("/v1/completions", json=body).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    failed += 1
                    time.sleep(0.05)
                t_ok = time.monotonic()
                rows.append({"away_s": t_back - t_kill, "recovery_s": t_ok - t_back,
                             "failed_requests": failed})  # fmt: skip
                print(f"  restart {i + 1}: Redis away {t_back - t_kill:.2f} s, first success "
                      f"{t_ok - t_back:.2f} s after its return ({failed} failed tries)",
                      file=sys.stderr)  # fmt: skip
                time.sleep(2.0)
    out["redis"] = rows
    print(f"\nRedis restart (embedded Redis SIGKILLed, serve restarts it; no persistence; "
          f"{args.restarts} times, one mock worker)")  # fmt: skip
    print("| restart | Redis away s | recovery: its return -> first success s | failed tries |")
    print("| --- | --- | --- | --- |")
    for i, r in enumerate(rows, 1):
        print(f"| {i} | {r['away_s']:.2f} | {r['recovery_s']:.2f} | {r['failed_requests']} |")
    rec = [r["recovery_s"] for r in rows]
    print(f"recovery median {statistics.median(rec):.2f} s, max {max(rec):.2f} s")


PARTS = {"overload": part_overload, "redis": part_redis}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cap", type=int, default=8, help="CONVEYOR_WORKER_MAX_REQUESTS")
    ap.add_argument("--wait-s", type=float, default=0.5, help="CONVEYOR_ADMISSION_WAIT_S")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=10.0, help="mock decode step")
    ap.add_argument("--restarts", type=int, default=3, help="<= 4: 5 exits stop serve")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--log-dir", type=Path)
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # tables as they come
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="conveyor-faults-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {log_dir}", file=sys.stderr)
    os.environ.pop("CONVEYOR_REDIS_URL", None)
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    for name in args.parts.split(","):
        PARTS[name](args, log_dir, out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
