"""KVBM tiers: what onboarding saves, what offload costs, what tiers do for a routed fleet.

    python bench/kvbm_tiers.py                          # all three parts
    python bench/kvbm_tiers.py --part ttft --reps 20    # one part
    python bench/kvbm_tiers.py --quick                  # a smoke run: few reps, short replay

(Not ``bench/kvbm.py``: a module of that name in bench/ would shadow the ``kvbm`` package
for every script run from there, bench/ being first on their path.)

1. **TTFT after eviction** (``--part ttft``). A 2048-token prefix, answered once, pushed
   out of the engine pool (G1) by other traffic, then asked again with a new 16-token
   suffix: time to first token when it is still in G1, onboarded from host memory (G2),
   onboarded from disk (G3), and recomputed (no tiers), median of ``--reps`` (each rep a
   fresh prefix). The reference engine runs in this process on its loop thread, as in a
   worker, one torch thread, on the ``conveyor model init --preset kvbm-bench`` model
   (generated into ``--model`` if missing): 6 layers, hidden 256, 4 KV heads, where a 2k
   prefill costs seconds on one core. G1 holds 160 blocks of 16 tokens; before
   each G3 read the prefix's files are dropped from the page cache (``posix_fadvise``),
   so the disk is read for real (a no-op on tmpfs). Targets (issue 22): G2 >= 5x faster
   than recompute, G3 >= 2x.
2. **Decode step time with offload** (``--part decode``). 16 sequences decode 192 tokens
   each after 256-token prompts, new ones taking the place of those that end, so blocks
   fill (and are written through to G2) all the time; every step that only decodes is
   timed. Offload off and on alternate for ``--rounds``. Target: p99 with offload within
   10% of without.
3. **Routed multi-turn replay** (``--part replay``). ``bench/replay.py`` against 8 mock
   workers (``conveyor serve --engine mock``) whose G1 holds 256 blocks of 16 tokens, on a
   synthetic multi-turn trace whose conversations grow to about half of one worker's G1;
   KV routing without tiers against G2 = 4x G1 (1024 blocks). "hit %" is the share of an
   unbounded cache's reusable tokens that were served cached. Target: >= 85% with G2.

Prints one table per part; ``--json-out`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT)]

import replay as rp  # noqa: E402
import trace_gen as tg  # noqa: E402

from kvbm.protocol import block_hashes, model_namespace  # noqa: E402

BS = 16
PREFIX = 2048
G1_BLOCKS = 160  # 2560 tokens: one 2k prompt and a little more
DEFAULT_MODEL = Path.home() / ".cache" / "conveyor" / "models" / "kvbm-bench"


# --- 1. TTFT after eviction -------------------------------------------------------------
class Timed:
    """An engine on its loop thread, as a worker runs it; ``ttft`` submits one request
    and waits for its end, returning the time to its first output."""

    def __init__(self, model_dir: Path, name: str, **tiers: object) -> None:
        from tasks.settings import engine_config
        from workers.engine import Engine
        from workers.engine_loop import EngineLoop

        self.name = name
        cfg = engine_config(
            num_kv_blocks=G1_BLOCKS,
            max_model_len=PREFIX + 256,
            max_num_batched_tokens=2048,
            **tiers,
        )  # type: ignore[arg-type]
        self.engine = Engine.from_model_dir(model_dir, cfg)
        self._first: dict[str, float] = {}
        self._done: queue.Queue = queue.Queue()
        self.loop = EngineLoop(self.engine, self._sink).start()

    def _sink(self, outs: list) -> None:
        now = time.perf_counter()
        for o in outs:
            self._first.setdefault(o.request_id, now)
            if o.finished:
                self._done.put(o)

    def ttft(self, prompt: list[int], max_tokens: int = 1) -> tuple[float, int]:
        from kvbm.protocol import Sampling
        from workers.engine_api import EngineRequest

        rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        self.loop.submit(EngineRequest(rid, prompt, Sampling(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))  # fmt: skip
        out = self._done.get(timeout=600)
        assert out.request_id == rid and out.finish_reason == "length", out
        return self._first.pop(rid) - t0, out.num_cached_tokens

    def settle(self) -> None:
        """Wait for the offload copies still under way."""
        off = self.engine.scheduler.offload
        while off is not None and off.busy:
            time.sleep(0.005)

    def close(self) -> None:
        self.loop.stop()
        self.engine.close()


def ensure_model(path: Path) -> Path:
    from workers.checkpoint import is_model_dir

    if not is_model_dir(path):
        from workers.model_init import PRESETS, init_model

        print(f"generating the kvbm-bench model in {path}", file=sys.stderr)
        init_model(path, PRESETS["kvbm-bench"])
    return path


def drop_page_cache(engine_dir: Path, model_name: str, prompt: list[int]) -> int:
    """Evict the prefix's G3 files from the page cache; how many were found."""
    ns = model_namespace(model_name)
    n = 0
    for h in block_hashes(prompt, BS, ns):
        for f in engine_dir.glob(f"*/slot-*/{h:016x}.kv"):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            n += 1
    return n


def part_ttft(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(1)
    model = ensure_model(args.model)
    disk = Path(args.disk_dir or tempfile.mkdtemp(prefix="kvbm-bench-"))
    rng = random.Random(22)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, 500) for _ in range(n)]

    engines = {
        "none": Timed(model, "none"),
        "g2": Timed(model, "g2", host_cache_blocks=8 * G1_BLOCKS),
        "g3": Timed(
            model,
            "g3",
            disk_cache_blocks=8 * G1_BLOCKS,
            disk_dir=str(disk),
            disk_offload_filter=False,
        ),  # fmt: skip
    }
    times: dict[str, list[float]] = {"G1 hit": [], "G2 onboard": [], "G3 onboard": [],
                                     "recompute": []}  # fmt: skip
    cached: dict[str, list[int]] = {k: [] for k in times}
    for e in engines.values():  # warm up: kernels, allocator, page faults
        e.ttft([1, *tokens(300)])
    for rep in range(args.reps):
        prefix = [1, *tokens(PREFIX - 1)]
        flood = [[1, *tokens(PREFIX + 256 - 2)] for _ in range(2)]  # 2 x 144 blocks > G1
        for name, e in engines.items():
            e.ttft(prefix + tokens(BS))  # the prefix computed once (and written through)
            if name == "g2":
                t, c = e.ttft(prefix + tokens(BS))
                times["G1 hit"].append(t)
                cached["G1 hit"].append(c)
            for f in flood:
                e.ttft(f)
            e.settle()
            if name == "g3":
                drop_page_cache(disk, "", prefix)
            label = {"none": "recompute", "g2": "G2 onboard", "g3": "G3 onboard"}[name]
            t, c = e.ttft(prefix + tokens(BS))
            times[label].append(t)
            cached[label].append(c)
        print(f"  rep {rep + 1}/{args.reps}: " + ", ".join(
            f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()), file=sys.stderr)  # fmt: skip
    for e in engines.values():
        e.close()
    rec = statistics.median(times["recompute"])
    rows = []
    out = {}
    for k, v in times.items():
        med = statistics.median(v)
        out[k] = {"ttft_median_ms": med * 1e3, "cached_tokens_median": statistics.median(
            cached[k]), "speedup_vs_recompute": rec / med}  # fmt: skip
        rows.append([k, f"{med * 1e3:.1f}", f"{min(v) * 1e3:.1f}", f"{max(v) * 1e3:.1f}",
                     f"{statistics.median(cached[k]):.0f}", f"{rec / med:.1f}x"])  # fmt: skip
    print(
        f"\nTTFT of a {PREFIX}-token prefix asked again after other traffic evicted it "
        f"from G1 ({args.reps} reps, kvbm-bench model, 1 torch thread; G3 in {disk})\n"
    )
    print(rp.format_table(["from", "TTFT median ms", "min", "max", "cached tokens",
                           "vs recompute"], rows))  # fmt: skip
    return out


# --- 2. Decode step time with offload ---------------------------------------------------
def part_decode(args: argparse.Namespace) -> dict:
    import torch

    from kvbm.protocol import Sampling
    from tasks.settings import engine_config
    from workers.engine import Engine
    from workers.engine_api import EngineRequest

    torch.set_num_threads(1)
    model = ensure_model(args.model)
    rng = random.Random(5)
    n_req, conc, prompt_len, out_len = (24, 8, 128, 96) if args.quick else (64, 16, 256, 192)
    prompts = [[1, *(rng.randrange(5, 500) for _ in range(prompt_len - 1))] for _ in range(n_req)]
    steps: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for side in ("off", "on") if r % 2 == 0 else ("on", "off"):
            cfg = engine_config(num_kv_blocks=1024, max_num_seqs=conc,
                               host_cache_blocks=4096 if side == "on" else 0)  # fmt: skip
            e = Engine.from_model_dir(model, cfg)
            real = e.scheduler.schedule
            kinds: list[bool] = []

            def spy(real=real, kinds=kinds):  # type: ignore[no-untyped-def]
                sched = real()
                kinds.append(bool(sched) and all(n == 1 for _, n in sched))
                return sched

            e.scheduler.schedule = spy  # type: ignore[method-assign]
            todo = list(prompts)
            active = 0
            while todo or e.has_unfinished:
                while todo and active < conc:
                    e.add_request(EngineRequest(uuid.uuid4().hex, todo.pop(),
                                                Sampling(max_tokens=out_len,
                                                               temperature=0.0,
                                                               ignore_eos=True)))  # fmt: skip
                    active += 1
                t0 = time.perf_counter()
                outs = e.step()
                dt = time.perf_counter() - t0
                if kinds and kinds[-1]:
                    steps[side].append(dt)
                active -= sum(o.finished for o in outs)
            e.close()
        print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)
    rows = []
    out = {}
    for side, v in steps.items():
        v.sort()
        p50, p99 = rp.pct(v, 50) * 1e3, rp.pct(v, 99) * 1e3
        out[side] = {"steps": len(v), "p50_ms": p50, "p99_ms": p99}
        rows.append([f"offload {side}", str(len(v)), f"{p50:.2f}", f"{p99:.2f}"])
    ratio = out["on"]["p99_ms"] / out["off"]["p99_ms"]
    print(
        f"\nDecode step time, {conc} sequences decoding ({n_req} requests of {prompt_len} + "
        f"{out_len} tokens; G2 write-through on or off), {args.rounds} alternated rounds\n"
    )
    print(rp.format_table(["", "decode steps", "p50 ms", "p99 ms"], rows))
    print(f"p99 with offload / without = {ratio:.3f}")
    out["p99_ratio"] = ratio
    return out


# --- 3. Routed multi-turn replay --------------------------------------------------------
def part_replay(args: argparse.Namespace) -> dict:
    knobs = ["--synthetic", "--start-server", "--workers", "8", "--modes", "kv",
             "--tokens-per-hash-id", "512", "--scale-down", "5", "--system-prompts", "4",
             "--system-len", "4", "--user-len", "2", "--output-len", "256",
             "--max-inflight", "128"]  # fmt: skip
    knobs += (["--sessions", "24", "--turns", "4", "--rate", "8", "--active-sessions", "16",
               "--think-time", "1", "--server-env", "CONVEYOR_MOCK__SPEEDUP=4"]
              if args.quick else
              ["--sessions", "128", "--turns", "6", "--rate", "16", "--active-sessions", "64",
               "--think-time", "2"])  # fmt: skip
    ra = rp.build_parser().parse_args(knobs)
    base_env = dict(ra.server_env)
    base_env.update(CONVEYOR_NUM_KV_BLOCKS="256", CONVEYOR_BLOCK_SIZE="16",
                    CONVEYOR_MAX_MODEL_LEN="4096")  # fmt: skip
    reqs = rp.load_trace(ra)
    block = tg.scaled_block_tokens(ra.tokens_per_hash_id, ra.scale_down)
    ideal = tg.ideal_reusable(reqs, block, BS)
    trace = tg.trace_stats(reqs, ideal)
    trace.update(block_tokens=block, replay_span_s=trace["span_s"] / ra.speedup)
    print(f"replay: {len(reqs)} requests, longest prompt {max(r.input_length for r in reqs)} "
          "tokens (G1 of one worker: 4096)", file=sys.stderr)  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="kvbm-replay-"))
    results: dict[str, dict] = {}
    for label, env in (("kv, no tiers", {}),
                       ("kv, G2 = 4x G1", {"CONVEYOR_KVBM_CPU_CACHE_BLOCKS": "1024"})):  # fmt: skip
        ra.server_env = {**base_env, **env}
        print(f"{label}: starting conveyor serve (logs in {log_dir})", file=sys.stderr)
        with rp.conveyor_server("kv", ra, log_dir, label=label.replace(" ", "").replace(
                ",", "-").replace("=", "")) as (url, redis_url):  # fmt: skip
            results[label] = asyncio.run(rp.run_mode(label, url, redis_url, reqs, ideal, ra))
    print(rp.report(results, trace))
    return {k: v["summary"] for k, v in results.items()}


# --- CLI --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["ttft", "decode", "replay", "all"], default="all")
    ap.add_argument("--reps", type=int, default=20, help="TTFT: prefixes timed (%(default)s)")
    ap.add_argument("--rounds", type=int, default=4,
                    help="decode: alternated off/on rounds (%(default)s)")  # fmt: skip
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                    help="the kvbm-bench model (generated if missing; %(default)s)")  # fmt: skip
    ap.add_argument("--disk-dir", help="TTFT: G3's directory (default: a new temp dir)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 3 reps, 2 rounds, a short replay")  # fmt: skip
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.rounds = min(args.reps, 3), min(args.rounds, 2)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    parts = ["ttft", "decode", "replay"] if args.part == "all" else [args.part]
    out = {}
    for part in parts:
        out[part] = {"ttft": part_ttft, "decode": part_decode, "replay": part_replay}[part](args)
    if args.json_out:
        args.json_out.write_text(json.dumps(rp._jsonable(out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
