"""Operator endpoints: ``GET /health``, ``GET /metrics`` and the prefix-cache reset.

``/health`` is 200 when Redis answers and every pool the mode requires has a live worker
(the stage table's required pools), else 503; its body lists the live workers per pool.
``/metrics`` exports the API's own metrics and the cluster's, read from Redis per scrape,
and the same under vLLM's names (:mod:`api.vllm_metrics`).
``POST /reset_prefix_cache`` (vLLM's) and ``POST /clear_kv_blocks`` (Dynamo's) make every
live engine worker forget its cached prefixes: one command on
:data:`cluster.keys.CONTROL_CHANNEL`, each worker's engine process answering in the
command's reply hash.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import Metric

from api.dynamo_metrics import dynamo_families
from api.errors import OpenAIError, bad_request
from api.state import api_state
from api.vllm_metrics import vllm_families
from cluster.keys import CONTROL_CHANNEL, control_reply_key

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


RESET_TIMEOUT_S = 30.0  # how long the workers have to answer a reset
ENGINE_POOLS = ("generate", "prefill", "decode")  # the pools whose workers cache prefixes


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
    membership = st.runner.router.membership
    pools = [p for p in st.settings.serving_mode.pools if p in ENGINE_POOLS]
    expected = {w.worker_id for p in pools for w in await membership.live_workers(p)}
    cid = secrets.token_hex(8)
    key = control_reply_key(cid)
    cmd = {"id": cid, "op": "reset_prefix_cache", "reset_external": reset_external}
    await st.redis.publish(CONTROL_CHANNEL, json.dumps(cmd))
    deadline = time.monotonic() + RESET_TIMEOUT_S
    answers: dict = {}
    while True:
        raw = await st.redis.hgetall(key)
        answers = {k.decode() if isinstance(k, bytes) else k: json.loads(v)
                   for k, v in raw.items()}  # fmt: skip
        if expected <= answers.keys() or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    for w in expected - answers.keys():
        answers[w] = {"success": False, "message": f"no answer in {RESET_TIMEOUT_S:g} s"}
    if not answers:
        raise OpenAIError(503, "no live engine worker to reset", "server_error", None,
                          "no_workers")  # fmt: skip
    ok = all(a.get("success") for a in answers.values())
    log.info("prefix cache reset on %d workers: %s", len(answers), "done" if ok else answers)
    return JSONResponse({"success": ok, "workers": dict(sorted(answers.items()))})
