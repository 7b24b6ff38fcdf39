"""serve's scaling of its worker table, on stand-in processes (a few lines of Python each,
not workers): new workers take numbers never used before, the newest are drained, a
draining process that exits leaves the table without a restart and without counting as a
crash, one that outlives the drain timeout is killed, and a planner that raises is logged
while serve goes on."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from planner.connectors import ConnectorError, Decision
from tasks.planner_serve import ServeConnector
from tasks.settings import Settings
from tasks.supervisor import Supervisor, _Child

# a stand-in worker: exits 0 a moment after SIGTERM (a warm shutdown), or ignores it
DRAINS = "import signal,sys,time;signal.signal(15,lambda *_: sys.exit(0));time.sleep(60)"
STUCK = "import signal,time;signal.signal(15,signal.SIG_IGN);time.sleep(60)"


STAND_IN = {"code": DRAINS}  # what the next worker started runs


@pytest.fixture
def sup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Supervisor]:
    monkeypatch.setitem(STAND_IN, "code", DRAINS)

    def start(self: Supervisor, c: _Child) -> None:
        code = STAND_IN["code"]
        c.proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        c.state, c.since, c.started = "running", time.time(), time.monotonic()

    monkeypatch.setattr(Supervisor, "_start", start)
    s = Supervisor(Settings(workers=2, serve_state_dir=tmp_path, serve_drain_timeout_s=60.0),
                   flower=False)  # fmt: skip
    s._worker_env = {}
    for _ in range(2):
        s._add_worker("generate")
    yield s
    for c in s.children:
        if c.proc is not None and c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()


def _names(sup: Supervisor) -> dict[str, str]:
    return {c.name: c.state for c in sup.children}


def _watch_until(sup: Supervisor, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"table: {_names(sup)}"
        sup._apply_scaling()
        assert sup._watch()
        time.sleep(0.05)


def test_scaling_up_takes_new_numbers_and_down_drains_the_newest(sup: Supervisor) -> None:
    assert sup.replicas("generate") == 2
    sup.scale("generate", 4)
    assert sup.replicas("generate") == 4 and sup.settling("generate")  # wanted, not yet applied
    sup._apply_scaling()
    assert _names(sup) == {f"worker-generate-{i}": "running" for i in range(4)}
    assert not sup.settling("generate")

    drained = [c for c in sup.children if c.number >= 2]
    time.sleep(0.5)  # the stand-ins have set their SIGTERM handlers
    sup.scale("generate", 2)
    sup._apply_scaling()
    want = {0: "running", 1: "running", 2: "draining", 3: "draining"}
    assert _names(sup) == {f"worker-generate-{i}": st for i, st in want.items()}
    assert sup.replicas("generate") == 2 and sup.settling("generate")
    assert [w.state for w in sup.workers("generate")].count("draining") == 2

    # more again while two drain: new numbers, the draining ones are not taken back
    sup.scale("generate", 3)
    sup._apply_scaling()
    assert sup.replicas("generate") == 3
    assert _names(sup)["worker-generate-4"] == "running"

    _watch_until(sup, lambda: not sup.settling("generate"))
    assert _names(sup) == {f"worker-generate-{i}": "running" for i in (0, 1, 4)}
    assert [c.proc.returncode for c in drained if c.proc is not None] == [0, 0]
    assert all(c.restarts == 0 and c.early_exits == 0 for c in sup.children)
    # the drained ones stay gone: a while of watching restarts nothing
    for _ in range(5):
        assert sup._watch()
        time.sleep(0.05)
    assert len(sup.children) == 3 and sup.replicas("generate") == 3


def test_a_worker_waiting_for_its_restart_goes_first(sup: Supervisor) -> None:
    c0, c1 = sup.children
    c0.proc.kill()  # type: ignore[union-attr]
    _watch_until(sup, lambda: c0.state == "backoff")
    assert sup.replicas("generate") == 2  # a restarting worker counts
    sup.scale("generate", 1)
    sup._apply_scaling()
    assert _names(sup) == {"worker-generate-1": "running"}
    assert sup.replicas("generate") == 1 and not sup.settling("generate")


def test_a_worker_that_does_not_drain_in_time_is_killed(
    sup: Supervisor, caplog: pytest.LogCaptureFixture
) -> None:
    sup.s.serve.drain_timeout_s = 0.5
    STAND_IN["code"] = STUCK
    sup.scale("generate", 3)
    sup._apply_scaling()
    stuck = sup.children[-1]
    time.sleep(0.3)  # it has set its handler
    sup.scale("generate", 2)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "conveyor.serve"):
        _watch_until(sup, lambda: stuck not in sup.children)
    assert time.monotonic() - t0 >= 0.5
    assert stuck.proc is not None and stuck.proc.returncode == -9
    assert "worker-generate-2" in caplog.text and "killing it" in caplog.text
    assert _names(sup) == {"worker-generate-0": "running", "worker-generate-1": "running"}


def test_a_pool_serve_does_not_run_is_refused(sup: Supervisor) -> None:
    with pytest.raises(ValueError, match="no decode pool"):
        sup.scale("decode", 1)
    with pytest.raises(ValueError):
        sup.scale("generate", -1)
    conn = ServeConnector(sup, client=object())  # type: ignore[arg-type]
    with pytest.raises(ConnectorError, match="no decode pool"):
        conn.scale(Decision("decode", 1, 0, "test"))


def test_settled_needs_every_started_worker_live_and_none_draining(
    sup: Supervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tasks.planner_serve as ps

    live: list[str] = []
    monkeypatch.setattr(ps, "live_workers", lambda _c, pool: [type("W", (), {"worker_id": w})
                                                              for w in live])  # fmt: skip
    conn = ServeConnector(sup, client=object())  # type: ignore[arg-type]
    ids = [f"{conn._host}-{c.proc.pid}" for c in sup.children]  # type: ignore[union-attr]
    d = Decision("generate", 1, 2, "test")
    conn.scale(d)
    live[:] = ids
    assert not conn.settled(d)  # not applied yet
    sup._apply_scaling()
    assert conn.replicas("generate") == 1
    assert not conn.settled(d)  # worker-generate-1 drains
    _watch_until(sup, lambda: not sup.settling("generate"))
    assert conn.settled(d)  # worker-generate-0 is live (the gone one's id lingers: no matter)
    up = Decision("generate", 2, 1, "test")
    conn.scale(up)
    sup._apply_scaling()
    assert not conn.settled(up)  # the new worker has not joined yet
    live.append(f"{conn._host}-{sup.children[-1].proc.pid}")  # type: ignore[union-attr]
    assert conn.settled(up)


def test_a_planner_that_raises_is_logged_and_serve_goes_on(
    sup: Supervisor, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[object] = []

    class Boom:
        def run(self, stop: threading.Event) -> None:
            raise RuntimeError("planner broke")

    def factory(conn: ServeConnector) -> Boom:
        seen.append(conn)
        return Boom()

    sup.planner = factory  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR, "conveyor.serve"):
        sup._start_planner()
        assert sup._planner_thread is not None
        sup._planner_thread.join(5)
    assert isinstance(seen[0], ServeConnector) and seen[0].name == "serve"
    assert "the planner failed" in caplog.text and "RuntimeError: planner broke" in caplog.text
    assert sup._watch() and not sup._stop
