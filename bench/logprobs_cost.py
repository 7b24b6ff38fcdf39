"""What logprobs cost: streamed chat at c=16 with ``logprobs=True, top_logprobs=5`` against
the same requests without, through the server; and the same pair on the engine alone.

    python bench/logprobs_cost.py                      # both parts, tiny default model
    python bench/logprobs_cost.py --parts server --rounds 3 --requests 96

``server``: redis, one reference worker and the API, started as bench/serve_latency.py
starts them (the engine pinned to the last CPU, the rest and this client to the others),
streamed ``/v1/chat/completions`` with c requests kept in
flight until ``--requests`` finished; chat prompts of about ``--prompt-len`` tokens (random
token ids decoded to text, new ones for every run, so no run finds another's prompt in
the prefix cache), ``--output-len`` tokens each (``ignore_eos``, greedy). Per round the two
arms run back to back, the first alternating from round to round (this machine's speed
drifts by ~8% over tens of seconds); output tok/s = completion tokens / wall time of the
run. The table shows each round and the median of the rounds per arm, and the ratio of the
medians (the target: >= 0.95). ``engine``: the same pair of workloads through an engine in
this process (its step time without HTTP, Redis or the API), with the CPU time per output
token, for where a gap would come from. ``--json PATH`` writes the raw figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

from common import run_parts  # noqa: E402
from serve_latency import _cpu_delta, _cpu_stats, local_server, output_lengths, pct  # noqa: E402
from sse_client import SSEClient, run_loop  # noqa: E402

from tasks.settings import DEFAULT_MODEL_DIR  # noqa: E402

ARMS = ("plain", "logprobs")
TOP = 5


def chat_prompts(model_dir: Path, n: int, length: int, seed: int) -> list[str]:
    """``n`` user messages of about ``length`` tokens: random token ids, decoded."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(seed)
    vocab = tok.get_vocab_size()
    return [tok.decode([rng.randrange(5, vocab) for _ in range(length)]) for _ in range(n)]


def body(arm: str, model: str, prompt: str, out_len: int) -> dict:
    b = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=out_len,
             temperature=0, ignore_eos=True, stream=True,
             stream_options={"include_usage": True})  # fmt: skip
    if arm == "logprobs":
        b.update(logprobs=True, top_logprobs=TOP)
    return b


async def one(client: SSEClient, b: dict) -> tuple[int, list[float], int, int]:
    """(completion tokens, arrival times of chunks with text, logprob entries seen,
    chunks)."""
    times, tokens, entries, chunks = [], 0, 0, 0
    for now, obj in await client.stream("/v1/chat/completions", b):
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
        for ch in obj.get("choices") or ():
            chunks += 1
            if ch["delta"].get("content"):
                times.append(now)
            if ch.get("logprobs"):
                entries += len(ch["logprobs"]["content"])
    return tokens, times, entries, chunks


async def run_arm(url: str, arm: str, model: str, prompts: list[str], lengths: list[int],
                  concurrency: int) -> dict:  # fmt: skip
    sem = asyncio.Semaphore(concurrency)
    async with SSEClient(url, concurrency, timeout_s=300) as client:

        async def go(p: str, n: int) -> tuple[int, list[float], int, int]:
            async with sem:
                return await one(client, body(arm, model, p, n))

        t0 = time.perf_counter()
        res = await asyncio.gather(*(go(p, n) for p, n in zip(prompts, lengths, strict=True)))
        wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in res)
    entries = sum(r[2] for r in res)
    assert tokens == sum(lengths), f"{arm}: {tokens} tokens, asked {sum(lengths)}"
    assert entries == (tokens if arm == "logprobs" else 0), f"{arm}: {entries} logprob entries"
    itl = [(b - a) * 1e3 for r in res for a, b in zip(r[1], r[1][1:], strict=False)]
    return dict(tok_s=tokens / wall, wall_s=wall, tokens=tokens, itl_p50_ms=pct(itl, 50),
                chunks_per_req=sum(r[3] for r in res) / len(res))  # fmt: skip


def part_server(args: argparse.Namespace, log_dir: Path, out: dict) -> None:
    """As bench/serve_latency.py --start-server: redis, one worker and the API started
    here, the engine on the last CPU, everything else (this client included) on the
    others; per arm, each process's CPU time per output token."""
    model_dir = args.model
    everything = tuple(os.sched_getaffinity(0))
    pin = args.pin_engine and len(everything) >= 2
    if pin:
        os.sched_setaffinity(0, everything[:-1])
    lengths = output_lengths(args.requests, args.output_len, 0.5, args.seed)
    rows = []
    try:
        with local_server(
            model_dir, log_dir, 1, engine_cpus=str(everything[-1]) if pin else None
        ) as (url, pids):
            pids["client"] = os.getpid()
            warm = chat_prompts(model_dir, 32, args.prompt_len, args.seed + 999)
            for arm in ARMS:  # untimed: the API's and the engine's first requests
                run_loop(run_arm(url, arm, model_dir.name,
                                 warm[:16] if arm == "plain" else warm[16:], [8] * 16,
                                 args.concurrency))  # fmt: skip
            for r in range(args.rounds):
                order = ARMS if r % 2 == 0 else ARMS[::-1]
                row: dict = {}
                for k, arm in enumerate(order):
                    prompts = chat_prompts(model_dir, args.requests, args.prompt_len,
                                           args.seed + 10 * r + k)  # fmt: skip
                    cpu0 = {name: _cpu_stats(pid) for name, pid in pids.items()}
                    row[arm] = run_loop(run_arm(url, arm, model_dir.name, prompts, lengths,
                                                args.concurrency))  # fmt: skip
                    cpu = _cpu_delta(pids, cpu0)
                    for name in pids:
                        row[arm][f"{name}_us"] = cpu[name] / row[arm]["tokens"] * 1e6
                    print(f"  round {r + 1} {arm:>8}: {row[arm]['tok_s']:7.1f} tok/s",
                          flush=True)  # fmt: skip
                rows.append(row)
    finally:
        os.sched_setaffinity(0, everything)
    out["server"] = rows
    print(f"\nserver, c={args.concurrency}: streamed chat, {args.requests} requests of "
          f"{args.output_len} +- 50% tokens, logprobs=True top_logprobs={TOP} vs none; "
          "CPU us per output token by process")  # fmt: skip
    keys = ("tok_s", "itl_p50_ms", "chunks_per_req") + tuple(f"{n}_us" for n in pids)
    _table(rows, keys)


def part_engine(args: argparse.Namespace, log_dir: Path, out: dict) -> None:
    import torch

    from kvbm.protocol import Sampling
    from tasks.settings import engine_config
    from workers.engine import Engine
    from workers.engine_api import EngineRequest

    torch.set_num_threads(1)
    lengths = output_lengths(args.requests, args.output_len, 0.5, args.seed)
    rng = random.Random(args.seed)

    def run(arm: str) -> dict:
        engine = Engine.from_model_dir(args.model, engine_config(max_num_seqs=args.concurrency))
        lp = TOP if arm == "logprobs" else None
        queue = [[1] + [rng.randrange(5, 500) for _ in range(args.prompt_len - 1)]
                 for _ in lengths]  # fmt: skip
        pending = list(zip(queue, lengths, strict=True))
        t0, c0, tokens, i = time.perf_counter(), time.process_time(), 0, 0
        while pending or engine.has_unfinished:
            while pending and engine.num_active < args.concurrency:
                p, n = pending.pop()
                engine.add_request(EngineRequest(f"r{i}", p, Sampling(
                    temperature=0, max_tokens=n, ignore_eos=True, logprobs=lp)))  # fmt: skip
                i += 1
            tokens += sum(len(o.token_ids) for o in engine.step())
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return dict(tok_s=tokens / wall, wall_s=wall, tokens=tokens, cpu_us=cpu / tokens * 1e6)

    everything = tuple(os.sched_getaffinity(0))
    if args.pin_engine and len(everything) >= 2:  # the core the server's engine gets
        os.sched_setaffinity(0, everything[-1:])
    rows = []
    try:
        for r in range(args.rounds):
            order = ARMS if r % 2 == 0 else ARMS[::-1]
            rows.append({arm: run(arm) for arm in order})
            print(f"  engine round {r + 1}: " + ", ".join(
                f"{a} {rows[-1][a]['tok_s']:.1f} tok/s" for a in ARMS), flush=True)  # fmt: skip
    finally:
        os.sched_setaffinity(0, everything)
    out["engine"] = rows
    print(f"\nengine in-process, {args.concurrency} in flight, same workload; CPU us per "
          "output token (less sensitive than tok/s to what else runs on the machine)")  # fmt: skip
    _table(rows, ("tok_s", "cpu_us"))


def _table(rows: list[dict], keys: tuple[str, ...]) -> None:
    head = f"{'':>20} " + " ".join(f"{'round ' + str(i + 1):>9}" for i in range(len(rows)))
    print(head + f" {'median':>9}")
    for key in keys:
        for arm in ARMS:
            vals = [row[arm][key] for row in rows]
            print(f"{arm + ' ' + key:>20} " + " ".join(f"{v:9.1f}" for v in vals)
                  + f" {statistics.median(vals):9.1f}")  # fmt: skip
    ratios = [row["logprobs"]["tok_s"] / row["plain"]["tok_s"] for row in rows]
    med = statistics.median(r["logprobs"]["tok_s"] for r in rows) / statistics.median(
        r["plain"]["tok_s"] for r in rows)  # fmt: skip
    verdict = "met" if med >= 0.95 else "MISSED"
    print(f"{'tok/s ratio':>20} " + " ".join(f"{x:9.3f}" for x in ratios) + f" {med:9.3f}"
          + f"   (target >= 0.95: {verdict})")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default="server,engine")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=128, help="per run")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-pin-engine", dest="pin_engine", action="store_false")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.model = args.model.expanduser()
    from workers.model_init import init_model, is_model_dir

    if not is_model_dir(args.model):
        print(f"creating the tiny default model in {args.model}", file=sys.stderr)
        init_model(args.model)
    log_dir = Path(tempfile.mkdtemp(prefix="logprobs-cost-"))
    print(f"logs in {log_dir}", file=sys.stderr)
    return run_parts({"server": part_server, "engine": part_engine}, args, log_dir)


if __name__ == "__main__":
    sys.exit(main())
