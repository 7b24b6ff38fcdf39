"""Helpers the bench scripts share: free loopback ports, ``conveyor serve`` on them, an
HTTP session, reading an OpenAI SSE stream.

The load generator shares this machine's cores with the server it measures, so it should
cost as little as it can: aiohttp (C HTTP parser) reads a stream for less CPU than httpx,
and ``bench/sse_client.py`` goes further for the serving benchmark (docs/performance.md,
"Bench client: a lean SSE reader").
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
CONVEYOR = str(Path(sys.executable).parent / "conveyor")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all held open until all are picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextmanager
def conveyor_serve(
    args: list[str], log_path: Path, want: dict[str, int], env: dict[str, str] | None = None,
    timeout_s: float = 300.0, conveyor: str = CONVEYOR, redis_url: str | None = None,
) -> Iterator[tuple[str, str]]:  # fmt: skip
    """``conveyor serve ARGS`` on free ports (no Flower) with its embedded Redis, under a
    password of our own; yields (API url, Redis url) once ``/health`` shows ``want`` live
    workers per pool, and stops the whole process group at the end. ``redis_url`` (one
    this function yielded before): the embedded Redis on that port and password again, so
    a client kept from the last server finds the next one."""
    port, flower_port, redis_port = free_ports(3)
    password = secrets.token_hex(16)
    if redis_url is not None:
        u = urlsplit(redis_url)
        redis_port, password = u.port or redis_port, u.password or password
    child = {k: v for k, v in os.environ.items() if k != "CONVEYOR_REDIS_URL"}
    child.update(env or {})
    child.update(CONVEYOR_REDIS_PORT=str(redis_port), CONVEYOR_REDIS_PASSWORD=password)
    argv = [conveyor, "serve", "--no-flower", "--port", str(port), "--flower-port",
            str(flower_port), *args]  # fmt: skip
    with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(argv, env=child, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, want, timeout_s, log_path)
        yield url, f"redis://:{password}@127.0.0.1:{redis_port}/0"
    finally:
        stop_group(proc)


def wait_ready(proc: subprocess.Popen, url: str, want: dict[str, int], timeout_s: float,
               log: Path) -> None:  # fmt: skip
    """Until ``url``'s /health is 200 with at least ``want[pool]`` live workers per pool."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{proc.args[1]} exited with {proc.returncode}:\n{tail}")
        try:
            r = httpx.get(f"{url}/health", timeout=2, trust_env=False)
            last = f"{r.status_code} {r.text[:200]}"
            live = r.json().get("workers") or {}
            if r.status_code == 200 and all(live.get(p, 0) >= n for p, n in want.items()):
                return
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health not showing {want} live workers after {timeout_s:.0f}s "
                       f"(last: {last}); log: {log}")  # fmt: skip


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGINT to a server's process group, SIGKILL if it is still there after grace_s."""
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            print(f"  server {proc.pid} ignored SIGINT for {grace_s:.0f}s: SIGKILL",
                  file=sys.stderr)  # fmt: skip
    with suppress(ProcessLookupError):  # stragglers in the group (workers, redis)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def session(url: str, max_connections: int, timeout_s: float) -> aiohttp.ClientSession:
    """A keep-alive HTTP session on ``url`` (use as ``async with``); no proxies from env."""
    return aiohttp.ClientSession(
        url,
        connector=aiohttp.TCPConnector(limit=max_connections),
        timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=10.0),
    )


async def stream_chunks(
    client: aiohttp.ClientSession, path: str, body: dict
) -> AsyncIterator[tuple[float, dict]]:
    """POST ``body`` with ``stream: true`` and yield ``(arrival time, chunk)`` for every
    data chunk up to ``[DONE]``; an HTTP error or an error event raises ``RuntimeError``
    with the server's message."""
    async with client.post(path, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {error_text(await r.read())}")
        async for line in r.content:  # one line at a time, as they arrive
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            now = time.perf_counter()
            obj = json.loads(data)
            if (msg := event_error(obj)) is not None:
                raise RuntimeError(f"stream error: {msg}")
            yield now, obj
        raise RuntimeError("stream ended without [DONE]")


def event_error(obj: dict) -> object | None:
    """An SSE error event's message (its ``error`` value if that has no message); None
    when the event is not an error."""
    if "error" not in obj:
        return None
    err = obj["error"]
    return err.get("message", err) if isinstance(err, dict) else err


def error_text(body: bytes) -> str:
    """The OpenAI error body's message, else the body's head."""
    try:
        err = json.loads(body)["error"]
        return str(err.get("message", err))[:300]
    except (ValueError, KeyError, TypeError, AttributeError):
        return body[:300].decode(errors="replace")


def run_parts(parts: dict, args, log_dir: Path) -> int:  # type: ignore[no-untyped-def]
    """Run the ``--parts`` a bench names (each ``part(args, log_dir, out)`` adds its figures
    to ``out``), on servers of their own (no inherited ``CONVEYOR_REDIS_URL``); write
    ``out`` with the arguments to ``--json`` if given."""
    os.environ.pop("CONVEYOR_REDIS_URL", None)
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    for name in args.parts.split(","):
        parts[name](args, log_dir, out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0
