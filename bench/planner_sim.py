"""The SLA planner under a ramp: ``conveyor serve --planner`` against a fixed pool sized
for the peak, both on the mock engine with a GPU-like cost model.

    python bench/planner_sim.py                          # 10 min planner run, then fixed
    python bench/planner_sim.py --duration 120 --runs planner --json-out sim.json
    python bench/planner_sim.py --trace mooncake.jsonl   # arrival times from a trace

The load ramps from 10% to 100% of one host's capacity (``--host-workers`` workers at
the targets) over the first half of ``--duration`` and down to 20% over the second. Its
arrival times are a Mooncake-format trace's (``--trace``; timestamps in ms), else a
Poisson process's, stretched onto the ramp by time rescaling: the k-th arrival goes out
when the ramp's cumulative intensity reaches the trace's k-th normalized arrival.

Each request is a streamed ``/v1/completions`` of random token ids (lengths uniform in
0.5..1.5x ``--isl``/``--osl``, ``ignore_eos``). A request is lost when it does not come
back with exactly its ``max_tokens`` tokens and a finish reason. Every ``--window-s`` the
TTFT p90 of the requests sent in the window and the ITL p90 of the tokens received in it
are compared with the targets; the live generate workers are read from Redis every second
and integrated into worker-seconds.

The mock engine's step cost (``--speedup`` divides it; the default 0.05 keeps the token
rate, and so this 2-core host's CPU, low while the shape of the costs stays a GPU's)::

    step = 8 ms + 0.08 ms x sequences + 0.02 us x KV tokens read + 60 us x prompt tokens

One host's capacity is what the planner's own model says ``--host-workers`` workers serve
within the targets with these costs (printed); ``--peak-share`` scales the peak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis
from common import ROOT, conveyor_serve
from sse_client import SSEClient, StreamError, run_loop

sys.path.insert(0, str(ROOT))
from cluster.membership import live_workers  # noqa: E402
from planner.model import Coefficients, Load, StepModel  # noqa: E402

COST = {"decode_step_ms": 8.0, "decode_ms_per_seq": 0.08, "decode_us_per_kv_token": 0.02,
        "prefill_us_per_token": 60.0}  # fmt: skip


@dataclass(slots=True)
class Rec:
    sent: float
    isl: int
    osl: int
    times: list[float] = field(default_factory=list)  # arrival of each chunk with text
    tokens: int = 0
    finish: str | None = None
    error: str | None = None

    @property
    def lost(self) -> bool:
        return self.error is not None or self.finish is None or self.tokens != self.osl


# --------------------------------------------------------------------------------------
# The load
# --------------------------------------------------------------------------------------
def ramp(t: float, duration: float) -> float:
    """The share of the peak at time ``t``: 0.1 -> 1.0 over the first half, 1.0 -> 0.2
    over the second."""
    half = duration / 2
    if t < half:
        return 0.1 + 0.9 * t / half
    return 1.0 - 0.8 * min(1.0, (t - half) / half)


def unit_arrivals(n: int, trace: Path | None, seed: int) -> np.ndarray:
    """``n`` arrival times of a unit-rate process: a trace's gaps (normalized to mean
    one, cycled), else exponential ones."""
    if trace is not None:
        ts = [json.loads(line)["timestamp"] for line in trace.open() if line.strip()]
        gaps = np.diff(np.sort(np.asarray(ts, dtype=np.float64)))
        gaps = gaps[gaps >= 0]
        if not len(gaps) or gaps.mean() <= 0:
            raise SystemExit(f"{trace}: no arrival gaps")
        gaps = np.resize(gaps / gaps.mean(), n)
    else:
        gaps = np.random.default_rng(seed).exponential(1.0, n)
    return np.cumsum(gaps)


def schedule(peak_rate: float, duration: float, trace: Path | None, seed: int) -> list[float]:
    """Send times (s from the start): the unit process mapped through the ramp's
    cumulative intensity (numerically, on a 0.1 s grid)."""
    grid = np.arange(0.0, duration + 0.1, 0.1)
    intensity = np.array([peak_rate * ramp(t, duration) for t in grid])
    cum = np.concatenate([[0.0], np.cumsum(intensity[:-1] * 0.1)])
    n = int(cum[-1] * 1.2) + 10
    units = unit_arrivals(n, trace, seed)
    units = units[units < cum[-1]]
    return [float(x) for x in np.interp(units, cum, grid)]


def per_worker_capacity(speedup: float, isl: float, osl: float, ttft_s: float, itl_s: float,
                        max_seqs: int, chunk: int, workers: int) -> float:  # fmt: skip
    """What one worker of a pool of ``workers`` serves at the targets with the bench's
    costs (the planner's own steady-state model: TTFT and ITL p90, Poisson arrivals over
    the pool), capped by the batch limit (Little: batch = rate x decode time)."""
    m = StepModel(chunk_tokens=chunk)
    m.coef = Coefficients(COST["decode_step_ms"] / 1e3 / speedup,
                          COST["prefill_us_per_token"] / 1e6 / speedup,
                          COST["decode_ms_per_seq"] / 1e3 / speedup,
                          COST["decode_us_per_kv_token"] / 1e6 / speedup)  # fmt: skip
    load = Load(0.0, isl, osl)
    cap = m.capacity(load, ttft_s, itl_s, workers=workers) or 0.0
    s = m.steady(cap * workers, load, workers=workers)
    if s is not None and cap * osl * s[1] > max_seqs:  # more than the engine batches
        lo, hi = 0.0, cap
        for _ in range(40):
            mid = (lo + hi) / 2
            st = m.steady(mid * workers, load, workers=workers)
            lo, hi = (mid, hi) if st is not None and mid * osl * st[1] <= max_seqs else (lo, mid)
        cap = lo
    return cap


# --------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------
async def _one(client: SSEClient, rec: Rec, model: str, rng: random.Random) -> None:
    offset = time.time() - time.perf_counter()  # the client stamps chunks with perf_counter
    body = {"model": model, "prompt": [rng.randrange(32, 500) for _ in range(rec.isl)],
            "max_tokens": rec.osl, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    try:
        for now, chunk in await client.stream("/v1/completions", body):
            for c in chunk.get("choices") or []:
                if c.get("text"):
                    rec.times.append(now + offset)
                if c.get("finish_reason"):
                    rec.finish = c["finish_reason"]
            if chunk.get("usage"):
                rec.tokens = chunk["usage"]["completion_tokens"]
    except (TimeoutError, StreamError, OSError) as e:
        rec.error = str(e)[:200]


async def drive(url: str, model: str, sends: list[float], args: argparse.Namespace,
                t0: float) -> list[Rec]:  # fmt: skip
    rng = random.Random(args.seed)
    recs: list[Rec] = []
    tasks = []
    async with SSEClient(url, max_connections=4096, timeout_s=600) as client:
        for at in sends:
            delay = t0 + at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            isl = max(16, int(args.isl * rng.uniform(0.5, 1.5)))
            osl = max(4, int(args.osl * rng.uniform(0.5, 1.5)))
            rec = Rec(time.time(), isl, osl)
            recs.append(rec)
            tasks.append(asyncio.ensure_future(_one(client, rec, model, rng)))
        await asyncio.gather(*tasks)
    return recs


class WorkerSampler(threading.Thread):
    """Live generate workers, once a second, from Redis."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(redis_url)
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append((time.time(), len(live_workers(self.client, "generate"))))
            except redis.RedisError:
                pass
            self.stop.wait(1.0)

    def worker_seconds(self, t0: float, t1: float) -> float:
        pts = [(t, n) for t, n in self.samples if t0 <= t <= t1]
        return sum(a[1] * (b[0] - a[0]) for a, b in zip(pts, pts[1:], strict=False))


def windows(recs: list[Rec], t0: float, duration: float, w: float, ttft_s: float,
            itl_s: float) -> list[dict]:  # fmt: skip
    out = []
    for k in range(int(math.ceil(duration / w))):
        a, b = t0 + k * w, t0 + (k + 1) * w
        ttfts = [r.times[0] - r.sent for r in recs if a <= r.sent < b and r.times]
        gaps = [y - x for r in recs for x, y in zip(r.times, r.times[1:], strict=False)
                if a <= y < b]  # fmt: skip
        t90 = float(np.percentile(ttfts, 90)) if ttfts else None
        i90 = float(np.percentile(gaps, 90)) if gaps else None
        ok = (t90 is None or t90 <= ttft_s) and (i90 is None or i90 <= itl_s)
        out.append({"t": k * w, "requests": len(ttfts), "ttft_p90": t90, "itl_p90": i90, "ok": ok})
    return out


def run_once(kind: str, args: argparse.Namespace, sends: list[float], log_dir: Path) -> dict:
    planner = kind == "planner"
    env = {
        "CONVEYOR_ENGINE": "mock",
        "CONVEYOR_MOCK__SPEEDUP": str(args.speedup),
        **{f"CONVEYOR_MOCK__{k.upper()}": str(v) for k, v in COST.items()},
        "CONVEYOR_MAX_NUM_SEQS": str(args.max_seqs),
        "CONVEYOR_MAX_NUM_BATCHED_TOKENS": str(args.chunk),
        "CONVEYOR_NUM_KV_BLOCKS": "16384",
        "CONVEYOR_MAX_MODEL_LEN": str(int(args.isl * 1.5 + args.osl * 1.5) + 64),
        "CONVEYOR_PLANNER_TTFT_MS": str(args.ttft_ms),
        "CONVEYOR_PLANNER_ITL_MS": str(args.itl_ms),
        "CONVEYOR_PLANNER_MIN_WORKERS": "1",
        "CONVEYOR_PLANNER_MAX_WORKERS": str(args.host_workers),
        "CONVEYOR_PLANNER_GPU_BUDGET": str(args.host_workers),
        "CONVEYOR_PLANNER_LOAD_INTERVAL_S": str(args.load_interval_s),
        "CONVEYOR_PLANNER_THROUGHPUT_INTERVAL_S": str(args.throughput_interval_s),
        "CONVEYOR_PLANNER_WINDOW_S": str(args.planner_window_s),
        "CONVEYOR_WORKER_MAX_REQUESTS": "0",  # no admission cap: requests queue at workers
    }
    if planner and args.record:
        env["CONVEYOR_PLANNER_RECORD"] = str(args.record)
    workers = 1 if planner else args.host_workers
    argv = ["--engine", "mock", "--workers", str(workers)] + (["--planner"] if planner else [])
    log_path = log_dir / f"planner_sim_{kind}.log"
    with conveyor_serve(argv, log_path, {"generate": workers}, env=env) as (url, rurl):
        model = json.loads(__import__("httpx").get(f"{url}/v1/models").text)["data"][0]["id"]
        sampler = WorkerSampler(rurl)
        sampler.start()
        t0 = time.time() + 1.0
        print(f"[{kind}] {len(sends)} requests over {args.duration:.0f} s; log {log_path}",
              flush=True)  # fmt: skip
        recs = run_loop(drive(url, model, sends, args, t0))
        t_end = t0 + args.duration
        sampler.stop.set()
        sampler.join()
    ws = windows(recs, t0, args.duration, args.window_s, args.ttft_ms / 1e3, args.itl_ms / 1e3)
    counts = [n for t, n in sampler.samples if t0 <= t <= t_end]
    ttfts = [r.times[0] - r.sent for r in recs if r.times]
    gaps = [y - x for r in recs for x, y in zip(r.times, r.times[1:], strict=False)]
    return {
        "kind": kind,
        "requests": len(recs),
        "lost": sum(r.lost for r in recs),
        "lost_examples": [
            r.error or f"{r.tokens}/{r.osl} tokens, finish {r.finish}" for r in recs if r.lost
        ][:5],  # fmt: skip
        "worker_seconds": sampler.worker_seconds(t0, t_end),
        "workers_min": min(counts, default=0),
        "workers_max": max(counts, default=0),
        "workers_mean": float(np.mean(counts)) if counts else 0.0,
        "windows_ok": sum(w["ok"] for w in ws) / max(1, len(ws)),
        "ttft_p90": float(np.percentile(ttfts, 90)) if ttfts else None,
        "itl_p90": float(np.percentile(gaps, 90)) if gaps else None,
        "windows": ws,
        "timeline": [(round(t - t0, 1), n) for t, n in sampler.samples],
    }


def report(results: list[dict], args: argparse.Namespace) -> str:
    fixed = next((r for r in results if r["kind"] == "fixed"), None)
    peak_ws = fixed["worker_seconds"] if fixed else args.host_workers * args.duration
    rows = [["run", "requests", "lost", "workers min/mean/max", "worker-s", "vs fixed peak",
             "windows in SLA", "TTFT p90", "ITL p90"]]  # fmt: skip
    for r in results:
        rows.append([r["kind"], str(r["requests"]), str(r["lost"]),
                     f"{r['workers_min']}/{r['workers_mean']:.2f}/{r['workers_max']}",
                     f"{r['worker_seconds']:.0f}", f"{r['worker_seconds'] / peak_ws:.2f}x",
                     f"{100 * r['windows_ok']:.1f}%", f"{(r['ttft_p90'] or 0) * 1e3:.0f} ms",
                     f"{(r['itl_p90'] or 0) * 1e3:.0f} ms"])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in rows]  # fmt: skip
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines.append(f"targets: TTFT p90 <= {args.ttft_ms:.0f} ms, ITL p90 <= {args.itl_ms:.0f} "
                 f"ms per {args.window_s:.0f} s window (>= 95% of windows); worker-seconds "
                 f"<= 0.7x the fixed pool's; no request lost")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--runs", default="planner,fixed")
    ap.add_argument("--host-workers", type=int, default=8, help="Workers of one host")
    ap.add_argument("--peak-share", type=float, default=0.9, help="Peak / the host's capacity")
    ap.add_argument("--peak-rate", type=float, help="req/s at the peak (default: from the model)")
    ap.add_argument("--isl", type=int, default=512)
    ap.add_argument("--osl", type=int, default=48)
    ap.add_argument("--ttft-ms", type=float, default=4000.0)
    ap.add_argument("--itl-ms", type=float, default=600.0)
    ap.add_argument("--speedup", type=float, default=0.05)
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=256, help="Prompt tokens a step at most")
    ap.add_argument("--load-interval-s", type=float, default=5.0)
    ap.add_argument("--throughput-interval-s", type=float, default=30.0)
    ap.add_argument("--planner-window-s", type=float, default=15.0)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--trace", type=Path)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--record", type=Path, help="The planner's observations (JSONL)")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = ap.parse_args(argv)
    cap = per_worker_capacity(args.speedup, args.isl, args.osl, args.ttft_ms / 1e3,
                              args.itl_ms / 1e3, args.max_seqs, args.chunk,
                              args.host_workers)  # fmt: skip
    peak = args.peak_rate or cap * args.host_workers * args.peak_share
    sends = schedule(peak, args.duration, args.trace, args.seed)
    print(f"one worker: {cap:.2f} req/s at the targets; peak {peak:.2f} req/s "
          f"({args.host_workers} workers x {args.peak_share:g}); {len(sends)} requests",
          flush=True)  # fmt: skip
    results = [run_once(k, args, sends, args.log_dir) for k in args.runs.split(",")]
    print(report(results, args))
    if args.json_out:
        out = {"args": {k: str(v) for k, v in vars(args).items()}, "capacity": cap,
               "results": results}  # fmt: skip
        args.json_out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
