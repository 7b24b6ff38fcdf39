"""Operator endpoints: ``GET /health``, ``GET /metrics`` and the prefix-cache reset.

``/health`` is 200 when Redis answers and every pool the mode requires has a live worker
(the stage table's required pools), else 503; its body lists the live workers per pool.
``/metrics`` exports the API's own metrics and the cluster's, read from Redis per scrape,
and the same under vLLM's names (:mod:`api.vllm_metrics`).
``POST /reset_prefix_cache`` (vLLM's) and ``POST /clear_kv_blocks`` (Dynamo's) make every
live engine worker forget its cached prefixes, and ``POST /pause``, ``POST /resume``,
``GET /is_paused`` (vLLM's) pause the deployment's engines: one command on
:data:`cluster.keys.CONTROL_CHANNEL` each, every worker's engine process answering in the
command's reply hash.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import Metric

from api.dynamo_metrics import dynamo_families
from api.errors import OpenAIError, bad_request
from api.state import ApiState, api_state
from api.vllm_metrics import vllm_families
from cluster.keys import CONTROL_CHANNEL, PAUSED_KEY, control_reply_key

log = logging.getLogger(__name__)

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    st = api_state(request)
    mode = st.settings.serving_mode
    try:
        await st.redis.ping()
        pools = {p: len(await st.runner.router.membership.live_workers(p)) for p in mode.pools}
    except Exception as e:  # noqa: BLE001 - any failure to reach Redis is "unavailable"
        return JSONResponse({"status": "unavailable", "redis": str(e)}, status_code=503)
    ok = all(pools[p] for p in mode.required_pools)
    body = {"status": "ok" if ok else "unavailable", "redis": "ok", "workers": pools}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/load")
async def load(request: Request) -> JSONResponse:
    """vLLM's server load: the requests this API process is serving now (a load balancer
    spreading clients over API replicas reads it)."""
    st = api_state(request)
    now = st.metrics.registry.get_sample_value("conveyor_requests_in_flight") or 0.0
    return JSONResponse({"server_load": int(now)})


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    st = api_state(request)
    try:
        await st.cluster.refresh(st.redis, st.runner.router)
    except Exception as e:  # noqa: BLE001 - still export the API's own metrics
        log.warning("cluster metrics unavailable: %s", e)
    families = list(st.metrics.exposed(st.cluster).collect())
    s, workers = st.settings, st.cluster.workers
    limits = {"context_length": st.builder.max_model_len,
              "kv_cache_block_size": s.engine.block_size,
              "max_num_seqs": s.engine.max_num_seqs,
              "max_num_batched_tokens": s.engine.max_num_batched_tokens,
              "migration_limit": s.api.migration_limit}  # fmt: skip
    families += [*vllm_families(families, workers, s.model_name),
                 *dynamo_families(families, workers, s.model_name, limits)]  # fmt: skip
    return Response(generate_latest(_Exported(families)), media_type=CONTENT_TYPE_LATEST)


class _Exported:
    """Families collected already, as the registry generate_latest reads."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


RESET_TIMEOUT_S = 30.0  # how long the workers have to answer a reset, a resume, a pause
ENGINE_POOLS = ("generate", "prefill", "decode")  # the pools whose workers run an engine


async def _engine_workers(st: ApiState) -> set[str]:
    membership = st.runner.router.membership
    pools = [p for p in st.settings.serving_mode.pools if p in ENGINE_POOLS]
    return {w.worker_id for p in pools for w in await membership.live_workers(p)}


async def command_engines(st: ApiState, op: str, timeout: float | None, **fields: object) -> dict:
    """Publish one control command to every engine process and gather their answers
    (worker id -> answer) until each live engine worker has answered or ``timeout`` (None:
    until then, however long; a worker that stops heartbeating is no longer waited for).
    A worker that did not answer in time is named with ``success: false``; none live at
    all is a 503."""
    expected = await _engine_workers(st)
    cid = secrets.token_hex(8)
    key = control_reply_key(cid)
    await st.redis.publish(CONTROL_CHANNEL, json.dumps({"id": cid, "op": op, **fields}))
    started = time.monotonic()
    checked = started
    answers: dict = {}
    while True:
        raw = await st.redis.hgetall(key)
        answers = {k.decode() if isinstance(k, bytes) else k: json.loads(v)
                   for k, v in raw.items()}  # fmt: skip
        now = time.monotonic()
        if expected <= answers.keys() or (timeout is not None and now - started > timeout):
            break
        if now - checked > 1.0:  # a worker that died is not waited for
            expected = (expected & await _engine_workers(st)) | answers.keys()
            checked = now
        await asyncio.sleep(0.05)
    for w in expected - answers.keys():
        answers[w] = {"success": False, "message": f"no answer in {timeout:g} s"}
    if not answers:
        raise OpenAIError(503, "no live engine worker", "server_error", None, "no_workers")
    return dict(sorted(answers.items()))


@router.post("/reset_prefix_cache")
@router.post("/clear_kv_blocks")
async def reset_prefix_cache(
    request: Request,
    reset_running_requests: bool = Query(False),
    reset_external: bool = Query(False),
) -> JSONResponse:
    """Every live engine worker forgets its cached prefixes (and, with
    ``reset_external``, the KVBM tiers' blocks below its GPU pool), as vLLM's
    ``/reset_prefix_cache`` does for its one engine and Dynamo's ``/clear_kv_blocks`` for
    its workers. A worker with requests holding blocks resets nothing and says so
    (``success: false``; retry when it is idle), as vLLM does. The answer:
    ``{"success", "workers": {id: {"success", "pool", "message"?}}}``."""
    st = api_state(request)
    if reset_running_requests:
        raise bad_request("reset_running_requests is not served: a worker resets only when "
                          "no request holds KV blocks (retry when idle)",
                          "reset_running_requests", "unsupported_parameter")  # fmt: skip
    answers = await command_engines(st, "reset_prefix_cache", RESET_TIMEOUT_S,
                                    reset_external=reset_external)  # fmt: skip
    ok = all(a.get("success") for a in answers.values())
    log.info("prefix cache reset on %d workers: %s", len(answers), "done" if ok else answers)
    return JSONResponse({"success": ok, "workers": answers})


PauseMode = Literal["abort", "wait", "keep"]


@router.post("/pause")
async def pause(
    request: Request,
    mode: Annotated[PauseMode, Query()] = "abort",
    wait_for_inflight_requests: bool = Query(False),
    clear_cache: bool = Query(True),
) -> JSONResponse:
    """vLLM's ``/pause`` (a weight update's first step), for the whole deployment: every
    engine worker stops starting requests; those that come meanwhile are accepted and
    wait in their worker until ``/resume``. ``mode``: ``abort`` ends every request in an
    engine now (finish reason ``abort``, with the tokens it had), ``wait`` lets them run to
    their end, ``keep`` freezes them where they are (they go on at resume). With
    ``clear_cache`` (not for ``keep``) each worker then forgets its cached KV, the tiers
    below too: it was computed with the old weights. Answered once every live engine
    worker has paused (for ``wait``, however long its requests take):
    ``{"status": "paused", "workers": {id: {"success", "pool", "paused", "held"}}}``; a
    ``/resume`` that came first makes it ``resumed``. ``wait_for_inflight_requests`` is
    vLLM's older spelling of ``mode=wait``."""
    st = api_state(request)
    if wait_for_inflight_requests:
        mode = "wait"
    state = {"mode": mode, "clear_cache": clear_cache, "at": time.time()}
    await st.redis.set(PAUSED_KEY, json.dumps(state))
    timeout = None if mode == "wait" else RESET_TIMEOUT_S
    answers = await command_engines(st, "pause", timeout, mode=mode, clear_cache=clear_cache)
    paused = await st.redis.exists(PAUSED_KEY) > 0  # a /resume may have come meanwhile
    log.info("pause (%s): %s", mode, answers)
    return JSONResponse({"status": "paused" if paused else "resumed", "workers": answers})


@router.post("/resume")
async def resume(request: Request) -> JSONResponse:
    """vLLM's ``/resume``: every engine worker starts again, the requests it held first (in
    their arrival order). ``{"status": "resumed", "workers": {id: {..., "released"}}}``."""
    st = api_state(request)
    await st.redis.delete(PAUSED_KEY)
    answers = await command_engines(st, "resume", RESET_TIMEOUT_S)
    log.info("resume: %s", answers)
    return JSONResponse({"status": "resumed", "workers": answers})


@router.get("/is_paused")
async def is_paused(request: Request) -> JSONResponse:
    """vLLM's ``/is_paused``: ``{"is_paused": bool}``, the deployment's pause."""
    return JSONResponse({"is_paused": await api_state(request).redis.exists(PAUSED_KEY) > 0})
