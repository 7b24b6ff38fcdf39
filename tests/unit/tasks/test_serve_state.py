"""The process table ``conveyor serve`` writes and ``conveyor status`` reads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tasks.serve_state import ProcessRecord, ServeState, describe_exit


def _state(pid: int, state: str = "running") -> ServeState:
    return ServeState(
        supervisor_pid=pid,
        state=state,
        api_url="http://127.0.0.1:8000",
        started=1000.0,
        processes=[
            ProcessRecord("redis", 11, "running", 0, 1000.0),
            ProcessRecord("worker-generate-0", None, "backoff", 2, 1290.0, "exited with code 1"),
            ProcessRecord("api", 13, "running", 1, 1250.0, "killed by SIGKILL"),
        ],
    )


def test_describe_exit_names_the_signal_or_the_code() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-11) == "killed by SIGSEGV"
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(0) == "exited with code 0"


def test_the_table_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "serve" / "8000.json"
    assert ServeState.read(path) is None
    _state(os.getpid()).write(path)
    assert ServeState.read(path) == _state(os.getpid())
    assert [p.name for p in tmp_path.joinpath("serve").iterdir()] == ["8000.json"]  # no tmp


def test_render_lists_every_process() -> None:
    text = _state(os.getpid()).render(now=1300.0)
    lines = text.splitlines()
    assert (
        lines[0] == f"conveyor serve (pid {os.getpid()}) http://127.0.0.1:8000: running, up 5m00s"
    )
    assert lines[1].split() == ["NAME", "PID", "STATE", "RESTARTS", "FOR", "LAST", "EXIT"]
    assert lines[2].split() == ["redis", "11", "running", "0", "5m00s", "-"]
    assert lines[3].split() == ["worker-generate-0", "-", "backoff", "2", "10s", "exited", "with",
                                "code", "1"]  # fmt: skip
    assert lines[4].split()[:5] == ["api", "13", "running", "1", "50s"]


def test_a_table_left_by_a_dead_serve_says_so() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    assert not _state(dead.pid).supervisor_alive
    assert "gone (the serve process died" in _state(dead.pid).render(now=1300.0)
    assert "stopped" in _state(dead.pid, "stopped").render(now=1300.0).splitlines()[0]
