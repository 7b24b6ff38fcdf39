"""Stage tasks. Thin: validate the payload, call one function in ``workers/``, return a handle.

The worker runtime (model, engine loop) is created once per worker process by
``conveyor worker`` before Celery starts consuming; tasks only look it up. torch is never
imported by importing this module, so the API can import the app to send tasks.
"""

from __future__ import annotations

import logging

from celery import Task, chain

from tasks.app import app, queue, route_to
from tasks.payloads import GeneratePayload

log = logging.getLogger(__name__)


# generate and prefill reach the engine as their message arrives, ahead of Celery's
# hand-over to a pool thread (tasks.intake)
BEGIN_ON_RECEIPT = "tasks.intake:begin_on_receipt"


@app.task(name="conveyor.generate", bind=True, acks_late=True, ignore_result=True,
          Strategy=BEGIN_ON_RECEIPT)  # fmt: skip
def generate(self: Task, payload: dict) -> dict:
    """Aggregated stage: prefill and decode the request on this worker, streaming tokens."""
    req = GeneratePayload.model_validate(payload)
    return _guarded(req, lambda rt: rt.generate(req.request_id, req.prompt_token_ids,
                                                req.sampling, req.forced_first_token))  # fmt: skip


@app.task(name="conveyor.prefill", bind=True, acks_late=True, ignore_result=True,
          Strategy=BEGIN_ON_RECEIPT)  # fmt: skip
def prefill(self: Task, payload: dict) -> dict:
    """Prefill stage: stream the first token, pin the KV, return the handle (which Celery
    hands to the chain's decode task)."""
    req = GeneratePayload.model_validate(payload)
    return _guarded(req, lambda rt: rt.prefill(req.request_id, req.prompt_token_ids,
                                               req.sampling, req.forced_first_token))  # fmt: skip


@app.task(name="conveyor.decode", bind=True, acks_late=True, ignore_result=True)
def decode(self: Task, handle: dict, payload: dict) -> dict:
    """Decode stage: pull the KV named by ``handle`` and generate from the second token.

    A failed pull (prefill worker gone, transfer error, timeout) sends the request through
    prefill again — on another prefill worker, keeping the first token the client already
    has — up to ``prefill_retries`` times; with no prefill worker alive it is redone here,
    aggregated. Past the limit the stream ends with an error frame."""
    from workers.runtime import KVPullFailed, get_runtime

    req = GeneratePayload.model_validate(payload)
    if handle.get("finished"):
        return handle  # the request ended on its first token; the stream is complete
    try:
        return _guarded(req, lambda rt: rt.decode(req.request_id, req.prompt_token_ids,
                                                  req.sampling, handle))  # fmt: skip
    except KVPullFailed as e:
        return _redo_prefill(get_runtime(), req, handle, str(e))


def _redo_prefill(rt, req: GeneratePayload, handle: dict, why: str) -> dict:  # type: ignore[no-untyped-def]
    import redis as redis_lib

    from tasks.settings import get_settings
    from workers.registry import live_workers, worker_queue

    limit = get_settings().prefill_retries
    if req.attempt >= limit:
        msg = f"KV transfer failed {req.attempt + 1} time(s), giving up: {why}"
        rt.fail(req.request_id, msg, "kv_transfer_failed", seq=1)
        return {"request_id": req.request_id, "finish_reason": "error", "error": msg}
    redo = req.model_copy(update={"attempt": req.attempt + 1,
                                  "forced_first_token": handle["first_token"]})  # fmt: skip
    try:
        alive = [w for w in live_workers(rt.redis, "prefill")
                 if w.worker_id != handle.get("prefill_worker")]  # fmt: skip
    except redis_lib.RedisError:
        alive = []
    if not alive:
        log.warning("[%s] %s; no other prefill worker: running it here", req.request_id, why)
        return rt.generate(req.request_id, req.prompt_token_ids, req.sampling,
                           redo.forced_first_token)  # fmt: skip
    target = min(alive, key=lambda w: w.load.get("active", 0))
    log.warning("[%s] %s; prefilling again on %s (attempt %d/%d)", req.request_id, why,
                target.worker_id, redo.attempt, limit)  # fmt: skip
    own = worker_queue(rt.pool, rt.worker_id)
    chain(
        prefill.si(redo.model_dump()).set(queue=queue(target.queue)),
        decode.s(redo.model_dump()).set(**route_to(own)),
    ).apply_async()
    return {"request_id": req.request_id, "redo": redo.attempt}


def _guarded(req: GeneratePayload, run):  # type: ignore[no-untyped-def]
    """Run a stage; any failure that is not the worker dying ends the stream clearly."""
    from workers.engine_proc import EngineDied
    from workers.runtime import KVPullFailed, get_runtime

    rt = get_runtime()
    try:
        return run(rt)
    except (EngineDied, KVPullFailed):
        raise  # EngineDied: the worker exits and the API sees its heartbeat stop
    except Exception as e:  # the stream must still end with a terminal frame
        log.exception("[%s] stage failed", req.request_id)
        rt.fail(req.request_id, f"generation failed: {e}", "task_failed")
        raise
