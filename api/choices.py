"""``n > 1``: one request, ``n`` choices, each on its own token stream, as one response.

The runner starts the request once (one route, one stage task: its worker computes the
prompt once and forks the choices from it, :mod:`workers.choices`) and hands back a
:class:`api.runner.RunningRequest` per choice, each with its first frame; each choice
then ends, is cancelled and migrates on its own. Here their frames become one response:
:func:`stream` relays them as SSE chunks as they come, each carrying its choice's
``index``, and ends the stream once every choice has finished (one ``[DONE]``; the usage
chunk once, after the last finish); :func:`collect` builds one body with the ``n``
choices in index order. An error on any choice ends the response (the others are
cancelled). Usage counts the prompt once and sums the choices' completion tokens, as
OpenAI and vLLM count it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

from fastapi.responses import JSONResponse

from api.errors import OpenAIError
from api.logprobs import ExtraOutput
from api.resume import FrameLogReader, Tagged, frames_of, split_at
from api.runner import Runner, RunningRequest, frame_error, stream_error, stream_failed
from api.sse import SSE_DONE, Formatter, sse_event, usage_body
from api.state import ApiState
from api.tools import ChatOutput
from kvbm.protocol import TokenFrame, Usage


async def stream(
    st: ApiState, runs: list[RunningRequest] | None, fmt: Formatter, include_usage: bool,
    end: Callable[[], None], tools: list[ChatOutput | None] | None = None,
    extras: list[ExtraOutput | None] | None = None, *,
    ready: AsyncGenerator[Ready, None] | None = None, tag: Tagged | None = None,
    dropped: Callable[[], None] | None = None, n: int | None = None, head: bytes = b"",
) -> AsyncIterator[bytes]:  # fmt: skip
    """The SSE events of a request of ``len(runs)`` choices; ``end()`` once it is over
    (accounting, and every choice's stream released: cancelled if unfinished), or
    ``dropped()`` instead if its client went away first. What the choices have ready at
    one moment goes out as one chunk (one write). Per choice: ``tools``, what reads its
    text into content and tool calls, ``extras``, its logprobs or echoed prompt (None:
    plain text). A resumable stream's writes carry SSE ids (``tag``); a resumed one's
    frames come from the logs (``ready``, and no ``runs``), a batch of prompts' from their
    runs as each starts (``ready``, and ``n``: choices per prompt, for the usage).
    ``head``: events before the first chunk (Dynamo's annotations, :mod:`api.nvext`)."""
    left = len(runs) if runs is not None else len(tools or extras or ())
    tools = tools or [None] * left
    extras = extras or [None] * left
    seqs = [-1] * left  # the last frame of each choice that went into a write
    # each choice's, from its terminal frame (a run's usage is its terminal frame's too)
    usages: list[Usage | None] = [None] * left

    def tagged(out: bytes) -> bytes:
        return tag.out(out, seqs) if tag is not None and out else out

    ended = False  # the stream came to its end (not its client gone)
    try:
        if head:
            yield head
        if fmt.chat:  # chat streams open with the assistant role, for every choice
            if role := tagged(b"".join(
                    sse_event(_opened(extras[i], fmt.chunk(fmt.role_delta(), None, include_usage,
                                                           index=i)))
                    for i in range(left))):  # fmt: skip
                yield role
        frames_in = ready if ready is not None else merged(st.runner, runs or [])
        async with aclosing(frames_in) as ready_:
            async for batches in ready_:
                out = b""
                for i, batch in batches:
                    seqs[i] = batch[-1].seq
                    last = batch[-1]
                    failed = last.error is not None
                    frames = batch[:-1] if failed else batch
                    fmt.counted(i, frames)
                    text = "".join(f.text for f in frames)
                    reader, extra = tools[i], extras[i]
                    if extra is not None and reader is None:  # logprobs, an echoed prompt
                        out += extra.event(fmt, frames, text, include_usage, i)
                    elif reader is None:
                        if text:
                            out += fmt.text_event(text, include_usage, i)
                    else:  # content and tool calls, parsed as they come
                        deltas = reader.feed(text)
                        if last.done and not failed:
                            deltas += reader.finish()
                        out += b"".join(sse_event(fmt.chunk(d, None, include_usage, index=i))
                                        for d in deltas)  # fmt: skip
                        if extra is not None:  # logprobs too: the batch's tokens, in a chunk
                            out += extra.beside_tools(fmt, frames, include_usage, i)
                    if failed:  # the error event, then [DONE], as vLLM ends it
                        ended = True
                        yield tagged(out + sse_event(frame_error(last).body())) + SSE_DONE
                        return
                    if last.done:
                        usages[i] = last.usage
                        reason = last.finish_reason
                        if reader is not None:
                            reason = reader.finish_reason(reason)
                        st.metrics.finish.labels(reason or "unknown").inc()
                        out += sse_event(fmt.chunk(fmt.empty_delta(), reason, include_usage,
                                                   stop_reason=last.stop_reason,
                                                   index=i))  # fmt: skip
                        left -= 1
                if not left:  # the last finish, usage and [DONE]: one chunk
                    ended = True
                    if include_usage:
                        out += sse_event(fmt.usage_chunk(usage_body(combined_usage(usages, n))))
                    yield tagged(out + SSE_DONE)
                    return
                if out := tagged(out):
                    yield out
        ended = True
    except Exception as e:  # noqa: BLE001 - the stream must end with a terminal event
        ended = True
        yield sse_event(stream_failed(e, fmt.rid).body()) + SSE_DONE
    finally:
        (end if ended or dropped is None else dropped)()


def _opened(extra: ExtraOutput | None, chunk: dict) -> dict:
    """A chat stream's first chunk, with what ``extra`` puts on it."""
    return chunk if extra is None else extra.open(chunk)


async def collect(
    st: ApiState,
    runs: list[RunningRequest] | None,
    fmt: Formatter,
    end: Callable[[], None],
    tools: list[ChatOutput | None] | None = None,
    extras: list[ExtraOutput | None] | None = None,
    *,
    ready: AsyncGenerator[Ready, None] | None = None,
    n: int | None = None,
) -> JSONResponse:
    """The whole body of a request of ``len(runs)`` choices; ``end()``, ``tools`` and
    ``extras`` as in :func:`stream`; a batch of prompts: its frames (``ready``, no
    ``runs``), ``n`` choices per prompt, ``extras`` one per choice of the batch."""
    count = len(runs) if runs is not None else len(extras or ())
    tools = tools or [None] * count
    extras = extras or [None] * count
    frames: list[list[TokenFrame]] = [[] for _ in range(count)]
    texts: list[list[str]] = [[] for _ in range(count)]
    last: list[TokenFrame | None] = [None] * count
    try:
        frames_in = ready if ready is not None else merged(st.runner, runs or [])
        async with aclosing(frames_in) as ready_:
            async for batches in ready_:
                for i, batch in batches:
                    for frame in batch:
                        if frame.error is not None:
                            raise frame_error(frame)
                        texts[i].append(frame.text)
                    if extras[i] is not None:
                        frames[i] += batch
                    last[i] = batch[-1]
    except OpenAIError:
        raise
    except Exception as e:  # noqa: BLE001
        raise stream_error(e) from e
    finally:
        end()
    choices = []
    prompt_logprobs = None
    for i, end_frame in enumerate(last):
        assert end_frame is not None and end_frame.done, "a choice ended without its last frame"
        choice = whole_choice(fmt, i, "".join(texts[i]), end_frame, tools[i], extras[i],
                              frames[i])  # fmt: skip
        st.metrics.finish.labels(choice["finish_reason"] or "unknown").inc()
        if fmt.chat:  # chat: the prompt's logprobs once, on the body (vLLM's place)
            prompt_logprobs = choice.pop("prompt_logprobs", None) or prompt_logprobs
        choices.append(choice)
    usage = combined_usage([f.usage if f is not None else None for f in last], n)
    body = fmt.whole(choices, usage_body(usage), prompt_logprobs)
    return JSONResponse(body, headers={"x-request-id": fmt.rid})


def whole_choice(
    fmt: Formatter, index: int, text: str, last: TokenFrame, tools: ChatOutput | None,
    extra: ExtraOutput | None, frames: list[TokenFrame] | None,
) -> dict:  # fmt: skip
    """One choice of a whole body from its text, terminal frame and (with ``extra``) its
    frames; in chat its prompt logprobs ride on it under ``prompt_logprobs`` for the
    caller to move onto the body."""
    message = tools.message(text) if tools else None  # before the reason: it counts the calls
    reason = tools.finish_reason(last.finish_reason) if tools else last.finish_reason
    logprobs = prompt = None
    if extra is not None:
        text, logprobs, prompt = extra.full(frames or [], text)
    choice = fmt.choice(index, text, reason, last.stop_reason, message, logprobs, prompt)
    if fmt.chat and prompt is not None:
        choice["prompt_logprobs"] = prompt
    if extra is not None:
        extra.whole_ids(choice, frames or [])
    return choice


Ready = list[tuple[int, list[TokenFrame]]]  # (choice index, its frames), as they came


async def merged(runner: Runner, runs: list[RunningRequest]) -> AsyncGenerator[Ready, None]:
    """Every choice's frames (:meth:`api.runner.Runner.batches`: each choice migrates on
    its own) as they come, until every choice's terminal frame: what had arrived at one
    moment in one list, as ``(index, batch)`` pairs; a choice's failure raises here.
    Prompt logprobs come on the first choice's first frame alone (it computed the
    prompt): they go on every choice's first frame, so each choice carries them as a
    request of one would (vLLM's completions have them on every choice)."""
    first = runs[0].first_frame
    if first is not None and first.prompt_logprobs is not None:
        for run in runs[1:]:
            if run.first_frame is not None:
                run.first_frame.prompt_logprobs = first.prompt_logprobs
    async with aclosing(merge({i: runner.batches(run) for i, run in enumerate(runs)})) as m:
        async for ready in m:
            yield ready


async def resumed(readers: list[FrameLogReader], after: list[int]) -> AsyncGenerator[Ready, None]:
    """A resumed request's choices from their frame logs, as :func:`merged` hands them out:
    first every choice's frames up to its seq in ``after`` (what the client has) in one
    list, then the rest as it comes."""
    parts = [await split_at(r, a) for r, a in zip(readers, after, strict=True)]
    firsts = [(have or rest)[0] for have, rest in parts if have or rest]
    if firsts and firsts[0].seq == 0 and firsts[0].prompt_logprobs is not None:
        for f in firsts[1:]:  # as merged() gives them: on every choice's first frame
            if f.seq == 0:
                f.prompt_logprobs = firsts[0].prompt_logprobs
    for k in (0, 1):
        if ready := [(i, part[k]) for i, part in enumerate(parts) if part[k]]:
            yield ready
    async with aclosing(merge({i: frames_of(r) for i, r in enumerate(readers)
                               if not r.done})) as m:  # fmt: skip
        async for ready in m:
            yield ready


async def merge(sources: dict[int, AsyncIterator[list[TokenFrame]]]) -> AsyncGenerator[Ready, None]:
    """The choices' batches (``index -> its batches``) as they come, until every source
    ended: what had arrived at one moment in one list; a source's failure raises here."""
    async with aclosing(_gather(sources, False)) as m:
        async for ready in m:
            yield ready


async def fan_in(sources: list[AsyncIterator[Ready]]) -> AsyncGenerator[Ready, None]:
    """:func:`merge` of sources that each hand out :data:`Ready` lists already (a batch of
    prompts: each prompt's choices, merged, under their indices in the response)."""
    async with aclosing(_gather(dict(enumerate(sources)), True)) as m:
        async for ready in m:
            yield ready


async def _gather(
    sources: dict[int, AsyncIterator], ready_lists: bool
) -> AsyncGenerator[Ready, None]:
    """Read every source in a task of its own; hand out what had arrived at one moment in
    one list. A source yields a choice's batches (its key is the choice's index) or, with
    ``ready_lists``, :data:`Ready` lists. Cancelling the reader cancels every source."""
    queue: asyncio.Queue[tuple[Ready | None, Exception | None]] = asyncio.Queue()

    async def pump(i: int, items: AsyncIterator) -> None:
        try:
            async for item in items:
                queue.put_nowait((item if ready_lists else [(i, item)], None))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((None, e))
            return
        queue.put_nowait((None, None))

    pumps = [asyncio.create_task(pump(i, b)) for i, b in sources.items()]
    try:
        left = len(pumps)
        while left:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            ready: Ready = []
            for got, err in items:
                if err is not None:
                    raise err
                if got is None:
                    left -= 1
                else:
                    ready += got
            if ready:
                yield ready
    finally:
        for task in pumps:
            task.cancel()


def request_usage(runs: list[RunningRequest]) -> Usage | None:
    """A request's usage from its streams' (one, or one per choice): the prompt (and its
    cached tokens) once, as its first stream counted it, the output tokens of all."""
    return combined_usage([r.usage for r in runs])


def combined_usage(usages: list[Usage | None], n: int | None = None) -> Usage | None:
    """:func:`request_usage` from each stream's usage; a batch of prompts counts each
    prompt once: ``n`` choices per prompt, prompt ``p``'s at ``p * n`` to ``p * n + n - 1``
    (None: one prompt)."""
    got = [u for u in usages if u is not None]
    if not got:
        return None
    if len(usages) == 1:
        return got[0]
    n = n or len(usages)
    firsts = [u for g in range(0, len(usages), n)
              if (u := next((x for x in usages[g:g + n] if x is not None), None))]  # fmt: skip
    out = Usage(sum(u.prompt_tokens for u in firsts), sum(u.completion_tokens for u in got),
                sum(u.cached_tokens for u in firsts))  # fmt: skip
    predicted = [u for u in got if u.accepted_prediction_tokens is not None]
    if predicted:  # every choice's drafts from its prediction
        out.accepted_prediction_tokens = sum(u.accepted_prediction_tokens or 0 for u in predicted)
        out.rejected_prediction_tokens = sum(u.rejected_prediction_tokens or 0 for u in predicted)
    return out
