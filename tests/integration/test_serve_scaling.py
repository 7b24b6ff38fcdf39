"""``conveyor serve`` scales its own workers for a planner: a real ``Supervisor`` (run in
this process, on a thread, so the test can hand it a planner) with the mock engine,
streamed requests from the official ``openai`` client all the time, the generate pool
scaled from 1 to 3 and back to 1 while requests run on the workers being drained. No
request is lost: every stream ends with its finish reason and all its tokens; the drained
workers exit 0 and are not restarted."""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from cluster.membership import live_workers
from planner.connectors import Connector, Decision
from tasks.serve_state import ServeState
from tasks.settings import Settings
from tasks.supervisor import Supervisor
from tests.integration.conftest import Streams, free_port, wait_for

pytestmark = pytest.mark.integration

MAX_TOKENS = 40
STREAMS = 6  # requests in flight at any time
STEP_MS = 50.0  # the mock engine's decode step: a request streams for about 2 s


class ScriptedPlanner:
    """The planner the test plays: each size put on ``steps`` becomes one Decision, and
    what the connector answered before, right after and once settled goes on ``done``."""

    def __init__(self) -> None:
        self.conn: Connector | None = None
        self.steps: queue.Queue[int] = queue.Queue()
        self.done: queue.Queue[tuple[int, int | None, int | None]] = queue.Queue()

    def __call__(self, conn: Connector) -> ScriptedPlanner:
        self.conn = conn
        return self

    def run(self, stop: threading.Event) -> None:
        assert self.conn is not None and self.conn.name == "serve"
        while not stop.is_set():
            try:
                n = self.steps.get(timeout=0.1)
            except queue.Empty:
                continue
            before = self.conn.replicas("generate")
            d = Decision("generate", n, before or 0, f"test: to {n}")
            self.conn.scale(d)
            after = self.conn.replicas("generate")
            while not self.conn.settled(d):
                if stop.wait(0.1):
                    return
            self.done.put((d.previous, after, self.conn.replicas("generate")))


@dataclass
class Served:
    sup: Supervisor
    planner: ScriptedPlanner
    url: str
    redis: redis.Redis
    state_file: Path

    def table(self) -> dict[str, tuple[str, int | None, int]]:
        state = ServeState.read(self.state_file)
        assert state is not None
        return {p.name: (p.state, p.pid, p.restarts) for p in state.processes}

    def health_workers(self) -> int:
        r = httpx.get(f"{self.url}/health", timeout=2)
        return int(r.json()["workers"]["generate"]) if r.status_code == 200 else 0

    def migrations(self) -> float:
        """Requests the API moved or sent again because a worker died under them."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("conveyor_migrations_total",
                                       "conveyor_requests_redispatched_total")))  # fmt: skip

    def live_ids(self) -> set[str]:
        return {w.worker_id for w in live_workers(self.redis, "generate")}

    def ids(self, *names: str) -> dict[str, str]:
        """worker name -> its worker id (serve's workers are ``<host>-<pid>``)."""
        pids = {w.name: w.pid for w in self.sup.workers("generate")}
        return {n: f"{socket.gethostname()}-{pids[n]}" for n in names}


@pytest.fixture
def served(fresh_db: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Served]:
    port = free_port()
    s = Settings(
        engine="mock", model=str(tiny_model_dir), port=port, redis_url=fresh_db, workers=1,
        heartbeat_s=0.5, worker_ttl_s=3.0, serve_state_dir=str(tmp_path / "state"),
        serve_drain_timeout_s=60.0, mock={"decode_step_ms": STEP_MS},
    )  # fmt: skip
    planner = ScriptedPlanner()
    sup = Supervisor(s, flower=False, planner=planner)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(sup.run()), daemon=True)
    thread.start()
    try:
        yield Served(sup, planner, f"http://127.0.0.1:{port}", redis.Redis.from_url(fresh_db),
                     s.serve_state_file)  # fmt: skip
        sup.stop()
        thread.join(90)
        assert codes == [0], "serve did not stop cleanly"
    finally:
        sup.stop()
        thread.join(90)
        for c in sup.children:  # whatever is left, should the test have failed midway
            if c.proc is not None and c.proc.poll() is None:
                os.killpg(c.proc.pid, signal.SIGKILL)


def test_scaling_up_and_draining_down_under_streamed_load_loses_no_request(
    served: Served,
) -> None:
    s = served
    wait_for(lambda: s.health_workers() == 1, 120, "the first worker up")
    assert s.sup.replicas("generate") == 1

    with Streams(s.url, s.sup.s.model_name, STREAMS, "the drain test", MAX_TOKENS) as traffic:
        wait_for(lambda: len(traffic.out) >= STREAMS, 60, "traffic flowing")

        # up to 3: the planner's scale returns at once, and settles once all 3 are live
        s.planner.steps.put(3)
        assert s.planner.done.get(timeout=180) == (1, 3, 3)
        assert s.health_workers() == 3 and len(s.live_ids()) == 3
        names = {p.name: p.state for p in s.sup.workers("generate")}
        assert names == {f"worker-generate-{i}": "running" for i in range(3)}

        # down to 1 while the two newest hold requests: they drain, the first stays
        leaving = s.ids("worker-generate-1", "worker-generate-2")
        children = {c.name: c for c in s.sup.children if c.name in leaving}

        def both_busy() -> bool:
            reports = {w.worker_id: w.report for w in live_workers(s.redis, "generate")}
            return all(reports[wid].inflight > 0 for wid in leaving.values())

        wait_for(both_busy, 60, "requests on both workers to be drained")
        drain_at = time.monotonic()
        s.planner.steps.put(1)
        seen_draining: set[str] = set()

        def drained() -> bool:
            seen_draining.update(n for n, (st, *_) in s.table().items() if st == "draining")
            try:
                return bool(s.planner.done.get_nowait() == (3, 1, 1))
            except queue.Empty:
                return False

        wait_for(drained, 120, "scaled down to 1")
        assert seen_draining == set(leaving), s.table()
        assert s.health_workers() == 1
        assert s.live_ids() == set(s.ids("worker-generate-0").values())
        assert s.sup.replicas("generate") == 1
        # requests go on on the one left
        done_before = len(traffic.out)
        wait_for(lambda: len(traffic.out) >= done_before + STREAMS, 60, "traffic after")

    # every request ended with its finish reason and all its tokens: none lost
    bad = [o for o in traffic.out if (o.error, o.finish, o.tokens) != (None, "length", MAX_TOKENS)]
    assert not bad, bad[:5]
    across = [o for o in traffic.out if o.sent < drain_at < o.ended]
    assert len(across) >= 2, "no request was in flight across the drain"
    # ... on the workers that held them: none was moved to another worker or sent again
    assert s.migrations() == 0

    # the drained workers exited 0 on their own and were not restarted
    assert {n: c.proc.returncode for n, c in children.items() if c.proc} == {
        "worker-generate-1": 0,
        "worker-generate-2": 0,
    }
    time.sleep(2)
    table = s.table()
    assert "worker-generate-1" not in table and "worker-generate-2" not in table
    assert table["worker-generate-0"][0] == "running" and table["worker-generate-0"][2] == 0
    assert [n for n in table if n.startswith("worker-")] == ["worker-generate-0"]
