"""The process table of a ``conveyor serve``: written by its supervisor, read by
``conveyor status``.

One small JSON file per deployment, keyed by the API port
(``Settings.serve_state_file``), replaced atomically on every change: which processes run,
their pids, states, restarts and last exits. A file rather than a Redis key, so the table
stays readable while Redis itself is down or restarting, and after ``serve`` has stopped
(the last state says why it stopped).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# ======================================================================================
# Public part
# ======================================================================================
# A process's state: running (spawned and not seen to exit), backoff (exited, restart
# scheduled), draining (a worker scaled away: SIGTERM sent, it finishes what it holds and
# leaves the table when it exits), failed (the exit that stopped serve), stopped (by
# serve's shutdown).
# The deployment's: running, stopping, stopped (on a signal), failed (a process died and
# restarts are off, or a process crash-looped, or startup failed).


@dataclass(slots=True)
class ProcessRecord:
    name: str
    pid: int | None
    state: str
    restarts: int
    since: float  # wall clock: when the process started, or when it exited (backoff)
    last_exit: str | None = None  # "killed by SIGKILL", "exited with code 1"


@dataclass(slots=True)
class ServeState:
    supervisor_pid: int
    state: str
    api_url: str
    started: float
    processes: list[ProcessRecord]
    reason: str | None = None  # why serve stopped or failed

    def write(self, path: Path) -> None:
        """Replace ``path`` atomically: a reader sees the old table or the new one."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> ServeState | None:
        """The table at ``path``; ``None`` when there is none (no serve used that port) or
        it cannot be read (written by another version)."""
        try:
            d = json.loads(path.read_text())
            d["processes"] = [ProcessRecord(**p) for p in d["processes"]]
            return cls(**d)
        except (OSError, ValueError, TypeError, KeyError):
            return None

    @property
    def supervisor_alive(self) -> bool:
        """Whether the serve that wrote this table still runs (a killed one leaves a table
        that says running)."""
        try:
            os.kill(self.supervisor_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def render(self, now: float | None = None) -> str:
        """A table a person reads (``conveyor status``)."""
        now = time.time() if now is None else now
        state = self.state
        if state in ("running", "stopping") and not self.supervisor_alive:
            state = "gone (the serve process died without cleaning up)"
        head = (
            f"conveyor serve (pid {self.supervisor_pid}) {self.api_url}: {state}, "
            f"up {_duration(now - self.started)}"
        )
        if self.reason:
            head += f"\n  {self.reason}"
        rows = [("NAME", "PID", "STATE", "RESTARTS", "FOR", "LAST EXIT")]
        for p in self.processes:
            rows.append((p.name, str(p.pid or "-"), p.state, str(p.restarts),
                         _duration(now - p.since), p.last_exit or "-"))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1]
                 for r in rows]  # fmt: skip
        return "\n".join([head, *lines])


def describe_exit(returncode: int) -> str:
    """``-9`` -> "killed by SIGKILL"; ``1`` -> "exited with code 1"."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


# ======================================================================================
# Helpers
# ======================================================================================
def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
