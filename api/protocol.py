"""OpenAI request bodies (the subset Conveyor serves, plus vLLM's common extensions).

Unknown fields are ignored, as vLLM does. Fields Conveyor does not support yet (``n > 1``,
``logprobs``, penalties, tools, ...) are accepted by the schema and rejected with a clear 400
by :func:`unsupported`, so the client learns what is missing instead of getting silence.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.errors import bad_request

PIN_HEADER = "x-conveyor-worker-id"  # or the body's worker_id: run on exactly this worker


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: Literal["text", "image_url", "input_audio", "image", "refusal"]
    text: str | None = None
    image_url: Any = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _SamplingFields(_Body):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Conveyor extension: pin the request to one worker (its id, as /metrics and the
    # worker's log name it); 400 when no live worker has that id
    worker_id: str | None = Field(None, min_length=1, max_length=200)

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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: dict | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Raise a 400 naming the first requested feature Conveyor does not serve yet."""
    checks: list[tuple[bool, str, str]] = [
        (req.n != 1, "n", "n > 1 is not supported yet; send n=1"),
        (bool(req.presence_penalty), "presence_penalty", "presence_penalty is not supported"),
        (bool(req.frequency_penalty), "frequency_penalty", "frequency_penalty is not supported"),
        (
            req.repetition_penalty not in (None, 1.0),
            "repetition_penalty",
            "repetition_penalty is not supported",
        ),
        (bool(req.logit_bias), "logit_bias", "logit_bias is not supported"),
        (req.stream_options is not None and not req.stream, "stream_options",
         "stream_options is only allowed when stream is true"),
    ]  # fmt: skip
    if isinstance(req, ChatCompletionRequest):
        rf = (req.response_format or {}).get("type", "text")
        checks += [
            (bool(req.logprobs) or req.top_logprobs is not None, "logprobs",
             "logprobs are not supported yet"),
            (bool(req.tools), "tools", "tool calling is not supported yet"),
            (rf != "text", "response_format", f"response_format {rf!r} is not supported"),
        ]  # fmt: skip
    else:
        checks += [
            (req.logprobs is not None, "logprobs", "logprobs are not supported yet"),
            (req.echo, "echo", "echo is not supported yet"),
            (req.suffix is not None, "suffix", "suffix is not supported"),
            (req.best_of not in (None, 1), "best_of", "best_of > 1 is not supported"),
        ]
    for bad, param, message in checks:
        if bad:
            raise bad_request(message, param=param, code="unsupported_parameter")
