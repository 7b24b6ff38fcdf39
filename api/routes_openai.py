"""The OpenAI-compatible endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions``
(stream and non-stream); ``/v1/models`` is :mod:`api.routes_models`'s.

A handler validates the body, builds the prompt (chat template, tokenizer, image
placeholders), checks it against the context window, has the media guard fetch and check
its images and store their bytes in Redis (:mod:`api.media`), and hands it to
:class:`api.runner.Runner`, which routes it, sends its chain and waits for its first frame;
the response then relays its frames as SSE events or collects them into one body. Every
refusal comes before the runner: nothing reaches the broker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from api import beam_search, choices, nvext
from api.admission import client_id
from api.errors import OpenAIError, bad_request
from api.logprobs import ExtraOutput, extra_output
from api.params import sampling_of
from api.protocol import (
    BatchChatRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    prompt_alone,
    unsupported,
)
from api.reasoning import output_parser, thinks
from api.resume import (
    FrameLogReader,
    Tagged,
    claim,
    linger,
    parse_event_id,
    resumed_batches,
)
from api.runner import RunningRequest, frame_error, stream_error, stream_failed
from api.sse import SSE_DONE, Formatter, SSEResponse, sse_event, usage_body
from api.state import ApiState, api_state, check_model
from api.tokenization import MAX_PROMPTS, Prompt
from api.tools import ChatOutput, ToolPlan, constrain, tool_plan
from cluster.lora import LoraRef
from kvbm.protocol import Sampling, TokenFrame, choice_request_id, choice_stream_id

router = APIRouter()
log = logging.getLogger(__name__)


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    started = time.perf_counter()
    st = api_state(request)
    lora = await check_model(st, req.model, task="generate")
    unsupported(req)
    forced_usage(st, req)
    with_template_defaults(st, req)
    plan = tool_plan(req, st.tool_parser)
    prompt = st.builder.truncated(dynamo_tokens(st, req) or chat_prompt(st, req),
                                  req.truncate_prompt_tokens, req.truncation_side)  # fmt: skip
    st.media.check_count(prompt.images)
    max_tokens = req.max_completion_tokens or req.max_tokens
    if req.use_beam_search:
        sampling = prepare(st, req, prompt, max_tokens, "messages", plan)
        return await beam_search.serve(st, req, request, prompt, sampling, "chat", started, lora)
    if (resumed := _last_event_id(st, request)) is not None:
        return await resume(st, req, prompt, max_tokens, "chat", started, "messages", resumed,
                            plan)  # fmt: skip
    return await _serve(st, req, request, prompt, max_tokens, "chat", started, "messages", plan,
                        lora)  # fmt: skip


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Response:
    started = time.perf_counter()
    st = api_state(request)
    lora = await check_model(st, req.model, task="generate")
    unsupported(req)
    forced_usage(st, req)
    given = dynamo_tokens(st, req)
    prompts: list[tuple[str | list[int], list[int]]] = (
        [(given.token_ids, given.token_ids)] if given is not None
        else st.builder.completion_prompts(req.prompt, req.add_special_tokens)
    )  # fmt: skip
    resumed = _last_event_id(st, request)
    if req.use_beam_search:
        if len(prompts) > 1:
            raise bad_request("beam search takes one prompt per request", "prompt",
                              "unsupported_parameter")  # fmt: skip
        prompt = st.builder.truncated(Prompt(prompts[0][1]), req.truncate_prompt_tokens,
                                      req.truncation_side)  # fmt: skip
        sampling = prepare(st, req, prompt, req.max_tokens, "prompt")
        return await beam_search.serve(st, req, request, prompt, sampling, "completion",
                                       started, lora)  # fmt: skip
    if len(prompts) > 1:
        if resumed is not None:
            raise bad_request("a stream of several prompts cannot be resumed (Last-Event-ID); "
                              "send one prompt per request to resume its stream", "prompt",
                              "unsupported_parameter")  # fmt: skip
        return await _serve_batch(st, req, request, prompts, started, lora)
    ((sent, ids),) = prompts
    prompt = st.builder.truncated(Prompt(ids), req.truncate_prompt_tokens, req.truncation_side)
    sent = _echoed(sent, ids, prompt)
    if resumed is not None:
        return await resume(st, req, prompt, req.max_tokens, "completion", started, "prompt",
                            resumed, sent=sent)  # fmt: skip
    return await _serve(st, req, request, prompt, req.max_tokens, "completion", started,
                        "prompt", lora=lora, sent=sent)  # fmt: skip


async def _serve_batch(
    st: ApiState, req: CompletionRequest, request: Request,
    prompts: list[tuple[str | list[int], list[int]]], started: float, lora: LoraRef | None,
) -> Response:  # fmt: skip
    """A batch of prompts (completions' list of strings or of token-id lists). Each prompt
    runs as a request of its own (routed on its own, its ``n`` choices forked where it
    runs); the response holds them all, prompt ``p``'s choice ``j`` at index ``p * n + j``
    as OpenAI and vLLM number them, and its usage sums the prompts. Every prompt is checked
    before any runs; the first starts before the response begins (its refusal is the
    response's status), the others as it streams, each released as soon as its choices
    end, so that their worker slots serve the prompts still waiting for admission."""
    n = req.n
    if len(prompts) * n > MAX_PROMPTS:
        raise bad_request(f"a batch of prompts holds at most {MAX_PROMPTS} choices (prompts x "
                          f"n), got {len(prompts)} x {n}", "n")  # fmt: skip
    built = [st.builder.truncated(Prompt(ids), req.truncate_prompt_tokens, req.truncation_side)
             for _, ids in prompts]  # fmt: skip
    samplings = [prepare(st, req, p, req.max_tokens, "prompt") for p in built]
    extras = [_extra(st, req, sampling, p.token_ids, _echoed(sent, ids, p))
              for (sent, ids), p, sampling in zip(prompts, built, samplings, strict=True)
              for _ in range(n)]  # fmt: skip
    return await _run_batch(st, [req] * len(built), request, built, samplings, extras, None,
                            "completion", started, lora)  # fmt: skip


@router.post("/v1/chat/completions/batch")
async def chat_completions_batch(body: BatchChatRequest, request: Request) -> Response:
    """vLLM's batch of conversations: chat's fields once, ``messages`` a list of
    conversations; one choice per conversation, in order (non-stream; no tools, ``n`` 1)."""
    started = time.perf_counter()
    st = api_state(request)
    shared = body.model_dump(exclude={"messages"}, exclude_unset=True)
    for name, bad in (("stream", bool(shared.get("stream"))), ("tools", bool(shared.get("tools"))),
                      ("n", shared.get("n", 1) != 1),
                      ("use_beam_search", bool(shared.get("use_beam_search")))):  # fmt: skip
        if bad:
            raise bad_request(f"{name} is not supported by /v1/chat/completions/batch (stream: "
                              "false, no tools, n 1, no beam search)", name,
                              "unsupported_parameter")  # fmt: skip
    if len(body.messages) > MAX_PROMPTS:
        raise bad_request(f"a batch holds at most {MAX_PROMPTS} conversations, got "
                          f"{len(body.messages)}", "messages")  # fmt: skip
    reqs: list[ChatCompletionRequest] = []
    for i, conversation in enumerate(body.messages):
        try:
            reqs.append(ChatCompletionRequest.model_validate({**shared, "messages": conversation}))
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise bad_request(f"messages[{i}]: {where}: {err['msg']}", f"messages.{i}") from None
    lora = await check_model(st, reqs[0].model, task="generate")
    for r in reqs:
        unsupported(r)
    built = [st.builder.truncated(chat_prompt(st, r), r.truncate_prompt_tokens,
                                  r.truncation_side) for r in reqs]  # fmt: skip
    for p in built:
        st.media.check_count(p.images)
    samplings = [prepare(st, r, p, r.max_completion_tokens or r.max_tokens, "messages")
                 for r, p in zip(reqs, built, strict=True)]  # fmt: skip
    extras = [_extra(st, r, s, p.token_ids) for r, p, s in zip(reqs, built, samplings, strict=True)]
    tools = [chat_output(st, r, None, s) for r, s in zip(reqs, samplings, strict=True)]
    return await _run_batch(st, reqs, request, built, samplings, extras, tools, "chat", started,
                            lora)  # fmt: skip


async def _run_batch(
    st: ApiState, reqs: list[ChatCompletionRequest] | list[CompletionRequest],
    request: Request, built: list[Prompt], samplings: list[Sampling],
    extras: list[ExtraOutput | None], tools: list[ChatOutput | None] | None, kind: str,
    started: float, lora: LoraRef | None,
) -> Response:  # fmt: skip
    """Run checked prompts (each its request's) as one response: :func:`_serve_batch`'s
    order, starts and releases; chat's conversations answer whole only."""
    req = reqs[0]
    n = req.n
    rid, first = await launch(st, req, request, built[0], samplings[0], kind, started,
                              lora)  # fmt: skip
    fmt = Formatter(kind, req.shown_id(kind, request.headers.get("x-request-id"), rid), req.model)
    if req.stream and req.continuous_usage:
        fmt.continuous_usage([len(p.token_ids) for p in built for _ in range(n)])
    running: dict[int, list[RunningRequest]] = {0: first}  # started and not yet ended

    def end(p: int) -> None:
        if (runs := running.pop(p, None)) is not None:
            end_request(st, runs, started)

    def end_all() -> None:  # the response is over: whatever still runs is released
        for p in list(running):
            end(p)

    async def one(p: int) -> AsyncGenerator[choices.Ready, None]:
        if p not in running:
            running[p] = (await launch(st, reqs[p], request, built[p], samplings[p], kind,
                                       started, lora))[1]  # fmt: skip
        try:
            async with aclosing(choices.merged(st.runner, running[p])) as ready:
                async for got in ready:
                    yield [(p * n + i, batch) for i, batch in got]
        finally:
            end(p)

    ready = choices.fan_in([one(p) for p in range(len(built))])
    if req.stream:
        gen = choices.stream(st, None, fmt, req.include_usage, end_all, None, extras,
                             ready=ready, n=n)  # fmt: skip
        return SSEResponse(gen, ping=15, headers={"x-request-id": fmt.rid})
    return await choices.collect(st, None, fmt, end_all, tools, extras, ready=ready, n=n)


def forced_usage(st: ApiState, req: ChatCompletionRequest | CompletionRequest) -> None:
    """CONVEYOR_FORCE_INCLUDE_USAGE (vLLM's --enable-force-include-usage): a stream carries
    its usage on every chunk and in a last chunk, asked for or not."""
    if st.settings.api.force_include_usage and req.stream:
        req.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)


def dynamo_tokens(st: ApiState, req: ChatCompletionRequest | CompletionRequest) -> Prompt | None:
    """Dynamo's ``nvext.token_data``: the prompt as its client tokenized it, in place of
    the messages or the prompt (checked against the vocabulary); None without it."""
    ids = req.nvext.token_data if req.nvext is not None else None
    if not ids:
        return None
    try:
        ((_, checked),) = st.builder.completion_prompts(ids)
    except OpenAIError as e:
        e.param = "nvext.token_data"
        raise
    return Prompt(checked)


def _echoed(sent: str | list[int], ids: list[int], prompt: Prompt) -> str | list[int]:
    """What ``echo`` repeats of a completion prompt sent as ``sent`` (its ids ``ids``):
    the prompt as sent, or the tokens truncate_prompt_tokens kept of it."""
    return sent if len(prompt.token_ids) == len(ids) else prompt.token_ids


def _last_event_id(st: ApiState, request: Request) -> str | None:
    """A reconnecting client's ``Last-Event-ID`` (resumable streams only)."""
    if not st.settings.api.resumable_streams:
        return None
    return request.headers.get("last-event-id") or None


# --------------------------------------------------------------------------------------
def with_template_defaults(st: ApiState, req: ChatCompletionRequest) -> None:
    """The deployment's default template variables under the request's own, on the
    request (CONVEYOR_DEFAULT_CHAT_TEMPLATE_KWARGS), so that what reads them (whether the
    model thinks: api.reasoning) sees what the template renders with."""
    if st.builder.default_template_kwargs:
        req.chat_template_kwargs = st.builder.template_kwargs(req.chat_template_kwargs)


def chat_prompt(st: ApiState, req: ChatCompletionRequest) -> Prompt:
    """The chat request's prompt: its messages and tools through the chat template."""
    with_template_defaults(st, req)
    return st.builder.chat_prompt(req.messages, req.tools, req.add_generation_prompt,
                                  req.continue_final_message, req.template_kwargs(),
                                  req.add_special_tokens, req.documents,
                                  req.chat_template)  # fmt: skip


async def _serve(
    st: ApiState,
    req: ChatCompletionRequest | CompletionRequest,
    request: Request,
    prompt: Prompt,
    max_tokens: int | None,
    kind: str,
    started: float,
    prompt_param: str,
    plan: ToolPlan | None = None,
    lora: LoraRef | None = None,
    sent: str | list[int] | None = None,
) -> Response:
    """Start one prompt and answer with its choices; ``sent``: a completion's prompt as
    sent (which ``echo`` repeats)."""
    rid, runs, sampling = await start(st, req, request, prompt, max_tokens, kind, started,
                                      prompt_param, plan, lora)  # fmt: skip
    echo = req.echoed() if isinstance(req, ChatCompletionRequest) else None
    shown = req.shown_id(kind, request.headers.get("x-request-id"), rid)
    fmt = Formatter(kind, shown, req.model, echo)  # the base model or the adapter it named
    fmt.nvext = nvext.response_fields(req.nvext, runs, started)  # Dynamo's, when asked
    head = nvext.annotation_events(req.nvext, prompt.token_ids, st.strings.decode) \
        if req.stream else b""  # fmt: skip
    if req.stream and req.continuous_usage:
        fmt.continuous_usage([len(prompt.token_ids)] * len(runs))
    # per choice: what reads its text into tool calls, and its logprobs or echo (None: the
    # text alone, the plain per-token path)
    tools = [chat_output(st, req, plan, sampling) for _ in runs]
    extras = [_extra(st, req, sampling, prompt.token_ids, sent) for _ in runs]
    if len(runs) > 1:  # n > 1: a stream per choice (api.choices), each read on its own
        end = partial(end_request, st, runs, started)
        if req.stream:
            tag = dropped = None
            if st.settings.api.resumable_streams:  # ids name the request's stream
                base = choice_request_id(runs[0].request_id) or runs[0].request_id
                tag = Tagged(base)
                if st.settings.api.resume_grace_s > 0:
                    dropped = partial(linger_on, st, base, partial(_drain_all, st, runs), end)
            gen = choices.stream(st, runs, fmt, req.include_usage, end, tools, extras,
                                 tag=tag, dropped=dropped, head=head)  # fmt: skip
            return SSEResponse(gen, ping=15, headers={"x-request-id": fmt.rid})
        return await choices.collect(st, runs, fmt, end, tools, extras)
    (run,) = runs
    if isinstance(req, ChatCompletionRequest) and nvext.speculative(req.nvext):
        run.after = partial(_warm_next_turn, st, req, plan, sampling, run, lora)
    if req.stream:
        gen = _stream(st, run, fmt, req.include_usage, started, tools[0], extras[0],
                      head=head)  # fmt: skip
        return SSEResponse(gen, ping=15, headers={"x-request-id": fmt.rid})
    return await _collect(st, run, fmt, started, tools[0], extras[0])


async def start(
    st: ApiState,
    req: ChatCompletionRequest | CompletionRequest,
    request: Request,
    prompt: Prompt,
    max_tokens: int | None,
    kind: str,
    started: float,
    prompt_param: str,
    plan: ToolPlan | None = None,
    lora: LoraRef | None = None,
) -> tuple[str, list[RunningRequest], Sampling]:
    """Check the request against the model, resolve its sampling (with its tool choice's
    constraint), store its images and start it: routed, sent, its first frame in. Returns
    the request's id, its runs (one, or one per choice, ``n > 1``; a run's stream id may be
    a retry's) and its sampling. ``lora``: the adapter its model names (check_model)."""
    sampling = prepare(st, req, prompt, max_tokens, prompt_param, plan)
    rid, runs = await launch(st, req, request, prompt, sampling, kind, started, lora)
    return rid, runs, sampling


def prepare(
    st: ApiState, req: ChatCompletionRequest | CompletionRequest, prompt: Prompt,
    max_tokens: int | None, prompt_param: str, plan: ToolPlan | None = None,
) -> Sampling:  # fmt: skip
    """The request's sampling for ``prompt``, checked against the context window (a 400
    before anything runs). ``max_tokens`` 0 (completions' echo: the prompt alone) runs one
    token, which computes the prompt's logprobs; the runner drops it."""
    asked = 1 if max_tokens == 0 else max_tokens
    # a 400 if it does not fit; what it asked, else the room left in the context
    fits = st.builder.check_length(len(prompt.token_ids), asked, prompt_param)
    # the model's default where none was asked, within its cap (the generation config)
    max_tokens = st.sampling_defaults.max_tokens(asked, fits)
    if req.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
            "min_tokens",
        )
    sampling = constrain(sampling_of(req, max_tokens, st.builder, st.sampling_defaults), plan)
    # a chat output the reasoning parser reads as thinking from its first token
    # (api.reasoning.output_parser): its grammar waits for the end of thinking, as vLLM's
    # does with a reasoning parser, and a thinking budget counts from the first token
    thinking = isinstance(req, ChatCompletionRequest) and thinks(
        st.settings.api.reasoning_parser, req.chat_template_kwargs
    )
    markers = st.builder.thinking_markers
    if thinking and markers is not None and sampling.structured is not None:
        sampling.structured = sampling.structured.model_copy(update={"after": markers[2]})
    if sampling.thinking is not None:
        if sampling.structured is not None and sampling.structured.after is None:
            # the grammar constrains the output from its first token; a forced end of
            # thinking would break it: strict auto calls give way, anything else is a 400
            if not sampling.structured.best_effort:
                raise bad_request("thinking_token_budget cannot be combined with a structured "
                                  "output or a forced tool choice unless a reasoning parser "
                                  "lets the model think first", "thinking_token_budget",
                                  "unsupported_parameter")  # fmt: skip
            sampling.structured = None
        sampling.thinking.inside = thinking
    return sampling


async def launch(
    st: ApiState, req: ChatCompletionRequest | CompletionRequest, request: Request,
    prompt: Prompt, sampling: Sampling, kind: str, started: float, lora: LoraRef | None,
) -> tuple[str, list[RunningRequest]]:  # fmt: skip
    """Start a prepared prompt: its images stored, its tenant's budget charged, routed,
    sent, its first frame in. Its id and runs, as :func:`start` returns them."""
    prompt_ids = prompt.token_ids  # image placeholders included: they fill the context too
    images = []
    if prompt.images:  # fetched and checked only once the rest of the request is valid
        loaded = await st.media.load(prompt.images)
        await st.media.store(st.redis, loaded)
        images = prompt.image_refs([im.hash for im in loaded])
    prefix = {"chat": "chatcmpl", "response": "resp", "message": "msg"}.get(kind, "cmpl")
    tenant = client_id(request.scope, bool(st.settings.api.api_key_list))
    await st.tenants.admit(tenant, len(prompt_ids))  # 429 when its minute is spent
    rid = st.hub.new_request_id(prefix)  # its stream needs no SUBSCRIBE
    st.metrics.in_flight.inc()
    ext = req.nvext
    sc = ext.session_control if ext is not None else None
    try:
        pin, prefill_pin = nvext.pins(req.worker_id, ext, request.headers,
                                      st.settings.serving_mode)  # fmt: skip
        session = await nvext.session_lookup(st.redis, sc)
        sticky = pin is None and prefill_pin is None and bool(session)
        if sticky:  # the session's workers, while they live
            pin, prefill_pin = session.get("decode") or None, session.get("prefill")
        run = partial(st.runner.start, rid, prompt_ids, sampling, started, images=images,
                      priority=req.priority, lora=lora, prompt_only=prompt_alone(req))  # fmt: skip
        try:
            runs = await run(pin, prefill_pin=prefill_pin)
        except OpenAIError as e:
            if not (sticky and e.code == "worker_not_found"):
                raise
            runs = await run(None)  # a worker of the session left: routed as usual
    except BaseException:
        st.metrics.in_flight.dec()
        raise
    await nvext.session_record(st.redis, sc, session, runs[0])
    runs[0].tenant = tenant
    st.metrics.prompt_tokens.inc(len(prompt_ids))
    st.metrics.traffic.started(len(prompt_ids))
    return rid, runs


def chat_output(
    st: ApiState, req: ChatCompletionRequest | CompletionRequest, plan: ToolPlan | None,
    sampling: Sampling,
) -> ChatOutput | None:  # fmt: skip
    """What reads one choice's chat text into content, tool calls and a reasoning model's
    thinking (None: the text is the content, as completions' always is)."""
    if not isinstance(req, ChatCompletionRequest):
        return None
    parser = output_parser(st.settings.api.reasoning_parser, plan, req)
    return ChatOutput(plan, parser) if parser is not None else None


async def _stream(
    st: ApiState, run: RunningRequest | None, fmt: Formatter, include_usage: bool,
    started: float, tools: ChatOutput | None = None, extra: ExtraOutput | None = None,
    *, frames: AsyncIterator[list[TokenFrame]] | None = None, tag: Tagged | None = None,
    head: bytes = b"",
) -> AsyncIterator[bytes]:  # fmt: skip
    """A started request's SSE events (``run``); or, with ``frames`` (and no ``run``), a
    resumed stream's, from its frame log, ``tag`` saying what its client has. ``head``:
    events before the first chunk (Dynamo's annotations, :mod:`api.nvext`)."""
    if run is not None and st.settings.api.resumable_streams and tag is None:
        tag = Tagged(run.request_id)  # the log that holds its first frames
    batches = frames if frames is not None else st.runner.batches(run)  # type: ignore[arg-type]
    ended = False  # the stream came to its end (not its client gone)
    try:
        if head:
            yield head
        if fmt.chat:  # chat streams open with the assistant role, as OpenAI's do
            opening = fmt.chunk(fmt.role_delta(), None, include_usage)
            role = sse_event(extra.open(opening) if extra is not None else opening)
            if out := (tag.out(role, (-1,)) if tag is not None else role):
                yield out
        async for batch in batches:
            last = batch[-1]
            failed = last.error is not None
            frames_ = batch[:-1] if failed else batch
            fmt.counted(0, frames_)
            text = "".join(f.text for f in frames_)
            if tools is not None:  # content and tool calls, parsed as they come
                deltas = tools.feed(text) + (tools.finish() if last.done and not failed else [])
                event = b"".join(sse_event(fmt.chunk(d, None, include_usage)) for d in deltas)
                if extra is not None:  # logprobs too: the batch's tokens, in a chunk
                    event += extra.beside_tools(fmt, frames_, include_usage)
            elif extra is not None:  # logprobs, an echoed prompt
                event = extra.event(fmt, frames_, text, include_usage)
            else:
                event = fmt.text_event(text, include_usage) if text else b""
            if not last.done:
                if event and tag is not None:
                    event = tag.out(event, (last.seq,))
                if event:
                    yield event
                continue
            # The stream's last events go out as one chunk (one write, one wake of the
            # client): its last text, the finish (or error) and usage, and [DONE].
            ended = True
            if failed:  # the error event, then [DONE], as vLLM ends a failed stream
                event += sse_event(frame_error(last).body()) + SSE_DONE
            else:
                reason = tools.finish_reason(last.finish_reason) if tools else last.finish_reason
                st.metrics.finish.labels(reason or "unknown").inc()
                event += sse_event(fmt.chunk(fmt.empty_delta(), reason, include_usage,
                                             stop_reason=last.stop_reason))  # fmt: skip
                if include_usage:
                    event += sse_event(fmt.usage_chunk(usage_body(last.usage)))
                event += SSE_DONE
            if out := (tag.out(event, (last.seq,)) if tag is not None else event):
                yield out
            return
        ended = True
        yield SSE_DONE
    except Exception as e:  # noqa: BLE001 - the stream must end with a terminal event
        ended = True
        yield sse_event(stream_failed(e, run.request_id if run else fmt.rid).body()) + SSE_DONE
    finally:
        if run is None:
            st.metrics.in_flight.dec()
        elif not ended and tag is not None and st.settings.api.resume_grace_s > 0:
            # the client went away: the request runs on for it to come back (api.resume)
            linger_on(st, tag.log_id, partial(drain, st, run), partial(end_request, st, [run],
                                                                      started))  # fmt: skip
        else:
            end_request(st, [run], started)


def _extra(
    st: ApiState, req: ChatCompletionRequest | CompletionRequest, sampling: Sampling,
    prompt_ids: list[int], sent: str | list[int] | None = None,
) -> ExtraOutput | None:  # fmt: skip
    """What a choice of ``req`` carries beside its text (api.logprobs.extra_output)."""
    return extra_output(st.strings, req, sampling, prompt_ids,
                        st.settings.api.return_tokens_as_token_ids, sent)  # fmt: skip


def linger_on(st: ApiState, log_id: str, drain: Callable[[], Awaitable[None]],
              end: Callable[[], None]) -> None:  # fmt: skip
    """A stream whose client went away runs on for the grace period (:func:`linger`)."""
    task = asyncio.get_running_loop().create_task(
        linger(st.settings.api.resume_grace_s, st.redis, log_id, drain, end)
    )
    st.runner.hold(task)


async def drain(st: ApiState, run: RunningRequest) -> None:
    """Read a stream to its end. The relay's own frame reader may have been cancelled
    inside a read when its client left: a new one reads on from the subscription."""
    async for batch in st.runner.batches(run):
        if batch[-1].done:
            break


async def _drain_all(st: ApiState, runs: list[RunningRequest]) -> None:
    """:func:`drain` for every choice of a request."""
    async with aclosing(choices.merged(st.runner, runs)) as ready:
        async for _ in ready:
            pass


async def resume(
    st: ApiState, req: ChatCompletionRequest | CompletionRequest, prompt: Prompt,
    max_tokens: int | None, kind: str, started: float, prompt_param: str, last_event_id: str,
    plan: ToolPlan | None = None, sent: str | list[int] | None = None,
) -> Response:  # fmt: skip
    """The rest of a stream a client lost (``Last-Event-ID``): the request it sends again is
    only read for how to format the stream (tools, logprobs, usage), never run again."""
    if not req.stream:
        raise bad_request("Last-Event-ID resumes a stream: send stream: true", "stream")
    prefix = ("chatcmpl-",) if kind == "chat" else ("cmpl-",)
    log_id, seqs = parse_event_id(last_event_id, prefix, req.n)
    logs = [choice_stream_id(log_id, i) for i in range(req.n)] if req.n > 1 else [log_id]
    if not await claim(st.redis, log_id, logs[0]):
        raise OpenAIError(404, f"no stream {log_id!r} to resume: it ended more than "
                          f"{st.settings.api.resume_ttl_s:g} s ago, or never ran here",
                          "invalid_request_error", "Last-Event-ID", "stream_not_found")  # fmt: skip
    sampling = prepare(st, req, prompt, max_tokens, prompt_param, plan)
    rid = log_id.split(".", 1)[0]  # the client's id (a retry's stream: <id>.r1)
    echo = req.echoed() if isinstance(req, ChatCompletionRequest) else None
    fmt = Formatter(kind, req.shown_id(kind, None, rid), req.model, echo)  # its model
    readers = [FrameLogReader(st.redis, x, st.settings.api.frame_timeout_s, prompt_alone(req))
               for x in logs]  # fmt: skip
    log.info("[%s] resumed after event %s", log_id, seqs)
    st.metrics.in_flight.inc()
    tag = Tagged(log_id, seqs)
    if req.n > 1:
        gen = choices.stream(st, None, fmt, req.include_usage, st.metrics.in_flight.dec,
                             [chat_output(st, req, plan, sampling) for _ in logs],
                             [_extra(st, req, sampling, prompt.token_ids, sent)
                              for _ in logs],
                             ready=choices.resumed(readers, seqs), tag=tag)  # fmt: skip
    else:
        out = chat_output(st, req, plan, sampling)
        gen = _stream(st, None, fmt, req.include_usage, started, out,
                      _extra(st, req, sampling, prompt.token_ids, sent),
                      frames=resumed_batches(readers[0], seqs[0]), tag=tag)  # fmt: skip
    return SSEResponse(gen, ping=15, headers={"x-request-id": fmt.rid})


async def _collect(
    st: ApiState, run: RunningRequest, fmt: Formatter, started: float,
    tools: ChatOutput | None = None, extra: ExtraOutput | None = None,
) -> JSONResponse:  # fmt: skip
    frames: list[TokenFrame] | None = [] if extra is not None else None
    text, last = await collect(st, run, started, frames)
    body = choices.whole_choice(fmt, 0, text, last, tools, extra, frames)
    st.metrics.finish.labels(body["finish_reason"] or "unknown").inc()
    prompt_logprobs = body.pop("prompt_logprobs", None) if fmt.chat else None
    out = fmt.whole([body], usage_body(last.usage), prompt_logprobs)
    return JSONResponse(out, headers={"x-request-id": fmt.rid})


async def collect(
    st: ApiState, run: RunningRequest, started: float, frames: list[TokenFrame] | None = None
) -> tuple[str, TokenFrame]:
    """A started request's whole text and its terminal frame (an error frame raises);
    every frame is also appended to ``frames`` when given."""
    parts: list[str] = []
    last = None
    try:
        async for batch in st.runner.batches(run):
            for frame in batch:
                if frame.error is not None:
                    raise frame_error(frame)
                parts.append(frame.text)
            if frames is not None:
                frames += batch
            last = batch[-1]
    except OpenAIError:
        raise
    except Exception as e:  # noqa: BLE001
        raise stream_error(e) from e
    finally:
        end_request(st, [run], started)
    assert last is not None and last.done, "batches() ended without a terminal frame"
    return "".join(parts), last


def _warm_next_turn(
    st: ApiState, req: ChatCompletionRequest, plan: ToolPlan | None, sampling: Sampling,
    run: RunningRequest, lora: LoraRef | None,
) -> None:  # fmt: skip
    """Dynamo's speculative prefill: the conversation with this turn's answer (its content
    and tool calls, as the client got them; its thinking left out), rendered as the next
    turn's prompt begins (no generation prompt), prefilled in the background. Not for a
    conversation with images (their bytes would be fetched again) or past the context."""
    text = st.strings.decode(run.output_ids, sampling.skip_special_tokens)
    out = chat_output(st, req, plan, sampling)
    msg = out.message(text) if out is not None else {"content": text}
    answer = ChatMessage(role="assistant", content=msg.get("content") or "",
                         tool_calls=msg.get("tool_calls"))  # fmt: skip
    try:
        nxt = st.builder.chat_prompt([*req.messages, answer], req.tools, False, False,
                                     req.template_kwargs(), req.add_special_tokens,
                                     req.documents, req.chat_template)  # fmt: skip
        st.builder.check_length(len(nxt.token_ids), 1, "messages")
    except OpenAIError as e:
        log.info("[%s] no speculative prefill: %s", run.request_id, e.message)
        return
    if nxt.images:
        return
    rid = st.hub.new_request_id("warm")
    st.runner.hold(asyncio.get_running_loop().create_task(
        nvext.warm(st.runner, rid, nxt.token_ids, lora, sampling.cache_salt)))  # fmt: skip


def end_request(st: ApiState, runs: list[RunningRequest], started: float) -> None:
    """The request is over (its streams: one, or one per choice): account for it and
    release every stream (cancelled on its worker if unfinished)."""
    m = st.metrics
    m.in_flight.dec()
    m.e2e.observe(time.perf_counter() - started)
    usage = choices.request_usage(runs)
    if usage is not None:
        m.completion_tokens.inc(usage.completion_tokens)
        m.observe_lengths(usage.prompt_tokens, usage.completion_tokens)
        m.traffic.finished(usage.completion_tokens)
        m.cached_tokens.inc(usage.cached_tokens)
        if runs and runs[0].tenant:
            st.tenants.used(runs[0].tenant, usage.completion_tokens)
    for run in runs:
        st.runner.finish(run)
    ended = runs[0].end if runs else None
    if ended is not None and ended.error is None and runs[0].after is not None:
        runs[0].after()
