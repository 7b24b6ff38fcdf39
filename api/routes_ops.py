"""Operator endpoints: ``GET /health`` and ``GET /metrics``.

``/health`` is 200 when Redis answers and every pool the mode requires has a live worker
(the stage table's required pools), else 503; its body lists the live workers per pool.
``/metrics`` exports the API's own metrics and the cluster's, read from Redis per scrape.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.state import api_state

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
    return Response(generate_latest(st.metrics.exposed(st.cluster)),
                    media_type=CONTENT_TYPE_LATEST)  # fmt: skip
