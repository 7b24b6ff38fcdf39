"""The OpenAI-compatible endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``
(stream and non-stream) and ``GET /v1/models``.

A handler validates the body, builds the prompt (chat template, tokenizer, image
placeholders), checks it against the context window, has the media guard fetch and check
its images and store their bytes in Redis (:mod:`api.media`), and hands it to
:class:`api.runner.Runner`, which routes it, sends its chain and waits for its first frame;
the response then relays its frames as SSE events or collects them into one body. Every
refusal comes before the runner: nothing reaches the broker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from api.errors import OpenAIError, bad_request
from api.logprobs import ExtraOutput, extra_output
from api.params import sampling_of
from api.protocol import PIN_HEADER, ChatCompletionRequest, CompletionRequest, unsupported
from api.runner import RunningRequest, frame_error, stream_error
from api.sse import SSE_DONE, Formatter, SSEResponse, sse_event, usage_body
from api.state import ApiState, api_state
from api.tokenization import Prompt
from kvbm.protocol import TokenFrame

log = logging.getLogger(__name__)

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    st = api_state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": st.settings.model_name,
                "object": "model",
                "created": st.created,
                "owned_by": "conveyor",
                "max_model_len": st.builder.max_model_len,
            }
        ],
    }


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    started = time.perf_counter()
    st = api_state(request)
    _check_model(st, req.model)
    unsupported(req)
    prompt = st.builder.chat_prompt(req.messages)
    st.media.check_count(prompt.images)
    max_tokens = req.max_completion_tokens or req.max_tokens
    return await _serve(st, req, request, prompt, max_tokens, "chat", started, "messages")


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Response:
    started = time.perf_counter()
    st = api_state(request)
    _check_model(st, req.model)
    unsupported(req)
    prompt = Prompt(st.builder.completion_ids(req.prompt))
    return await _serve(st, req, request, prompt, req.max_tokens, "completion", started,
                        "prompt")  # fmt: skip


# --------------------------------------------------------------------------------------
def _check_model(st: ApiState, name: str) -> None:
    served = st.settings.model_name
    if name != served:
        raise OpenAIError(404, f"The model `{name}` does not exist. Available: `{served}`.",
                          "invalid_request_error", "model", "model_not_found")  # fmt: skip


async def _serve(
    st: ApiState,
    req: ChatCompletionRequest | CompletionRequest,
    request: Request,
    prompt: Prompt,
    max_tokens: int | None,
    kind: str,
    started: float,
    prompt_param: str,
) -> Response:
    prompt_ids = prompt.token_ids  # image placeholders included: they fill the context too
    max_tokens = st.builder.check_length(len(prompt_ids), max_tokens, prompt_param)
    if req.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
            "min_tokens",
        )
    sampling = sampling_of(req, max_tokens, st.builder)
    images = []
    if prompt.images:  # fetched and checked only once the rest of the request is valid
        loaded = await st.media.load(prompt.images)
        await st.media.store(st.redis, loaded)
        images = prompt.image_refs([im.hash for im in loaded])
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    rid = st.hub.new_request_id(prefix)  # its stream needs no SUBSCRIBE
    st.metrics.in_flight.inc()
    try:
        pin = req.worker_id or request.headers.get(PIN_HEADER) or None
        run = await st.runner.start(rid, prompt_ids, sampling, started, pin, images)
    except BaseException:
        st.metrics.in_flight.dec()
        raise
    st.metrics.prompt_tokens.inc(len(prompt_ids))
    fmt = Formatter(kind, rid, st.settings.model_name)
    extra = extra_output(st.strings, req, sampling, prompt_ids)  # None: text alone
    if req.stream:
        gen = _stream(st, run, fmt, req.include_usage, started, extra)
        return SSEResponse(gen, ping=15, headers={"x-request-id": rid})
    return await _collect(st, run, fmt, started, extra)


async def _stream(
    st: ApiState, run: RunningRequest, fmt: Formatter, include_usage: bool, started: float,
    extra: ExtraOutput | None = None,
) -> AsyncIterator[bytes]:  # fmt: skip
    try:
        if fmt.chat:  # chat streams open with the assistant role, as OpenAI's do
            yield sse_event(fmt.chunk(fmt.role_delta(), None, include_usage))
        async for batch in st.runner.batches(run):
            last = batch[-1]
            failed = last.error is not None
            frames = batch[:-1] if failed else batch
            text = "".join(f.text for f in frames)
            if extra is not None:  # logprobs, an echoed prompt
                event = extra.event(fmt, frames, text, include_usage)
            else:
                event = fmt.text_event(text, include_usage) if text else b""
            if not last.done:
                if event:
                    yield event
                continue
            # The stream's last events go out as one chunk (one write, one wake of the
            # client): its last text, the finish (or error) and usage, and [DONE].
            if failed:
                yield event + sse_event(frame_error(last).body())
                return
            st.metrics.finish.labels(last.finish_reason or "unknown").inc()
            event += sse_event(fmt.chunk(fmt.empty_delta(), last.finish_reason, include_usage,
                                         stop_reason=last.stop_reason))  # fmt: skip
            if include_usage:
                event += sse_event(fmt.usage_chunk(usage_body(last.usage)))
            yield event + SSE_DONE
            return
        yield SSE_DONE
    except Exception as e:  # noqa: BLE001 - the stream must end with a terminal event
        err = stream_error(e)
        log.warning("[%s] stream ended with error: %s", run.request_id, err.message)
        yield sse_event(err.body())
    finally:
        _account(st, run, started)
        st.runner.finish(run)


async def _collect(
    st: ApiState, run: RunningRequest, fmt: Formatter, started: float,
    extra: ExtraOutput | None = None,
) -> JSONResponse:  # fmt: skip
    parts: list[str] = []
    frames: list[TokenFrame] = []  # kept for the extras only
    last = None
    try:
        async for batch in st.runner.batches(run):
            for frame in batch:
                if frame.error is not None:
                    raise frame_error(frame)
                parts.append(frame.text)
            if extra is not None:
                frames += batch
            last = batch[-1]
    except OpenAIError:
        raise
    except Exception as e:  # noqa: BLE001
        raise stream_error(e) from e
    finally:
        _account(st, run, started)
        st.runner.finish(run)
    assert last is not None and last.done, "batches() ended without a terminal frame"
    st.metrics.finish.labels(last.finish_reason or "unknown").inc()
    text, usage = "".join(parts), usage_body(last.usage)
    if extra is None:
        body = fmt.full(text, last.finish_reason, last.stop_reason, usage)
    else:
        text, logprobs, prompt_logprobs = extra.full(frames, text)
        body = fmt.full(text, last.finish_reason, last.stop_reason, usage, logprobs,
                        prompt_logprobs)  # fmt: skip
    return JSONResponse(body, headers={"x-request-id": run.request_id})


def _account(st: ApiState, run: RunningRequest, started: float) -> None:
    m = st.metrics
    m.in_flight.dec()
    m.e2e.observe(time.perf_counter() - started)
    if run.usage is not None:
        m.completion_tokens.inc(run.usage.completion_tokens)
        m.cached_tokens.inc(run.usage.cached_tokens)
