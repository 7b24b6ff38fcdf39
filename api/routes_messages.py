"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API,
through the chat pipeline (as vLLM serves it beside the OpenAI API).

The body becomes the chat request it means (:func:`api.anthropic.chat_request`), which is
checked, rendered, constrained and started exactly as ``/v1/chat/completions`` does it
(:func:`api.routes_openai.start`). Its output goes through the request's parser into
content blocks (:class:`api.anthropic.ContentBlocks`): a Message object, or the Messages
stream (``event:`` + ``data:`` lines): ``message_start``, ``ping``, each block's
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta`` (the stop reason and
the usage) and ``message_stop``; or, after a failure mid-stream, an ``error`` event.
Errors on these paths are in Anthropic's shape (:func:`api.errors.anthropic_error_body`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from api.anthropic import (
    ContentBlocks,
    MessagesBody,
    MessagesRequest,
    chat_request,
    message_body,
    stop_of,
    usage_body,
)
from api.errors import OpenAIError, anthropic_error_body
from api.protocol import ChatCompletionRequest, unsupported
from api.reasoning import output_parser
from api.routes_generate import generate_body, text_only
from api.routes_openai import chat_prompt, collect, end_request, prepare, start
from api.runner import RunningRequest, frame_error, stream_failed
from api.sse import SSEResponse, json_line
from api.state import ApiState, api_state, check_model
from api.tokenization import Prompt
from api.tool_parsers import Event, Text, ToolParser
from api.tools import ToolPlan, tool_plan
from kvbm.protocol import TokenFrame

router = APIRouter()


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    started = time.perf_counter()
    st = api_state(request)
    lora = await check_model(st, body.model, task="generate")
    req, plan, prompt = _rendered(st, body)
    unsupported(req)
    st.media.check_count(prompt.images)
    # max_tokens past the context window: up to its end (model_context_window_exceeded)
    room = st.builder.max_model_len - len(prompt.token_ids)
    max_tokens = min(body.max_tokens, room) if room > 0 else body.max_tokens
    rid, (run,), sampling = await start(st, req, request, prompt, max_tokens, "message",
                                        started, "messages", plan, lora)  # fmt: skip
    parser = output_parser(st.settings.api.reasoning_parser, plan, req)
    out = _Output(body, "msg_" + rid.split("-", 1)[1], parser)
    headers = {"x-request-id": rid}
    if body.stream:
        gen = _stream(st, run, out, started, len(prompt.token_ids))
        return SSEResponse(gen, ping=15, headers=headers)
    text, last = await collect(st, run, started)
    st.metrics.finish.labels(last.finish_reason or "unknown").inc()
    out.feed(text)
    out.finish()  # the parser's held text too
    return JSONResponse(out.message(last), headers=headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesBody, request: Request) -> Response:
    """The prompt's length in tokens, as ``/v1/messages`` would render it (system, tools,
    messages); nothing runs."""
    st = api_state(request)
    await check_model(st, body.model, task="generate")
    _, _, prompt = _rendered(st, body)
    return JSONResponse({"input_tokens": len(prompt.token_ids)})


@router.post("/v1/messages/render")
async def render_message(body: MessagesRequest, request: Request) -> Response:
    """The body as the ``/inference/v1/generate`` body it runs as (vLLM's): the chat
    request it means, rendered and its sampling resolved; nothing runs."""
    st = api_state(request)
    await check_model(st, body.model, task="generate")
    req, plan, prompt = _rendered(st, body)
    unsupported(req)
    text_only(prompt)
    room = st.builder.max_model_len - len(prompt.token_ids)
    max_tokens = min(body.max_tokens, room) if room > 0 else body.max_tokens
    sampling = prepare(st, req, prompt, max_tokens, "messages", plan)
    return JSONResponse(generate_body(req, prompt, sampling, f"msg_{uuid.uuid4().hex}"))


def _rendered(st: ApiState, body: MessagesBody) -> tuple[ChatCompletionRequest, ToolPlan | None,
                                                        Prompt]:  # fmt: skip
    """The chat request the body means, its tools (checked before they are rendered) and
    its prompt."""
    req = chat_request(body)
    if st.builder.thinking_markers is None:
        # a budget with nothing to count between: left unenforced (chat's field is a 400)
        req.thinking_token_budget = None
    plan = tool_plan(req, st.tool_parser)
    return req, plan, chat_prompt(st, req)


class _Output:
    """One message's output: parser events -> content blocks -> the Message."""

    def __init__(self, body: MessagesRequest, msg_id: str, parser: ToolParser | None) -> None:
        self.body = body
        self.id = msg_id
        self.parser = parser
        self.blocks = ContentBlocks()

    def feed(self, text: str) -> list[dict]:
        parsed: list[Event] = self.parser.feed(text) if self.parser else [Text(text)]
        return self.blocks.events(parsed)

    def finish(self) -> list[dict]:
        events = self.blocks.events(self.parser.finish()) if self.parser else []
        return events + self.blocks.finish()

    def stop(self, last: TokenFrame) -> tuple[str, str | None]:
        return stop_of(last, self.body, self.blocks.calls)

    def message(self, last: TokenFrame) -> dict:
        return message_body(self.id, self.body.model, self.blocks.content, self.stop(last),
                            usage_body(last.usage))  # fmt: skip


def _sse(event: dict) -> bytes:
    """One Messages stream event: its type on the ``event:`` line, as Anthropic sends them."""
    return f"event: {event['type']}\r\ndata: {json_line(event)}\r\n\r\n".encode()


async def _stream(st: ApiState, run: RunningRequest, out: _Output, started: float,
                  prompt_tokens: int) -> AsyncIterator[bytes]:  # fmt: skip
    head = message_body(out.id, out.body.model, [], (None, None), usage_body(None, prompt_tokens))
    yield _sse({"type": "message_start", "message": head}) + _sse({"type": "ping"})
    try:
        async for batch in st.runner.batches(run):
            last = batch[-1]
            if last.error is not None:
                events = [e for f in batch[:-1] for e in out.feed(f.text)]
                yield b"".join(map(_sse, events)) + _error_event(frame_error(last))
                return
            events = [e for f in batch if f.text for e in out.feed(f.text)]
            if last.done:
                events += out.finish()
                st.metrics.finish.labels(last.finish_reason or "unknown").inc()
                reason, sequence = out.stop(last)
                events.append({"type": "message_delta",
                               "delta": {"stop_reason": reason, "stop_sequence": sequence},
                               "usage": usage_body(last.usage)})  # fmt: skip
                events.append({"type": "message_stop"})
            if events:
                yield b"".join(map(_sse, events))
    except Exception as e:  # noqa: BLE001 - the stream must end with a terminal event
        yield _error_event(stream_failed(e, run.request_id))
    finally:
        end_request(st, [run], started)


def _error_event(err: OpenAIError) -> bytes:
    return _sse(anthropic_error_body(err.status, err.message, err.param))
