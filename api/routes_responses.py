"""``POST /v1/responses``: OpenAI's Responses API, stateless, through the chat pipeline.

The body becomes the chat request it means (:func:`api.responses.chat_request`), which is
checked, rendered, constrained and started exactly as ``/v1/chat/completions`` does it
(:func:`api.routes_openai.start`). Its output goes through the request's tool parser (or
stays text) into output items (:class:`api.responses.OutputItems`): a Response object, or
the Responses stream (``event:`` + ``data:`` lines, each event with its
``sequence_number``): ``response.created``, ``response.in_progress``, the items' events,
and ``response.completed`` — also when the output stopped at ``max_output_tokens``, with
``status: "incomplete"`` in the response, as vLLM ends its streams — or, after an error
mid-stream, ``error`` then ``response.failed``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from api.errors import OpenAIError
from api.protocol import unsupported
from api.responses import OutputItems, ResponsesRequest, chat_request, created_now, response_body
from api.routes_openai import chat_prompt, collect, end_request, start
from api.runner import RunningRequest, frame_error, stream_failed
from api.sse import SSEResponse, json_line
from api.state import ApiState, api_state, check_model
from api.tool_parsers import Event, Text, ToolParser
from api.tools import tool_plan
from kvbm.protocol import TokenFrame

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    started = time.perf_counter()
    st = api_state(request)
    check_model(st, body.model)
    req = chat_request(body)
    unsupported(req)
    plan = tool_plan(req, st.tool_parser)
    prompt = chat_prompt(st, req)
    st.media.check_count(prompt.images)
    rid, (run,), _ = await start(  # the Responses API has no n: one run
        st, req, request, prompt, req.max_tokens, "response", started, "input", plan
    )
    out = _Output(st, body, rid, plan.parser() if plan is not None else None)
    if body.stream:
        return SSEResponse(_stream(st, run, out, started), ping=15, headers={"x-request-id": rid})
    return await _collect(st, run, out, started)


class _Output:
    """One response's output: parser events -> output items -> the Response."""

    def __init__(
        self, st: ApiState, body: ResponsesRequest, rid: str, parser: ToolParser | None
    ) -> None:
        self.body = body
        self.id = "resp_" + rid.split("-", 1)[1]
        self.model = st.settings.model_name
        self.created = created_now()
        self.parser = parser
        self.items = OutputItems()

    def feed(self, text: str) -> list[dict]:
        parsed: list[Event] = self.parser.feed(text) if self.parser else [Text(text)]
        return self.items.events(parsed)

    def finish(self, last: TokenFrame) -> list[dict]:
        events = self.items.events(self.parser.finish()) if self.parser else []
        return events + self.items.finish(self.status(last))

    def status(self, last: TokenFrame) -> str:
        return "incomplete" if last.finish_reason == "length" else "completed"

    def response(self, status: str, last: TokenFrame | None) -> dict:
        usage = last.usage if last is not None else None
        return response_body(
            self.body, self.id, self.created, self.model, self.items.output, status, usage
        )


def _sse(event: dict) -> bytes:
    """One Responses stream event: its type on the ``event:`` line, as OpenAI sends them."""
    return f"event: {event['type']}\r\ndata: {json_line(event)}\r\n\r\n".encode()


async def _stream(
    st: ApiState, run: RunningRequest, out: _Output, started: float
) -> AsyncIterator[bytes]:
    items = out.items
    try:
        head = out.response("in_progress", None)
        yield _sse(items.event("response.created", response=head)) + _sse(
            items.event("response.in_progress", response=head)
        )
        async for batch in st.runner.batches(run):
            last = batch[-1]
            failed = last.error is not None
            text = "".join(f.text for f in (batch[:-1] if failed else batch))
            events = out.feed(text) if text else []
            if failed:
                err = frame_error(last)
                yield b"".join(map(_sse, events)) + _failed(out, err)
                return
            if last.done:
                status = out.status(last)
                events += out.finish(last)
                st.metrics.finish.labels(last.finish_reason or "unknown").inc()
                events.append(
                    items.event("response.completed", response=out.response(status, last))
                )
            if events:
                yield b"".join(map(_sse, events))
            if last.done:
                return
    except Exception as e:  # noqa: BLE001 - the stream must end with a terminal event
        yield _failed(out, stream_failed(e, run.request_id))
    finally:
        end_request(st, [run], started)


def _failed(out: _Output, err: OpenAIError) -> bytes:
    """``error`` then ``response.failed`` (the response so far, with the error)."""
    items = out.items
    failed = out.response("failed", None)
    failed["error"] = {"code": err.code or "server_error", "message": err.message}
    return _sse(items.event("error", code=err.code, message=err.message, param=err.param)) + _sse(
        items.event("response.failed", response=failed)
    )


async def _collect(st: ApiState, run: RunningRequest, out: _Output, started: float) -> Response:
    text, last = await collect(st, run, started)
    st.metrics.finish.labels(last.finish_reason or "unknown").inc()
    out.feed(text)
    out.finish(last)
    body = out.response(out.status(last), last)
    return JSONResponse(body, headers={"x-request-id": run.request_id})
