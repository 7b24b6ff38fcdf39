"""Stage tasks. Thin: validate the payload, call one function in ``workers/``, return a handle.

The worker runtime (model, engine loop) is created once per worker process by
``conveyor worker`` before Celery starts consuming; tasks only look it up. torch is never
imported by importing this module, so the API can import the app to send tasks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery import Task, chain

from cluster.queues import worker_queue
from kvbm.protocol import (
    EncodeHandle,
    PrefillHandle,
    StagePayload,
    StageSummary,
    block_hashes,
    model_namespace,
)
from tasks.app import app, queue, route_to

if TYPE_CHECKING:  # imported where used: the API process imports this module, not workers
    from workers.engine_ipc import Run

log = logging.getLogger(__name__)


# generate, prefill and embed reach the engine as their message arrives, ahead of Celery's
# hand-over to a pool thread (tasks.celery_ext)
BEGIN_ON_RECEIPT = "tasks.celery_ext:begin_on_receipt"


@app.task(name="conveyor.encode", bind=True, acks_late=True, ignore_result=True)
def encode(self: Task, payload: dict) -> dict:
    """Encode stage: the request's images through the vision tower; the handle (which
    Celery hands to the chain's next task) says where their embeddings are."""
    cmd = stage_command("encode", (payload,))
    assert not isinstance(cmd, StagePayload), "an encode task's command encodes"
    return _guarded(cmd.payload, lambda rt: rt.encode(cmd)).model_dump()


@app.task(name="conveyor.generate", bind=True, acks_late=True, ignore_result=True,
          Strategy=BEGIN_ON_RECEIPT)  # fmt: skip
def generate(self: Task, *args: dict) -> dict:
    """Aggregated stage: prefill and decode the request on this worker, streaming tokens
    (``args``: the payload, after an encode task's handle in the e-pd mode)."""
    cmd = stage_command("generate", args)
    if isinstance(cmd, StagePayload):
        return _ended(cmd)
    return _guarded(cmd.payload, lambda rt: rt.generate(cmd)).model_dump()


@app.task(name="conveyor.prefill", bind=True, acks_late=True, ignore_result=True,
          Strategy=BEGIN_ON_RECEIPT)  # fmt: skip
def prefill(self: Task, *args: dict) -> dict:
    """Prefill stage: stream the first token, pin the KV, return the handle (which Celery
    hands to the chain's decode task)."""
    cmd = stage_command("prefill", args)
    if isinstance(cmd, StagePayload):
        h = PrefillHandle(request_id=cmd.request_id, prefill_worker="", finished=True,
                          finish_reason="error", error="encoding failed")  # fmt: skip
        return h.model_dump()
    return _guarded(cmd.payload, lambda rt: rt.prefill(cmd)).model_dump()


@app.task(name="conveyor.embed", bind=True, acks_late=True, ignore_result=True,
          Strategy=BEGIN_ON_RECEIPT)  # fmt: skip
def embed(self: Task, payload: dict) -> dict:
    """Embedding: the prompt's pooled hidden states, computed on this worker and sent back
    as the request's one frame (the payload's ``pooling`` says how)."""
    cmd = stage_command("embed", (payload,))
    assert not isinstance(cmd, StagePayload), "an embed task's command embeds"
    return _guarded(cmd.payload, lambda rt: rt.embed(cmd)).model_dump()


def stage_command(stage: str, args: tuple[dict, ...]) -> Run | StagePayload:
    """A stage task's Celery arguments as its engine command (workers.engine_ipc): built
    here only, for the task and for tasks.celery_ext's begin on receipt. ``args``: the
    payload last; before it, a decode's prefill handle, or in the e-pd mode a generate's or
    prefill's encode handle. The payload alone comes back when that encode task failed (it
    has ended the stream then: nothing is left to run)."""
    from workers.engine_ipc import Decode, Embed, Encode, Generate, Prefill

    req = StagePayload.model_validate(args[-1])
    if stage == "decode":
        return Decode(req, PrefillHandle.model_validate(args[0]))
    if stage in ("encode", "embed"):
        return (Encode if stage == "encode" else Embed)(req)
    if stage not in ("generate", "prefill"):
        raise ValueError(f"stage must be generate, prefill, decode, encode or embed, "
                         f"not {stage!r}")  # fmt: skip
    run = Generate if stage == "generate" else Prefill
    if len(args) == 2:  # after an encode task
        enc = EncodeHandle.model_validate(args[0])
        if enc.error is not None:
            return req
        return run(req, enc.embeddings)
    return run(req)


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
    from workers.engine_ipc import Decode
    from workers.runtime import KVPullFailed, get_runtime

    cmd = stage_command("decode", (handle, payload))
    assert isinstance(cmd, Decode), "a decode task's command decodes"
    if cmd.handle.finished:
        return handle  # the request ended on its first token; the stream is complete
    try:
        return _guarded(cmd.payload, lambda rt: rt.decode(cmd)).model_dump()
    except KVPullFailed as e:
        return _redo_prefill(get_runtime(), cmd.payload, cmd.handle, str(e)).model_dump()


def _redo_prefill(rt, req: StagePayload, handle: PrefillHandle, why: str) -> StageSummary:
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
        from workers.engine_ipc import Generate

        return rt.generate(Generate(redo))
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
    ns = model_namespace(req.model, req.lora.name if req.lora is not None else None,
                         req.sampling.cache_salt)  # fmt: skip
    hashes = block_hashes(req.prompt_token_ids, s.engine.block_size, ns)

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


def _guarded(req: StagePayload, run: Callable):
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
