"""``POST /v1/responses``: OpenAI's Responses API, through the chat pipeline.

The body becomes the chat request it means (:func:`api.responses.chat_request`), which is
checked, rendered, constrained and started exactly as ``/v1/chat/completions`` does it
(:func:`api.routes_openai.start`). Its output goes through the request's tool parser (or
stays text) into output items (:class:`api.responses.OutputItems`): a Response object, or
the Responses stream (``event:`` + ``data:`` lines, each event with its
``sequence_number``): ``response.created``, ``response.in_progress``, the items' events,
and ``response.completed`` — also when the output stopped at ``max_output_tokens``, with
``status: "incomplete"`` in the response, as vLLM ends its streams — or, after an error
mid-stream, ``error`` then ``response.failed``.

**Background responses** (``background: true``; they need ``CONVEYOR_RESUMABLE_STREAMS``,
whose frame log they are read from): the API that accepts one answers at once (or streams
it from the log) and reads it to its end in a task of its own, then stores the final
Response in Redis (:func:`response_key`). ``GET /v1/responses/{id}`` answers from there on
any replica, or, while it runs (or if the API that accepted it died), by reading its frame
log through the same formatter: events are made one frame at a time and item ids come from
the response id, so the same frames always give the same events and sequence numbers, and
``?stream=true&starting_after=N`` sends those after N, then follows the log live.
``POST /v1/responses/{id}/cancel`` cancels it on its worker wherever it runs.

**Stored responses** (``CONVEYOR_RESPONSES_STORE``, on by default; a request's
``store: false`` opts out): once a response ends, its turn (input and output items) and the
response it continued go into its record (:mod:`cluster.response_store`), before its last
event or body leaves, so a client's next request always finds it. ``previous_response_id``
puts the stored conversation before the request's input; ``GET /v1/responses/{id}``,
``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` answer for it on
every replica. ``conversation`` (the Conversations API, :mod:`api.routes_conversations`)
puts that conversation's items before the input instead, and adds the turn's input and
output items to it once the response ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from api.errors import OpenAIError, bad_request
from api.logprobs import ID_STRINGS, LogprobsRenderer
from api.protocol import ChatCompletionRequest, unsupported
from api.reasoning import output_parser
from api.responses import (
    OutputItems,
    ResponsesRequest,
    chat_request,
    conversation_id,
    conversation_item,
    created_now,
    input_items,
    listed_item,
    response_body,
    wants_logprobs,
)
from api.resume import FrameLogReader, claim, event_id, frames_of, parse_event_id
from api.routes_conversations import conversation_of, page
from api.routes_openai import chat_prompt, collect, drain, end_request, linger_on, start
from api.runner import RunningRequest, frame_error, stream_failed
from api.sse import SSEResponse, json_line
from api.state import ApiState, api_state, check_model
from api.tokenization import Prompt
from api.tool_parsers import Event, Text, ToolParser
from api.tools import ToolPlan, tool_plan
from cluster.resp import as_str
from cluster.response_store import ChainBroken, Turn, response_key
from kvbm.protocol import (
    CANCEL_CHANNEL,
    FRAMES_OPEN_TTL_S,
    TokenFrame,
    cancelled_key,
    frames_key,
)

router = APIRouter()
log = logging.getLogger(__name__)

BACKGROUND_TTL_S = 24 * 3600  # a background response's record, from its start


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    started = time.perf_counter()
    st = api_state(request)
    lora = await check_model(st, body.model, task="generate")
    if body.background and not st.settings.api.resumable_streams:
        raise bad_request("background responses need the frame log: set "
                          "CONVEYOR_RESUMABLE_STREAMS=true", "background",
                          "unsupported_parameter")  # fmt: skip
    req, prompt = _rendered(st, body, await _history(st, body))
    unsupported(req)
    plan = tool_plan(req, st.tool_parser)
    st.media.check_count(prompt.images)
    if st.settings.api.resumable_streams and (last := request.headers.get("last-event-id")):
        return await _resume(st, body, last)
    rid, (run,), sampling = await start(  # the Responses API has no n: one run
        st, req, request, prompt, req.max_tokens, "response", started, "input", plan, lora
    )
    out = _Output(st, body, rid, _parser(st, req, plan))
    if body.background:
        return await _background(st, body, run, out, started)
    if body.stream:
        key = None
        if st.settings.api.resumable_streams:  # a stream to resume, and to GET, for a while
            key, _ = await _save_record(st, body, run, out, FRAMES_OPEN_TTL_S, background=False)
        return SSEResponse(_stream(st, run, out, started, key), ping=15,
                           headers={"x-request-id": rid})  # fmt: skip
    return await _collect(st, run, out, started)


def _rendered(st: ApiState, body: ResponsesRequest,
              history: list[dict]) -> tuple[ChatCompletionRequest, Prompt]:  # fmt: skip
    """The chat request the body means after ``history``, and its prompt. With
    ``truncation: "auto"`` (OpenAI's), a conversation too long for the context window
    loses its oldest items (the history's, then the input's; the instructions and the last
    item stay), as few as leave room for ``max_output_tokens`` (one token without it)."""
    req = chat_request(body, history)
    prompt = chat_prompt(st, req)
    room = body.max_output_tokens or 1

    def fits(p: Prompt) -> bool:
        return len(p.token_ids) + room <= st.builder.max_model_len

    if body.truncation != "auto" or fits(prompt):
        return req, prompt
    given = [{"role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input  # fmt: skip
    items = [*history, *given]
    lo, hi = 1, len(items) - 1  # the fewest dropped that fit: fewer items, fewer tokens
    best, dropped = None, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        cut = body.model_copy(update={"input": items[mid:], "previous_response_id": None,
                                      "conversation": None})  # fmt: skip
        r = chat_request(cut)
        p = chat_prompt(st, r)
        if fits(p):
            best, dropped, hi = (r, p), mid, mid - 1
        else:
            lo = mid + 1
    if best is None:  # not even the last item fits: the context-window 400 says so
        return req, prompt
    log.info("truncation auto: the oldest %d of %d items dropped to fit the context window",
             dropped, len(items))  # fmt: skip
    return best


def _stores(st: ApiState, body: ResponsesRequest) -> bool:
    """Whether the response is kept once it ends (OpenAI's default, where the store is on)."""
    return st.settings.api.responses_store and body.store is not False


async def _history(st: ApiState, body: ResponsesRequest) -> list[dict]:
    """The items of the conversation the request continues (oldest first): its
    ``conversation``'s, or the chain ``previous_response_id`` ends."""
    if (cid := conversation_id(body)) is not None:
        return (await conversation_of(st, cid, "conversation")).items
    prev = body.previous_response_id
    if prev is None:
        return []
    if not st.settings.api.responses_store:
        raise bad_request("previous_response_id needs stored responses "
                          "(CONVEYOR_RESPONSES_STORE is off): send the whole conversation "
                          "in `input`", "previous_response_id",
                          "unsupported_parameter")  # fmt: skip
    try:
        if not prev.startswith("resp_"):
            raise ChainBroken(prev)  # no response of ours
        turns = await st.responses.conversation(prev)
    except ChainBroken as e:
        what = "" if e.response_id == prev else f" (its conversation's {e.response_id!r} is gone)"
        raise OpenAIError(404, f"Response with id '{prev}' not found{what}.",
                          "invalid_request_error", "previous_response_id",
                          "not_found") from None  # fmt: skip
    return [item for t in turns for item in t.items()]


class _Output:
    """One response's output: parser events -> output items -> the Response."""

    def __init__(
        self, st: ApiState, body: ResponsesRequest, rid: str, parser: ToolParser | None
    ) -> None:
        self.body = body
        self.id = "resp_" + rid.split("-", 1)[1]
        self.model = body.model  # the base model or the LoRA adapter it named
        self.created = created_now()
        self.parser = parser
        self.items = OutputItems(self.id.removeprefix("resp_"))
        self.cancelled = False  # a background response cancelled by request
        self.final: dict | None = None  # the Response once the stream ended
        self.stored = _stores(st, body)  # kept in the response store once it ends
        # the output text's logprobs, when the request includes them (chat's entries)
        strings = ID_STRINGS if st.settings.api.return_tokens_as_token_ids else st.strings
        self.lps = LogprobsRenderer(strings, True, body.top_logprobs or 0) \
            if wants_logprobs(body) else None  # fmt: skip

    def feed(self, text: str) -> list[dict]:
        parsed: list[Event] = self.parser.feed(text) if self.parser else [Text(text)]
        return self.items.events(parsed)

    def feed_frames(self, frames: list[TokenFrame]) -> list[dict]:
        """The events of ``frames``, one frame at a time: the same for the same frames
        however they were batched (a background response's stream, read again). With
        logprobs, a frame's tokens' entries go out with the text they became."""
        out: list[dict] = []
        for f in frames:
            if self.lps is not None and f.token_ids:
                lps = f.logprobs if f.logprobs is not None else [None] * len(f.token_ids)
                self.items.pending += self.lps.full(f.token_ids, lps)["content"]
            if f.text:
                out += self.feed(f.text)
        return out

    def finish(self, last: TokenFrame) -> list[dict]:
        events = self.items.events(self.parser.finish()) if self.parser else []
        return events + self.items.finish(self.status(last))

    def status(self, last: TokenFrame) -> str:
        if self.cancelled and last.finish_reason == "abort":
            return "cancelled"
        return "incomplete" if last.finish_reason == "length" else "completed"

    def response(self, status: str, last: TokenFrame | None) -> dict:
        usage = last.usage if last is not None else None
        return response_body(self.body, self.id, self.created, self.model, self.items.output,
                             status, usage, self.stored)  # fmt: skip


def _sse(event: dict, response_id: str | None = None) -> bytes:
    """One Responses stream event: its type on the ``event:`` line, as OpenAI sends them;
    with ``response_id``, the ``id:`` a client resumes after (``Last-Event-ID``)."""
    head = event_id(response_id, (event["sequence_number"],)) if response_id else b""
    return head + f"event: {event['type']}\r\ndata: {json_line(event)}\r\n\r\n".encode()


async def _events(
    st: ApiState, out: _Output, batches: AsyncIterator[list[TokenFrame]],
    cancelled: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncIterator[list[dict]]:  # fmt: skip
    """The stream's events, a list per batch of frames: ``response.created`` and
    ``response.in_progress``, the items', then ``response.completed`` (``out.final`` is
    then the Response) or ``error`` + ``response.failed``. ``cancelled``: whether a
    background response's cancel was asked for (an aborted stream then ends cancelled)."""
    items = out.items
    head = out.response("in_progress", None)
    yield [items.event("response.created", response=head),
           items.event("response.in_progress", response=head)]  # fmt: skip
    async for batch in batches:
        last = batch[-1]
        failed = last.error is not None
        events = out.feed_frames(batch[:-1] if failed else batch)
        if failed:
            yield events + _failed_events(out, frame_error(last))
            return
        if last.done:
            if cancelled is not None and last.finish_reason == "abort":
                out.cancelled = await cancelled()
            status = out.status(last)
            events += out.finish(last)
            st.metrics.finish.labels(last.finish_reason or "unknown").inc()
            out.final = out.response(status, last)
            events.append(items.event("response.completed", response=out.final))
        if events:
            yield events
        if last.done:
            return


async def _stream(
    st: ApiState, run: RunningRequest, out: _Output, started: float, key: str | None
) -> AsyncIterator[bytes]:
    """A foreground stream; with ``key`` (resumable streams: the response's record) its
    events carry ids, its end is stored for GET, and a client that goes away has the
    grace period to come back."""
    ids = out.id if key is not None else None
    ended = False  # the stream came to its end (not its client gone)
    try:
        async for events in _events(st, out, st.runner.batches(run)):
            if out.final is not None:  # the last events: the response is stored first
                await _store_final(st, key, out, st.settings.api.resume_ttl_s)
            yield b"".join(_sse(e, ids) for e in events)
        ended = True
    except Exception as e:  # noqa: BLE001 - the stream must end with a terminal event
        ended = True
        failed = _failed_events(out, stream_failed(e, run.request_id))
        await _store_final(st, key, out, st.settings.api.resume_ttl_s)
        yield b"".join(_sse(ev, ids) for ev in failed)
    finally:
        end = partial(end_request, st, [run], started)
        if not ended and key is not None and st.settings.api.resume_grace_s > 0:
            linger_on(st, run.request_id, partial(drain, st, run), end)
        else:
            end()


def _failed_events(out: _Output, err: OpenAIError) -> list[dict]:
    """``error`` then ``response.failed`` (the response so far, with the error)."""
    items = out.items
    failed = out.response("failed", None)
    failed["error"] = {"code": err.code or "server_error", "message": err.message}
    out.final = failed
    return [items.event("error", code=err.code, message=err.message, param=err.param),
            items.event("response.failed", response=failed)]  # fmt: skip


# --------------------------------------------------------------------------------------
# Background responses
# --------------------------------------------------------------------------------------
async def _background(st: ApiState, body: ResponsesRequest, run: RunningRequest, out: _Output,
                      started: float) -> Response:  # fmt: skip
    """Record a background response, read it to its end here in a task of its own, and
    answer at once: the Response in progress, or its stream (from its frame log)."""
    key, rec = await _save_record(st, body, run, out, BACKGROUND_TTL_S, background=True)
    head = out.response("in_progress", None)
    task = asyncio.get_running_loop().create_task(_relay(st, run, out, started, key))
    st.runner.hold(task)
    if body.stream:
        return SSEResponse(_from_log(st, out.id, rec, -1), ping=15,
                           headers={"x-request-id": out.id})  # fmt: skip
    return JSONResponse(head, headers={"x-request-id": out.id})


async def _save_record(st: ApiState, body: ResponsesRequest, run: RunningRequest, out: _Output,
                       ttl_s: float, background: bool) -> tuple[str, dict[str, str]]:  # fmt: skip
    """Record a response whose stream can be read again (:func:`response_key`); its key
    and the record as :func:`_record` reads it back."""
    key = response_key(out.id)
    record: dict[Any, Any] = {"body": body.model_dump_json(), "log": run.request_id,
                              "created": str(out.created), "cancelled": "0",
                              "background": str(int(background))}  # fmt: skip
    pipe = st.redis.pipeline(transaction=False)
    pipe.hset(key, mapping=record)
    pipe.expire(key, int(ttl_s))
    await pipe.execute()
    return key, record


async def _relay(st: ApiState, run: RunningRequest, out: _Output, started: float,
                 key: str) -> None:  # fmt: skip
    """Read a background response to its end (its load, migrations and cancel stay with
    this API) and store the final Response."""
    try:
        async for _ in _events(st, out, st.runner.batches(run), partial(_cancelled, st, key)):
            pass
    except Exception as e:  # noqa: BLE001 - the response fails, the API goes on
        _failed_events(out, stream_failed(e, run.request_id))
    finally:
        end_request(st, [run], started)
    await _store_final(st, key, out, BACKGROUND_TTL_S)


async def _store_final(st: ApiState, key: str | None, out: _Output, ttl_s: float) -> None:
    """Keep a response that ended: in the store (its turn too) if it is stored, else in
    its record ``key`` (a background or resumable one) for ``ttl_s``; neither: nothing."""
    if out.final is None:
        return
    if (cid := conversation_id(out.body)) is not None:
        await _to_conversation(st, cid, out)
    if key is None and not out.stored:
        return
    try:
        if out.stored:
            turn = Turn(input_items(out.body, out.id), out.items.output)
            extra = {} if key is not None else {"background": "0", "created": str(out.created)}
            await st.responses.save(out.id, turn, out.body.previous_response_id, out.final,
                                    extra)  # fmt: skip
            return
        assert key is not None
        pipe = st.redis.pipeline(transaction=False)
        pipe.hset(key, "final", json.dumps(out.final))
        pipe.expire(key, int(ttl_s))
        await pipe.execute()
    except Exception as e:  # noqa: BLE001 - a GET rebuilds it from the frame log
        log.warning("[%s] could not store the final response: %s", out.id, e)


async def _to_conversation(st: ApiState, cid: str, out: _Output) -> None:
    """A response that ended (completed or incomplete; not failed or cancelled) adds its
    input and output items to its conversation, once (their ids come from its id)."""
    assert out.final is not None
    if out.final["status"] not in ("completed", "incomplete"):
        return
    # the input was checked as it was rendered, and input_items gave each item an id
    items = [conversation_item(it) for it in input_items(out.body, out.id)]
    try:
        if await st.conversations.add(cid, items + out.items.output) is None:
            log.warning("[%s] conversation %s was deleted before the response ended", out.id,
                        cid)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the response itself is answered
        log.warning("[%s] could not add the turn to conversation %s: %s", out.id, cid, e)


async def _cancelled(st: ApiState, key: str) -> bool:
    return await st.redis.hget(key, "cancelled") in (b"1", "1")


async def _record(st: ApiState, response_id: str) -> dict[str, str]:
    if not (rec := await _read_record(st, response_id)):
        raise _not_found(response_id)
    return rec


def _not_found(response_id: str, kind: str = "response") -> OpenAIError:
    return OpenAIError(404, f"No {kind} found with id '{response_id}'.",
                       "invalid_request_error", "response_id", "not_found")  # fmt: skip


async def _read_record(st: ApiState, response_id: str) -> dict[str, str]:
    """A recorded response (:func:`response_key`); empty if there is none."""
    if not response_id.startswith("resp_"):
        return {}
    raw = await st.redis.hgetall(response_key(response_id))
    return {as_str(k): as_str(v) for k, v in raw.items()}


def _parser(st: ApiState, req: ChatCompletionRequest, plan: ToolPlan | None) -> ToolParser | None:
    """What reads the output into items: tool calls, a reasoning model's thinking."""
    return output_parser(st.settings.api.reasoning_parser, plan, req)


def _rebuilt(st: ApiState, response_id: str, rec: dict[str, str]) -> _Output:
    """A background response's formatter, as the API that accepted it made it."""
    body = ResponsesRequest.model_validate_json(rec["body"])
    req = chat_request(body.model_copy(update={"background": False}))
    plan = tool_plan(req, st.tool_parser)
    rid = "resp-" + response_id.removeprefix("resp_")
    out = _Output(st, body, rid, _parser(st, req, plan))
    out.created = int(rec["created"])
    return out


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, stream: bool = False,
                       starting_after: int = -1) -> Response:  # fmt: skip
    """A background response (or, with resumable streams, a streamed one for a while after
    it ended): its status and output (any replica); with ``stream=true`` its events after
    ``starting_after`` (or the ``Last-Event-ID`` header's), then live to its end."""
    st = api_state(request)
    rec = await _record(st, response_id)
    if stream and "log" not in rec:  # stored, but not streamed through the frame log
        raise bad_request(f"response '{response_id}' has no stream to replay: GET it "
                          "without stream", "stream")  # fmt: skip
    if stream:
        if starting_after < 0 and (last := request.headers.get("last-event-id")):
            last_id, (starting_after,) = parse_event_id(last, (response_id,))
            if last_id != response_id:
                raise bad_request("Last-Event-ID names another response", "Last-Event-ID",
                                  "invalid_event_id")  # fmt: skip
        if not await st.redis.exists(frames_key(rec["log"])):
            raise OpenAIError(404, f"the stream of response '{response_id}' is no longer "
                              "kept; GET it without stream", "invalid_request_error",
                              "stream", "not_found")  # fmt: skip
        return SSEResponse(_from_log(st, response_id, rec, starting_after), ping=15,
                           headers={"x-request-id": response_id})  # fmt: skip
    if "final" in rec:
        return JSONResponse(json.loads(rec["final"]))
    out = _rebuilt(st, response_id, rec)
    frames = await FrameLogReader(st.redis, rec["log"], 0).available()
    if frames:

        async def once() -> AsyncIterator[list[TokenFrame]]:
            yield frames

        async for _ in _events(st, out, once(), partial(_cancelled, st, response_key(out.id))):
            pass
    background = out.body.background is True
    if out.final is not None:  # ended, and nobody stored it (its API died): store it now
        ttl_s = BACKGROUND_TTL_S if background else st.settings.api.resume_ttl_s
        await _store_final(st, response_key(out.id), out, ttl_s)
        return JSONResponse(out.final)
    return JSONResponse(out.response("in_progress", None))


async def _from_log(st: ApiState, response_id: str, rec: dict[str, str],
                    after: int) -> AsyncIterator[bytes]:  # fmt: skip
    """A recorded response's events numbered after ``after``, from its frame log."""
    out = _rebuilt(st, response_id, rec)
    reader = FrameLogReader(st.redis, rec["log"], st.settings.api.frame_timeout_s)
    try:
        async for events in _events(st, out, frames_of(reader), partial(
                _cancelled, st, response_key(out.id))):  # fmt: skip
            if sel := [e for e in events if e["sequence_number"] > after]:
                yield b"".join(_sse(e, response_id) for e in sel)
    except Exception as e:  # noqa: BLE001 - the stream must end with a terminal event
        failed = _failed_events(out, stream_failed(e, response_id))
        yield b"".join(_sse(ev, response_id) for ev in failed)


async def _resume(st: ApiState, body: ResponsesRequest, last_event_id: str) -> Response:
    """The rest of a streamed response a client lost (``Last-Event-ID`` on the same request
    sent again): its events after that one, from its frame log (never run again)."""
    if not body.stream:
        raise bad_request("Last-Event-ID resumes a stream: send stream: true", "stream")
    response_id, (after,) = parse_event_id(last_event_id, ("resp_",))
    rec = await _read_record(st, response_id)
    if "log" not in rec or not await claim(st.redis, rec["log"]):
        raise OpenAIError(404, f"no stream of response {response_id!r} to resume: it ended "
                          f"more than {st.settings.api.resume_ttl_s:g} s ago, or never ran here",
                          "invalid_request_error", "Last-Event-ID", "stream_not_found")  # fmt: skip
    log.info("[%s] resumed after event %d", response_id, after)
    return SSEResponse(_from_log(st, response_id, rec, after), ping=15,
                       headers={"x-request-id": response_id})  # fmt: skip


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    """Cancel a background response wherever it runs; the Response as it stands."""
    st = api_state(request)
    rec = await _record(st, response_id)
    if rec.get("background", "1") != "1":
        raise bad_request("only a background response can be cancelled", "response_id")
    if "final" in rec:
        return JSONResponse(json.loads(rec["final"]))
    log_id = rec["log"]
    pipe = st.redis.pipeline(transaction=False)
    pipe.hset(response_key(response_id), "cancelled", 1)
    pipe.set(cancelled_key(log_id), 1, ex=BACKGROUND_TTL_S)
    pipe.publish(CANCEL_CHANNEL, log_id)
    await pipe.execute()
    out = _rebuilt(st, response_id, rec)
    return JSONResponse(out.response("cancelled", None))


async def _collect(st: ApiState, run: RunningRequest, out: _Output, started: float) -> Response:
    frames: list[TokenFrame] | None = [] if out.lps is not None else None
    text, last = await collect(st, run, started, frames)
    st.metrics.finish.labels(last.finish_reason or "unknown").inc()
    if frames is not None:  # with logprobs: each frame's tokens beside its text
        out.feed_frames(frames)
    else:
        out.feed(text)
    out.finish(last)
    out.final = body = out.response(out.status(last), last)
    await _store_final(st, None, out, 0)
    return JSONResponse(body, headers={"x-request-id": run.request_id})


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    """Forget a response (a background one still running runs on, unrecorded)."""
    st = api_state(request)
    if not response_id.startswith("resp_") or not await st.responses.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, after: str | None = None,
                           limit: int = 20, order: str = "desc") -> Response:  # fmt: skip
    """A stored response's input items (this turn's), as OpenAI pages them: ``order``
    asc or desc (default), ``limit`` 1-100, ``after`` an item id."""
    st = api_state(request)
    turn = await st.responses.turn(response_id) if response_id.startswith("resp_") else None
    if turn is None:
        raise _not_found(response_id, "stored response")
    return JSONResponse(page([listed_item(item) for item in turn.input], order, after, limit,
                             f"response '{response_id}'"))  # fmt: skip
