"""CPU per request, per server process: Conveyor's pipeline against Dynamo's, side by side.

    python bench/cpu_per_request.py --peer-dir /work/peers          # conveyor-mock + dynamo
    python bench/cpu_per_request.py --subjects conveyor-mock,conveyor-ref --model DIR
    python bench/cpu_per_request.py --peer-dir DIR --concurrency 64 --requests 1024

Each subject is a whole server started here, with its engine taking (next to) no time,
driven by the same client: ``--requests`` streamed chat completions (a prompt of about
``--isl`` tokens, ``--osl`` output tokens with ``ignore_eos``), ``--concurrency`` in
flight, after ``--warmup`` requests. A server's CPU is the change in user + system time
(``/proc/<pid>/stat``) of every process in its process tree over the timed requests,
split by role (api, celery worker, engine, redis, flower, ...); the client runs in this
process and is not counted. Subjects:

    conveyor-mock   ``conveyor serve`` (API, one worker, Flower, embedded Redis), the mock
                    engine at ``--speedup`` (1000: steps take ~zero time)
    conveyor-ref    the same with the reference (torch) engine on ``--model``
    conveyor-pd     ``conveyor serve --mode disagg`` with the reference engine (KV over
                    ``--kv-transfer``): the disaggregated pipeline's cost
    dynamo          Dynamo 1.6.1's frontend + mocker at ``--speedup`` (``../shared/peers``,
                    installed in ``--peer-dir``; file discovery, no etcd or NATS)

Subjects run one after the other within a run, and ``--runs`` (3) runs repeat them; the
table gives each run's figures and the median. The model is ``--peer-dir``'s
``tiny-llama-w`` (the peers' 5M-parameter Llama with an 8k vocabulary) unless ``--model``
says otherwise; Dynamo's mocker reads ``tiny-llama`` (the same tokenizer and config).

Targets (issue 33): Conveyor's CPU per request <= Dynamo's, and so req/s >= and TTFT mean
<= Dynamo's, at c=16 and at c=64 with 1,024 requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from common import CONVEYOR, ROOT, free_ports, stop_group, wait_ready  # noqa: E402
from sse_client import SSEClient, StreamError, run_loop  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PEERS = ROOT.parent / "shared" / "peers"
WORDS = ("river stone light green paper window quiet number garden yellow music table "
         "winter orange simple travel market silver")  # fmt: skip


# --------------------------------------------------------------------------------------
# Processes and their CPU
# --------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system seconds) of a live process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = raw[raw.rindex(")") + 2 :].split()  # the command name may hold spaces
    return int(f[1]), (int(f[11]) + int(f[12])) / TICK


def tree(roots: list[int]) -> dict[int, float]:
    """Every live process under (and including) ``roots``: pid -> CPU seconds so far."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            stats[int(d)] = st
    out: dict[int, float] = {}
    todo = [r for r in roots if r in stats]
    while todo:
        pid = todo.pop()
        out[pid] = stats[pid][1]
        todo += [p for p, (pp, _) in stats.items() if pp == pid and p not in out]
    return out


def role(pid: int) -> str:
    """What a server process is, from its command line (a process that multiprocessing
    spawned is its parent's: the API's processes, or a worker's engine)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    cmd = " ".join(a.decode(errors="replace") for a in argv if a)
    if "multiprocessing.spawn" in cmd and (st := _stat(pid)) is not None:
        parent = role(st[0])
        return {"celery worker": "engine", "api": "api"}.get(parent, parent)
    for needle, name in (("conveyor serve", "supervisor"), ("tasks.cli serve", "supervisor"),
                         ("redis-server", "redis"), ("tasks.flower", "flower"),
                         ("engine_proc", "engine"),
                         ("encode_server", "encode"), ("resource_tracker", "mp tracker"),
                         ("tasks.cli worker", "celery worker"), ("celery", "celery worker"),
                         ("tasks.cli api", "api"), ("uvicorn", "api"),
                         ("dynamo.frontend", "frontend"),
                         ("dynamo.mocker", "mocker")):  # fmt: skip
        if needle in cmd:
            return name
    return "other: " + cmd[:60]


def cpu_by_role(before: dict[int, float], after: dict[int, float],
                roles: dict[int, str]) -> dict[str, float]:  # fmt: skip
    """CPU seconds per role between two :func:`tree` snapshots (a process that started
    meanwhile counts from 0; one that ended meanwhile is lost, and is reported)."""
    out: dict[str, float] = {}
    for pid, t in after.items():
        name = roles.setdefault(pid, role(pid))
        out[name] = out.get(name, 0.0) + t - before.get(pid, 0.0)
    gone = set(before) - set(after)
    if gone:
        print(f"  note: {len(gone)} server processes ended during the run", file=sys.stderr)
    return out


# --------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------
@contextmanager
def conveyor(subject: str, model: Path, speedup: float, log: Path, kv_transfer: str,
             api_workers: int = 1, extra_env: dict[str, str] | None = None,
             ) -> Iterator[tuple[str, list[int]]]:  # fmt: skip
    """``conveyor serve`` with Flower and its embedded Redis, as ``make serve`` runs it;
    yields (API url, the root pids of its process tree)."""
    port, flower_port, redis_port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_MODEL=str(model), CONVEYOR_SERVED_MODEL_NAME="tiny-llama",
               CONVEYOR_REDIS_PORT=str(redis_port),
               CONVEYOR_REDIS_PASSWORD=secrets.token_hex(16))  # fmt: skip
    env.update(extra_env or {})
    args = ["--port", str(port), "--flower-port", str(flower_port),
            "--api-workers", str(api_workers)]  # fmt: skip
    want = {"generate": 1}
    if subject == "conveyor-mock":
        env.update(CONVEYOR_ENGINE="mock", CONVEYOR_MOCK__SPEEDUP=str(speedup))
    else:
        env["CONVEYOR_ENGINE"] = "reference"
    if subject == "conveyor-pd":
        args += ["--mode", "disagg", "--kv-transfer", kv_transfer]
        want = {"prefill": 1, "decode": 1}
    with open(log, "wb") as out:
        proc = subprocess.Popen([CONVEYOR, "serve", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, want, 300, log)
        yield url, [proc.pid]
    finally:
        stop_group(proc)


@contextmanager
def dynamo(peer_dir: Path, speedup: float, log: Path) -> Iterator[tuple[str, list[int]]]:
    """Dynamo's frontend (:8090) and mocker, through the peers' scripts."""
    env = {**os.environ, "PEER_DIR": str(peer_dir)}
    subprocess.run(["bash", str(PEERS / "dyn_mocker_up.sh"), str(speedup)], env=env,
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    url = "http://127.0.0.1:8090"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                models = httpx.get(f"{url}/v1/models", timeout=2).json().get("data") or []
                if models:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"Dynamo lists no model after 180 s; logs in {peer_dir}/logs")
            time.sleep(0.5)
        pids = [int((peer_dir / f"{n}.pid").read_text()) for n in ("frontend", "mocker")]
        log.write_text(f"see {peer_dir}/logs\n")
        yield url, pids
    finally:
        subprocess.run(["bash", str(PEERS / "down.sh")], env=env, stdout=subprocess.DEVNULL)
        time.sleep(1.0)


# --------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------
def prompts(n: int, isl: int, seed: int, tokenizer: Path | None = None) -> list[str]:
    """``n`` distinct prompts of about ``isl`` tokens by ``tokenizer`` (a tokenizer.json;
    without one, a word counts as a token), the chat template's few left out."""
    words = WORDS.split()
    rng = random.Random(seed)
    count = len
    if tokenizer is not None and tokenizer.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer))
        count = lambda text: len(tok.encode(text, add_special_tokens=False).ids)  # noqa: E731
    out = []
    for i in range(n):
        text = f"{i}:"
        while count(text) < isl - 8:
            text += " " + rng.choice(words)
        out.append(text)
    return out


async def drive(url: str, texts: list[str], osl: int, concurrency: int) -> dict[str, Any]:
    """Stream one chat per text, ``concurrency`` at a time: wall time, TTFT and tokens."""
    ttft: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    queue = list(reversed(texts))
    async with SSEClient(url, concurrency, 120.0) as client:

        async def one() -> None:
            while queue:
                text = queue.pop()
                body = {"model": "tiny-llama", "stream": True, "max_tokens": osl,
                        "ignore_eos": True, "temperature": 0,
                        "messages": [{"role": "user", "content": text}],
                        "stream_options": {"include_usage": True}}  # fmt: skip
                t0 = time.perf_counter()
                try:
                    events = await client.stream("/v1/chat/completions", body)
                except StreamError as e:
                    errors.append(str(e))
                    continue
                first = next((t for t, ev in events if any(
                    (c.get("delta") or {}).get("content") for c in ev.get("choices") or [])),
                    None)  # fmt: skip
                if first is not None:
                    ttft.append(first - t0)
                usage = next((ev["usage"] for _, ev in reversed(events) if ev.get("usage")), {})
                tokens.append(int(usage.get("completion_tokens") or 0))

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"wall": wall, "ttft": ttft, "tokens": tokens, "errors": errors}


# --------------------------------------------------------------------------------------
def measure(subject: str, args: argparse.Namespace, run: int, logs: Path) -> dict[str, Any]:
    log = logs / f"{subject}-{run}.log"
    model = Path(args.model) if args.model else Path(args.peer_dir) / "tiny-llama-w"
    if subject == "dynamo":
        server = dynamo(Path(args.peer_dir), args.speedup, log)
    else:
        server = conveyor(subject, model, args.speedup, log, args.kv_transfer, args.api_workers,
                          dict(e.split("=", 1) for e in args.env))  # fmt: skip
    with server as (url, roots):
        seed = 1000 * run  # every subject of a run gets the same prompts
        tok = model / "tokenizer.json"
        run_loop(drive(url, prompts(args.warmup, args.isl, seed, tok), args.osl,
                       args.concurrency))  # fmt: skip
        texts = prompts(args.requests, args.isl, seed + 1, tok)
        roles: dict[int, str] = {}
        before = tree(roots)
        res = run_loop(drive(url, texts, args.osl, args.concurrency))
        after = tree(roots)
        cpu = cpu_by_role(before, after, roles)
    n = len(res["tokens"])
    if res["errors"]:
        print(f"  {subject}: {len(res['errors'])} errors, first: {res['errors'][0]}",
              file=sys.stderr)  # fmt: skip
    return {"subject": subject, "run": run, "requests": n, "errors": len(res["errors"]),
            "wall_s": res["wall"], "req_s": n / res["wall"],
            "ttft_mean_ms": 1000 * statistics.fmean(res["ttft"]) if res["ttft"] else float("nan"),
            "tokens_mean": statistics.fmean(res["tokens"]) if res["tokens"] else 0.0,
            "cpu_ms": {k: 1000 * v / max(n, 1) for k, v in sorted(cpu.items())},
            "cpu_ms_total": 1000 * sum(cpu.values()) / max(n, 1)}  # fmt: skip


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\nCPU per request: {args.requests} streamed chats, ISL ~{args.isl}, OSL {args.osl}, "
        f"c={args.concurrency}, engines at {args.speedup:g}x; cpus={os.cpu_count()}"
    )
    print(f"{'subject':<15} {'run':>3} {'CPU ms/req':>10} {'req/s':>7} {'TTFT ms':>8} "
          f"{'tok/req':>7}  by process (ms/req)")  # fmt: skip
    for r in rows:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms"].items() if v >= 0.005)
        print(f"{r['subject']:<15} {r['run']:>3} {r['cpu_ms_total']:>10.2f} {r['req_s']:>7.0f} "
              f"{r['ttft_mean_ms']:>8.1f} {r['tokens_mean']:>7.1f}  {parts}")  # fmt: skip
    print("\nmedians:")
    for subject in dict.fromkeys(r["subject"] for r in rows):
        mine = [r for r in rows if r["subject"] == subject]
        med = {k: statistics.median(r[k] for r in mine)
               for k in ("cpu_ms_total", "req_s", "ttft_mean_ms")}  # fmt: skip
        roles = sorted({k for r in mine for k in r["cpu_ms"]})
        parts = ", ".join(f"{k} {statistics.median(r['cpu_ms'].get(k, 0.0) for r in mine):.2f}"
                          for k in roles)  # fmt: skip
        print(f"{subject:<15} {med['cpu_ms_total']:>14.2f} {med['req_s']:>7.0f} "
              f"{med['ttft_mean_ms']:>8.1f}          {parts}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--subjects", default="conveyor-mock,dynamo")
    ap.add_argument("--peer-dir", default=os.environ.get("PEER_DIR"),
                    help="where ../shared/peers installed Dynamo and the checkpoints")  # fmt: skip
    ap.add_argument("--model", help="Conveyor's model dir (default: PEER_DIR/tiny-llama-w)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--speedup", type=float, default=1000.0)
    ap.add_argument("--kv-transfer", default="redis", help="conveyor-pd's KV transfer")
    ap.add_argument("--api-workers", type=int, default=1, help="Conveyor's API processes")
    ap.add_argument("--env", action="append", default=[], metavar="CONVEYOR_X=VALUE",
                    help="a setting for Conveyor's servers (repeatable)")  # fmt: skip
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", help="write every run's figures here")
    args = ap.parse_args()
    subjects = args.subjects.split(",")
    if args.model is None and args.peer_dir is None:
        ap.error("give --peer-dir (the peers' checkpoints and Dynamo) or --model")
    if "dynamo" in subjects and args.peer_dir is None:
        ap.error("the dynamo subject needs --peer-dir")
    logs = Path(tempfile.mkdtemp(prefix="cpu-per-request-"))
    rows = []
    for run in range(1, args.runs + 1):
        order = subjects if run % 2 else subjects[::-1]  # neither side always goes first
        for subject in order:
            rows.append(measure(subject, args, run, logs))
            r = rows[-1]
            print(f"  run {run} {subject}: {r['cpu_ms_total']:.2f} ms/req, {r['req_s']:.0f} "
                  f"req/s, TTFT {r['ttft_mean_ms']:.1f} ms", file=sys.stderr)  # fmt: skip
    rows.sort(key=lambda r: (subjects.index(r["subject"]), r["run"]))
    report(rows, args)
    print(f"(logs: {logs})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
