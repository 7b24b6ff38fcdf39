"""What structured outputs cost: ``json_schema`` decoding against free decoding, through
the server on the reference engine.

    python bench/structured_cost.py --start-server          # redis + worker + api, then bench
    python bench/structured_cost.py --url http://127.0.0.1:8000 --model DIR   # a running server

Each side keeps ``--concurrency`` (16) requests in flight until ``--requests`` (64) have
finished: streaming ``/v1/completions``, greedy, token-id prompts of ``--prompt-len`` (128),
every request exactly ``--output-len`` (128) tokens. *free*: ``ignore_eos``. *json*: the
same, with ``response_format`` ``json_schema`` (SCHEMA below: records with a bounded
string, an integer range, an enum and a boolean; the shortest document it allows is far
longer than ``--output-len``, so these requests end on ``length`` too, after the same
number of tokens, every one of them under the grammar's mask). The grammar compiles once,
in the warm-up.

Both sides run back to back in every round, which one goes first alternating (this
machine's speed drifts over tens of seconds), on prompts new in every round (no prefix
cache hit from an earlier run). The report gives each round and the median of the rounds
(``--rounds``, 3): output tok/s per side (all tokens / wall time) and json / free, ITL p50
per side and json - free, TTFT p50, and the engine process's CPU per token. Timing as
``bench/serve_latency.py`` defines it (whose server, client and statistics this reuses).

Targets (issue 30): json tok/s >= 0.90 x free, ITL p50 <= free + 0.5 ms.
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

from serve_latency import (  # noqa: E402
    _cpu_delta,
    _cpu_stats,
    _interrupt,
    local_server,
    make_prompts,
    request_record,
    summarize,
)
from sse_client import SSEClient, run_loop  # noqa: E402

from tasks.settings import DEFAULT_MODEL_DIR  # noqa: E402

TARGETS = {"ratio": 0.90, "itl_ms": 0.5}
SIDES = ("free", "json")
SCHEMA = {
    "type": "array", "minItems": 64, "maxItems": 64,
    "items": {
        "type": "object", "required": ["name", "qty", "unit", "ok"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "qty": {"type": "integer", "minimum": 0, "maximum": 9999},
            "unit": {"enum": ["kg", "g", "l", "ml", "pcs"]},
            "ok": {"type": "boolean"},
        },
    },
}  # fmt: skip


def _body(side: str, model: str, prompt: list[int], n: int) -> dict:
    body = dict(model=model, prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True,
                stream=True, stream_options={"include_usage": True})  # fmt: skip
    if side == "json":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "rows", "schema": SCHEMA}}  # fmt: skip
    return body


async def _one(client: SSEClient, body: dict) -> dict:
    events: list[tuple[float, str, bool]] = []
    tokens = 0
    reason = None
    t0 = time.perf_counter()
    for now, obj in await client.stream("/v1/completions", body):
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
        if obj.get("choices"):
            ch = obj["choices"][0]
            reason = ch.get("finish_reason") or reason
            events.append((now, ch.get("text") or "", ch.get("finish_reason") is not None))
    rec = request_record(t0, events, tokens, body["max_tokens"])
    rec["text"] = "".join(text for _, text, _ in events)
    rec["finish_reason"] = reason
    return rec


async def _side(url: str, side: str, prompts: list[list[int]], args,  # type: ignore[no-untyped-def]
                pids: dict[str, int]) -> dict:  # fmt: skip
    """One side's run: c in flight (the first c started ``--stagger-ms`` apart)."""
    c = args.concurrency
    async with SSEClient(url, c + 4, 300.0) as client:
        model = (await client.get_json("/v1/models"))["data"][0]["id"]
        sem = asyncio.Semaphore(c)

        async def run(i: int, prompt: list[int]) -> dict:
            async with sem:
                if i < c:
                    await asyncio.sleep(i * args.stagger_ms / 1e3)
                return await _one(client, _body(side, model, prompt, args.output_len))

        cpu0, t = {k: _cpu_stats(p) for k, p in pids.items()}, time.perf_counter()
        recs = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t
        cpu = _cpu_delta(pids, cpu0)
    bad = [r for r in recs if r["tokens"] != args.output_len or r["finish_reason"] != "length"]
    assert not bad, f"{side}: {len(bad)} requests did not make {args.output_len} tokens"
    if side == "json":  # what the grammar allowed: a prefix of a document of SCHEMA
        assert all(r["text"].startswith('[{"name":"') for r in recs), recs[0]["text"][:80]
    s = summarize(recs, wall)
    s["engine_cpu_ms_per_token"] = 1e3 * cpu.get("engine", float("nan")) / s["completion_tokens"]
    return s


def _warm_up(url: str, prompts: list[list[int]], args) -> None:  # type: ignore[no-untyped-def]
    """Untimed: both sides once (the grammar compiles here, xgrammar loads)."""

    async def go() -> None:
        async with SSEClient(url, 4, 300.0) as client:
            model = (await client.get_json("/v1/models"))["data"][0]["id"]
            for side, p in zip(SIDES, prompts, strict=True):
                await _one(client, _body(side, model, p, args.output_len))

    run_loop(go())


def _row(label: str, free: dict, js: dict) -> str:
    ratio = js["tok_s"] / free["tok_s"]
    ditl = js["itl_p50"] - free["itl_p50"]
    ok = ratio >= TARGETS["ratio"] and ditl <= TARGETS["itl_ms"]
    return (f"{label:<7} {free['tok_s']:>6.0f} {js['tok_s']:>6.0f} {ratio:>6.3f} "
            f"{free['itl_p50']:>6.2f} {js['itl_p50']:>6.2f} {ditl:>+6.2f} "
            f"{free['tpot_p50']:>6.2f} {js['tpot_p50']:>6.2f} "
            f"{js['tpot_p50'] - free['tpot_p50']:>+6.2f} "
            f"{free['engine_cpu_ms_per_token']:>6.3f} {js['engine_cpu_ms_per_token']:>6.3f}"
            f"  {'ok' if ok else 'MISS'}")  # fmt: skip


def report(rounds: list[dict], steps: list[tuple[float, float]], args) -> dict:  # type: ignore[no-untyped-def]
    out: dict = {}
    if rounds:
        print(f"\nthrough the server: json_schema vs free decoding, c={args.concurrency}, "
              f"{args.requests} requests x {args.output_len} tokens per side and round, "
              f"prompts of {args.prompt_len} tokens")  # fmt: skip
        print(
            f"{'':<7} {'tok/s':>6} {'tok/s':>6} {'json/':>6} {'ITL':>6} {'ITL':>6} "
            f"{'ITL':>6} {'TPOT':>6} {'TPOT':>6} {'TPOT':>6} {'engine':>6} {'engine':>6}"
        )
        print(
            f"{'round':<7} {'free':>6} {'json':>6} {'free':>6} {'free':>6} {'json':>6} "
            f"{'delta':>6} {'free':>6} {'json':>6} {'delta':>6} {'ms/tok':>6} {'ms/tok':>6}"
        )
        print(
            f"{'':<7} {'':>6} {'':>6} {'':>6} {'p50 ms':>6} {'p50 ms':>6} {'':>6} "
            f"{'p50 ms':>6} {'p50 ms':>6} {'':>6} {'free':>6} {'json':>6}"
        )
        for i, r in enumerate(rounds):
            print(_row(f"{i + 1}", r["free"], r["json"]))
        keys = ("tok_s", "itl_p50", "tpot_p50", "engine_cpu_ms_per_token")
        med = {side: {k: statistics.median(r[side][k] for r in rounds) for k in keys}
               for side in SIDES}  # fmt: skip
        print(_row("median", med["free"], med["json"]))
        # the targets on each round's own ratio / delta (the row above: each side's medians)
        ratio = statistics.median(r["json"]["tok_s"] / r["free"]["tok_s"] for r in rounds)
        delta = statistics.median(r["json"]["itl_p50"] - r["free"]["itl_p50"] for r in rounds)
        print(f"median of the rounds' json/free tok/s: {ratio:.3f} (target >= "
              f"{TARGETS['ratio']}); of their ITL p50 delta: {delta:+.2f} ms (target <= "
              f"+{TARGETS['itl_ms']} ms)")  # fmt: skip
        out.update(median=med, ratio=ratio, itl_delta_ms=delta)
    if steps:
        print(f"\nin-process engine: CPU ms per decode step, {args.concurrency} sequences")
        print(f"{'round':<7} {'free':>6} {'json':>6} {'delta':>6}")
        for i, (free, js) in enumerate(steps):
            print(f"{i + 1:<7} {free:>6.2f} {js:>6.2f} {js - free:>+6.2f}")
        delta = statistics.median(js - free for free, js in steps)
        print(
            f"{'median':<7} {statistics.median(f for f, _ in steps):>6.2f} "
            f"{statistics.median(j for _, j in steps):>6.2f} {delta:>+6.2f}"
        )
        out["engine_step_delta_ms"] = delta
    return out


def engine_steps(model_dir: Path, vocab: int, args) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    """In this process, the engine alone: per round, the mean CPU time of a decode step
    (the engine thread's: other processes on the core do not count) with ``--concurrency``
    free sequences and with as many under SCHEMA (which goes first alternates), every step
    of the run in which they all decode; new prompts for each."""
    import threading

    import torch

    from kvbm.protocol import Sampling, StructuredOutput
    from tasks.settings import engine_config
    from workers.engine import Engine
    from workers.engine_api import EngineRequest

    torch.set_num_threads(args.torch_threads)
    c = args.concurrency
    engine = Engine.from_model_dir(model_dir, engine_config(num_kv_blocks=4096))
    woken = threading.Event()
    engine.set_waker(woken.set)
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))

    def run(side: str, seed: int) -> float:
        for i, p in enumerate(make_prompts(c, args.prompt_len, vocab, seed)):
            params = Sampling(max_tokens=args.output_len, temperature=0, ignore_eos=True,
                              structured=spec if side == "json" else None)  # fmt: skip
            assert engine.add_request(EngineRequest(f"{side}{seed}-{i}", p, params)) is None
        times = []
        while engine.has_unfinished:
            t = time.thread_time()
            outs = engine.step()
            dt = time.thread_time() - t
            if not outs and engine.stalled:  # (the warm-up's grammar compiling)
                woken.wait(1.0)
                woken.clear()
            elif len(outs) == c and not any(o.finished for o in outs):
                times.append(dt)
        return 1e3 * statistics.mean(times[1:])  # the first one ran the prompts too

    run("json", 10**6)  # warm-up: xgrammar loads, the grammar compiles
    rounds = []
    for r in range(args.rounds):
        got = {}
        for k, side in enumerate(SIDES[::-1] if r % 2 else SIDES):
            got[side] = run(side, 10**6 + 1 + 2 * r + k)
        rounds.append((got["free"], got["json"]))
        print(f"  engine round {r + 1}: free {got['free']:.2f} ms/step, json "
              f"{got['json']:.2f}", file=sys.stderr)  # fmt: skip
    engine.close()
    return rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--start-server", action="store_true", help="run redis+worker+api here")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64, help="per side and round")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stagger-ms", type=float, default=16.0)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument(
        "--no-pin-engine",
        dest="pin_engine",
        action="store_false",
        help="don't pin the engine to the last CPU and the rest to the others",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default="server,engine",
                    help="server: through the server (the targets); engine: the engine alone "
                    "in this process, ms per decode step")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write raw results here")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    model_dir = args.model.expanduser()

    from workers.model_init import init_model, is_model_dir

    if not is_model_dir(model_dir):
        print(f"creating the tiny default model in {model_dir}", file=sys.stderr)
        init_model(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    ncpu = len(os.sched_getaffinity(0))
    pin = args.pin_engine and ncpu >= 2
    engine_cpu, others = (ncpu - 1,), tuple(range(ncpu - 1))
    rounds: list[dict] = []

    def bench(url: str, pids: dict[str, int]) -> None:
        _warm_up(url, make_prompts(2, args.prompt_len, vocab, args.seed), args)
        for r in range(args.rounds):
            order = SIDES[::-1] if r % 2 else SIDES
            print(f"round {r + 1}/{args.rounds}: {order[0]} first", file=sys.stderr)
            got = {}
            for k, side in enumerate(order):  # new prompts for every side and round
                prompts = make_prompts(args.requests, args.prompt_len, vocab,
                                       args.seed + 1 + 2 * r + k)  # fmt: skip
                got[side] = run_loop(_side(url, side, prompts, args, pids))
                s = got[side]
                print(f"  {side}: {s['tok_s']:.0f} tok/s, ITL p50 {s['itl_p50']:.2f} ms",
                      file=sys.stderr)  # fmt: skip
            rounds.append(got)

    steps: list[tuple[float, float]] = []
    if "engine" in parts:
        if pin:  # the core the server's engine gets
            os.sched_setaffinity(0, engine_cpu)
        steps = engine_steps(model_dir, vocab, args)
    if "server" in parts and args.start_server:
        log_dir = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
        print(f"  starting redis + worker + api (logs in {log_dir})", file=sys.stderr)
        if pin:
            os.sched_setaffinity(0, others)
        with local_server(model_dir, log_dir, args.torch_threads,
                          engine_cpus=",".join(map(str, engine_cpu)) if pin else None,
                          ) as (url, pids):  # fmt: skip
            bench(url, pids)
    elif "server" in parts:
        bench(args.url, {})
    out = report(rounds, steps, args)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), "rounds": rounds,
                                         "engine_steps": steps, **out},
                                        indent=1, default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
