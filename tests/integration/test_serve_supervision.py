"""``conveyor serve`` keeps serving when one of its processes dies: the supervisor restarts
it with backoff, stops the deployment on a crash loop, and reports its processes through
``conveyor status``. Real processes throughout: ``kill -9`` on a real worker, API, Flower
and redis-server, requests over real HTTP while they die and come back."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis

from cluster.membership import live_workers
from tasks.serve_state import ServeState
from tests.integration.conftest import BIN, Proc, free_port, spawn, wait_for
from tests.integration.test_serve import _alive, _descendants

pytestmark = pytest.mark.integration

TTL_S = 3.0  # CONVEYOR_WORKER_TTL_S: a killed worker counts as live at most this long


@dataclass
class Serve:
    proc: Proc
    url: str
    flower_url: str
    redis_url: str
    state_file: Path
    model: str
    argv: list[str]
    env: dict[str, str]

    def table(self) -> dict[str, dict]:
        state = ServeState.read(self.state_file)
        assert state is not None, f"no process table at {self.state_file}"
        return {p.name: {"pid": p.pid, "state": p.state, "restarts": p.restarts,
                         "last_exit": p.last_exit} for p in state.processes}  # fmt: skip

    def complete(self, timeout: float = 10.0, **extra: object) -> httpx.Response:
        body = {"model": self.model, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        return httpx.post(f"{self.url}/v1/completions", json=body | extra, timeout=timeout)

    def status(self, *flags: str) -> subprocess.CompletedProcess:
        port = self.url.rsplit(":", 1)[1]
        env = {**os.environ, "CONVEYOR_SERVE_STATE_DIR": str(self.state_file.parent)}
        return subprocess.run([str(BIN / "conveyor"), "status", "--port", port, *flags],
                              env=env, capture_output=True, text=True, timeout=60)  # fmt: skip


@contextmanager
def serving(tmp_path: Path, model_dir: Path, *flags: str, **env_extra: str) -> Iterator[Serve]:
    """``conveyor serve --engine mock`` on free ports; whatever is left is killed after."""
    api_port, flower_port, redis_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_HEARTBEAT_S="0.5", CONVEYOR_WORKER_TTL_S=str(TTL_S),
               CONVEYOR_SERVE_STATE_DIR=str(tmp_path / "state"), PYTHONUNBUFFERED="1",
               CONVEYOR_REDIS_PASSWORD="supervised", **env_extra)  # fmt: skip
    argv = [str(BIN / "conveyor"), "serve", "--engine", "mock", "--model", str(model_dir),
            "--port", str(api_port), "--flower-port", str(flower_port),
            "--redis-port", str(redis_port), *flags]  # fmt: skip
    proc = spawn("serve", argv, env, tmp_path)
    s = Serve(proc, f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{flower_port}",
              f"redis://:supervised@127.0.0.1:{redis_port}/0",
              tmp_path / "state" / f"{api_port}.json",
              model_dir.name, argv, env)  # fmt: skip
    kids: set[int] = set()
    try:
        yield s
    finally:
        if proc.popen.poll() is None:
            kids = _descendants(proc.popen.pid)
            proc.stop(signal.SIGINT, timeout=40)
        for pid in kids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _healthy(s: Serve, workers: int) -> bool:
    r = httpx.get(f"{s.url}/health", timeout=1)
    return r.status_code == 200 and r.json()["workers"]["generate"] == workers


def _wait_restarted(s: Serve, name: str, old_pid: int, timeout: float) -> int:
    """The new pid of ``name`` once the supervisor has restarted it."""
    got: list[int] = []

    def restarted() -> bool:
        p = s.table()[name]
        if p["state"] == "running" and p["pid"] not in (None, old_pid):
            got.append(p["pid"])
            return True
        return False

    wait_for(restarted, timeout, f"{name} restarted", [s.proc])
    return got[-1]


class Traffic:
    """Requests one after another from a thread, each recorded with when it was sent."""

    def __init__(self, s: Serve) -> None:
        self.s = s
        self.log: list[tuple[float, bool, str]] = []  # (sent, ok, what)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                r = self.s.complete()
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
                self.log.append((t, ok, f"{r.status_code} {r.text[:200]}"))
            except httpx.HTTPError as e:
                self.log.append((t, False, repr(e)))
            time.sleep(0.05)

    def sent_after(self, t: float) -> list[tuple[float, bool, str]]:
        return [x for x in list(self.log) if x[0] >= t]


def _no_orphans(kids: set[int]) -> list[int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(k) for k in kids):
        time.sleep(0.2)
    return [k for k in kids if _alive(k)]


# ======================================================================================
def test_killed_worker_api_and_flower_are_restarted_and_serving_goes_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with serving(tmp_path, tiny_model_dir, "--workers", "2") as s:
        wait_for(lambda: _healthy(s, 2), 120, "2 workers up", [s.proc])
        wait_for(lambda: httpx.get(f"{s.flower_url}/healthcheck", timeout=1).status_code == 200,
                 60, "flower up", [s.proc])  # fmt: skip
        before = s.table()
        assert set(before) == {
            "redis",
            "worker-generate-0",
            "worker-generate-1",
            "api",
            "flower",
            "batch-runner",
        }
        assert all(p["state"] == "running" and p["restarts"] == 0 for p in before.values())
        r = redis.Redis.from_url(s.redis_url)

        with Traffic(s) as traffic:
            # --- a worker: the others serve while it restarts under a fresh id ----------
            wait_for(lambda: any(ok for _, ok, _ in traffic.log), 30, "traffic", [s.proc])
            dead = before["worker-generate-1"]["pid"]
            os.kill(dead, signal.SIGKILL)
            killed = time.monotonic()
            new = _wait_restarted(s, "worker-generate-1", dead, 30)
            new_id = f"{socket.gethostname()}-{new}"
            wait_for(lambda: new_id in {w.worker_id for w in live_workers(r, "generate")},
                     60, "the restarted worker live", [s.proc])  # fmt: skip
            # back within 10 s: the waits above allow longer, so this can fail
            back_in = time.monotonic() - killed
            assert back_in < 10, f"the restarted worker was live {back_in:.1f} s after the kill"
            dead_id = f"{socket.gethostname()}-{dead}"
            wait_for(lambda: dead_id not in {w.worker_id for w in live_workers(r, "generate")},
                     TTL_S + 5, "the dead worker's heartbeat to expire", [s.proc])  # fmt: skip
            pinned = s.complete(worker_id=new_id)
            assert pinned.status_code == 200, pinned.text  # the new worker takes requests
            # traffic after the expiry (its pace depends on the machine's load)
            wait_for(lambda: len(traffic.sent_after(killed + TTL_S + 0.5)) >= 5, 20,
                     "requests after the expiry", [s.proc])  # fmt: skip
            after_expiry = traffic.sent_after(killed + TTL_S + 0.5)
            assert all(ok for _, ok, _ in after_expiry), [x for x in after_expiry if not x[1]]

            # --- the API: requests fail only while it restarts ------------------------
            api_pid = s.table()["api"]["pid"]
            os.kill(api_pid, signal.SIGKILL)
            killed = time.monotonic()
            _wait_restarted(s, "api", api_pid, 10)
            wait_for(lambda: any(ok for t, ok, _ in traffic.sent_after(killed)), 30,
                     "the restarted API answering", [s.proc])  # fmt: skip
            back = min(t for t, ok, _ in traffic.sent_after(killed) if ok)
            wait_for(lambda: len(traffic.sent_after(back)) >= 5, 30,
                     "5 requests since the API came back", [s.proc])  # fmt: skip
            since_back = traffic.sent_after(back)
            assert all(ok for _, ok, _ in since_back), [x for x in since_back if not x[1]]

        # --- Flower ---------------------------------------------------------------------
        flower_pid = s.table()["flower"]["pid"]
        os.kill(flower_pid, signal.SIGKILL)
        _wait_restarted(s, "flower", flower_pid, 10)
        wait_for(lambda: httpx.get(f"{s.flower_url}/healthcheck", timeout=1).status_code == 200,
                 60, "flower back", [s.proc])  # fmt: skip

        table = s.table()
        for name in ("worker-generate-1", "api", "flower"):
            assert table[name]["restarts"] == 1, table
            assert table[name]["last_exit"] == "killed by SIGKILL", table
        assert table["worker-generate-0"]["restarts"] == 0
        assert table["worker-generate-0"]["pid"] == before["worker-generate-0"]["pid"]
        shown = s.status()
        assert shown.returncode == 0, shown.stdout + shown.stderr
        row = next(ln for ln in shown.stdout.splitlines() if ln.startswith("worker-generate-1"))
        assert row.split()[1:4] == [str(table["worker-generate-1"]["pid"]), "running", "1"]
        assert "killed by SIGKILL" in row
        log = s.proc.log.read_text()
        assert re.search(rf"worker-generate-1 \(pid {dead}\) killed by SIGKILL; restarting it "
                         r"in 1\.0 s \(restart 1\)", log), log[-3000:]  # fmt: skip

        # a second serve on the same port refuses to start, leaving this one's table alone
        again = subprocess.run(s.argv, env=s.env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 1
        assert f"conveyor serve (pid {s.proc.popen.pid}) already serves on port" in again.stderr
        assert ServeState.read(s.state_file).supervisor_pid == s.proc.popen.pid  # type: ignore[union-attr]

        # Ctrl-C still stops everything
        kids = _descendants(s.proc.popen.pid)
        s.proc.popen.send_signal(signal.SIGINT)
        assert s.proc.popen.wait(60) == 0, s.proc.tail()
        assert not _no_orphans(kids), s.proc.tail()
        assert s.status().returncode == 1  # not running any more


def test_killed_redis_comes_back_on_its_port_with_its_data(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Requests open while Redis dies lose nothing: the API's token streams notice the
    dropped connection and each starts again from what its client has (as for a lost
    worker), so every stream ends whole, with the tokens an undisturbed run gives."""
    with serving(tmp_path, tiny_model_dir, "--workers", "1", "--no-flower",
                 CONVEYOR_REDIS_APPENDONLY="true",
                 CONVEYOR_MOCK__DECODE_STEP_MS="20") as s:  # fmt: skip
        wait_for(lambda: _healthy(s, 1), 120, "worker up", [s.proc])
        assert s.complete().status_code == 200
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="-", max_retries=0)
        ask = {"model": s.model, "prompt": "hello there", "max_tokens": 120, "temperature": 0,
               "extra_body": {"ignore_eos": True}}  # fmt: skip
        undisturbed = client.completions.create(**ask).choices[0].text  # type: ignore[call-overload]

        def stream() -> tuple[str, str | None]:
            text, finish = "", None
            for chunk in client.completions.create(**ask, stream=True, timeout=60):  # type: ignore[call-overload]
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            return text, finish

        r = redis.Redis.from_url(s.redis_url)
        r.set("supervision-test", "kept")
        time.sleep(1.5)  # appendfsync everysec
        with ThreadPoolExecutor(3) as pool:
            open_streams = [pool.submit(stream) for _ in range(3)]
            time.sleep(1.0)  # about 50 tokens into each
            old = s.table()["redis"]["pid"]
            os.kill(old, signal.SIGKILL)
            _wait_restarted(s, "redis", old, 10)
            for f in open_streams:
                assert f.result(timeout=90) == (undisturbed, "length"), s.proc.tail()
        assert re.search(r"the API's Redis connection came back|lost while Redis was away",
                         s.proc.log.read_text()), s.proc.tail()  # fmt: skip
        wait_for(r.ping, 10, "the restarted redis-server answering", [s.proc])
        assert r.get("supervision-test") == b"kept"  # same port, same data dir

        # the others reconnect: once the worker's heartbeat is back, every request works,
        # the first one included (none of its frames lost on a connection Redis closed)
        wait_for(lambda: _healthy(s, 1), 30, "the worker live again", [s.proc])
        got = [s.complete(timeout=30) for _ in range(10)]
        assert [r.status_code for r in got] == [200] * 10, (
            [r.text for r in got],
            s.proc.log.read_text()[-6000:],
        )
        table = s.table()
        assert (
            table["redis"]["restarts"] == 1 and table["redis"]["last_exit"] == "killed by SIGKILL"
        )


def test_a_crash_looping_worker_stops_serve_with_a_clear_message(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # an engine pinned to a CPU that does not exist fails to start: the worker exits at
    # once, on every start
    with serving(tmp_path, tiny_model_dir, "--workers", "1", "--no-flower",
                 CONVEYOR_ENGINE_CPUS="999", CONVEYOR_SERVE_RESTART_BACKOFF_S="0.5",
                 CONVEYOR_SERVE_CRASH_LOOP_EXITS="4") as s:  # fmt: skip
        wait_for(lambda: s.proc.popen.poll() is not None, 120, "serve to give up")
        assert s.proc.popen.returncode == 1
        log = s.proc.log.read_text()
        delays = [float(d) for d in
                  re.findall(r"worker-generate-0 \(pid \d+\) exited with code \d+; "
                             r"restarting it in ([\d.]+) s", log)]  # fmt: skip
        assert delays == [0.5, 1.0, 2.0], log[-3000:]
        assert re.search(
            r"worker-generate-0 is crash-looping \(4 exits in a row, each within 60 s of its "
            r"start, last: exited with code \d+\): stopping everything",
            log,
        ), log[-3000:]
        state = ServeState.read(s.state_file)
        assert state is not None and state.state == "failed"
        assert "worker-generate-0 is crash-looping" in (state.reason or "")
        worker = next(p for p in state.processes if p.name == "worker-generate-0")
        assert (worker.state, worker.restarts) == ("failed", 3)
        assert all(p.state == "stopped" for p in state.processes if p is not worker)
        shown = s.status()
        assert shown.returncode == 1 and "crash-looping" in shown.stdout
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{s.url}/health", timeout=1)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_an_engine_that_is_not_installed_stops_serve_in_one_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # a configuration error, not a crash: the worker says why once, serve does not restart it
    with serving(tmp_path, tiny_model_dir, "--workers", "1", "--no-flower",
                 "--engine", "vllm") as s:  # fmt: skip
        assert s.proc.popen.wait(120) == 1, s.proc.tail()
        log = s.proc.log.read_text()
        said = [ln for ln in log.splitlines() if "needs vLLM, which is not installed" in ln]
        assert len(said) == 1, log[-3000:]
        assert "`make install-vllm`" in said[0]
        assert "Traceback" not in log and "restarting it" not in log, log[-3000:]
        assert re.search(r"worker-generate-0 \(pid \d+\) cannot start \(exited with code 78: "
                         r"a configuration error, its reason above\): stopping everything",
                         log), log[-3000:]  # fmt: skip
        state = ServeState.read(s.state_file)
        assert state is not None and state.state == "failed"


def test_ctrl_c_during_a_restart_backoff_stops_everything(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    slow = {"CONVEYOR_ENGINE_CPUS": "999", "CONVEYOR_SERVE_RESTART_BACKOFF_S": "30"}
    with serving(tmp_path, tiny_model_dir, "--workers", "1", "--no-flower", **slow) as s:
        wait_for(lambda: "restarting it in 30.0 s" in s.proc.log.read_text(), 60,
                 "a worker in backoff", [s.proc])  # fmt: skip
        wait_for(lambda: httpx.get(f"{s.url}/v1/models", timeout=1).status_code == 200, 60,
                 "the API up", [s.proc])  # fmt: skip
        assert s.table()["worker-generate-0"]["state"] == "backoff"
        kids = _descendants(s.proc.popen.pid)
        assert kids, "redis and the API run during the backoff"
        t = time.monotonic()
        s.proc.popen.send_signal(signal.SIGINT)
        assert s.proc.popen.wait(30) == 0, s.proc.tail()
        assert time.monotonic() - t < 20  # did not wait out the backoff
        assert not _no_orphans(kids), s.proc.tail()
        assert all(p["state"] == "stopped" for p in s.table().values())
        assert s.status().stdout.splitlines()[1] == "  stopped by SIGINT"
        assert "started worker-generate-0" not in s.proc.log.read_text().split("received SIGINT")[1]


def test_no_restart_stops_everything_when_a_process_dies(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with serving(tmp_path, tiny_model_dir, "--workers", "1", "--no-flower",
                 "--no-restart") as s:  # fmt: skip
        wait_for(lambda: _healthy(s, 1), 120, "worker up", [s.proc])
        kids = _descendants(s.proc.popen.pid)
        os.kill(s.table()["worker-generate-0"]["pid"], signal.SIGKILL)
        assert s.proc.popen.wait(60) == 1, s.proc.tail()
        assert "killed by SIGKILL: stopping everything (restarts are off)" in s.proc.tail()
        assert not _no_orphans(kids), s.proc.tail()
