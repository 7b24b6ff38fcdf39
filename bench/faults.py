"""Faults and overload: what a client sees when the deployment is pushed past its
capacity, or loses a piece, with the mock engine and real processes (``conveyor serve``
with its embedded Redis, no Flower).

    python bench/faults.py                       # every part
    python bench/faults.py --parts overload --workers 2 --cap 8
    python bench/faults.py --parts migration --rounds 3 --tokens 128

``overload``  ``--workers`` mock workers, each capped at ``--cap`` requests
              (``CONVEYOR_WORKER_MAX_REQUESTS``), an admission wait of ``--wait-s``;
              ``--rounds`` bursts of 3x the capacity (workers x cap) streamed requests
              sent at once. Accepted / refused split, how fast a refusal comes back
              (p50 / p99 of the 503's latency), the accepted requests' TTFT, and the
              API's RSS before the first burst and after the last (once idle).
``redis``     One mock worker; ``--restarts`` times: SIGKILL the embedded Redis (serve
              restarts it, with its backoff) and time how long it is away, and from its
              return (its first PING) to the first request that succeeds: the recovery.
``migration`` Two mock workers (the mock engine resumes as the reference one does:
              prompt + tokens so far, then on); per ``--victim`` (``worker``: the Celery
              worker process, whose engine process then says it died; ``engine``: only
              the engine process, which takes its worker along), ``--rounds`` rounds of
              ``--streams`` greedy streams of ``--tokens`` tokens, half pinned to each
              worker, and the victim SIGKILLed once every stream is a quarter through.
              Per round: streams migrated and failed, time from the kill to the next
              token on each migrated stream (p50 / p99), tokens lost / duplicated against
              an uninterrupted run (the text re-tokenized, aligned), usage != max_tokens.
              serve restarts the victim between rounds.

Each part starts its own server and stops it; ``PARTS`` maps a name to its function
``part(args, log_dir, out)``, which prints its table and puts its raw numbers under
``out[name]`` (``--json PATH`` writes them).
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
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
from common import conveyor_serve, event_error, run_parts  # noqa: E402

from cluster.keys import alive_key, worker_key  # noqa: E402
from tasks.serve_state import ServeState  # noqa: E402
from tasks.settings import Settings  # noqa: E402


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


async def pinned_stream(http: aiohttp.ClientSession, model: str, tokens: int, worker: str,
                        rec: dict) -> dict:  # fmt: skip
    """One greedy streamed completion pinned to ``worker``, filling ``rec`` as it goes:
    each text chunk's arrival time and text, the usage, and how it ended (``done``, or
    ``error``)."""
    body = {"model": model, "prompt": "migration bench", "max_tokens": tokens,
            "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    rec.update(times=[], text=[], usage=None, done=False, error=None)
    try:
        async with http.post("/v1/completions", json=body,
                             headers={"x-conveyor-worker-id": worker}) as r:  # fmt: skip
            if r.status != 200:
                rec["error"] = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return rec
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    rec["done"] = True
                    break
                now = time.monotonic()
                obj = json.loads(data)
                if (msg := event_error(obj)) is not None:
                    rec["error"] = str(msg)
                    break
                rec["usage"] = obj.get("usage") or rec["usage"]
                for choice in obj.get("choices") or ():
                    if choice.get("text"):
                        rec["times"].append(now)
                        rec["text"].append(choice["text"])
    except (aiohttp.ClientError, TimeoutError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


def live_generate_workers(r: redis.Redis) -> dict[str, int]:
    """Live generate workers -> their engine process's pid (from their heartbeat report)."""
    now_ms = int(r.time()[0] * 1000)
    out = {}
    for wid in r.zrangebyscore(alive_key("generate"), f"({now_ms}", "+inf"):
        report = r.get(worker_key("generate", wid.decode()))
        if report is not None:
            out[wid.decode()] = int(json.loads(report)["engine_pid"])
    return out


def token_diff(tok, want: str, got: str) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Tokens of ``want`` missing from ``got`` and tokens of ``got`` beyond ``want``, both
    texts re-tokenized and aligned (0, 0 when the texts are equal)."""
    a, b = tok.encode(want).ids, tok.encode(got).ids
    lost = dup = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op in ("delete", "replace"):
            lost += i2 - i1
        if op in ("insert", "replace"):
            dup += j2 - j1
    return lost, dup


async def migration_streams(
    url: str, model: str, args: argparse.Namespace, pins: list[str], kill_pid: int | None
) -> tuple[float, list[dict]]:
    """Streams pinned to ``pins``; ``kill_pid`` SIGKILLed once each is a quarter through.
    The kill's time and the streams' records."""
    recs: list[dict] = [{"times": []} for _ in pins]
    conn = aiohttp.TCPConnector(limit=len(pins) + 4)
    async with aiohttp.ClientSession(url, connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=300)) as http:  # fmt: skip
        tasks = [asyncio.create_task(pinned_stream(http, model, args.tokens, w, rec))
                 for w, rec in zip(pins, recs, strict=True)]  # fmt: skip
        t_kill = float("nan")
        if kill_pid is not None:
            quarter, t_end = max(args.tokens // 4, 1), time.monotonic() + 60
            while (min(len(rec["times"]) for rec in recs) < quarter
                   and time.monotonic() < t_end):  # fmt: skip
                await asyncio.sleep(0.002)
            t_kill = time.monotonic()
            os.kill(kill_pid, signal.SIGKILL)
        await asyncio.gather(*tasks)
    for rec in recs:
        rec["text"] = "".join(rec["text"])
    return t_kill, recs


def migration_round(url: str, model: str, r: redis.Redis, args: argparse.Namespace,
                    victim_kind: str, want: str, tok) -> dict:  # type: ignore[no-untyped-def]  # fmt: skip
    """One round: two live workers (serve restarted the last victim), ``--streams``
    streams half on each, the victim's process (or its engine's) SIGKILLed mid-stream."""
    deadline = time.monotonic() + 120
    while len(live := live_generate_workers(r)) < 2:
        assert time.monotonic() < deadline, f"two live workers, not {live}"
        time.sleep(0.2)
    (victim, engine_pid), (other, _) = sorted(live.items())[:2]
    with open(f"/proc/{engine_pid}/stat") as f:  # the engine's parent: the Celery worker
        worker_pid = int(f.read().rsplit(")", 1)[1].split()[1])
    pins = [victim if i % 2 == 0 else other for i in range(args.streams)]
    t_kill, recs = asyncio.run(migration_streams(
        url, model, args, pins, engine_pid if victim_kind == "engine" else worker_pid))  # fmt: skip
    resumed_ms, stalls_ms, lost, dup, usage_off, failed, migrated = [], [], 0, 0, 0, 0, 0
    for pin, rec in zip(pins, recs, strict=True):
        if not rec["done"] or rec["error"]:
            failed += 1
        if rec["usage"] is None or rec["usage"]["completion_tokens"] != args.tokens:
            usage_off += 1
        a, b = token_diff(tok, want, rec["text"])
        lost, dup = lost + a, dup + b
        if pin != victim or not rec["done"]:
            continue
        migrated += 1
        ts = rec["times"]
        before = sum(t <= t_kill for t in ts)
        # the dead worker's last frames may land just after the kill: the next token of
        # the new worker ends the longest gap from the last token before the kill on
        gaps = [(ts[i] - ts[i - 1], i) for i in range(max(before, 1), len(ts))]
        if gaps:
            stall, i = max(gaps)
            resumed_ms.append((ts[i] - t_kill) * 1e3)
            stalls_ms.append(stall * 1e3)
    return {"victim": victim_kind, "migrated": migrated, "failed": failed, "lost": lost,
            "duplicated": dup, "usage_off": usage_off, "resumed_ms": resumed_ms,
            "stalls_ms": stalls_ms}  # fmt: skip


def part_migration(args: argparse.Namespace, log_dir: Path, out: dict) -> None:
    from tokenizers import Tokenizer

    rows = []
    for kind in args.victim.split(","):
        state_dir = log_dir / f"state-migration-{kind}"
        env = serve_env(state_dir, CONVEYOR_MOCK__DECODE_STEP_MS=str(args.step_ms),
                        CONVEYOR_SERVE_RESTART_BACKOFF_S="0.5",
                        CONVEYOR_SERVE_CRASH_LOOP_EXITS=str(args.rounds + 2))  # fmt: skip
        with conveyor_serve(["--workers", "2"], log_dir / f"migration-{kind}.log",
                            {"generate": 2}, env) as (url, rurl):  # fmt: skip
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            tok = Tokenizer.from_file(str(Settings().model / "tokenizer.json"))
            r = redis.Redis.from_url(rurl)
            live = sorted(live_generate_workers(r))
            _, ref = asyncio.run(migration_streams(url, model, args, live[:1], None))
            assert ref[0]["done"], f"the uninterrupted run failed: {ref[0]}"
            want = ref[0]["text"]
            for i in range(args.rounds):
                row = migration_round(url, model, r, args, kind, want, tok)
                rows.append(row)
                print(f"  {kind} round {i + 1}: {row['migrated']} migrated, {row['failed']} "
                      f"failed", file=sys.stderr)  # fmt: skip
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
        moved = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("conveyor_migrations_total{")
                    and 'outcome="moved"' in line)  # fmt: skip
        print(
            f"  {kind}: conveyor_migrations_total{{outcome=moved}} = {moved:.0f}", file=sys.stderr
        )
    out["migration"] = rows
    print(f"\nMigration: 2 mock workers ({args.step_ms:g} ms steps), {args.streams} greedy streams "
          f"of {args.tokens} tokens per round (half on the victim), the victim SIGKILLed once "
          f"every stream is a quarter through; serve restarts it between rounds")  # fmt: skip
    print(
        "| victim | round | migrated | failed | kill -> next token p50 / p99 ms | "
        "longest stall p50 ms | tokens lost / duplicated | usage != max_tokens |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, row in enumerate(rows):
        n = sum(1 for x in rows[:i] if x["victim"] == row["victim"]) + 1
        res, st = row["resumed_ms"], row["stalls_ms"]
        print(f"| {row['victim']} | {n} | {row['migrated']} | {row['failed']} | "
              f"{pct(res, 50):.0f} / {pct(res, 99):.0f} | {pct(st, 50):.0f} | "
              f"{row['lost']} / {row['duplicated']} | {row['usage_off']} |")  # fmt: skip
    for kind in args.victim.split(","):
        res = [x for row in rows if row["victim"] == kind for x in row["resumed_ms"]]
        print(f"{kind}: kill -> next token over all rounds p50 {pct(res, 50):.0f} ms, "
              f"p99 {pct(res, 99):.0f} ms ({len(res)} streams)")  # fmt: skip


PARTS = {"overload": part_overload, "redis": part_redis, "migration": part_migration}


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
    ap.add_argument("--streams", type=int, default=16, help="migration: streams per round")
    ap.add_argument("--victim", default="worker,engine", help="migration: worker | engine")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--log-dir", type=Path)
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # tables as they come
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="conveyor-faults-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {log_dir}", file=sys.stderr)
    return run_parts(PARTS, args, log_dir)


if __name__ == "__main__":
    sys.exit(main())
