"""vLLM's tokens-in, tokens-out surface: ``POST /inference/v1/generate``, the render
endpoints that turn an OpenAI request into its body (``/v1/completions/render``,
``/v1/chat/completions/render``; ``/v1/messages/render`` is :mod:`api.routes_messages`'s),
and ``/inference/v1/abort_requests`` (also ``/abort_requests``).

A generate request is a prompt as token ids and vLLM's ``SamplingParams`` by their own
names; the answer is the output's token ids (``output_mode`` ``tokens``, the default) or
those and their text (``text``), per choice, with logprobs by token id, as one body or an
SSE stream. RL trainers and external routers use it, as they use vLLM's: the client owns
the chat template and the tokenizer, or asks a render endpoint for both. A rendered body
sent to generate gives the tokens the OpenAI endpoint gives for the same request.

Left out, each a 400 naming it: multimodal ``features`` and ``content_parts``,
``kv_transfer_params`` and ``ec_transfer_params`` (Conveyor moves KV between its own
workers), and the SamplingParams fields no engine here serves (``prompt_logprob_token_ids``,
``logprob_token_ids``, ``repetition_detection`` and the like). ``/v1/*/derender`` is not
served.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api import choices
from api.errors import OpenAIError, bad_request
from api.logprobs import LogprobsRenderer, frame_tokens, prompt_logprobs
from api.protocol import ChatCompletionRequest, CompletionRequest, unsupported
from api.routes_openai import chat_prompt, end_request, launch, prepare
from api.runner import RunningRequest, frame_error, stream_error, stream_failed
from api.sse import SSE_DONE, SSEResponse, sse_event, usage_body
from api.state import ApiState, api_state, check_model
from api.tokenization import Prompt
from api.tools import tool_plan
from cluster.keys import ABORTS_CHANNEL
from kvbm.protocol import (
    CANCEL_CHANNEL,
    LOGPROB_FLOOR,
    Sampling,
    TokenFrame,
    Usage,
    cancelled_key,
)

router = APIRouter()
log = logging.getLogger(__name__)

# vLLM's SamplingParams fields a generate request may set, by the names
# CompletionRequest reads them under (the same, but for these few)
SAMPLING_FIELDS = frozenset({
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens",
    "min_tokens", "logprobs", "prompt_logprobs", "skip_special_tokens",
    "include_stop_str_in_output", "structured_outputs", "logit_bias", "allowed_token_ids",
    "bad_words", "thinking_token_budget",
})  # fmt: skip
# fields that change nothing here: the output is detokenized in any case (stop strings
# need it), and each frame carries what came since the last one
SAMPLING_NO_OPS = frozenset({"detokenize", "output_kind", "spaces_between_special_tokens",
                             "skip_clone", "output_text_buffer_length", "flat_logprobs",
                             "stream_interval"})  # fmt: skip
CANCELLED_TTL_S = 600  # as the runner keeps a cancelled request's key


class GenerateRequest(BaseModel):
    """vLLM's ``GenerateRequest`` (``/inference/v1/generate``'s body)."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    priority: int = 0
    output_mode: Literal["tokens", "text"] = "tokens"
    return_token_ids: bool | None = None
    # False: a reasoning model is still thinking where the prompt ends, so a structured
    # output applies after its end of thinking (the render step says so)
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    token_offsets: list[tuple[int, int]] | None = None
    # not served here (400 when set)
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


class AbortRequest(BaseModel):
    request_ids: list[str]


# --------------------------------------------------------------------------------------
@router.post("/inference/v1/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    started = time.perf_counter()
    st = api_state(request)
    for name in ("features", "content_parts", "kv_transfer_params", "ec_transfer_params"):
        if getattr(body, name):
            raise bad_request(f"{name} is not supported: Conveyor's generate takes text "
                              "prompts as token ids and moves KV between its own workers",
                              name, "unsupported_parameter")  # fmt: skip
    model = body.model or st.settings.model_name
    lora = await check_model(st, model, task="generate")
    req = completion_request(body, model)
    unsupported(req)
    try:
        ((_, ids),) = st.builder.completion_prompts(body.token_ids)
    except OpenAIError as e:  # an id outside the vocabulary: named as this body names it
        e.param = "token_ids" if e.param == "prompt" else e.param
        raise
    prompt = Prompt(ids)
    try:
        sampling = prepare(st, req, prompt, req.max_tokens, "token_ids")
    except OpenAIError as e:  # a sampling field: named as this body nests it
        if e.param is not None and e.param.split(".")[0] in SAMPLING_FIELDS:
            e.param = f"sampling_params.{e.param}"
        raise
    markers = st.builder.thinking_markers
    if body.reasoning_ended is False and sampling.structured is not None and markers:
        sampling.structured = sampling.structured.model_copy(update={"after": markers[2]})
    client_id = request.headers.get("x-request-id") or body.request_id  # vLLM's: the header
    rid = f"generate-tokens-{client_id}"
    _, runs = await launch(st, req, request, prompt, sampling, "generate", started, lora)
    out = _Output(st, body, sampling, rid, model, ids)
    running = st.generating.setdefault(client_id, [])
    running += runs

    def end() -> None:
        left = [r for r in running if r not in runs]
        if left:
            st.generating[client_id] = left
        else:
            st.generating.pop(client_id, None)
        end_request(st, runs, started)

    ready = choices.merged(st.runner, runs)
    if body.stream:
        include, continuous = _usage_options(body.stream_options)
        return SSEResponse(out.stream(ready, end, include, continuous), ping=15)
    return JSONResponse(await out.whole(ready, end, runs))


def completion_request(body: GenerateRequest, model: str) -> CompletionRequest:
    """The request's SamplingParams as a completions request of its token ids (which
    checks them as completions does); a 400 names the field as ``sampling_params.<name>``."""
    sp = dict(body.sampling_params)
    unknown = sorted(k for k in sp if k not in SAMPLING_FIELDS | SAMPLING_NO_OPS)
    if unknown:
        raise bad_request(f"sampling_params.{unknown[0]} is not supported here",
                          f"sampling_params.{unknown[0]}", "unsupported_parameter")  # fmt: skip
    fields = {k: v for k, v in sp.items() if k in SAMPLING_FIELDS and v is not None}
    # none given: what the context window leaves (vLLM's server default), not completions' 16
    fields["max_tokens"] = sp.get("max_tokens")
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    if isinstance(fields.get("logit_bias"), dict):  # ids as keys, as JSON writes them
        fields["logit_bias"] = {str(k): v for k, v in fields["logit_bias"].items()}
    so = fields.get("structured_outputs")
    if isinstance(so, dict) and isinstance(so.get("json"), str):  # a schema as JSON text
        try:
            fields["structured_outputs"] = {**so, "json": json.loads(so["json"])}
        except ValueError:
            raise bad_request("sampling_params.structured_outputs.json is not JSON",
                              "sampling_params.structured_outputs.json") from None  # fmt: skip
    try:
        return CompletionRequest.model_validate({
            **fields, "model": model, "prompt": body.token_ids, "stream": bool(body.stream),
            "cache_salt": body.cache_salt, "priority": body.priority,
        })  # fmt: skip
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("list[", "dict[")))
        top = {"prompt": "token_ids", "priority": "priority", "cache_salt": "cache_salt"}
        head = str(err["loc"][0]) if err["loc"] else ""
        param = top[head] if head in top else f"sampling_params.{loc}"  # as the body names it
        raise bad_request(f"{param}: {err['msg']}", param) from None


def _usage_options(opts: dict[str, Any] | None) -> tuple[bool, bool]:
    """stream_options' (include_usage, continuous_usage_stats)."""
    opts = opts or {}
    include = bool(opts.get("include_usage"))
    return include, include and bool(opts.get("continuous_usage_stats"))


class _Output:
    """A generate request's choices as vLLM's generate writes them."""

    def __init__(self, st: ApiState, body: GenerateRequest, sampling: Sampling, rid: str,
                 model: str, prompt_ids: list[int]) -> None:  # fmt: skip
        self.st, self.body, self.rid, self.model = st, body, rid, model
        self.prompt_ids = prompt_ids
        self.text = body.output_mode == "text"
        self.top = sampling.logprobs  # None: no logprobs asked for
        self.prompt_top = sampling.prompt_logprobs
        self.n = sampling.n

    def logprobs(self, frames: list[TokenFrame]) -> dict | None:
        if self.top is None:
            return None
        ids, lps = frame_tokens(frames)
        if self.text:  # chat's shape: decoded tokens and their bytes
            return LogprobsRenderer(self.st.strings, True, self.top).full(ids, lps)
        return {"content": [_token_logprob(t, lp, self.top) for t, lp in
                            zip(ids, lps, strict=True)]}  # fmt: skip

    def choice(self, index: int, frames: list[TokenFrame], whole: bool) -> dict:
        last = frames[-1] if frames else None
        done = last is not None and last.done
        out: dict[str, Any] = {"index": index}
        if self.text:
            out["text"] = "".join(f.text for f in frames)
        out["logprobs"] = self.logprobs(frames)
        finish = last.finish_reason if done and last is not None else None
        out["finish_reason"] = (finish or "stop") if whole else finish
        out["stop_reason"] = last.stop_reason if done and last is not None else None
        out["token_ids"] = [t for f in frames for t in f.token_ids]
        return out

    async def whole(self, ready: AsyncIterator[choices.Ready], end: Any,
                    runs: list[RunningRequest]) -> dict:  # fmt: skip
        got: list[list[TokenFrame]] = [[] for _ in range(self.n)]
        try:
            async with aclosing(ready) as frames:  # type: ignore[type-var]
                async for batch in frames:
                    for i, part in batch:
                        for f in part:
                            if f.error is not None:
                                raise frame_error(f)
                        got[i] += part
        except OpenAIError:
            raise
        except Exception as e:  # noqa: BLE001 - a lost worker, a timeout: its OpenAI error
            raise stream_error(e) from e
        finally:
            end()
        usage = choices.request_usage(runs) or Usage()
        body: dict[str, Any] = {
            "request_id": self.rid, "model": self.model, "created": int(time.time()),
            "output_mode": "text" if self.text else "tokens",
            "choices": [self.choice(i, frames, True) for i, frames in enumerate(got)],
            "usage": usage_body(usage),
        }  # fmt: skip
        first = got[0][0] if got and got[0] else None
        if self.prompt_top is not None and first is not None and first.prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs(self.st.strings, self.prompt_ids,
                                                      first.prompt_logprobs)  # fmt: skip
        if self.body.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        return body

    async def stream(self, ready: AsyncIterator[choices.Ready], end: Any, include_usage: bool,
                     continuous: bool) -> AsyncIterator[bytes]:  # fmt: skip
        mode = "text" if self.text else "tokens"
        counted = [0] * self.n
        prompt_ids = self.prompt_ids if self.body.return_token_ids else None
        last_usage: list[Usage | None] = [None] * self.n
        try:
            async with aclosing(ready) as frames:  # type: ignore[type-var]
                async for batch in frames:
                    event = b""
                    for i, part in batch:
                        failed = part[-1].error if part else None
                        if failed is not None:
                            raise frame_error(part[-1])
                        counted[i] += sum(len(f.token_ids) for f in part)
                        if part and part[-1].done:
                            last_usage[i] = part[-1].usage
                        choice = self.choice(i, part, False)
                        chunk: dict[str, Any] = {"request_id": self.rid, "output_mode": mode,
                                                 "choices": [choice]}  # fmt: skip
                        if prompt_ids is not None:
                            chunk["prompt_token_ids"], prompt_ids = prompt_ids, None
                        if continuous:
                            p = len(self.prompt_ids)
                            chunk["usage"] = {"prompt_tokens": p, "completion_tokens": counted[i],
                                              "total_tokens": p + counted[i]}  # fmt: skip
                        event += sse_event(chunk)
                    if event:
                        yield event
            event = b""
            if include_usage:
                usage = choices.combined_usage(last_usage) or Usage(len(self.prompt_ids),
                                                                     sum(counted))  # fmt: skip
                event += sse_event({"request_id": self.rid, "output_mode": mode,
                                    "choices": [], "usage": usage_body(usage)})  # fmt: skip
            yield event + SSE_DONE
        except Exception as e:  # noqa: BLE001 - the stream ends with a terminal event
            yield sse_event(stream_failed(e, self.rid).body()) + SSE_DONE
        finally:
            end()


def _token_logprob(tid: int, lp: list | None, top: int) -> dict:
    """One output token's logprobs by token id (vLLM's generate shape): the sampled token
    first among ``top_logprobs``, then the likeliest others, ``max(top, 1)`` in all."""
    if lp is None:
        return {"token_id": tid, "logprob": LOGPROB_FLOOR, "rank": None, "top_logprobs": []}
    tops = [{"token_id": tid, "logprob": lp[0], "rank": lp[1]}]
    for rank, (t, x) in enumerate(lp[2], start=1):
        if len(tops) >= max(top, 1):
            break
        if t != tid:
            tops.append({"token_id": t, "logprob": x, "rank": rank})
    return {"token_id": tid, "logprob": lp[0], "rank": lp[1], "top_logprobs": tops}


# --------------------------------------------------------------------------------------
@router.post("/inference/v1/abort_requests")
@router.post("/abort_requests")
async def abort_requests(body: AbortRequest, request: Request) -> Response:
    """Abort generate requests by their ``request_id`` (as sent, or as the response names
    it: ``generate-tokens-<id>``), wherever they run: the ids go to every API process
    (:data:`cluster.keys.ABORTS_CHANNEL`), and each ends those it serves with finish
    reason ``abort`` and the tokens they had. Unknown ids are ignored, as vLLM ignores
    them."""
    if body.request_ids:
        await api_state(request).redis.publish(ABORTS_CHANNEL, json.dumps(body.request_ids))
    return Response(status_code=200)


def on_abort(st: ApiState, payload: bytes) -> None:
    """An /abort_requests heard on ABORTS_CHANNEL (by this process's stream hub): cancel
    the generate requests of those ids this process serves, as a client that left would."""
    try:
        ids = [str(x) for x in json.loads(payload)]
    except (ValueError, TypeError):
        log.warning("ignored a malformed abort message: %r", payload[:200])
        return
    commands: list[tuple] = []
    for rid in ids:
        for run in st.generating.get(rid.removeprefix("generate-tokens-"), []):
            if not run.finished:
                commands += [("SET", cancelled_key(run.request_id), 1, "EX", CANCELLED_TTL_S),
                             ("PUBLISH", CANCEL_CHANNEL, run.request_id)]  # fmt: skip
    if commands:
        log.info("aborting %d generate requests: %s", len(commands) // 2, ", ".join(ids))
        st.runner.hold(asyncio.get_running_loop().create_task(_send(st, commands)))


async def _send(st: ApiState, commands: list[tuple]) -> None:
    async with st.redis.pipeline(transaction=False) as pipe:
        for c in commands:
            pipe.execute_command(*c)
        await pipe.execute()


# --------------------------------------------------------------------------------------
@router.post("/v1/completions/render")
async def render_completions(req: CompletionRequest, request: Request) -> JSONResponse:
    """A completions request as the generate bodies it runs as: one per prompt."""
    st = await _renderable(req, request)
    out = []
    for _, ids in st.builder.completion_prompts(req.prompt, req.add_special_tokens):
        prompt = st.builder.truncated(Prompt(ids), req.truncate_prompt_tokens,
                                      req.truncation_side)  # fmt: skip
        sampling = prepare(st, req, prompt, req.max_tokens, "prompt")
        out.append(generate_body(req, prompt, sampling, f"cmpl-{uuid.uuid4().hex}"))
    return JSONResponse(out)


@router.post("/v1/chat/completions/render")
async def render_chat(req: ChatCompletionRequest, request: Request) -> JSONResponse:
    """A chat request as the generate body it runs as: its messages and tools through
    the chat template, its tool choice's constraint, its sampling resolved."""
    st = await _renderable(req, request)
    plan = tool_plan(req, st.tool_parser)
    prompt = text_only(st.builder.truncated(chat_prompt(st, req), req.truncate_prompt_tokens,
                                            req.truncation_side))  # fmt: skip
    max_tokens = req.max_completion_tokens or req.max_tokens
    sampling = prepare(st, req, prompt, max_tokens, "messages", plan)
    return JSONResponse(generate_body(req, prompt, sampling, f"chatcmpl-{uuid.uuid4().hex}"))


async def _renderable(req: ChatCompletionRequest | CompletionRequest,
                      request: Request) -> ApiState:  # fmt: skip
    """The API's state, once ``req`` is one a render endpoint takes."""
    st = api_state(request)
    await check_model(st, req.model, task="generate")
    unsupported(req)
    if req.use_beam_search:
        raise bad_request("beam search is not supported by the render endpoint",
                          "use_beam_search", "unsupported_parameter")  # fmt: skip
    return st


def text_only(prompt: Prompt) -> Prompt:
    """A rendered prompt without images (generate takes no multimodal features)."""
    if prompt.images:
        raise bad_request("images are not supported by the render endpoint (generate "
                          "takes no multimodal features)", "messages",
                          "unsupported_parameter")  # fmt: skip
    return prompt


def generate_body(req: ChatCompletionRequest | CompletionRequest, prompt: Prompt,
              sampling: Sampling, rid: str) -> dict:  # fmt: skip
    """The generate body of one prepared prompt."""
    body: dict[str, Any] = {
        "request_id": rid, "token_ids": prompt.token_ids,
        "sampling_params": vllm_sampling_params(sampling, req), "model": req.model,
        "stream": bool(req.stream), "priority": req.priority,
    }  # fmt: skip
    if req.stream and req.stream_options is not None:
        body["stream_options"] = req.stream_options.model_dump(exclude_none=True)
    if sampling.cache_salt:
        body["cache_salt"] = sampling.cache_salt
    if sampling.structured is not None:  # whether the grammar waits for the end of thinking
        body["reasoning_ended"] = sampling.structured.after is None
    return body


def vllm_sampling_params(s: Sampling, req: ChatCompletionRequest | CompletionRequest) -> dict:
    """A resolved :class:`Sampling` by vLLM's SamplingParams names (what generate reads)."""
    out: dict[str, Any] = {
        "n": s.n, "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty, "repetition_penalty": s.repetition_penalty,
        "temperature": s.temperature, "top_p": s.top_p, "top_k": max(s.top_k, 0),
        "min_p": s.min_p, "seed": s.seed, "stop": s.stop, "stop_token_ids": s.stop_token_ids,
        "ignore_eos": s.ignore_eos, "max_tokens": s.max_tokens, "min_tokens": s.min_tokens,
        "logprobs": s.logprobs, "prompt_logprobs": s.prompt_logprobs,
        "skip_special_tokens": s.skip_special_tokens,
        "include_stop_str_in_output": s.include_stop_str_in_output,
        "logit_bias": {str(k): v for k, v in s.logit_bias.items()} or None,
        "allowed_token_ids": s.allowed_token_ids, "bad_words": req.bad_words or None,
        "structured_outputs": None,
        "thinking_token_budget": s.thinking.budget if s.thinking is not None else None,
    }  # fmt: skip
    so = s.structured
    if so is not None:
        spec: dict[str, Any] = {"disable_any_whitespace": not so.any_whitespace}
        if so.json_schema is not None:
            spec["json"] = json.loads(so.json_schema)
        elif so.json_object:
            spec["json_object"] = True
        elif so.regex is not None:
            spec["regex"] = so.regex
        elif so.choice is not None:
            spec["choice"] = so.choice
        elif so.grammar is not None:
            spec["grammar"] = so.grammar
        elif so.structural_tag is not None:
            spec["structural_tag"] = so.structural_tag
        out["structured_outputs"] = spec
    return out
