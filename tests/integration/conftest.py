"""Integration fixtures: everything real.

A ``redis-server`` on a free loopback port, ``conveyor worker`` processes consuming the
real Celery queues, ``conveyor api`` over real HTTP, and the official ``openai`` client.
No eager Celery, no fake Redis.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tasks.supervisor import redis_server_binary

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def spawn(name: str, argv: list[str], env: dict[str, str], logdir: Path) -> Proc:
    log = logdir / f"{name}.log"
    fh = open(log, "wb")  # noqa: SIM115 - lives as long as the process
    p = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return Proc(name, p, log)


def wait_for(cond, timeout: float, what: str, procs: list[Proc] = ()) -> None:  # type: ignore[no-untyped-def, assignment]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited early:\n{p.tail()}")
        try:
            if cond():
                return
        except Exception:  # noqa: BLE001, S110 - not up yet
            pass
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs)
    raise TimeoutError(f"timed out waiting for {what}\n{tails}")


async def async_wait_for(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    """``wait_for`` inside an event loop: poll ``cond`` (a function, or a coroutine
    function such as a Redis query) until it holds or ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (await ok if inspect.isawaitable(ok := cond()) else ok):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def start_redis(d: Path, *extra: str, auth: str = "") -> tuple[Proc, str]:
    """A ``redis-server`` on a free loopback port, no persistence, files in ``d``; ``extra``
    are more of its arguments, ``auth`` the ``user:password@`` part of the URL to use."""
    exe = redis_server_binary()
    assert exe, "integration tests need redis-server (make test installs it)"
    port = free_port()
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(d), *extra]  # fmt: skip
    p = spawn("redis", argv, dict(os.environ), d)
    url = f"redis://{auth}127.0.0.1:{port}/0"
    wait_for(lambda: redis.Redis.from_url(url).ping(), 10, "redis-server", [p])
    return p, url


# databases of the session's redis-server: one per test that deploys (RedisDbs)
DATABASES = 512


class RedisDbs:
    """Hands out the databases of one redis-server, each flushed, none twice: a test (or
    a module's fixture) that deploys workers gets a database no other test or module
    uses. Database 0 is the session ``cluster``'s."""

    def __init__(self, url: str) -> None:
        self.base = url.rsplit("/", 1)[0]
        r = redis.Redis.from_url(url)
        self.count = int(r.config_get("databases")["databases"])
        self.owners: dict[int, str] = {0: "the session cluster"}

    def take(self, owner: str) -> str:
        """A fresh, flushed database for ``owner`` (a test's or module's node id)."""
        n = max(self.owners) + 1
        assert n < self.count, (
            f"all {self.count} databases of the session's redis-server are handed out "
            "(raise DATABASES in tests/integration/conftest.py)"
        )
        self.owners[n] = owner
        url = f"{self.base}/{n}"
        redis.Redis.from_url(url).flushdb()
        return url

    def strays(self) -> list[int]:
        """Databases that hold keys but were never handed out: a test that picked its
        number by hand, and may share it with another module."""
        keyspace = redis.Redis.from_url(f"{self.base}/0").info("keyspace")
        return sorted(int(k[2:]) for k in keyspace if int(k[2:]) not in self.owners)


def session_redis(d: Path) -> Iterator[tuple[str, RedisDbs]]:
    """The session's redis-server with ``DATABASES`` databases and their allocator; at the
    end, no database that the allocator did not hand out may hold keys."""
    p, url = start_redis(d, "--databases", str(DATABASES))
    dbs = RedisDbs(url)
    yield url, dbs
    try:
        strays = dbs.strays()
        assert not strays, f"dbs {strays} were used without RedisDbs.take (fresh_db)"
    finally:
        p.stop()


@pytest.fixture(scope="session")
def _session_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RedisDbs]]:
    yield from session_redis(tmp_path_factory.mktemp("redis"))


@pytest.fixture(scope="session")
def redis_url(_session_redis: tuple[str, RedisDbs]) -> str:
    """The session's redis-server, database 0: the session ``cluster``'s."""
    return _session_redis[0]


@pytest.fixture(scope="session")
def redis_dbs(_session_redis: tuple[str, RedisDbs]) -> RedisDbs:
    """Fresh databases for module-scoped fixtures: ``redis_dbs.take(request.node.nodeid)``."""
    return _session_redis[1]


@pytest.fixture
def fresh_db(redis_dbs: RedisDbs, request: pytest.FixtureRequest) -> str:
    """A database of this test's own, flushed: the test's fixtures and its body share it."""
    return redis_dbs.take(request.node.nodeid)


@pytest.fixture
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of this test's own, for server-wide commands (CLIENT PAUSE ALL,
    CLIENT KILL by type, SCRIPT FLUSH, CONFIG RESETSTAT and server-wide command counts)
    that would reach, or count, every other test's clients on the shared one."""
    p, url = start_redis(tmp_path_factory.mktemp("own-redis"))
    yield url
    p.stop()


def needs_redis(url: str, major: int, why: str) -> None:
    """Skip the test, saying why, where the redis-server at ``url`` is older than
    ``major`` (a system Redis 6 where the suite's features need 7)."""
    version = str(redis.Redis.from_url(url).info("server")["redis_version"])
    if int(version.split(".")[0]) < major:
        pytest.skip(f"needs Redis >= {major} ({why}); this redis-server is {version}")


def celery_events(redis_url: str) -> str:
    """The pattern of Celery's event channels of ``redis_url``'s database only: kombu
    prefixes fanout channels with ``/<db>.``, so ``*celeryev*`` takes every database's."""
    return f"/{redis_url.rsplit('/', 1)[1] or '0'}.celeryev/*"


def base_env(redis_url: str, model_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(
        CONVEYOR_REDIS_URL=redis_url,
        CONVEYOR_MODEL=str(model_dir),
        CONVEYOR_HEARTBEAT_S="0.5",
        CONVEYOR_WORKER_TTL_S="3",
        CONVEYOR_NUM_KV_BLOCKS="512",
        # tests read a request's account in the worker's log (off by default: CPU)
        CONVEYOR_LOG_REQUESTS="true",
        # an API stopped with streams open ends them after 5 s, not 30 (test teardowns)
        CONVEYOR_SHUTDOWN_DRAIN_S="5",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


@dataclass
class Cluster:
    url: str
    redis_url: str
    model_dir: Path
    model_name: str
    workers: list[Proc]
    api: Proc
    extra: list[Proc] = field(default_factory=list)

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", **kw)  # type: ignore[arg-type]

    def async_client(self, **kw: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", **kw)  # type: ignore[arg-type]

    def worker_loads(self) -> dict[str, dict]:
        r = redis.Redis.from_url(self.redis_url)
        out = {}
        for key in r.scan_iter("conveyor:worker:generate:*"):
            raw = r.get(key)
            if raw:
                info = json.loads(raw)
                out[info["worker_id"]] = info
        return out


@contextmanager
def stop_on_error(*procs: Proc) -> Iterator[None]:
    """Stop ``procs`` if the block raises: a fixture that fails to start leaks nothing."""
    try:
        yield
    except BaseException:
        for p in procs:
            p.stop()
        raise


def celery_at(redis_url: str, **settings: object) -> None:
    """Point this test process's Celery app at ``redis_url`` (dropping connections made
    for another deployment: Celery caches its broker pools)."""
    from tasks.app import app, configure
    from tasks.settings import Settings

    configure(Settings(redis_url=redis_url, **settings))
    app.close()
    app.amqp._producer_pool = None


def start_worker(name: str, pool: str, worker_id: str, env: dict[str, str], logdir: Path) -> Proc:
    """A real ``conveyor worker`` process (its readiness shows in the API's /health)."""
    argv = [str(BIN / "conveyor"), "worker", "--pool", pool, "--worker-id", worker_id]
    return spawn(name, argv, env, logdir)


def start_api(name: str, env: dict[str, str], logdir: Path) -> tuple[Proc, str]:
    port = free_port()
    p = spawn(name, [str(BIN / "conveyor"), "api", "--port", str(port)], env, logdir)
    url = f"http://127.0.0.1:{port}"
    with stop_on_error(p):
        wait_for(
            lambda: httpx.get(f"{url}/v1/models", timeout=1).status_code == 200,
            60,
            f"{name} up",
            [p],
        )
    return p, url


@contextmanager
def generate_workers(name: str, env: dict[str, str], model_dir: Path, logdir: Path,
                     worker_ids: list[str], up_s: float = 90) -> Iterator[Cluster]:  # fmt: skip
    """Generate workers of ``worker_ids`` and an API on ``env`` (a fixture's deployment),
    each worker live within ``up_s``, up until the block ends."""
    workers = [start_worker(f"w-{wid}", "generate", wid, env, logdir) for wid in worker_ids]
    with stop_on_error(*workers):
        api, http = start_api(f"api-{name}", env, logdir)
    with stop_on_error(*workers, api):
        wait_for(lambda: httpx.get(f"{http}/health", timeout=1).json()["workers"]["generate"]
                 == len(workers), up_s, f"{len(workers)} live workers",
                 [*workers, api])  # fmt: skip
    try:
        yield Cluster(http, env["CONVEYOR_REDIS_URL"], model_dir, model_dir.name, workers, api)
    finally:
        api.stop()
        for w in workers:
            w.stop()


@contextmanager
def one_worker(name: str, worker_id: str, env: dict[str, str], model_dir: Path,
               logdir: Path) -> Iterator[Cluster]:  # fmt: skip
    """A generate worker and an API on ``env`` (a module fixture's deployment), up until
    the block ends."""
    with generate_workers(name, env, model_dir, logdir, [worker_id], up_s=60) as c:
        yield c


@pytest.fixture(scope="session")
def cluster(
    redis_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    env = base_env(redis_url, tiny_model_dir)
    with generate_workers("itest", env, tiny_model_dir, tmp_path_factory.mktemp("logs"),
                          ["itest-w0", "itest-w1"]) as c:  # fmt: skip
        yield c


# --------------------------------------------------------------------------------------
# Streams running all the time (the official client), for tests of scaling and draining
# --------------------------------------------------------------------------------------
@dataclass
class Outcome:
    sent: float
    ended: float
    finish: str | None
    tokens: int | None
    error: str | None = None


class Streams:
    """``n`` threads, each streaming one completion of ``prompt`` (``max_tokens``,
    ``ignore_eos``) after another until stopped; every outcome on ``out``."""

    def __init__(self, url: str, model: str, n: int, prompt: str, max_tokens: int,
                 timeout: float = 60) -> None:  # fmt: skip
        # no retries: a lost request must show as an error, not be sent again
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                    timeout=timeout)  # fmt: skip
        self.model, self.prompt, self.max_tokens = model, prompt, max_tokens
        self.out: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def __enter__(self) -> Streams:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            finish, tokens = None, None
            try:
                stream = self.client.completions.create(
                    model=self.model, prompt=self.prompt, max_tokens=self.max_tokens,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                self.out.append(Outcome(sent, time.monotonic(), finish, tokens))
            except Exception as e:  # noqa: BLE001 - recorded, asserted on below
                self.out.append(Outcome(sent, time.monotonic(), finish, tokens, repr(e)))
