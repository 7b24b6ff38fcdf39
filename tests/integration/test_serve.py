"""``conveyor serve``: one command brings up Redis, a worker, the API and Flower; SIGINT
stops every child and leaves no orphan."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import BIN, free_port, spawn, wait_for

pytestmark = pytest.mark.integration


def _descendants(pid: int) -> set[int]:
    """All processes whose ancestry leads to ``pid`` (from /proc)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parent[int(entry)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    out: set[int] = set()
    frontier = {pid}
    while frontier:
        nxt = {c for c, p in parent.items() if p in frontier and c not in out}
        out |= nxt
        frontier = nxt
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_runs_everything_and_stops_cleanly(
    tiny_model_dir: Path, tmp_path: Path, sig: int
) -> None:
    api_port, flower_port, redis_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_NUM_KV_BLOCKS="256", CONVEYOR_HEARTBEAT_S="0.5",
               CONVEYOR_SERVE_STATE_DIR=str(tmp_path / "state"))  # fmt: skip
    argv = [
        str(BIN / "conveyor"),
        "serve",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(api_port),
        "--flower-port",
        str(flower_port),
        "--redis-port",
        str(redis_port),
        "--workers",
        "1",
    ]
    serve = spawn("serve", argv, env, tmp_path)
    url = f"http://127.0.0.1:{api_port}"
    try:
        wait_for(
            lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200,
            120,
            "serve healthy",
            [serve],
        )
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=60,
            json={
                "model": tiny_model_dir.name,
                "prompt": "hello",
                "max_tokens": 4,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        wait_for(
            lambda: (
                httpx.get(f"http://127.0.0.1:{flower_port}/healthcheck", timeout=1).status_code
                == 200
            ),
            60,
            "flower",
            [serve],
        )
        kids = _descendants(serve.popen.pid)
        assert len(kids) >= 4, "redis, worker, api and flower should be running"
        serve.popen.send_signal(sig)  # as Ctrl-C / docker stop would
        assert serve.popen.wait(60) == 0, serve.tail()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(k) for k in kids):
            time.sleep(0.2)
        assert not [k for k in kids if _alive(k)], f"orphans left: {kids}\n{serve.tail()}"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=1)
    finally:
        if serve.popen.poll() is None:
            serve.stop(signal.SIGKILL)
            subprocess.run(["pkill", "-f", f"--port {redis_port}"], check=False)


def test_cli_help_everywhere() -> None:
    for cmd in (
        [],
        ["serve"],
        ["status"],
        ["worker"],
        ["api"],
        ["flower"],
        ["queues"],
        ["worker-health"],
        ["model"],
        ["model", "init"],
    ):
        out = subprocess.run(
            [str(BIN / "conveyor"), *cmd, "--help"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, (cmd, out.stderr)
        assert "Usage:" in out.stdout
