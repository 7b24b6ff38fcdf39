"""Stage tasks. Thin: validate the payload, call one function in ``workers/``, return a handle.

The worker runtime (model, engine loop) is created once per worker process by
``conveyor worker`` before Celery starts consuming; tasks only look it up. torch is never
imported by importing this module, so the API can import the app to send tasks.
"""

from __future__ import annotations

import logging

from celery import Task

from tasks.app import app
from tasks.payloads import GeneratePayload

log = logging.getLogger(__name__)


@app.task(name="conveyor.generate", bind=True, acks_late=True, ignore_result=True)
def generate(self: Task, payload: dict) -> dict:
    """Aggregated stage: prefill and decode the request on this worker, streaming tokens."""
    from workers.engine_proc import EngineDied
    from workers.runtime import get_runtime

    rt = get_runtime()
    req = GeneratePayload.model_validate(payload)
    try:
        return rt.generate(req.request_id, req.prompt_token_ids, req.sampling)
    except EngineDied:
        raise  # the worker is exiting; the API sees its heartbeat stop and moves on
    except Exception as e:  # the stream must still end with a terminal frame
        log.exception("[%s] generate failed", req.request_id)
        rt.fail(req.request_id, f"generation failed: {e}", "task_failed")
        raise
