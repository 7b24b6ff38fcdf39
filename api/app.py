"""The OpenAI-compatible HTTP front (FastAPI): the app factory.

    POST /v1/chat/completions   stream (SSE) and non-stream      api.routes_openai
    POST /v1/completions        stream (SSE) and non-stream      api.routes_openai
    GET  /v1/models             the served model                 api.routes_openai
    POST /v1/responses          stream (SSE) and non-stream      api.routes_responses
    POST /v1/messages           Anthropic's Messages API         api.routes_messages
    /v1/messages/batches        its Message Batches API          api.routes_message_batches
    POST /v1/embeddings         pooled hidden states             api.routes_embeddings
    POST /tokenize, /detokenize vLLM's, in the API alone         api.routes_tokenize
    POST /inference/v1/generate vLLM's tokens in, tokens out     api.routes_generate
    POST /v1/*/render           a request as generate's body     api.routes_generate
    GET  /health                Redis and the required pools     api.routes_ops
    GET  /metrics               Prometheus                       api.routes_ops
    GET  /docs, /openapi.json   FastAPI's own

The API tokenizes (chat template included), validates against the context window, and
hands the request to :class:`api.runner.Runner`; it never imports torch or the engine.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from api import (
    routes_batches,
    routes_classify,
    routes_conversations,
    routes_embeddings,
    routes_generate,
    routes_message_batches,
    routes_messages,
    routes_models,
    routes_openai,
    routes_ops,
    routes_responses,
    routes_sagemaker,
    routes_scores,
    routes_tokenize,
)
from api.admission import ClientLimitMiddleware
from api.classifier import load_classifier
from api.cluster_metrics import ClusterCollector
from api.drain import Drain
from api.errors import install_error_handlers
from api.media import MediaGuard
from api.metrics import ApiMetrics
from api.middleware import AccessMiddleware, AuthMiddleware
from api.params import SamplingDefaults
from api.runner import Runner
from api.state import ApiState
from api.streams import StreamHub
from api.tenants import TenantBudget
from api.tokenization import PromptBuilder
from api.tool_parsers import parser_for_template
from api.tracing import TracingMiddleware
from cluster.conversations import ConversationStore
from cluster.lora import LoraRegistry
from cluster.response_store import ResponseStore
from cluster.tracing import start_tracing
from cluster.traffic import flush_loop
from tasks.app import configure as configure_celery
from tasks.heap import freeze_startup_heap, trim_heap
from tasks.settings import Settings, get_settings

log = logging.getLogger(__name__)


IDLE_TRIM_S = 2.0  # an API with nothing in flight this long gives freed heap back


async def _trim_when_idle(metrics: ApiMetrics) -> None:
    """Once the requests in flight are down to none, and some ended since the last look,
    collect the cyclic garbage the streams left and hand the C heap's free pages back to
    the OS (:func:`tasks.heap.trim_heap`). Nothing is in flight, so the full collection
    pauses no stream (docs/performance.md, "API: 1,000 concurrent streams")."""
    get = metrics.registry.get_sample_value
    seen = 0.0
    while True:
        await asyncio.sleep(IDLE_TRIM_S)
        ended = get("conveyor_request_latency_seconds_count") or 0.0
        if ended != seen and not get("conveyor_requests_in_flight"):
            seen = ended
            gc.collect()
            trim_heap()


def create_app(settings: Settings | None = None) -> FastAPI:
    s = settings or get_settings()
    metrics = ApiMetrics()
    cluster = ClusterCollector(s.serving_mode)
    metrics.registry.register(cluster)
    builder = PromptBuilder(s.model, s.engine.max_model_len, s.model_name, s.api.chat_template,
                            s.api.default_chat_template_kwargs)  # fmt: skip
    builder.set_thinking_markers(s.api.reasoning_markers())
    builder.trust_request_templates = s.api.trust_request_chat_template
    media = MediaGuard(s.multimodal, metrics)
    st = ApiState(s, metrics, cluster, builder, media, classifier=load_classifier(s.model))
    st.tool_parser = s.api.tool_call_parser or parser_for_template(builder.template_text)
    st.sampling_defaults = SamplingDefaults.load(s.model, s.api.generation_config,
                                                 s.api.override_generation_config)  # fmt: skip
    if st.sampling_defaults.values or st.sampling_defaults.max_tokens_cap:
        log.info("sampling defaults from the generation config (CONVEYOR_GENERATION_CONFIG=%s): "
                 "%s; max_tokens cap %s", s.api.generation_config, st.sampling_defaults.values,
                 st.sampling_defaults.max_tokens_cap)  # fmt: skip
    configure_celery(s)
    # traces (cluster.tracing): None, and no middleware, unless an endpoint is set
    tracing = start_tracing(s.otlp_traces_endpoint, s.otlp_traces_protocol, "conveyor-api")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        st.redis = aioredis.Redis.from_url(s.effective_redis_url)
        st.hub = StreamHub(s.effective_redis_url, fast=s.broker_fastpath)
        await st.hub.start()
        st.runner = await Runner(s, st.redis, st.hub, metrics, tracing).open()
        st.hub.on_abort = partial(routes_generate.on_abort, st)  # /abort_requests, any API's
        st.tenants = TenantBudget(st.redis, s.admission.tenant_tokens_per_min, metrics)
        st.responses = ResponseStore(st.redis, s.api.responses_store_ttl_s)
        st.conversations = ConversationStore(st.redis, s.api.responses_store_ttl_s)
        st.loras = LoraRegistry(st.redis)
        static = await routes_models.register_static(st)
        st.created = int(time.time())
        freeze_startup_heap("api")  # no full collection pauses every stream later
        trimmer = asyncio.get_running_loop().create_task(_trim_when_idle(metrics))
        # the traffic counters the planner reads, added to Redis once a second
        flusher = asyncio.get_running_loop().create_task(flush_loop(metrics.traffic, st.redis))
        drain = Drain(st.hub, s.api.shutdown_drain_s).install()
        log.info("api up: model %s, mode %s, redis %s, fast path %s", s.model_name, s.mode,
                 s.redis_url_for_logs, "on" if s.broker_fastpath else "off")  # fmt: skip
        if static:
            log.info("LoRA adapters: %s", ", ".join(f"{r.name}={r.path}" for r in static))
        try:
            yield
        finally:
            drain.uninstall()
            trimmer.cancel()
            flusher.cancel()
            try:
                await metrics.traffic.flush(st.redis)  # the last second's counts
            except Exception as e:  # noqa: BLE001 - shutting down: Redis may be gone
                log.warning("last traffic counts not written: %s", e)
            await st.runner.aclose()
            await st.media.aclose()
            await st.hub.close()
            await st.redis.aclose()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # the last spans out

    app = FastAPI(title="Conveyor", version="0.1.0", lifespan=lifespan)
    app.state.conveyor = st
    install_error_handlers(app)
    if s.admission.client_max_requests:  # inside the access counts, so its 429s are counted too
        app.add_middleware(ClientLimitMiddleware, max_requests=s.admission.client_max_requests,
                           by_key=bool(s.api.api_key_list), retry_after_s=s.admission.retry_after_s,
                           metrics=metrics)  # fmt: skip
    app.add_middleware(AccessMiddleware, max_body_bytes=s.api.max_body_bytes, metrics=metrics)
    keys = s.api.api_key_list
    if keys:  # outermost: an unauthenticated request is answered before anything reads it
        app.add_middleware(AuthMiddleware, keys=keys, protect_ops=s.api.api_keys_protect_ops)
    if (cors := s.api.cors) is not None:  # outside the auth: a preflight carries no key
        app.add_middleware(CORSMiddleware, **cors)
    if tracing is not None:  # outermost: every answer is in the span, a 401 included
        app.add_middleware(TracingMiddleware, tracing=tracing)
    app.include_router(routes_models.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_messages.router)
    app.include_router(routes_message_batches.router)
    app.include_router(routes_conversations.router)
    app.include_router(routes_embeddings.router)
    app.include_router(routes_scores.router)
    app.include_router(routes_classify.router)
    app.include_router(routes_tokenize.router)
    app.include_router(routes_generate.router)
    app.include_router(routes_batches.router)
    app.include_router(routes_ops.router)
    app.include_router(routes_sagemaker.router)
    return app
