"""serve's restart rule on a child's exits, at given times: the backoff doubles with each
early exit in a row, ``serve_crash_loop_exits`` of them stop serve however far apart they
come, a process that ran a full window starts the count again, and an exit with
``EXIT_CONFIG`` is never restarted."""

from __future__ import annotations

from tasks.settings import Settings
from tasks.supervisor import Supervisor, _Child
from workers.start_errors import EXIT_CONFIG


def _supervisor(**kw: object) -> Supervisor:
    rule: dict = {"serve_restart_backoff_s": 1.0, "serve_restart_backoff_max_s": 30.0,
                  "serve_crash_loop_exits": 5, "serve_crash_loop_window_s": 60.0}  # fmt: skip
    return Supervisor(Settings(**(rule | kw)), flower=False)


def _run(sup: Supervisor, c: _Child, uptimes: list[float], rc: int = 1) -> list[bool]:
    """Start ``c`` and let it exit after each of ``uptimes`` (its restart delay waited
    out); what ``_exited`` answered each time (False: stop everything)."""
    now, out = 1000.0, []
    for up in uptimes:
        c.started = now
        now += up
        out.append(sup._exited(c, rc, now))
        if not out[-1]:
            break
        now = c.restart_at
    return out


def test_a_slow_crash_loop_stops_serve() -> None:
    # a worker that dies 35 s into every start: 5 exits take minutes, not 60 s
    sup, c = _supervisor(), _Child("worker-generate-0", ["x"])
    assert _run(sup, c, [35.0] * 6) == [True, True, True, True, False]
    assert c.state == "failed" and c.early_exits == 5
    assert sup._reason == (
        "worker-generate-0 is crash-looping (5 exits in a row, each within 60 s of its start, "
        "last: exited with code 1): stopping everything"
    )


def test_the_backoff_doubles_with_each_early_exit_up_to_its_cap() -> None:
    sup, c = _supervisor(serve_crash_loop_exits=8), _Child("api", ["x"])
    delays = []
    now = 0.0
    for _ in range(7):
        c.started = now
        now += 2.0
        assert sup._exited(c, -9, now)
        delays.append(c.restart_at - now)
        now = c.restart_at
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_process_that_ran_a_full_window_starts_the_count_again() -> None:
    sup, c = _supervisor(), _Child("worker-generate-0", ["x"])
    # four early exits, then a run of an hour, then four more: never five in a row
    assert _run(sup, c, [5.0, 5.0, 5.0, 5.0, 3600.0, 5.0, 5.0, 5.0]) == [True] * 8
    assert c.early_exits == 4 and c.state == "backoff"
    assert sup._exited(c, 1, c.restart_at + 5.0) is False  # the fifth in a row
    assert c.state == "failed"


def test_an_exit_with_exit_config_is_not_restarted() -> None:
    sup, c = _supervisor(), _Child("worker-generate-0", ["x"])
    assert _run(sup, c, [2.0], rc=EXIT_CONFIG) == [False]
    assert c.state == "failed" and c.restarts == 0
    assert sup._reason == (
        "worker-generate-0 (pid 0) cannot start (exited with code 78: a configuration error, "
        "its reason above): stopping everything"
    )
