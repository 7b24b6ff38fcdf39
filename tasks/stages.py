"""Stage tasks. Thin: validate the payload, call one function in ``workers/``, return a handle.

The worker runtime (model, engine loop) is created once per worker process by
``conveyor worker`` before Celery starts consuming; tasks only look it up. torch is never
imported by importing this module, so the API can import the app to send tasks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from celery import Task, chain

from cluster.queues import worker_queue
from kvbm.protocol import (
    EmbeddingRef,
    EncodeHandle,
    PrefillHandle,
    StagePayload,
    StageSummary,
    block_hashes,
    model_namespace,
)
from tasks.app import app, queue, route_to

log = logging.getLogger(__name__)


# generate, prefill and embed reach the engine as their message arrives, ahead of Celery's
# hand-over to a pool thread (tasks.celery_ext)
BEGIN_ON_RECEIPT = "tasks.celery_ext:begin_on_receipt"


@app.task(name="conveyor.encode", bind=True, acks_late=True, ignore_result=True)
def encode(self: Task, payload: dict) -> dict:
    """Encode stage: the request's images through the vision tower; the handle (which
    Celery hands to the chain's next task) says where their embeddings are."""
    req = StagePayload.model_validate(payload)
    return _guarded(req, lambda rt: rt.encode(req)).model_dump()


@app.task(name="conveyor.generate", bind=True, acks_late=True, ignore_result=True,
          Strategy=BEGIN_ON_RECEIPT)  # fmt: skip
def generate(self: Task, *args: dict) -> dict:
    """Aggregated stage: prefill and decode the request on this worker, streaming tokens
    (``args``: the payload, after an encode task's handle in the e-pd mode)."""
    req, refs, failed = stage_args(args)
    if failed:
        return _ended(req)
    return _guarded(req, lambda rt: rt.generate(req, refs)).model_dump()


@app.task(name="conveyor.prefill", bind=True, acks_late=True, ignore_result=True,
          Strategy=BEGIN_ON_RECEIPT)  # fmt: skip
def prefill(self: Task, *args: dict) -> dict:
    """Prefill stage: stream the first token, pin the KV, return the handle (which Celery
    hands to the chain's decode task)."""
    req, refs, failed = stage_args(args)
    if failed:
        h = PrefillHandle(request_id=req.request_id, prefill_worker="", finished=True,
                          finish_reason="error", error="encoding failed")  # fmt: skip
        return h.model_dump()
    return _guarded(req, lambda rt: rt.prefill(req, refs)).model_dump()


@app.task(name="conveyor.embed", bind=True, acks_late=True, ignore_result=True,
          Strategy=BEGIN_ON_RECEIPT)  # fmt: skip
def embed(self: Task, payload: dict) -> dict:
    """Embedding: the prompt's pooled hidden states, computed on this worker and sent back
    as the request's one frame (the payload's ``pooling`` says how)."""
    req = StagePayload.model_validate(payload)
    return _guarded(req, lambda rt: rt.embed(req)).model_dump()


def stage_args(args: tuple[dict, ...]) -> tuple[StagePayload, list[EmbeddingRef], bool]:
    """A generate or prefill task's arguments (the payload alone, or an encode task's handle
    then the payload) as the payload, the embeddings the encode task made of its images
    (none for a text request) and whether that encode task failed (it has ended the stream
    then: nothing is left to run)."""
    req = StagePayload.model_validate(args[-1])
    if len(args) == 2:
        enc = EncodeHandle.model_validate(args[0])
        if enc.error is not None:
            return req, [], True
        return req, enc.embeddings, False
    return req, [], False


def _ended(req: StagePayload) -> dict:
    """The summary of a request whose encode task failed (its stream is over)."""
    return StageSummary(request_id=req.request_id, finish_reason="error",
                        error="encoding failed").model_dump()  # fmt: skip


@app.task(name="conveyor.decode", bind=True, acks_late=True, ignore_result=True)
def decode(self: Task, handle: dict, payload: dict) -> dict:
    """Decode stage: pull the KV named by ``handle`` and generate from the second token.

    A failed pull (prefill worker gone, transfer error, timeout) sends the request through
    prefill again, on another prefill worker the router picks, keeping the first token
    the client already has, up to ``prefill_retries`` times; with no other prefill worker
    alive it is redone here, aggregated. Past the limit the stream ends with an error
    frame."""
    from workers.runtime import KVPullFailed, get_runtime

    req = StagePayload.model_validate(payload)
    h = PrefillHandle.model_validate(handle)
    if h.finished:
        return handle  # the request ended on its first token; the stream is complete
    try:
        return _guarded(req, lambda rt: rt.decode(req, h)).model_dump()
    except KVPullFailed as e:
        return _redo_prefill(get_runtime(), req, h, str(e)).model_dump()


def _redo_prefill(rt, req: StagePayload, handle: PrefillHandle, why: str) -> StageSummary:  # type: ignore[no-untyped-def]
    from tasks.settings import get_settings

    s = get_settings()
    if req.attempt >= s.transfer.prefill_retries:
        msg = f"KV transfer failed {req.attempt + 1} time(s), giving up: {why}"
        rt.fail(req.request_id, msg, "kv_transfer_failed", seq=1)
        return StageSummary(request_id=req.request_id, finish_reason="error", error=msg)
    redo = req.model_copy(update={"attempt": req.attempt + 1,
                                  "forced_first_token": handle.first_token})  # fmt: skip
    target = _pick_prefill(req, exclude=handle.prefill_worker)
    if target is None:
        log.warning("[%s] %s; no other prefill worker: running it here", req.request_id, why)
        return rt.generate(redo)
    log.warning("[%s] %s; prefilling again on %s (attempt %d/%d)", req.request_id, why,
                target, redo.attempt, s.transfer.prefill_retries)  # fmt: skip
    chain(
        prefill.si(redo.model_dump()).set(queue=queue(worker_queue("prefill", target))),
        decode.s(redo.model_dump()).set(**route_to(worker_queue(rt.pool, rt.worker_id))),
    ).apply_async()
    return StageSummary(request_id=req.request_id, redo=redo.attempt)


def _pick_prefill(req: StagePayload, exclude: str) -> str | None:
    """A live prefill worker other than ``exclude``, picked by the router as the API picks
    one (its load is not held: the redo is counted by nobody once it runs)."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    from tasks.router import Router, RouterConfig, RouteRequest
    from tasks.settings import get_settings

    s = get_settings()
    hashes = block_hashes(req.prompt_token_ids, s.engine.block_size, model_namespace(req.model))

    async def pick() -> str | None:
        client = aioredis.Redis.from_url(s.effective_redis_url)
        try:
            router = Router(client, RouterConfig.from_settings(s), follow=False)
            route = await router.pick(
                "prefill", RouteRequest(hashes, len(req.prompt_token_ids), exclude={exclude})
            )
            if route is None:
                return None
            await router.release(route)
            return route.worker_id
        finally:
            await client.aclose()

    try:
        return asyncio.run(pick())
    except RedisError as e:
        log.warning("[%s] the router did not answer (%s): no prefill worker", req.request_id, e)
        return None


def _guarded(req: StagePayload, run: Callable):  # type: ignore[no-untyped-def, type-arg]
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
        seq = req.resume.next_seq if req.resume is not None else 0  # after what is out
        for sid in req.stream_ids:  # n > 1: every choice's stream
            rt.fail(sid, f"generation failed: {e}", "task_failed", seq)
        raise
