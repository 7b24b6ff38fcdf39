"""Everything that leans on Celery's internals, in one place (tested with Celery 5.7.x;
``pyproject.toml`` pins ``celery<5.8``). With ``CONVEYOR_BROKER_FASTPATH=false`` neither
is used and the worker runs Celery's stock consumer and strategy.

:class:`Consumer` (Celery's ``worker_consumer`` setting): Celery buffers a worker's task
events and flushes them as one ``task.multi`` message, but asks for a flush after every
event, so a request cost one ``PUBLISH`` round trip per event. Here a flush waits until
``EVENT_FLUSH_S`` has passed since the last one, so a burst of events goes out as one
message (docs/performance.md, "Celery: batched task events"); the events themselves are
unchanged, and worker heartbeats are not buffered. Overrides ``Consumer._flush_events``
(private).

:func:`begin_on_receipt` (the *strategy*, the per-task-type message handler, of the
``generate`` and ``prefill`` tasks): starts the request in the engine as its message arrives
(:meth:`workers.runtime.WorkerRuntime.begin`), without waiting for Celery's hand-over to a
pool thread (docs/performance.md, "Celery: requests begin on receipt"), then lets Celery's
own strategy handle the message as always; the task, when a pool thread runs it, waits for
the run already under way. Acknowledgement (late), task events and failure handling are
unchanged. A message the strategy declines (revoked, or raising) has its request aborted;
messages Celery would not run at once (an ETA, an expiry, a rate limit) are left to Celery
alone, as are redelivered ones (the task first checks whether the request was abandoned)
and anything that does not parse. Uses ``celery.worker.strategy.default`` and
``celery.worker.state.revoked`` (internal).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery.worker import state as worker_state
from celery.worker.consumer import Consumer as CeleryConsumer
from celery.worker.strategy import default as default_strategy
from kombu.utils.json import loads

log = logging.getLogger(__name__)

EVENT_FLUSH_S = 0.05  # the longest a buffered task event waits for company
# the tasks begun on receipt (an embed task's request too: workers.pooling)
STAGES = {"conveyor.generate": "generate", "conveyor.prefill": "prefill",
          "conveyor.embed": "embed"}  # fmt: skip


class Consumer(CeleryConsumer):
    _last_flush = 0.0
    _flush_scheduled = False

    def _flush_events(self) -> None:
        # Runs on the event loop's thread (Celery schedules it with ``hub.call_soon``;
        # the timer below fires there too), so no lock is needed for the two flags.
        wait = self._last_flush + EVENT_FLUSH_S - time.monotonic()
        if wait > 0 and self.hub is not None:
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self.hub.call_later(wait, self._flush_due)
            return
        self._last_flush = time.monotonic()
        super()._flush_events()

    def _flush_due(self) -> None:
        self._flush_scheduled = False
        self._flush_events()

    def shutdown(self) -> None:
        # events still buffered go out before the dispatcher closes
        if self.event_dispatcher is not None:
            self.event_dispatcher.flush()
        super().shutdown()


def begin_on_receipt(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    handle = default_strategy(task, app, consumer, **kwargs)
    stage = STAGES[task.name]
    if task.rate_limit or not fastpath():  # Celery would hold the task back: so must we
        return handle

    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                   **kw: Any) -> Any:  # fmt: skip
        request_id = _begin(stage, message)
        try:
            out = handle(message, body, ack, reject, callbacks, **kw)
        except BaseException:
            if request_id is not None:
                _forget(request_id)
            raise
        if request_id is not None and message.headers.get("id") in worker_state.revoked:
            _forget(request_id)
        return out

    return on_message


def fastpath() -> bool:
    from tasks.settings import get_settings

    return get_settings().broker_fastpath


def _begin(stage: str, message: Any) -> str | None:
    """Start the message's request; its id, or ``None`` if it was left to the task."""
    from workers.runtime import get_runtime

    headers = message.headers or {}
    # a redelivered copy (kombu marks it) may be of a request the API is done with: its
    # task looks at the cancelled key before anything runs (WorkerRuntime._abandoned)
    if headers.get("eta") or headers.get("expires") or headers.get("redelivered"):
        return None
    try:
        if message.content_type != "application/json":
            return None
        from kvbm.protocol import StagePayload
        from tasks.stages import stage_command

        cmd = stage_command(stage, tuple(loads(message.body)[0]))
        if isinstance(cmd, StagePayload):
            return None  # its encode task failed: the task says so, nothing to run
        get_runtime().begin(cmd)  # type: ignore[arg-type]  # generate, prefill or embed
    except Exception as e:  # noqa: BLE001 - the task meets the same problem and reports it
        log.debug("message %s left to its task: %s", headers.get("id"), e)
        return None
    return cmd.request_id


def _forget(request_id: str) -> None:
    from workers.runtime import get_runtime

    try:
        get_runtime().forget(request_id)
    except Exception:  # noqa: BLE001
        log.exception("[%s] could not abort a request whose task will not run", request_id)
