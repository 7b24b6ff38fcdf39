"""Beam search (vLLM's ``use_beam_search``) for chat and completions, run by the API as
vLLM's server runs it: one pipeline request per live beam per step.

Each step sends every live beam (the prompt and the beam's tokens so far) through the
pipeline as a one-token request asking for the ``2 * width`` most likely next tokens
(their raw log-probabilities, as the engine computes logprobs); the prefix cache serves
each beam's prompt and earlier tokens, so a step computes about one token per beam. Every
beam grows by each of those tokens; a candidate ending in an end-of-sequence token is
complete (unless ``ignore_eos``), the ``width`` best of the others live on. After
``max_tokens`` steps (or once no beam lives) the ``n`` (= ``width``) best of the complete
and live beams are the choices. A beam's score is vLLM's: its cumulative log-probability
divided by its length (prompt included, a final end-of-sequence token not) to the power
``length_penalty``. Streamed, the whole beams come once the search has ended (as vLLM
streams one).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from api.admission import client_id
from api.errors import OpenAIError, bad_request, first_error
from api.protocol import PIN_HEADER, ChatCompletionRequest, CompletionRequest
from api.sse import SSE_DONE, Formatter, SSEResponse, sse_event
from api.state import ApiState
from api.tokenization import Prompt
from cluster.lora import LoraRef
from kvbm.protocol import MAX_LOGPROBS, Sampling

MAX_WIDTH = MAX_LOGPROBS // 2  # each step asks for 2 x width top logprobs


@dataclass(slots=True)
class Beam:
    tokens: list[int] = field(default_factory=list)  # generated so far
    logprob: float = 0.0  # their cumulative log-probability
    ended: bool = False  # its last token ends the sequence


def score(beam: Beam, prompt_len: int, length_penalty: float) -> float:
    """vLLM's beam score: the cumulative log-probability over the length (prompt
    included, a final end-of-sequence token not) to the power ``length_penalty``."""
    n = prompt_len + len(beam.tokens) - (1 if beam.ended else 0)
    return beam.logprob / (max(n, 1) ** length_penalty)


def check(req: ChatCompletionRequest | CompletionRequest, sampling: Sampling) -> None:
    """A 400 naming the first field beam search does not take (it ranks by the model's
    log-probabilities alone: nothing that samples, constrains or reshapes the logits
    applies, as in vLLM, and its output is whole)."""
    chat = isinstance(req, ChatCompletionRequest)
    wants_logprobs = req.logprobs if chat else req.logprobs is not None
    checks = [
        (req.n > MAX_WIDTH, "n", f"beam search takes n (its width) up to {MAX_WIDTH}"),
        (bool(wants_logprobs), "logprobs", "logprobs are not returned with beam search"),
        (sampling.prompt_logprobs is not None, "prompt_logprobs",
         "prompt_logprobs are not returned with beam search"),
        (bool(sampling.stop), "stop", "stop strings do not end beams; beams end on the "
         "end-of-sequence token or max_tokens"),
        (bool(sampling.stop_token_ids), "stop_token_ids", "stop_token_ids do not end beams"),
        (sampling.min_tokens > 0, "min_tokens", "min_tokens does not apply to beam search"),
        (sampling.penalized, "presence_penalty", "penalties do not apply to beam search"),
        (bool(sampling.logit_bias), "logit_bias", "logit_bias does not apply to beam search"),
        (sampling.allowed_token_ids is not None, "allowed_token_ids",
         "allowed_token_ids does not apply to beam search"),
        (bool(sampling.bad_words), "bad_words", "bad_words do not apply to beam search"),
        (sampling.structured is not None, "response_format",
         "structured outputs do not apply to beam search"),
        (chat and bool(req.tools) and req.tool_choice != "none", "tools",  # type: ignore[union-attr]
         "tool calls are not parsed with beam search (tool_choice none renders the tools)"),
        (not chat and req.echo, "echo", "echo is not served with beam search"),
    ]  # fmt: skip
    for bad, param, message in checks:
        if bad:
            raise bad_request(message, param, "unsupported_parameter")


async def serve(
    st: ApiState, req: ChatCompletionRequest | CompletionRequest, request: Request,
    prompt: Prompt, sampling: Sampling, kind: str, started: float, lora: LoraRef | None,
) -> Response:  # fmt: skip
    """Run the beam search and answer its ``n`` best beams as the request's choices."""
    check(req, sampling)
    if prompt.images:
        raise bad_request("beam search takes text prompts", "messages", "unsupported_content")
    width, ids = req.n, prompt.token_ids
    await st.tenants.admit(client_id(request.scope, bool(st.settings.api.api_key_list)),
                           len(ids))  # fmt: skip
    rid = st.hub.new_request_id("chatcmpl" if kind == "chat" else "cmpl")
    pin = req.worker_id or request.headers.get(PIN_HEADER) or None
    st.metrics.in_flight.inc()
    try:
        beams = await search(st, rid, ids, sampling, width, req.length_penalty, started, pin,
                             req.priority, lora)  # fmt: skip
    finally:
        st.metrics.in_flight.dec()
        st.metrics.e2e.observe(time.perf_counter() - started)
    fmt = Formatter(kind, req.shown_id(kind, request.headers.get("x-request-id"), rid),
                    req.model)  # fmt: skip
    choices, out_tokens = [], 0
    for i, b in enumerate(beams):
        shown = b.tokens[:-1] if b.ended else b.tokens
        text = st.builder.tokenizer.decode(shown, skip_special_tokens=sampling.skip_special_tokens)
        # as vLLM: a complete beam stops on its end-of-sequence token (its stop_reason), not
        # counted among its tokens
        choices.append(fmt.choice(i, text, "stop" if b.ended else "length",
                                  b.tokens[-1] if b.ended else None))  # fmt: skip
        out_tokens += len(shown)
    st.metrics.prompt_tokens.inc(len(ids))
    st.metrics.completion_tokens.inc(out_tokens)
    st.metrics.observe_lengths(len(ids), out_tokens)
    usage = {"prompt_tokens": len(ids), "completion_tokens": out_tokens,
             "total_tokens": len(ids) + out_tokens}  # fmt: skip
    headers = {"x-request-id": fmt.rid}
    if not req.stream:
        return JSONResponse(fmt.whole(choices, usage), headers=headers)
    # streamed, as vLLM streams a beam search: the whole beams once it has ended, each
    # choice's text in a chunk and its finish in the next, then usage and [DONE]
    inc = req.include_usage
    events = []
    for c in choices:
        i, text = c["index"], c["message"]["content"] if fmt.chat else c["text"]
        if fmt.chat:
            events.append(sse_event(fmt.chunk(fmt.role_delta(), None, inc, index=i)))
        events.append(sse_event(fmt.chunk(fmt.text_delta(text), None, inc, index=i)))
        events.append(sse_event(fmt.chunk(fmt.empty_delta(), c["finish_reason"], inc,
                                          c["stop_reason"], index=i)))  # fmt: skip
    if inc:
        events.append(sse_event(fmt.usage_chunk(usage)))
    events.append(SSE_DONE)

    async def replay() -> AsyncIterator[bytes]:
        for e in events:
            yield e

    return SSEResponse(replay(), ping=15, headers=headers)


async def search(
    st: ApiState, rid: str, prompt: list[int], sampling: Sampling, width: int,
    length_penalty: float, started: float, pin: str | None, priority: int,
    lora: LoraRef | None,
) -> list[Beam]:  # fmt: skip
    """The ``width`` best beams after ``sampling.max_tokens`` steps (module docstring)."""
    eos = set(st.builder.eos_token_ids)
    step_params = Sampling(max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True,
                           cache_salt=sampling.cache_salt)  # fmt: skip
    live, done = [Beam()], []
    for step in range(sampling.max_tokens):
        try:  # the step's requests at once; one failing cancels the others
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(_top(st, f"{rid}.s{step}b{j}", prompt + b.tokens,
                                             step_params, started, pin, priority, lora))
                         for j, b in enumerate(live)]  # fmt: skip
        except BaseExceptionGroup as eg:
            raise first_error(eg) from None
        tops = [t.result() for t in tasks]
        grown = []
        for beam, top in zip(live, tops, strict=True):
            for token, logprob in top:
                b = Beam(beam.tokens + [token], beam.logprob + logprob)
                if token in eos and not sampling.ignore_eos:
                    b.ended = True
                    done.append(b)
                else:
                    grown.append(b)
        grown.sort(key=lambda b: score(b, len(prompt), length_penalty), reverse=True)
        live = grown[:width]
        if not live:
            break
    best = sorted(done + live, key=lambda b: score(b, len(prompt), length_penalty),
                  reverse=True)  # fmt: skip
    return best[:width]


async def _top(
    st: ApiState, stream_id: str, ids: list[int], params: Sampling, started: float,
    pin: str | None, priority: int, lora: LoraRef | None,
) -> list[tuple[int, float]]:  # fmt: skip
    """The most likely next tokens after ``ids`` and their log-probabilities: one
    one-token request through the pipeline (routed on its prefix, as any)."""
    try:
        (run,) = await st.runner.start(stream_id, ids, params, started, pin,
                                       priority=priority, lora=lora)  # fmt: skip
    except OpenAIError as e:
        if e.param != "logprobs":
            raise
        # the engine computes no logprobs (the mock engine): the search itself cannot run
        raise bad_request(f"beam search ranks beams by the engine's logprobs: {e.message}",
                          "use_beam_search", "unsupported_parameter") from None  # fmt: skip
    try:
        frames = [f async for batch in st.runner.batches(run) for f in batch]
    finally:
        st.runner.finish(run)
    last = frames[-1]
    if last.error is not None:
        raise OpenAIError(500, f"a beam search step failed: {last.error.message}",
                          "server_error", None, "engine_error")  # fmt: skip
    lp = next((f.logprobs[0] for f in frames if f.logprobs), None)
    if lp is None:
        raise OpenAIError(500, "a beam search step came back without logprobs",
                          "server_error", None, "engine_error")  # fmt: skip
    return [(int(t), float(x)) for t, x in lp[2]]
