"""cluster.logs: the JSON lines (fields, a request's id, the trace a line was logged in)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from cluster.logs import JsonFormatter, formatter
from tests.unit.cluster.test_tracing import SID, TID, memory_tracing


def _record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("api.runner", logging.WARNING, __file__, 1, msg, args, exc_info)


def test_a_json_line_and_its_request_id() -> None:
    line = json.loads(JsonFormatter().format(_record("[chatcmpl-1a.r1] sent %s -> %s", "a", "b")))
    assert line["message"] == "[chatcmpl-1a.r1] sent a -> b"
    assert (line["level"], line["logger"], line["request_id"]) == ("WARNING", "api.runner",
                                                                    "chatcmpl-1a.r1")  # fmt: skip
    assert line["time"].endswith("+00:00") and isinstance(line["pid"], int)
    assert "trace_id" not in line and "exception" not in line
    plain = json.loads(JsonFormatter().format(_record("api up: [not an id] é")))
    assert "request_id" not in plain and plain["message"].endswith("é")


def test_an_exception_rides_in_its_line() -> None:
    line = json.loads(JsonFormatter().format(_record("failed", exc=True)))
    assert "ValueError: boom" in line["exception"] and "\n" not in json.dumps(line)


def test_a_line_logged_inside_a_span_names_it() -> None:
    from cluster.tracing import parent_context

    t, _ = memory_tracing()
    with t.tracer.start_as_current_span("s", context=parent_context(f"00-{TID}-{SID}-01")) as sp:
        line = json.loads(JsonFormatter().format(_record("[r] in a span")))
    assert line["trace_id"] == TID and line["span_id"] == f"{sp.get_span_context().span_id:016x}"


def test_formats() -> None:
    assert not isinstance(formatter("text"), JsonFormatter)
    with pytest.raises(ValueError, match="unknown log format"):
        formatter("xml")


def test_the_cli_logs_json_from_its_first_line() -> None:
    """``conveyor --log-format json``: a command's own lines, a warning's included."""
    code = ("import logging, warnings\n"
            "from tasks.cli import main\n"
            "@main.command()\n"
            "def hello():\n"
            "    logging.getLogger('conveyor').info('[req-1] hello')\n"
            "    warnings.warn('careful')\n"
            "main(['--log-format', 'json', 'hello'])\n")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = [json.loads(ln) for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 0, p.stderr
    assert lines[0]["message"] == "[req-1] hello" and lines[0]["request_id"] == "req-1"
    assert any("careful" in ln["message"] and ln["logger"] == "py.warnings" for ln in lines)
