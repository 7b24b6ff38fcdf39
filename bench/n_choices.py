"""``n > 1``: the time to the first token with n choices, and the prompt computed once.

    python bench/n_choices.py                          # n = 1, 2, 4, 8; 1024-token prompts
    python bench/n_choices.py --n 1,8 --prompt-len 512 --requests 6 --rounds 3

Starts ``conveyor serve`` (embedded Redis, one ``generate`` worker on the reference
engine, ``--model`` or the default tiny model; its engine pinned to the last CPU, this
client to the others, as bench/serve_latency.py does) and, per round, for each n (the
order alternating from round to round: this machine's speed drifts), sends ``--requests``
streamed ``/v1/completions`` one at a time, each a fresh random ``--prompt-len``-token
prompt (nothing cached), ``n`` choices of ``--output-len`` tokens (``ignore_eos``,
temperature 1, seeded). Per request: TTFT (submit -> the first chunk with text, whatever
choice), TTFT all (-> every choice has had one) and end to end. After each batch the
worker's heartbeat report gives the prompt tokens it ran through the model
(``prompt_tokens_computed``) and admitted (``prompt_tokens_seen``): per request, in
prompts (1.00: the prompt once).

A baseline row, ``N x n=1``: the largest n as that many n=1 requests of one fresh prompt,
sent together (what a client without ``n`` does; its figures are per group of N): the
prompt is computed once per request that starts before another has cached it.

Per round each figure is the median of its requests; the table shows the median of the
rounds' (``--rounds``, 3). Targets (issue 30): n=8's TTFT <= 1.3 x n=1's; prompt tokens
computed = one prompt per request. ``--json PATH`` writes every request's numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

import redis  # noqa: E402
from common import conveyor_serve  # noqa: E402
from sse_client import SSEClient, run_loop  # noqa: E402

from cluster.keys import alive_key, worker_key  # noqa: E402
from tasks.settings import DEFAULT_MODEL_DIR  # noqa: E402
from workers.model_init import init_model, is_model_dir  # noqa: E402

TTFT_TARGET = 1.3  # n=8's TTFT over n=1's
COUNTERS = ("prompt_tokens_computed", "prompt_tokens_seen")


async def one(client: SSEClient, model: str, prompt: list[int], n: int, out_len: int,
              seed: int) -> dict:  # fmt: skip
    """One streamed request of ``n`` choices: its TTFT, TTFT of every choice, e2e (ms)."""
    body = dict(model=model, prompt=prompt, n=n, max_tokens=out_len, temperature=1.0,
                seed=seed, ignore_eos=True, stream=True)  # fmt: skip
    t0 = time.perf_counter()
    chunks = await client.stream("/v1/completions", body)
    end = time.perf_counter()
    first: dict[int, float] = {}
    for at, chunk in chunks:
        for c in chunk["choices"]:
            if c.get("text"):
                first.setdefault(c["index"], at)
    assert sorted(first) == list(range(n)), f"choices with text: {sorted(first)} of {n}"
    return {"ttft_ms": (min(first.values()) - t0) * 1000,
            "ttft_all_ms": (max(first.values()) - t0) * 1000,
            "e2e_ms": (end - t0) * 1000}  # fmt: skip


async def apart(client: SSEClient, model: str, prompt: list[int], n: int, out_len: int,
                seed: int) -> dict:  # fmt: skip
    """``n`` requests of n=1 and one prompt, sent together: as :func:`one` for them all."""
    t0 = time.perf_counter()
    recs = await asyncio.gather(*(one(client, model, prompt, 1, out_len, seed + i)
                                  for i in range(n)))  # fmt: skip
    return {"ttft_ms": min(r["ttft_ms"] for r in recs),
            "ttft_all_ms": max(r["ttft_all_ms"] for r in recs),
            "e2e_ms": (time.perf_counter() - t0) * 1000}  # fmt: skip


def counters(r: redis.Redis) -> dict[str, int]:
    """The generate worker's counters, once a heartbeat has reported it idle twice alike."""
    last: dict = {}
    for _ in range(100):
        (wid,) = [w.decode() for w in r.zrange(alive_key("generate"), 0, -1)]
        rep = json.loads(r.get(worker_key("generate", wid)))
        now = {k: rep[k] for k in (*COUNTERS, "running", "waiting")}
        if now == last and not now["running"] and not now["waiting"]:
            return now
        last = now
        time.sleep(0.6)  # the heartbeat: 0.5 s
    raise TimeoutError(f"the worker never settled: {last}")


def run_batch(url: str, r: redis.Redis, model: str, prompts: list[list[int]], n: int,
              args: argparse.Namespace, baseline: bool) -> dict:  # fmt: skip
    """One round's requests for one row: their records and the worker's counters moved."""
    before = counters(r)

    async def go() -> list[dict]:
        async with SSEClient(url, max(n, 1), 300.0) as client:
            f = apart if baseline else one
            return [await f(client, model, p, n, args.output_len, 1000 * i)
                    for i, p in enumerate(prompts)]  # fmt: skip

    recs = run_loop(go())
    after = counters(r)
    moved = {k: (after[k] - before[k]) / (len(prompts) * args.prompt_len) for k in COUNTERS}
    return {"requests": recs, "prompts_per_request": moved}


def table(rows: dict[str, list[dict]], args: argparse.Namespace) -> str:
    def med(row: list[dict], key: str) -> float:
        return statistics.median(statistics.median(q[key] for q in rnd["requests"])
                                 for rnd in row)  # fmt: skip

    base = med(rows["n=1"], "ttft_ms")
    out = [f"prompt {args.prompt_len} tokens, {args.output_len} output tokens per choice; "
           f"median of {args.rounds} rounds of {args.requests} requests (c=1)", "",
           "| request | TTFT p50 (ms) | TTFT / n=1 | every choice's first token p50 (ms) | "
           "end to end p50 (ms) | prompts computed per request | prompts admitted per "
           "request |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, row in rows.items():
        ttft = med(row, "ttft_ms")
        per = {k: statistics.median(rnd["prompts_per_request"][k] for rnd in row)
               for k in COUNTERS}  # fmt: skip
        out.append(f"| {name} | {ttft:.1f} | {ttft / base:.2f} | {med(row, 'ttft_all_ms'):.1f} | "
                   f"{med(row, 'e2e_ms'):.1f} | {per['prompt_tokens_computed']:.2f} | "
                   f"{per['prompt_tokens_seen']:.2f} |")  # fmt: skip
    top = f"n={max(args.ns)}"
    if top in rows and max(args.ns) > 1:
        ratio = med(rows[top], "ttft_ms") / base
        computed = statistics.median(rnd["prompts_per_request"]["prompt_tokens_computed"]
                                     for rnd in rows[top])  # fmt: skip
        ok = ratio <= TTFT_TARGET and abs(computed - 1) < 0.01
        out += ["", f"target: {top} TTFT <= {TTFT_TARGET} x n=1 -> {ratio:.2f}; prompt "
                f"computed once -> {computed:.2f} prompts per request: "
                f"{'met' if ok else 'MISSED'}"]  # fmt: skip
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--n", default="1,2,4,8", help="the choices per request to measure")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8, help="per row and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="leave out the N x n=1 row")  # fmt: skip
    ap.add_argument(
        "--no-pin-engine",
        dest="pin_engine",
        action="store_false",
        help="don't pin the engine to the last CPU and this client to the others",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.ns = sorted({int(x) for x in args.n.split(",")} | {1})
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    model_dir = args.model.expanduser()
    if not is_model_dir(model_dir):
        print(f"creating the tiny default model in {model_dir}", file=sys.stderr)
        init_model(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    env = {"CONVEYOR_HEARTBEAT_S": "0.5", "CONVEYOR_MODEL": str(model_dir)}
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin_engine and len(cpus) > 1:
        env["CONVEYOR_ENGINE_CPUS"] = str(cpus[-1])
        os.sched_setaffinity(0, cpus[:-1])
    rng = random.Random(args.seed)
    names = [f"n={n}" for n in args.ns] + ([f"{max(args.ns)} x n=1"] if args.baseline else [])
    rows: dict[str, list[dict]] = {name: [] for name in names}
    log_dir = Path(tempfile.mkdtemp(prefix="n-choices-"))
    with conveyor_serve(["--model", str(model_dir)], log_dir / "serve.log", {"generate": 1},
                        env) as (url, rurl):  # fmt: skip
        r = redis.Redis.from_url(rurl)
        model = model_dir.name

        def fresh(k: int) -> list[list[int]]:
            """``k`` prompts nothing has cached."""
            return [[1] + [rng.randrange(5, vocab) for _ in range(args.prompt_len - 1)]
                    for _ in range(k)]  # fmt: skip

        run_batch(url, r, model, fresh(2), max(args.ns), args, False)  # warm-up
        for rnd in range(args.rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            for name in order:
                baseline = " x " in name
                n = max(args.ns) if baseline else int(name.removeprefix("n="))
                res = run_batch(url, r, model, fresh(args.requests), n, args, baseline)
                rows[name].append(res)
                print(f"round {rnd + 1} {name}: TTFT p50 "
                      f"{statistics.median(q['ttft_ms'] for q in res['requests']):.1f} ms, "
                      f"prompts computed per request "
                      f"{res['prompts_per_request']['prompt_tokens_computed']:.2f}")  # fmt: skip
    print()
    print(table(rows, args))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
