"""Online latency beside a batch: does a Batch API job leave online traffic alone?

    python bench/batch_online.py                     # 3 rounds, a batch of 500 requests
    python bench/batch_online.py --rounds 1 --batch 100 --seconds 15

Starts ``conveyor serve`` (its batch runner included) on the mock engine with real step
times (``--step-ms`` a decode step, 100 us a prompt token, at most ``--max-num-seqs``
sequences a step), then per round, in an order that alternates: ``--online`` closed-loop
streaming clients (half the engine's batch by default: half its capacity) for
``--seconds`` alone, and the same clients while a batch of ``--batch`` requests runs, until
it completes. It reports the online TTFT p50/p99 of each phase, their ratio, and the
batch's completion time; the median ratio of the rounds is the figure.

Target (issue 34): online TTFT p99 with the batch <= 1.2x without, median of three.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from common import CONVEYOR, ROOT, free_ports, stop_group, wait_ready  # noqa: E402
from sse_client import SSEClient, StreamError, run_loop  # noqa: E402

TARGET = 1.2


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000 if s else float("nan")


async def online(url: str, model: str, clients: int, until: asyncio.Event,
                 seconds: float) -> list[float]:  # fmt: skip
    """Closed-loop streaming completions until ``until`` is set and ``seconds`` passed."""
    ttft: list[float] = []
    t_end = time.monotonic() + seconds
    async with SSEClient(url, clients, 120.0) as client:

        async def one(i: int) -> None:
            n = 0
            while time.monotonic() < t_end or not until.is_set():
                body = {"model": model, "prompt": f"online {i} {n} " + "word " * 60,
                        "max_tokens": 32, "ignore_eos": True, "stream": True}  # fmt: skip
                n += 1
                t0 = time.perf_counter()
                try:
                    events = await client.stream("/v1/completions", body)
                except StreamError:
                    continue
                first = next((t for t, ev in events if _has_text(ev)), None)
                if first is not None:
                    ttft.append(first - t0)

        await asyncio.gather(*(one(i) for i in range(clients)))
    return ttft


def _has_text(ev: dict) -> bool:
    return any(c.get("text") for c in ev.get("choices") or [])


def batch_file(model: str, n: int, seed: int) -> bytes:
    lines = [json.dumps({"custom_id": f"b{seed}-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": model, "prompt": f"batch {seed} {i} " + "word " * 60,
                                  "max_tokens": 32, "ignore_eos": True}})
             for i in range(n)]  # fmt: skip
    return ("\n".join(lines) + "\n").encode()


async def with_batch(url: str, model: str, clients: int, n: int, seed: int,
                     seconds: float) -> tuple[list[float], float]:  # fmt: skip
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    f = c.files.create(file=("b.jsonl", io.BytesIO(batch_file(model, n, seed))), purpose="batch")
    done = asyncio.Event()
    t0 = time.monotonic()
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")

    async def watch() -> float:
        while True:
            status = (await asyncio.to_thread(c.batches.retrieve, b.id)).status
            if status in ("completed", "failed", "cancelled", "expired"):
                done.set()
                assert status == "completed", status
                return time.monotonic() - t0
            await asyncio.sleep(0.5)

    ttft, took = await asyncio.gather(online(url, model, clients, done, seconds), watch())
    return ttft, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=30.0, help="online phase alone")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--online", type=int, help="online clients (default: max-num-seqs / 2)")
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--env", action="append", default=[], metavar="CONVEYOR_X=VALUE",
                    help="a setting for the server (repeatable)")  # fmt: skip
    args = ap.parse_args()
    clients = args.online or max(1, args.max_num_seqs // 2)
    port, flower_port, redis_port = free_ports(3)
    tmp = Path(tempfile.mkdtemp(prefix="batch-online-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_ENGINE="mock", CONVEYOR_MOCK__DECODE_STEP_MS=str(args.step_ms),
               CONVEYOR_MOCK__SPEEDUP="1", CONVEYOR_MAX_NUM_SEQS=str(args.max_num_seqs),
               CONVEYOR_FILES_DIR=str(tmp / "files"), CONVEYOR_REDIS_PORT=str(redis_port),
               CONVEYOR_SERVE_STATE_DIR=str(tmp / "state"))  # fmt: skip
    env.update(kv.split("=", 1) for kv in args.env)
    log = tmp / "serve.log"
    argv = [CONVEYOR, "serve", "--port", str(port), "--flower-port", str(flower_port),
            "--no-flower"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        wait_ready(proc, url, {"generate": 1}, 300, log)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for _ in range(60):  # the batch runner's heartbeat
            if httpx.post(f"{url}/v1/batches", json={}).status_code != 503:
                break
            time.sleep(0.5)
        run_loop(online(url, model, clients, _set(), 3.0))  # warm-up
        for rnd in range(args.rounds):
            order = ("alone", "batch") if rnd % 2 == 0 else ("batch", "alone")
            res: dict = {}
            for phase in order:
                if phase == "alone":
                    res["alone"] = run_loop(online(url, model, clients, _set(), args.seconds))
                else:
                    res["batch"], res["took"] = run_loop(
                        with_batch(url, model, clients, args.batch, rnd, 0.0)
                    )
            ratio = pct(res["batch"], 0.99) / pct(res["alone"], 0.99)
            rows.append({"alone": res["alone"], "batch": res["batch"], "took": res["took"],
                         "ratio": ratio})  # fmt: skip
            print(f"  round {rnd + 1}: p99 alone {pct(res['alone'], 0.99):.1f} ms, beside "
                  f"the batch {pct(res['batch'], 0.99):.1f} ms (x{ratio:.2f}); batch of "
                  f"{args.batch} in {res['took']:.1f} s", file=sys.stderr)  # fmt: skip
    finally:
        stop_group(proc)
    print(
        f"\nonline TTFT beside a batch: {clients} closed-loop online streams (32 tokens), "
        f"a batch of {args.batch}, mock engine {args.step_ms:g} ms steps, "
        f"max_num_seqs {args.max_num_seqs}; cpus={os.cpu_count()}"
    )
    print(f"{'round':>5} {'p50 alone':>10} {'p99 alone':>10} {'p50 batch':>10} "
          f"{'p99 batch':>10} {'ratio':>6} {'batch s':>8}")  # fmt: skip
    for i, r in enumerate(rows, 1):
        print(f"{i:>5} {pct(r['alone'], .5):>10.1f} {pct(r['alone'], .99):>10.1f} "
              f"{pct(r['batch'], .5):>10.1f} {pct(r['batch'], .99):>10.1f} {r['ratio']:>6.2f} "
              f"{r['took']:>8.1f}")  # fmt: skip
    med = statistics.median(r["ratio"] for r in rows)
    print(f"median p99 ratio {med:.2f} (target <= {TARGET}): {'PASS' if med <= TARGET else 'MISS'}")


def _set() -> asyncio.Event:
    e = asyncio.Event()
    e.set()
    return e


if __name__ == "__main__":
    main()
