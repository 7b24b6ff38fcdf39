"""OpenAI request bodies, with vLLM's extensions (same names and meanings).

Unknown fields are ignored, as vLLM does. A field Conveyor does not serve is accepted by
the schema and refused with a clear 400 naming it (:func:`unsupported`), so the client
learns what is missing instead of getting silence.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from api.errors import bad_request
from kvbm.protocol import MAX_LOGPROBS

PIN_HEADER = "x-conveyor-worker-id"  # or the body's worker_id: run on exactly this worker
MAX_N = 128  # choices per request (vLLM has no cap; each one holds a sequence slot)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far
    continuous_usage_stats: bool = False


class ContentPart(_Body):
    type: Literal["text", "image_url", "input_audio", "image", "refusal"]
    text: str | None = None
    image_url: Any = None


class ToolCallFunction(_Body):
    name: str = Field(min_length=1)
    arguments: str | dict = "{}"  # OpenAI sends a JSON string; a few clients an object


class ToolCall(_Body):
    """A call an assistant message made (sent back in the next turn's history)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers


class SessionControl(_Body):
    """Dynamo's ``nvext.session_control``: a conversation's turns stick to the workers
    that served it (:mod:`api.nvext`)."""

    session_id: str = Field(min_length=1, max_length=256)
    action: Literal["open", "close"] | None = None  # open: the first turn; close: the last
    timeout: int = Field(300, ge=1, le=86400)  # s without a turn before it is forgotten


class NvExt(_Body):
    """NVIDIA Dynamo's ``nvext`` extension of chat and completions, so that a Dynamo
    client's requests run here unchanged: the fields with a counterpart are mapped onto
    it (:meth:`_SamplingFields._nvext`), the response's fields are :mod:`api.nvext`'s.
    Fields it does not know are ignored, as Dynamo ignores them."""

    greed_sampling: bool | None = None  # greedy: temperature 0
    ignore_eos: bool | None = None  # older Dynamo releases' sampling fields
    top_k: int | None = Field(None, ge=-1)
    repetition_penalty: float | None = Field(None, gt=0.0)
    max_thinking_tokens: int | None = Field(None, ge=0)  # thinking_token_budget
    backend_instance_id: int | str | None = None  # the worker it runs on: worker_id
    decode_worker_id: int | str | None = None
    prefill_worker_id: int | str | None = None  # P/D: the worker that prefills it
    token_data: list[int] | None = Field(None, min_length=1)  # the prompt, tokenized
    agent_hints: dict[str, Any] | None = None  # priority: higher first (Dynamo's sense)
    # the response's nvext: "worker_id" (who served it), "timing" (its latencies)
    extra_fields: list[str] | None = None
    # streamed as SSE events before the first chunk: "formatted_prompt", "token_ids"
    annotations: list[str] | None = None
    # Dynamo's: a completions prompt goes to the tokenizer as it is (it always does here;
    # chat renders its template, as Dynamo's does)
    use_raw_prompt: bool | None = None
    session_control: SessionControl | None = None


class _SamplingFields(_Body):
    """Fields chat and completions share: OpenAI's, then vLLM's extensions (same names,
    same meanings). :func:`api.params.sampling_of` resolves them into the engine's
    :class:`kvbm.protocol.Sampling`."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=-1)
    # vLLM's: the prompt's last k tokens only (-1: as many as the context window holds)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # the prompt's and the output's token ids in the response (prompt_token_ids, token_ids)
    return_token_ids: bool = False
    # logprobs name each token "token_id:<id>" (None: CONVEYOR_RETURN_TOKENS_AS_TOKEN_IDS)
    return_tokens_as_token_ids: bool | None = None
    # structured outputs: vLLM's object, or its older guided_* fields (one kind at most)
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # vLLM's: lower values are served first (the admission wait for a worker under its
    # cap, the engine's waiting queue and whom it preempts); equal ones in arrival order
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    # vLLM's beam search (api.beam_search): n beams, ranked by their log-probability over
    # their length to the power length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: a prefix is shared in the KV cache only between requests with the same salt
    # (none: the unsalted ones'); a tenant's salt keeps others from timing its prompts
    cache_salt: str | None = Field(None, min_length=1, max_length=1000)
    # vLLM's: the response's id is chatcmpl-<it> (cmpl-<it>); the X-Request-Id header wins.
    # Printable ASCII, as it is also sent back as that header
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[!-~]+$")
    # vLLM's: with truncate_prompt_tokens, keep the last tokens (left, the default) or the
    # first ones (right)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: at most this many tokens inside a thinking block, then its end is forced
    # (the reasoning markers: CONVEYOR_REASONING_PARSER or CONVEYOR_REASONING_CONFIG)
    thinking_token_budget: int | None = Field(None, ge=0)
    # Conveyor extension: pin the request to one worker (its id, as /metrics and the
    # worker's log name it); 400 when no live worker has that id
    worker_id: str | None = Field(None, min_length=1, max_length=200)
    # NVIDIA Dynamo's extension (NvExt)
    nvext: NvExt | None = None

    @model_validator(mode="after")
    def _nvext(self) -> _SamplingFields:
        """Dynamo's ``nvext`` fields onto their counterparts (a field set in the body
        itself wins)."""
        ext = self.nvext
        if ext is None:
            return self
        if ext.greed_sampling:
            self.temperature = 0.0
        if ext.ignore_eos:
            self.ignore_eos = True
        if ext.top_k is not None and self.top_k is None:
            self.top_k = ext.top_k
        if ext.repetition_penalty is not None and self.repetition_penalty is None:
            self.repetition_penalty = ext.repetition_penalty
        if ext.max_thinking_tokens is not None and self.thinking_token_budget is None:
            self.thinking_token_budget = ext.max_thinking_tokens
        pin = ext.decode_worker_id if ext.decode_worker_id is not None else ext.backend_instance_id
        if pin is not None and self.worker_id is None:
            self.worker_id = str(pin)
        priority = (ext.agent_hints or {}).get("priority")
        if isinstance(priority, int) and not isinstance(priority, bool) and self.priority == 0:
            self.priority = max(-(2**31), min(2**31 - 1, -priority))  # lower first here
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            if len(v) > 16:
                raise ValueError("at most 16 stop sequences")
            if any(not s for s in v):
                raise ValueError("stop sequences must be non-empty")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats (it counts only with include_usage)."""
        opts = self.stream_options
        return bool(opts and opts.include_usage and opts.continuous_usage_stats)

    def shown_id(self, kind: str, header: str | None, rid: str) -> str:
        """The id a response shows (its ``id`` and ``x-request-id``), as vLLM's: the
        client's ``X-Request-Id`` header or this body's ``request_id`` after the kind's
        prefix; else the request's own id ``rid`` (its stream's, the logs')."""
        client = header or self.request_id
        if not client:
            return rid
        return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{client}"


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # vLLM's: the rendered prompt
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    # vLLM's: retrieval documents for templates that take them ({"title", "text"}...), a
    # request's own template (with CONVEYOR_TRUST_REQUEST_CHAT_TEMPLATE), and the
    # tokenizer's special tokens (a BOS) on top of what the template writes
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    add_special_tokens: bool = False
    echo: bool = False
    # vLLM's: with a reasoning parser, whether the thinking is returned (``reasoning``)
    include_reasoning: bool = True
    # OpenAI's: how hard a reasoning model thinks; the chat template's reasoning_effort
    # variable, as vLLM passes it (a template that does not read it ignores it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # OpenAI's predicted output: text the answer is expected to mostly repeat, drafted from
    # for speculative decoding (workers.spec_decode)
    prediction: dict | None = None

    def template_kwargs(self) -> dict | None:
        """The template's extra variables: chat_template_kwargs, and reasoning_effort
        unless they set it themselves."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def echoed(self) -> str | None:
        """vLLM's chat ``echo``: the last message's text, which the answer's content starts
        with, when that message is the assistant's (the answer's role); else None."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant":
            return None
        if isinstance(last.content, list):
            return "".join(p.text or "" for p in last.content if p.type == "text")
        return last.content or ""


class BatchChatRequest(BaseModel):
    """vLLM's ``/v1/chat/completions/batch`` body: chat's fields, once for every
    conversation, and ``messages`` a list of conversations (each checked as chat checks
    its messages, with the rest of the body)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[list[dict[str, Any]]] = Field(min_length=1)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    # 16 unless given, as OpenAI's and vLLM's completions (null: the rest of the context);
    # 0: with echo, the prompt alone (vLLM's)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    # vLLM's: the tokenizer's special tokens (a BOS) around a text prompt; false: its text
    # alone (token-id prompts are taken as sent either way)
    add_special_tokens: bool = True
    best_of: int | None = None


def prompt_alone(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """Completions' echo with ``max_tokens`` 0: the prompt alone, the token run for its
    logprobs dropped (:func:`api.streams.output_dropped`)."""
    return isinstance(req, CompletionRequest) and req.max_tokens == 0


def unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Raise a 400 naming the first requested feature Conveyor does not serve yet."""
    checks: list[tuple[bool, str, str]] = [
        (req.stream_options is not None and not req.stream, "stream_options",
         "stream_options is only allowed when stream is true"),
    ]  # fmt: skip
    if isinstance(req, ChatCompletionRequest):
        checks += [
            (req.add_generation_prompt and req.continue_final_message, "continue_final_message",
             "continue_final_message and add_generation_prompt cannot both be true (set "
             "add_generation_prompt to false to continue the last message)"),
        ]  # fmt: skip
    else:
        checks += [
            (req.suffix is not None, "suffix", "suffix is not supported"),
            (req.best_of not in (None, 1), "best_of", "best_of > 1 is not supported"),
        ]
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt "
                              "alone)", "max_tokens", "invalid_value")  # fmt: skip
    ext = req.nvext
    if ext is not None:
        gaie = any(a.startswith("query_instance_id:") for a in ext.annotations or ())
        checks += [
            (gaie, "nvext.annotations", "the query_instance_id annotation (the Gateway API "
             "Inference Extension's query-only routing) is not supported"),
        ]  # fmt: skip
    for bad, param, message in checks:
        if bad:
            raise bad_request(message, param=param, code="unsupported_parameter")
