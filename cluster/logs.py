"""How every Conveyor process logs: text lines, or one JSON object per line
(``CONVEYOR_LOG_FORMAT=json``, as Dynamo's ``DYN_LOGGING_JSONL``) for log pipelines
(Loki, Elasticsearch, Cloud Logging) that index fields rather than parse lines.

A JSON line carries ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``pid``, ``message``;
``request_id`` when the message is about one request (the ``[<id>]`` its lines start
with); ``trace_id`` and ``span_id`` when it was logged inside a traced span
(cluster.tracing), so a log line leads to its trace; ``exception`` with the traceback.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime

TEXT_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"
FORMATS = ("text", "json")

_REQUEST_ID = re.compile(r"\[([\w.:-]+)\]")  # "[chatcmpl-ab12.r1] sent ..." -> the id


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": message,
        }
        if message.startswith("[") and (m := _REQUEST_ID.match(message)):
            out["request_id"] = m.group(1)
        out.update(_trace_ids())
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def _trace_ids() -> dict[str, str]:
    """The current span's ids, where this process traces (OpenTelemetry is loaded only
    then: no import here)."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return {}
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}


def formatter(fmt: str) -> logging.Formatter:
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (one of {', '.join(FORMATS)})")
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


def setup_logging(level: str | int, fmt: str = "text") -> None:
    """The root logger at ``level``, writing to stderr in ``fmt``; as ``basicConfig``, it
    leaves a root logger that has handlers already as it is."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(fmt))
    lvl = level if isinstance(level, int) else getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=lvl, handlers=[handler])
    if fmt == "json":  # warnings.warn's too, so every line of the process is JSON
        logging.captureWarnings(True)
