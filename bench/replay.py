"""KV-aware routing: replay a Mooncake trace against Conveyor once per router mode.

    python bench/replay.py --start-server --synthetic --scale-down 8
    python bench/replay.py --start-server --trace conv.jsonl --speedup 2 --max-requests 2000 \\
        --server-env CONVEYOR_MAX_MODEL_LEN=16384 --plot ttft.png --json-out out.json
    python bench/replay.py --url http://127.0.0.1:8000 --label kv --trace t.jsonl \\
        --redis-url redis://127.0.0.1:6390/0
    python bench/replay.py gen --out trace.jsonl --sessions 128     # write a synthetic trace

``--start-server`` starts a fresh ``conveyor serve --engine mock --router-mode MODE`` per
mode of ``--modes`` (cold caches each time, its own embedded Redis), waits for ``/health``
to list ``--workers`` live generate workers, replays, then stops it (SIGINT to its process
group, SIGKILL after 20 s). With ``--api-replicas N`` it also starts N-1 more ``conveyor
api`` processes against the same Redis, and the requests go to the replicas in turn (each
replica routes with its own view: the index it follows, the load it commits). ``--url``
replays once against a running server (several comma-separated URLs: replicas in turn).

Each request goes out at its trace timestamp / ``--speedup`` (at most ``--max-inflight`` in
flight; a late send is recorded as lag) as a streaming ``/v1/completions`` whose prompt is
token ids (``bench/trace_gen.py``: equal leading hash ids, equal token prefix), with
``ignore_eos`` and ``max_tokens`` = the trace's output length. TTFT = send -> first chunk
with text (the finishing chunk if none had text); E2E = send -> end of stream. Cached tokens
come from the usage chunk's ``prompt_tokens_details.cached_tokens``. A failed request is
counted, never fatal.

Hit rate = cached tokens / ideal reusable tokens (an infinite cache in arrival order, whole
engine blocks, never the last prompt token), over the requests that succeeded. Load: every
50 ms the router's KV blocks per live worker (field ``<worker>:blocks`` of the hash
``cluster.keys.load_key("generate")``). Spread = the busiest worker's time-averaged
blocks / the mean
worker's; also max/mean per sample with blocks in use, averaged (and p95) over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import httpx
import redis

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT)]

import trace_gen as tg  # noqa: E402
from common import (  # noqa: E402
    conveyor_serve,
    free_ports,
    session,
    stop_group,
    stream_chunks,
    wait_ready,
)

from cluster.keys import load_key  # noqa: E402
from cluster.membership import live_workers  # noqa: E402

MODES = ("kv", "round_robin", "random")
POOL = "generate"
# KV blocks the router counts against a worker: field "blocks" of a hash per worker, or
# else field "<id>:blocks" of one hash per pool (both layouts are read; missing = 0)
SAMPLE_PERIOD_S = 0.05


# --- Replay ---------------------------------------------------------------------------
@dataclass(slots=True)
class Record:
    index: int
    input_len: int
    output_len: int
    ideal_tokens: int
    scheduled_s: float = math.nan  # trace time / speedup, from the start of the replay
    sent_s: float = math.nan
    ttft_ms: float = math.nan
    e2e_ms: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


async def replay(
    clients: list[aiohttp.ClientSession],
    model: str,
    requests: list[tg.TraceRequest],
    ideal: list[int],
    prompt_of: Callable[[tg.TraceRequest], list[int]],
    speedup: float,
    max_inflight: int,
    progress: str = "",
) -> tuple[list[Record], float]:
    """Send every request at its time; return the records and the wall time (first send
    to last response)."""
    sem = asyncio.Semaphore(max_inflight)
    recs = [Record(i, r.input_length, r.output_length, ideal[i]) for i, r in enumerate(requests)]
    t_first = requests[0].timestamp_ms
    start = time.perf_counter()
    tasks = []
    ticker = asyncio.create_task(_progress(recs, start, progress)) if progress else None
    for rec, req in zip(recs, requests, strict=True):
        rec.scheduled_s = (req.timestamp_ms - t_first) / 1e3 / speedup
        delay = start + rec.scheduled_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await sem.acquire()
        body = dict(model=model, prompt=prompt_of(req), max_tokens=req.output_length,
                    temperature=0, ignore_eos=True, stream=True,
                    stream_options={"include_usage": True})  # fmt: skip
        client = clients[rec.index % len(clients)]  # replicas in turn
        tasks.append(asyncio.create_task(_send(client, body, rec, sem, start)))
    await asyncio.gather(*tasks)
    if ticker:
        ticker.cancel()
    wall = max((r.sent_s + r.e2e_ms / 1e3 for r in recs if r.e2e_ms == r.e2e_ms), default=0.0)
    return recs, wall


async def _send(
    client: aiohttp.ClientSession, body: dict, rec: Record, sem: asyncio.Semaphore, start: float
) -> None:
    t0 = time.perf_counter()
    rec.sent_s = t0 - start
    first: float | None = None
    finished_at: float | None = None
    usage: dict | None = None
    try:
        async for now, obj in stream_chunks(client, "/v1/completions", body):
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or ():
                if first is None and ch.get("text"):
                    first = now
                if finished_at is None and ch.get("finish_reason") is not None:
                    finished_at = now
        end = time.perf_counter()
        if usage is None:
            raise RuntimeError("no usage chunk (stream_options.include_usage ignored?)")
        first = first if first is not None else finished_at
        rec.ttft_ms = (first - t0) * 1e3 if first is not None else math.nan
        rec.e2e_ms = (end - t0) * 1e3
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        rec.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)
    except Exception as e:  # noqa: BLE001 - one failed request must not end the replay
        rec.error = f"{type(e).__name__}: {e}"[:300]
        rec.e2e_ms = (time.perf_counter() - t0) * 1e3
    finally:
        sem.release()


async def _progress(recs: list[Record], start: float, label: str) -> None:
    while True:
        await asyncio.sleep(5)
        sent = sum(r.sent_s == r.sent_s for r in recs)
        done = sum(r.e2e_ms == r.e2e_ms for r in recs)
        errs = sum(r.error is not None for r in recs)
        print(f"  {label}: {time.perf_counter() - start:6.1f}s sent {sent}/{len(recs)} "
              f"done {done} errors {errs}", file=sys.stderr)  # fmt: skip


# --- Router load sampling -------------------------------------------------------------
class LoadSampler:
    """A thread reading, every ``period_s``, the router's ``blocks`` per live worker (so a
    busy event loop does not skew the sampling clock)."""

    def __init__(self, redis_url: str, pool: str = POOL, period_s: float = SAMPLE_PERIOD_S):
        self._r = redis.Redis.from_url(redis_url, socket_timeout=2)
        self.pool = pool
        self.period_s = period_s
        self.samples: list[dict[str, int]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def start(self) -> LoadSampler:
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, int]]:
        self._stop.set()
        self._thread.join()
        self._r.close()
        return self.samples

    def sample(self) -> dict[str, int]:
        ids = [w.worker_id for w in live_workers(self._r, self.pool)]
        if not ids:
            return {}
        blocks = self._r.hmget(load_key(self.pool), [f"{i}:blocks" for i in ids])
        return {i: int(b or 0) for i, b in zip(ids, blocks, strict=True)}

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            try:
                self.samples.append(self.sample())
            except (redis.RedisError, ValueError):
                self.errors += 1
            due = max(due + self.period_s, time.monotonic())
            self._stop.wait(due - time.monotonic())


# --- Statistics -----------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    """Linearly interpolated percentile; NaN for an empty list."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def load_spread(samples: list[list[int]]) -> dict:
    """Blocks per live worker, one list per sample. Imbalance = max/mean over the samples
    whose mean is > 0; mean/max blocks are averaged over every sample with a live worker."""
    live = [s for s in samples if s]
    ratios = [max(s) / (sum(s) / len(s)) for s in live if sum(s) > 0]
    return dict(samples=len(samples), busy_samples=len(ratios),
                imbalance_mean=_mean(ratios), imbalance_p95=pct(ratios, 95),
                mean_blocks=_mean([sum(s) / len(s) for s in live]),
                max_blocks=_mean([max(s) for s in live]),
                peak_blocks=max((max(s) for s in live), default=0))  # fmt: skip


def load_summary(samples: list[dict[str, int]]) -> dict:
    """``spread`` is the headline: the busiest worker's time-averaged blocks over the mean
    worker's. The per-sample ratio (``imbalance_*``) is also reported; it is large whenever
    few requests are in flight (one request on one of 8 workers is 8.0) whatever the
    router does."""
    out = load_spread([list(s.values()) for s in samples])
    workers = sorted({w for s in samples for w in s})
    per = {w: _mean([s[w] for s in samples if w in s]) for w in workers}
    out["per_worker_mean_blocks"] = per
    avg = _mean(list(per.values()))
    out["spread"] = max(per.values()) / avg if per and avg > 0 else math.nan
    return out


def summarize(recs: list[Record], wall_s: float) -> dict:
    ok = [r for r in recs if r.error is None]
    cached = sum(r.cached_tokens for r in ok)
    ideal = sum(r.ideal_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    ttft = [r.ttft_ms for r in ok if r.ttft_ms == r.ttft_ms]
    return dict(requests=len(recs), ok=len(ok), errors=len(recs) - len(ok),
                cached_tokens=cached, ideal_tokens=ideal, prompt_tokens=prompt,
                completion_tokens=out_tokens,
                hit_rate=cached / ideal if ideal else math.nan,
                reused_fraction=cached / prompt if prompt else math.nan,
                ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99), ttft_mean_ms=_mean(ttft),
                e2e_p50_ms=pct([r.e2e_ms for r in ok], 50),
                wall_s=wall_s,
                req_s=len(ok) / wall_s if wall_s > 0 else math.nan,
                out_tok_s=out_tokens / wall_s if wall_s > 0 else math.nan,
                send_lag_p99_ms=pct([(r.sent_s - r.scheduled_s) * 1e3 for r in recs], 99),
                short_outputs=sum(r.completion_tokens != r.output_len for r in ok),
                prompt_mismatches=sum(r.prompt_tokens != r.input_len for r in ok))  # fmt: skip


def ttft_ratios(results: dict[str, dict]) -> dict[str, float]:
    """Mean TTFT of every other mode / mean TTFT of kv."""
    if "kv" not in results:
        return {}
    kv = results["kv"]["summary"]["ttft_mean_ms"]
    if not kv or kv != kv:
        return {}
    return {m: r["summary"]["ttft_mean_ms"] / kv for m, r in results.items() if m != "kv"}


# --- Running one mode -----------------------------------------------------------------
async def run_mode(
    label: str,
    url: str,
    redis_url: str | None,
    requests: list[tg.TraceRequest],
    ideal: list[int],
    args: argparse.Namespace,
) -> dict:
    block = tg.scaled_block_tokens(args.tokens_per_hash_id, args.scale_down)
    token_range = args.token_range

    def prompt_of(req: tg.TraceRequest) -> list[int]:
        return tg.prompt_tokens(req, block, token_range)

    urls = url.split(",")
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(
            session(u, args.max_inflight + 8, args.request_timeout)) for u in urls]  # fmt: skip
        model = args.model
        if not model:
            async with clients[0].get("/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        sampler = LoadSampler(redis_url).start() if redis_url else None
        try:
            recs, wall = await replay(clients, model, requests, ideal, prompt_of, args.speedup,
                                      args.max_inflight, progress=label)  # fmt: skip
        finally:
            samples = sampler.stop() if sampler else []
    errors: dict[str, int] = {}
    for r in recs:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    load = None
    if sampler:
        load = {**load_summary(samples), "sample_errors": sampler.errors}
    return dict(label=label, url=url, model=model, summary=summarize(recs, wall), load=load,
                error_kinds=dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
                requests=[asdict(r) for r in recs])  # fmt: skip


# --- A fresh server per mode ----------------------------------------------------------
@contextmanager
def conveyor_server(mode: str, args: argparse.Namespace, log_dir: Path,
                    label: str | None = None) -> Iterator[tuple]:  # fmt: skip
    """``conveyor serve`` with router mode ``mode`` (its log named after ``label``, default
    the mode), and ``--api-replicas - 1`` more API processes on its Redis; yields
    (comma-separated API urls, redis url)."""
    serve_args = ["--engine", args.engine, "--workers", str(args.workers), "--router-mode",
                  mode, *shlex.split(args.serve_args)]  # fmt: skip
    want = {POOL: args.workers}
    log_path = log_dir / f"serve-{label or mode}.log"
    with conveyor_serve(serve_args, log_path, want, args.server_env, args.server_timeout,
                        args.conveyor) as (url, redis_url):  # fmt: skip
        replicas: list[subprocess.Popen] = []
        try:
            urls = [url]
            for i, rport in enumerate(free_ports(args.api_replicas - 1), start=1):
                renv = {**os.environ, **args.server_env, "CONVEYOR_REDIS_URL": redis_url,
                        "CONVEYOR_ROUTER_MODE": mode}  # fmt: skip
                with open(log_dir / f"api{i}-{label or mode}.log", "wb") as rlog:
                    replicas.append(subprocess.Popen(
                        [args.conveyor, "api", "--port", str(rport)], env=renv, stdout=rlog,
                        stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True))  # fmt: skip
                rurl = f"http://127.0.0.1:{rport}"
                wait_ready(replicas[-1], rurl, want, args.server_timeout, log_path)
                urls.append(rurl)
            yield ",".join(urls), redis_url
        finally:
            for r in replicas:
                stop_group(r)


# --- Report ---------------------------------------------------------------------------
def _f(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Right-aligned columns but the first."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for r in [headers, *rows]:
        assert len(r) == len(headers), "a table row needs one cell per header"
        rest = [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        cells = [r[0].ljust(widths[0]), *rest]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def report(results: dict[str, dict], trace: dict) -> str:
    headers = ["mode", "req", "err", "hit %", "reuse %", "TTFT p50", "TTFT p99",
               "TTFT mean", "E2E p50", "req/s", "out tok/s", "spread", "max/mean", "p95",
               "blk mean", "blk max"]  # fmt: skip
    rows = []
    for label, res in results.items():
        s, ld = res["summary"], res["load"] or {}
        rows.append([label, str(s["requests"]), str(s["errors"]),
                     _f(100 * s["hit_rate"], ".1f"), _f(100 * s["reused_fraction"], ".1f"),
                     _f(s["ttft_p50_ms"], ".1f"), _f(s["ttft_p99_ms"], ".1f"),
                     _f(s["ttft_mean_ms"], ".1f"), _f(s["e2e_p50_ms"], ".1f"),
                     _f(s["req_s"], ".2f"), _f(s["out_tok_s"], ".1f"),
                     _f(ld.get("spread"), ".2f"), _f(ld.get("imbalance_mean"), ".2f"),
                     _f(ld.get("imbalance_p95"), ".2f"),
                     _f(ld.get("mean_blocks"), ".1f"),
                     _f(ld.get("max_blocks"), ".1f")])  # fmt: skip
    out = [f"\nTrace: {trace['requests']} requests over {trace['span_s']:.1f}s (replayed "
           f"{trace['replay_span_s']:.1f}s), {trace['prompt_tokens']} prompt tokens, "
           f"{100 * trace['ideal_fraction']:.1f}% reusable by an ideal cache; "
           f"{trace['block_tokens']} tokens per hash id", "",
           format_table(headers, rows), "",
           "hit % = cached / ideal reusable tokens; reuse % = cached / prompt tokens; times "
           "in ms; spread = busiest worker's time-averaged router KV blocks / the mean "
           "worker's; max/mean, p95 = the same ratio per 50 ms sample (high whenever few "
           "requests are in flight); blk = time-averaged mean and max blocks per "
           "worker"]  # fmt: skip
    ratios = {m: r for m, r in ttft_ratios(results).items() if r == r}
    if "round_robin" in ratios:
        out.append(f"\nmean TTFT round_robin / kv = {ratios['round_robin']:.2f}x")
    for m, r in ratios.items():
        if m != "round_robin":
            out.append(f"mean TTFT {m} / kv = {r:.2f}x")
    for label, res in results.items():
        s, ld = res["summary"], res["load"]
        if res["error_kinds"]:
            out.append(f"\n{label}: {s['errors']} failed; most common:")
            out += [f"  {n} x {e}" for e, n in res["error_kinds"].items()]
        if s["short_outputs"]:
            out.append(f"{label}: WARNING {s['short_outputs']} requests made fewer or more "
                       "tokens than asked (ignore_eos not honoured?)")  # fmt: skip
        if s["send_lag_p99_ms"] > 100:
            out.append(f"{label}: sends ran late (p99 {s['send_lag_p99_ms']:.0f} ms): "
                       "--max-inflight reached or the client is CPU-bound")  # fmt: skip
        if ld is not None and ld["busy_samples"] == 0:
            out.append(f"{label}: no load sample had blocks in use "
                       f"({load_key(POOL)} '<worker>:blocks')")  # fmt: skip
    return "\n".join(out)


def plot_cdf(results: dict[str, dict], path: Path, logx: bool) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, res in results.items():
        ttft = sorted(r["ttft_ms"] for r in res["requests"]
                      if r["error"] is None and r["ttft_ms"] == r["ttft_ms"])  # fmt: skip
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=label)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    if logx:
        ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("TTFT CDF per router mode")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"TTFT CDF: {path}")


def _jsonable(x: object) -> object:
    """NaN -> None, so the file is strict JSON."""
    if isinstance(x, float):
        return None if x != x else x
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


# --- CLI ------------------------------------------------------------------------------
def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad}; allowed: {', '.join(MODES)}")
    return modes


def _token_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.replace(":", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("expected LO,HI") from None
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError("expected 0 <= LO < HI")
    return lo, hi


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, val = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError("expected KEY=VAL")
    return key, val


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="'replay.py gen --out FILE [synthetic knobs]' writes a synthetic trace.",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="Mooncake JSONL trace")
    src.add_argument("--synthetic", action="store_true", help="generate one (knobs below)")
    ap.add_argument("--speedup", type=float, default=1.0, help="divide inter-arrival times")
    ap.add_argument("--max-requests", type=int, help="replay only the first K requests")
    ap.add_argument("--tokens-per-hash-id", type=int, default=tg.MOONCAKE_TOKENS_PER_HASH_ID,
                    help="tokens per hash id in the trace (%(default)s)")  # fmt: skip
    ap.add_argument("--scale-down", type=float, default=1.0, metavar="S",
                    help="divide tokens per hash id, input and output lengths by S")  # fmt: skip
    ap.add_argument("--output-scale-down", type=float,
                    help="divide output lengths by this instead of S")  # fmt: skip
    ap.add_argument("--max-output-tokens", type=int, help="cap output lengths (after scaling)")
    ap.add_argument("--max-input-tokens", type=int, help="cap prompt lengths (after scaling)")
    ap.add_argument("--token-range", type=_token_range, default=tg.DEFAULT_TOKEN_RANGE,
                    metavar="LO,HI", help="prompt token ids in [LO, HI) (32,500)")  # fmt: skip
    ap.add_argument("--engine-block-size", type=int, default=16,
                    help="the engine's KV block size, for ideal reuse (%(default)s)")  # fmt: skip
    srv = ap.add_argument_group("server")
    srv.add_argument(
        "--url",
        help="a running server (one run, labelled --label); several "
        "comma-separated: replicas taking the requests in turn",
    )
    srv.add_argument("--label", default="server", help="row label for --url (%(default)s)")
    srv.add_argument("--redis-url", help="--url: its Redis, to sample router load")
    srv.add_argument("--start-server", action="store_true",
                     help="a fresh 'conveyor serve' per mode of --modes")  # fmt: skip
    srv.add_argument("--modes", type=_modes, default=list(MODES),
                     help="router modes for --start-server (kv,round_robin,random)")  # fmt: skip
    srv.add_argument("--workers", type=int, default=8, help="generate workers (%(default)s)")
    srv.add_argument(
        "--api-replicas",
        type=int,
        default=1,
        help="API processes routing the replay in turn (%(default)s)",
    )
    srv.add_argument("--engine", default="mock", help="conveyor serve --engine (%(default)s)")
    srv.add_argument("--server-env", type=_env_pair, action="append", default=[],
                     metavar="KEY=VAL", help="extra server environment (repeatable)")  # fmt: skip
    srv.add_argument("--serve-args", default="", help="extra 'conveyor serve' arguments")
    srv.add_argument("--conveyor", default=str(Path(sys.executable).parent / "conveyor"),
                     help="the conveyor executable (%(default)s)")  # fmt: skip
    srv.add_argument("--server-timeout", type=float, default=180.0,
                     help="seconds to wait for /health (%(default)s)")  # fmt: skip
    cl = ap.add_argument_group("client and output")
    cl.add_argument("--model", help="model id (default: the first of /v1/models)")
    cl.add_argument("--max-inflight", type=int, default=256, help="(%(default)s)")
    cl.add_argument("--request-timeout", type=float, default=600.0, help="s (%(default)s)")
    cl.add_argument("--json-out", type=Path, help="write results (and per-request records)")
    cl.add_argument("--plot", type=Path, help="TTFT CDF per mode, PNG")
    cl.add_argument("--plot-logx", action="store_true", help="log-scale TTFT axis")
    tg.add_synthetic_args(ap)
    return ap


def load_trace(args: argparse.Namespace) -> list[tg.TraceRequest]:
    reqs = tg.synthesize(tg.synthetic_config(args)) if args.synthetic else tg.read_trace(args.trace)
    if args.max_requests is not None:
        reqs = reqs[: args.max_requests]
    return tg.scale_trace(reqs, args.tokens_per_hash_id, args.scale_down,
                          args.output_scale_down, args.max_output_tokens,
                          args.max_input_tokens)  # fmt: skip


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gen"]:
        return tg.gen_main(argv[1:], prog="replay.py gen")
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.start_server == bool(args.url):
        ap.error("give exactly one of --url and --start-server")
    if args.speedup <= 0 or args.max_inflight < 1:
        ap.error("--speedup must be > 0 and --max-inflight >= 1")
    args.server_env = dict(args.server_env)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    reqs = load_trace(args)
    if not reqs:
        ap.error("the trace has no requests")
    block = tg.scaled_block_tokens(args.tokens_per_hash_id, args.scale_down)
    ideal = tg.ideal_reusable(reqs, block, args.engine_block_size)
    trace = tg.trace_stats(reqs, ideal)
    trace.update(block_tokens=block, replay_span_s=trace["span_s"] / args.speedup)

    # Ctrl-C and SIGTERM unwind through conveyor_server's clean-up
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    results: dict[str, dict] = {}
    failed: dict[str, str] = {}
    if args.url:
        try:
            results[args.label] = asyncio.run(
                run_mode(args.label, args.url, args.redis_url, reqs, ideal, args)
            )
        except (OSError, httpx.HTTPError, aiohttp.ClientError, redis.RedisError, ValueError,
                KeyError) as e:  # fmt: skip
            failed[args.label] = f"{type(e).__name__}: {e}"
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="conveyor-replay-"))
        print(f"server logs in {log_dir}", file=sys.stderr)
        for mode in args.modes:
            print(f"mode {mode}: starting conveyor serve ...", file=sys.stderr)
            try:
                with conveyor_server(mode, args, log_dir) as (url, redis_url):
                    results[mode] = asyncio.run(run_mode(mode, url, redis_url, reqs, ideal, args))
            except (RuntimeError, OSError, httpx.HTTPError, aiohttp.ClientError, redis.RedisError,
                    ValueError,
                    KeyError) as e:  # fmt: skip
                failed[mode] = f"{type(e).__name__}: {e}"
                print(f"mode {mode} failed: {e}", file=sys.stderr)
    if results:
        print(report(results, trace))
    for mode, err in failed.items():
        print(f"\n{mode}: no result ({err.splitlines()[0] if err else 'error'})")
    if args.json_out:
        conf = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        out = dict(config=conf, trace=trace, modes=results, failed=failed,
                   ttft_mean_ratio_vs_kv=ttft_ratios(results))  # fmt: skip
        args.json_out.write_text(json.dumps(_jsonable(out), indent=1))
        print(f"\nresults: {args.json_out}")
    if args.plot and results:
        plot_cdf(results, args.plot, args.plot_logx)
    return 0 if results and not failed else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
