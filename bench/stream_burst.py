"""A burst of SSE streams opened at once by one httpx client, against ``conveyor serve``
with the mock engine: how many complete, and how the others ended.

    python bench/stream_burst.py --model DIR [--streams 1000] [--runs 3] [--conveyor EXE]

``--conveyor``: serve through a wrapper, e.g. a script that runs ``ulimit -Sn 1024`` and
execs ``conveyor`` (the API's open-files soft limit at start, as on many hosts).

One ``httpx.AsyncClient`` whose connection limit admits every stream, each a streamed
chat completion read to ``[DONE]``: the way a user's load generator opens them (the
connections all at once, each with its request right behind). Prints a table: per run,
streams complete, failed, and the first errors by kind.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import CONVEYOR, conveyor_serve


async def _one(client: httpx.AsyncClient, url: str, model: str, tokens: int) -> int:
    """Stream one chat completion to ``[DONE]``; its completion tokens (the usage chunk's)."""
    body = {"model": model, "messages": [{"role": "user", "content": "a burst"}],
            "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    n = -1
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return n
            if line.startswith("data: ") and '"usage":{' in line:
                n = json.loads(line[6:])["usage"]["completion_tokens"]
    raise RuntimeError("stream ended without [DONE]")


async def burst(client: httpx.AsyncClient, url: str, model: str, streams: int,
                tokens: int) -> collections.Counter:  # fmt: skip
    results = await asyncio.gather(*(_one(client, url, model, tokens) for _ in range(streams)),
                                   return_exceptions=True)  # fmt: skip
    out: collections.Counter = collections.Counter()
    for r in results:
        if isinstance(r, BaseException):
            root: BaseException = r  # httpx's errors wrap httpcore's, which wrap the socket's
            while (inner := root.__cause__ or root.__context__) is not None:
                root = inner
            why = f"{type(r).__name__}: {str(r)[:200]}"
            out[why + (f" ({type(root).__name__}: {root})" if root is not r else "")] += 1
        else:
            out["complete" if r == tokens else f"{r} tokens"] += 1
    return out


async def bursts(url: str, model: str, args: argparse.Namespace) -> list:
    """``args.runs`` bursts, ``args.gap`` s apart, on one client (its idle keep-alive
    connections carry the next burst's first requests)."""
    limits = httpx.Limits(max_connections=args.streams + 10,
                          max_keepalive_connections=args.streams + 10)  # fmt: skip
    rows = []
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(180.0)) as client:
        for i in range(args.runs):
            if i:
                await asyncio.sleep(args.gap)
            t0 = time.monotonic()
            got = await burst(client, url, model, args.streams, args.tokens)
            rows.append((i, time.monotonic() - t0, got))
            print(f"run {i}: {time.monotonic() - t0:.1f} s {dict(got)}", file=sys.stderr)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model dir (conveyor model init DIR)")
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--engine", default="mock", choices=["mock", "reference"])
    p.add_argument("--conveyor", default=CONVEYOR, help="the conveyor executable to serve with")
    p.add_argument("--gap", type=float, default=5.0, help="seconds between bursts")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 4 * args.streams + 1000)
    if soft < want:  # the API inherits it
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    per_worker = args.streams // args.workers + 10
    env = {"CONVEYOR_ENGINE": "mock", "CONVEYOR_WORKER_CONCURRENCY": str(per_worker),
           "CONVEYOR_MAX_NUM_SEQS": str(per_worker), "CONVEYOR_NUM_KV_BLOCKS": "4096",
           "CONVEYOR_WORKER_MAX_REQUESTS": "0", "CONVEYOR_MOCK__DECODE_STEP_MS": "100",
           "CONVEYOR_MOCK__DECODE_MS_PER_SEQ": "0.02"}  # fmt: skip
    log = Path(tempfile.mkdtemp(prefix="stream_burst-")) / "serve.log"
    model = Path(args.model).name
    serve = ["--model", args.model, "--engine", args.engine, "--workers", str(args.workers)]
    with conveyor_serve(serve, log, {"generate": args.workers}, env=env,
                        conveyor=args.conveyor) as (url, _):  # fmt: skip
        rows = asyncio.run(bursts(url, model, args))
    print(f"\n{args.streams} streams x {args.tokens} tokens, one httpx client (serve log: {log})")
    print(f"{'run':>3} {'s':>6} {'complete':>8} {'failed':>6}  errors")
    for i, took, got in rows:
        errors = {k: v for k, v in got.items() if k != "complete"}
        print(f"{i:>3} {took:>6.1f} {got['complete']:>8} {sum(errors.values()):>6}  {errors}")
    return 0 if all(got["complete"] == args.streams for _, _, got in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
