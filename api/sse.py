"""Response shapes: OpenAI's completion bodies and chunks, and their SSE encoding."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from importlib.metadata import version

from sse_starlette.sse import EventSourceResponse
from starlette.types import Message, Send

from kvbm.protocol import TokenFrame, Usage

# The sse-starlette versions whose private ``_send_with_timeout`` LeanSSEResponse overrides
# (tested: 3.7.0; pyproject.toml pins the same range). Another version gets the stock
# response: a changed private method must not change how streams are sent.
SSE_STARLETTE_TESTED = ((3, 7), (3, 8))  # [from, to)


class LeanSSEResponse(EventSourceResponse):
    """sse-starlette's response, minus a cancel scope per chunk when no send timeout is set
    (its default): a deadline that never fires, for a measurable share of the API's CPU
    (docs/performance.md, "API: SSE without a cancel scope per chunk"). With a
    ``send_timeout`` its own send is used."""

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def lean_fits(installed: str) -> bool:
    """Whether sse-starlette ``installed`` is a version LeanSSEResponse was tested on."""
    try:
        major_minor = tuple(int(p) for p in installed.split(".")[:2])
    except ValueError:  # a version string of another shape: not one tested
        return False
    low, high = SSE_STARLETTE_TESTED
    return low <= major_minor < high and hasattr(EventSourceResponse, "_send_with_timeout")


# what the routes answer streams with
SSEResponse: type[EventSourceResponse] = (
    LeanSSEResponse if lean_fits(version("sse-starlette")) else EventSourceResponse
)


def json_line(obj: object) -> str:
    # ASCII-escaped on purpose: raw U+2028, U+0085 ... in an SSE line break clients that
    # split lines with str.splitlines(), and random-weight models emit such characters.
    # Escaped, the JSON is also one line, so an event is ``data: <json>`` and a blank line.
    return json.dumps(obj, separators=(",", ":"))


def sse_event(obj: dict) -> bytes:
    """One SSE event, encoded as sse-starlette would (it sends bytes as they are)."""
    return b"data: " + json_line(obj).encode() + b"\r\n\r\n"


SSE_DONE = b"data: [DONE]\r\n\r\n"


def usage_body(u: Usage | None) -> dict:
    """OpenAI's usage object for a stream's terminal frame's usage."""
    u = u or Usage()
    body: dict = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    if u.accepted_prediction_tokens is not None:  # a predicted output was drafted from
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": u.accepted_prediction_tokens,
            "rejected_prediction_tokens": u.rejected_prediction_tokens,
        }
    return body


class Formatter:
    """Builds chat.completion(.chunk) or text_completion bodies for one request (``index``:
    the choice a chunk or body part is of, when the request asked for ``n > 1``)."""

    def __init__(self, kind: str, rid: str, model: str, echo: str | None = None) -> None:
        self.chat = kind == "chat"
        self.echo = echo or ""  # chat's echo: the last (assistant) message, before the output
        self.rid = rid
        self.model = model
        self.created = int(time.time())
        self._text_events: dict[int, tuple[bytes, bytes]] = {}  # per choice index
        self._lp_events: dict[int, tuple[bytes, bytes, bytes]] = {}  # per choice index
        # vLLM's continuous_usage_stats: each choice's prompt and output tokens so far,
        # on every chunk (None: chunks carry "usage": null)
        self._prompt_tokens: list[int] | None = None
        self._output_tokens: list[int] = []
        # Dynamo's nvext.extra_fields: what the finish chunks and the whole body carry
        # under "nvext" (api.nvext.response_fields; None: nothing)
        self.nvext: Callable[[], dict | None] | None = None

    def continuous_usage(self, prompt_tokens: list[int]) -> None:
        """Every chunk carries its choice's usage so far (``prompt_tokens``: each choice's
        prompt), as vLLM's ``stream_options.continuous_usage_stats`` asks."""
        self._prompt_tokens = prompt_tokens
        self._output_tokens = [0] * len(prompt_tokens)

    def counted(self, index: int, frames: Iterable[TokenFrame]) -> None:
        """The output tokens of ``frames`` (of choice ``index``), for continuous usage."""
        if self._prompt_tokens is not None:
            self._output_tokens[index] += sum(len(f.token_ids) for f in frames)

    def _usage_now(self, index: int) -> dict | None:
        if self._prompt_tokens is None:
            return None
        p, o = self._prompt_tokens[index], self._output_tokens[index]
        return {"prompt_tokens": p, "completion_tokens": o, "total_tokens": p + o}

    def text_event(self, text: str, include_usage: bool, index: int = 0) -> bytes:
        """``sse_event(chunk(text_delta(text), None, include_usage, index=index))``, from a
        template: the chunks of a stream differ only in their text (this is the per-token
        path)."""
        if self._prompt_tokens is not None:  # a usage of its own on each: no template
            return sse_event(self.chunk(self.text_delta(text), None, include_usage, index=index))
        template = self._text_events.get(index)
        if template is None:
            probe = "\x00"
            body = json_line(self.chunk(self.text_delta(probe), None, include_usage,
                                        index=index))  # fmt: skip
            before, after = body.split(json_line(probe))
            template = b"data: " + before.encode(), after.encode() + b"\r\n\r\n"
            self._text_events[index] = template
        head, tail = template
        return head + json_line(text).encode() + tail

    def logprobs_event(self, text: str, logprobs: str, include_usage: bool,
                       index: int = 0) -> bytes:  # fmt: skip
        """:meth:`text_event` with the chunk's ``logprobs`` (JSON text,
        :class:`api.logprobs.LogprobsRenderer`) in place of ``null``, from a template."""
        if self._prompt_tokens is not None:  # a usage of its own on each: no template
            return sse_event(self.chunk(self.text_delta(text), None, include_usage, index=index,
                                        logprobs=json.loads(logprobs)))  # fmt: skip
        template = self._lp_events.get(index)
        if template is None:
            body = json_line(self.chunk(self.text_delta("\x00"), None, include_usage,
                                        index=index, logprobs="\x01"))  # fmt: skip
            before, rest = body.split(json_line("\x00"))
            between, after = rest.split(json_line("\x01"))
            template = (b"data: " + before.encode(), between.encode(),
                        after.encode() + b"\r\n\r\n")  # fmt: skip
            self._lp_events[index] = template
        head, mid, tail = template
        return head + json_line(text).encode() + mid + logprobs.encode() + tail

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def role_delta(self) -> dict:
        return {"role": "assistant", "content": self.echo}

    def text_delta(self, text: str) -> dict:
        return {"content": text} if self.chat else {"text": text}

    def empty_delta(self) -> dict:
        return {} if self.chat else {"text": ""}

    def chunk(
        self,
        delta: dict,
        finish_reason: str | None,
        include_usage: bool,
        stop_reason: str | int | None = None,
        index: int = 0,
        logprobs: object = None,
    ) -> dict:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}  # fmt: skip
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": delta["text"], "logprobs": logprobs,
                      "finish_reason": finish_reason}  # fmt: skip
            body = self._head("text_completion")
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = self._usage_now(index)
        if finish_reason is not None:
            self._with_nvext(body)
        return body

    def _with_nvext(self, body: dict) -> None:
        if self.nvext is not None and (ext := self.nvext()):
            body["nvext"] = ext

    def usage_chunk(self, usage: dict) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage
        return body

    def full(
        self, text: str, finish_reason: str | None, stop_reason: str | int | None, usage: dict,
        message: dict | None = None, logprobs: dict | None = None,
        prompt_logprobs: list | None = None,
    ) -> dict:  # fmt: skip
        """A whole response of one choice. ``message``: the chat message when it is more
        than the text (tool calls); ``prompt_logprobs`` (vLLM's) where vLLM puts them: on
        the body in chat, on the choice in completions (only when asked for)."""
        choice = self.choice(0, text, finish_reason, stop_reason, message, logprobs,
                             prompt_logprobs)  # fmt: skip
        return self.whole([choice], usage, prompt_logprobs)

    def choice(
        self, index: int, text: str, finish_reason: str | None, stop_reason: str | int | None,
        message: dict | None = None, logprobs: dict | None = None,
        prompt_logprobs: list | None = None,
    ) -> dict:  # fmt: skip
        """One choice of a whole (non-streamed) body (the rest as in :meth:`full`)."""
        if self.chat:
            if message is None:
                message = {"role": "assistant", "content": self.echo + text}
            elif self.echo:
                message["content"] = self.echo + (message.get("content") or "")
            return {"index": index, "message": message,
                    "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}  # fmt: skip
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": finish_reason, "stop_reason": stop_reason}  # fmt: skip
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        return choice

    def whole(self, choices: list[dict], usage: dict, prompt_logprobs: list | None = None) -> dict:
        """A whole body of ``choices`` (:meth:`choice`); chat's ``prompt_logprobs`` on it."""
        body = self._head("chat.completion" if self.chat else "text_completion")
        body["choices"] = choices
        body["usage"] = usage
        if self.chat and prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        if self.chat:  # vLLM's return_token_ids: the prompt's ids once, on the body
            ids = [c.pop("prompt_token_ids", None) for c in choices]
            if ids and ids[0] is not None:
                body["prompt_token_ids"] = ids[0]
        self._with_nvext(body)
        return body
