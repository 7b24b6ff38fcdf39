"""The OpenAI-compatible HTTP front (FastAPI).

    POST /v1/chat/completions   stream (SSE) and non-stream
    POST /v1/completions        stream (SSE) and non-stream
    GET  /v1/models             the served model
    GET  /health                200 when Redis answers and every stage has a live worker
    GET  /metrics               Prometheus
    GET  /docs, /openapi.json   FastAPI's own

The API tokenizes (chat template included), validates against the context window, and
hands the request to :class:`api.runner.Runner`; it never imports torch or the engine.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.types import Message, Send

from api.cluster_metrics import ClusterCollector
from api.errors import OpenAIError, bad_request, install_error_handlers
from api.metrics import ApiMetrics
from api.middleware import AccessMiddleware
from api.protocol import PIN_HEADER, ChatCompletionRequest, CompletionRequest, unsupported
from api.runner import Runner, RunningRequest, frame_error, stream_error
from api.streams import StreamHub
from api.tokenization import PromptBuilder
from tasks.app import configure as configure_celery
from tasks.heap import freeze_startup_heap
from tasks.pipeline import required_pools, stages
from tasks.settings import Settings, get_settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    s = settings or get_settings()
    metrics = ApiMetrics()
    cluster = ClusterCollector(s.mode)
    metrics.registry.register(cluster)
    builder = PromptBuilder(s.model, s.max_model_len)
    configure_celery(s)
    state: dict = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client = aioredis.Redis.from_url(s.effective_redis_url)
        hub = StreamHub(s.effective_redis_url)
        await hub.start()
        state["redis"] = client
        state["hub"] = hub
        state["runner"] = Runner(s, client, hub, metrics)
        state["created"] = int(time.time())
        freeze_startup_heap("api")  # no full collection pauses every stream later
        log.info("api up: model %s, mode %s, redis %s", s.model_name, s.mode,
                 s.effective_redis_url)  # fmt: skip
        try:
            yield
        finally:
            await state["runner"].aclose()
            await hub.close()
            await client.aclose()

    app = FastAPI(title="Conveyor", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(AccessMiddleware, max_body_bytes=s.max_body_bytes, metrics=metrics)

    # ----------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def list_models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": s.model_name,
                    "object": "model",
                    "created": state.get("created", 0),
                    "owned_by": "conveyor",
                    "max_model_len": builder.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        client: aioredis.Redis = state["redis"]
        try:
            await client.ping()
        except Exception as e:  # noqa: BLE001
            return JSONResponse({"status": "unavailable", "redis": str(e)}, status_code=503)
        runner: Runner = state["runner"]
        pools = {p: await runner.router.live_count(p) for p in stages(s.mode)}
        ok = all(pools[p] for p in required_pools(s.mode))
        body = {"status": "ok" if ok else "unavailable", "redis": "ok", "workers": pools}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            await cluster.refresh(state["redis"])
        except Exception as e:  # noqa: BLE001 - still export the API's own metrics
            log.warning("cluster metrics unavailable: %s", e)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        started = time.perf_counter()
        _check_model(req.model)
        unsupported(req)
        prompt_ids = builder.chat_ids(req.messages)
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await _serve(req, request, prompt_ids, max_tokens, "chat", started, "messages")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        started = time.perf_counter()
        _check_model(req.model)
        unsupported(req)
        prompt_ids = builder.completion_ids(req.prompt)
        return await _serve(req, request, prompt_ids, req.max_tokens, "completion", started,
                            "prompt")  # fmt: skip

    # ----------------------------------------------------------------------------------
    def _check_model(name: str) -> None:
        if name != s.model_name:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist. Available: `{s.model_name}`.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    async def _serve(
        req: ChatCompletionRequest | CompletionRequest,
        request: Request,
        prompt_ids: list[int],
        max_tokens: int | None,
        kind: str,
        started: float,
        prompt_param: str,
    ) -> Response:
        max_tokens = builder.check_length(len(prompt_ids), max_tokens, prompt_param)
        if req.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
                "min_tokens",
            )
        sampling = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "top_k": 0 if req.top_k in (None, -1) else req.top_k,
            "seed": req.seed,
            "stop": req.stop_list(),
            "stop_token_ids": req.stop_token_ids or [],
            "ignore_eos": req.ignore_eos,
            "min_tokens": req.min_tokens,
        }
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        rid = state["hub"].new_request_id(prefix)  # its stream needs no SUBSCRIBE
        runner: Runner = state["runner"]
        metrics.in_flight.inc()
        try:
            pin = req.worker_id or request.headers.get(PIN_HEADER) or None
            run = await runner.start(rid, prompt_ids, sampling, started, pin)
        except BaseException:
            metrics.in_flight.dec()
            raise
        metrics.prompt_tokens.inc(len(prompt_ids))
        fmt = _Formatter(kind, rid, s.model_name)
        if req.stream:
            gen = _stream(runner, run, fmt, req.include_usage, started)
            return _SSE(gen, ping=15, headers={"x-request-id": rid})
        return await _collect(runner, run, fmt, started)

    async def _stream(
        runner: Runner,
        run: RunningRequest,
        fmt: _Formatter,
        include_usage: bool,
        started: float,
    ) -> AsyncIterator[dict]:
        try:
            if fmt.chat:  # chat streams open with the assistant role, as OpenAI's do
                yield _data(fmt.chunk(fmt.role_delta(), None, include_usage))
            async for batch in runner.batches(run):
                last = batch[-1]
                failed = bool(last.get("error"))
                text = "".join(f.get("text") or "" for f in (batch[:-1] if failed else batch))
                event = fmt.text_event(text, include_usage) if text else b""
                if not (failed or last.get("done")):
                    if event:
                        yield event
                    continue
                # The stream's last events go out as one chunk (one write, one wake of the
                # client): its last text, the finish (or error) and usage, and [DONE].
                if failed:
                    yield event + _data(frame_error(last).body())
                    return
                reason = last.get("finish_reason")
                metrics.finish.labels(reason or "unknown").inc()
                event += _data(fmt.chunk(fmt.empty_delta(), reason, include_usage,
                                         stop_reason=last.get("stop_reason")))  # fmt: skip
                if include_usage:
                    event += _data(fmt.usage_chunk(_usage(last)))
                yield event + _DONE
                return
            yield _DONE
        except Exception as e:  # noqa: BLE001 - the stream must end with a terminal event
            err = stream_error(e)
            log.warning("[%s] stream ended with error: %s", run.request_id, err.message)
            yield _data(err.body())
        finally:
            _account(run, started)
            runner.finish(run)

    async def _collect(
        runner: Runner, run: RunningRequest, fmt: _Formatter, started: float
    ) -> JSONResponse:
        parts: list[str] = []
        last: dict = {}
        try:
            async for batch in runner.batches(run):
                for frame in batch:
                    if frame.get("error"):
                        raise frame_error(frame)
                    parts.append(frame.get("text") or "")
                last = batch[-1]
        except OpenAIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise stream_error(e) from e
        finally:
            _account(run, started)
            runner.finish(run)
        reason = last.get("finish_reason")
        metrics.finish.labels(reason or "unknown").inc()
        body = fmt.full("".join(parts), reason, last.get("stop_reason"), _usage(last))
        return JSONResponse(body, headers={"x-request-id": run.request_id})

    def _account(run: RunningRequest, started: float) -> None:
        metrics.in_flight.dec()
        metrics.e2e.observe(time.perf_counter() - started)
        if run.usage:
            metrics.completion_tokens.inc(run.usage.get("completion_tokens", 0))
            metrics.cached_tokens.inc(run.usage.get("cached_tokens", 0))

    return app


# --------------------------------------------------------------------------------------
# Response shapes
# --------------------------------------------------------------------------------------


class _SSE(EventSourceResponse):
    """sse-starlette's response, minus a cancel scope per chunk when no send timeout is set
    (its default): anyio's ``move_on_after(None)`` was ~4% of the API's CPU at 16 streams,
    for a deadline that never fires. With a ``send_timeout`` its own send is used."""

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def _json(obj: object) -> str:
    # ASCII-escaped on purpose: raw U+2028, U+0085 ... in an SSE line break clients that
    # split lines with str.splitlines(), and random-weight models emit such characters.
    # Escaped, the JSON is also one line, so an event is ``data: <json>`` and a blank line.
    return json.dumps(obj, separators=(",", ":"))


def _data(obj: dict) -> bytes:
    """One SSE event, encoded as sse-starlette would (it sends bytes as they are)."""
    return b"data: " + _json(obj).encode() + b"\r\n\r\n"


_DONE = b"data: [DONE]\r\n\r\n"


def _usage(frame: dict) -> dict:
    u = frame.get("usage") or {}
    p, c = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)},
    }


class _Formatter:
    """Builds chat.completion(.chunk) or text_completion bodies for one request."""

    def __init__(self, kind: str, rid: str, model: str) -> None:
        self.chat = kind == "chat"
        self.rid = rid
        self.model = model
        self.created = int(time.time())
        self._text_event: tuple[bytes, bytes] | None = None

    def text_event(self, text: str, include_usage: bool) -> bytes:
        """``_data(chunk(text_delta(text), None, include_usage))``, from a template: the
        chunks of a stream differ only in their text (this is the per-token path)."""
        if self._text_event is None:
            probe = "\x00"
            body = _json(self.chunk(self.text_delta(probe), None, include_usage))
            head, tail = body.split(_json(probe))
            self._text_event = b"data: " + head.encode(), tail.encode() + b"\r\n\r\n"
        head, tail = self._text_event
        return head + _json(text).encode() + tail

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def role_delta(self) -> dict:
        return {"role": "assistant", "content": ""}

    def text_delta(self, text: str) -> dict:
        return {"content": text} if self.chat else {"text": text}

    def empty_delta(self) -> dict:
        return {} if self.chat else {"text": ""}

    def chunk(
        self,
        delta: dict,
        finish_reason: str | None,
        include_usage: bool,
        stop_reason: str | int | None = None,
    ) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": delta["text"], "logprobs": None,
                      "finish_reason": finish_reason}  # fmt: skip
            body = self._head("text_completion")
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage
        return body

    def full(
        self, text: str, finish_reason: str | None, stop_reason: str | int | None, usage: dict
    ) -> dict:
        if self.chat:
            body = self._head("chat.completion")
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": stop_reason}  # fmt: skip
        else:
            body = self._head("text_completion")
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}  # fmt: skip
        body["choices"] = [choice]
        body["usage"] = usage
        return body
