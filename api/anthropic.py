"""Anthropic's Messages API: the request as a chat request, the output as content blocks.

A ``POST /v1/messages`` body becomes the :class:`ChatCompletionRequest` it means
(:func:`chat_request`), so it is rendered, constrained, routed and run exactly as a chat
request is (the route is :mod:`api.routes_messages`):

* ``system`` (a string or text blocks) is a system message first;
* a message's ``text`` and ``image`` blocks are its content parts (an image's base64 source
  a ``data:`` URL); an assistant's ``tool_use`` blocks are its ``tool_calls``; a user's
  ``tool_result`` blocks are ``tool`` messages, before the rest of that turn; earlier
  ``thinking`` blocks are dropped (a model's past thinking does not go back into its
  prompt, as Anthropic's API does for earlier turns);
* a last message of the assistant's is a prefill: the answer continues it
  (``continue_final_message``), and the content returned is only what was added;
* ``tools`` (``name``, ``description``, ``input_schema``) are function tools;
  ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` are chat's ``auto`` /
  ``required`` / a named function / ``none``, ``disable_parallel_tool_use`` is
  ``parallel_tool_calls: false``;
* ``thinking`` reaches the chat template as ``enable_thinking`` (Qwen3's switch: off for
  ``disabled``), and an ``enabled`` one's ``budget_tokens`` is chat's
  ``thinking_token_budget`` where the deployment has reasoning markers (without them the
  budget has nothing to count and is left unenforced); ``output_config.format`` (or the
  older ``output_format``), a JSON schema, is ``response_format``;
  ``output_config.effort`` is ``reasoning_effort``;
* ``stop_sequences`` are ``stop``, ``metadata.user_id`` is ``user``; ``temperature``,
  ``top_p`` and ``top_k``, which older clients still send, are taken as they are.

``max_tokens`` beyond the context window's room runs to the window's end, which stops
with ``model_context_window_exceeded`` (as Anthropic's API does), not a 400.

The output goes through the same parser a chat request's does (tool calls; a reasoning
model's thinking, ``CONVEYOR_REASONING_PARSER``); :class:`ContentBlocks` turns its events
into ``thinking``, ``text`` and ``tool_use`` blocks and, streamed, into the Messages
stream's ``content_block_*`` events. A whole message is the same builder fed the whole
text, so both give the same blocks.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.errors import bad_request
from api.protocol import ChatCompletionRequest
from api.tool_parsers import CallArgs, CallStart, Event, Reasoning, Text
from kvbm.protocol import TokenFrame, Usage

log = logging.getLogger(__name__)

# Anthropic's stop reasons, by what ended the output
END_TURN, MAX_TOKENS, STOP_SEQUENCE = "end_turn", "max_tokens", "stop_sequence"
TOOL_USE, WINDOW_FULL = "tool_use", "model_context_window_exceeded"
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": named


class MessagesBody(BaseModel):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the prompt."""

    model_config = ConfigDict(extra="ignore")  # betas' fields Conveyor has no use for

    model: str = Field(min_length=1)
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    chat_template_kwargs: dict | None = None  # vLLM's, as in chat


class MessagesRequest(MessagesBody):
    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    metadata: dict | None = None
    output_config: dict | None = None
    output_format: dict | None = None  # the structured-outputs beta's name for the format
    # vLLM's extensions, as in chat
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    cache_salt: str | None = Field(None, min_length=1, max_length=1000)
    worker_id: str | None = Field(None, min_length=1, max_length=200)
    structured_outputs: dict | None = None


def chat_request(req: MessagesBody) -> ChatCompletionRequest:
    """The chat request a Messages request means; a 400 naming the field it cannot take."""
    messages: list[dict] = []
    if req.system:
        messages.append({"role": "system", "content": _system(req.system)})
    for i, msg in enumerate(req.messages):
        messages += _messages(msg, f"messages.{i}")
    prefill = req.messages[-1].get("role") == "assistant"
    kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:
        kwargs.setdefault("enable_thinking", _thinking(req.thinking))
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
        "chat_template_kwargs": kwargs or None,
    }
    if isinstance(req, MessagesRequest):
        body |= {
            "max_tokens": req.max_tokens,
            "stop": req.stop_sequences or None,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "user": _user(req.metadata),
            "response_format": _output_format(req),
            "reasoning_effort": _effort(req.output_config),
            "seed": req.seed,
            "min_p": req.min_p,
            "repetition_penalty": req.repetition_penalty,
            "priority": req.priority,
            "cache_salt": req.cache_salt,
            "worker_id": req.worker_id,
            "structured_outputs": req.structured_outputs,
            "thinking_token_budget": _budget(req.thinking),
        }
    if req.tools:
        body["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"], parallel = _tool_choice(req.tool_choice, body.get("tools"))
        body["parallel_tool_calls"] = parallel
    try:
        return ChatCompletionRequest(**body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise bad_request(f"messages: {err['msg']} ({loc})", "messages") from None


def _system(system: str | list[dict]) -> str:
    return _text_blocks(system, "system", "system blocks must be text blocks")


def _text_blocks(value: str | list, param: str, refusal: str, code: str | None = None) -> str:
    """A string as it is, or text blocks' texts joined by newlines; any other block is a
    400 (``refusal``, ``code``) naming its type."""
    if isinstance(value, str):
        return value
    texts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad_request(refusal, f"{param}.{i}.type", code)
        texts.append(_text(block, f"{param}.{i}"))
    return "\n".join(texts)


def _messages(msg: dict, param: str) -> list[dict]:
    """One Messages-API message as chat messages: a user turn's tool results are ``tool``
    messages, before the rest of it."""
    role = msg.get("role")
    if role not in ("user", "assistant"):
        raise bad_request("role must be 'user' or 'assistant' (the system prompt is the "
                          "top-level `system`)", f"{param}.role")  # fmt: skip
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of content blocks",
                          f"{param}.content")  # fmt: skip
    parts: list[dict] = []
    calls: list[dict] = []
    results: list[dict] = []
    shown: list[dict] = []  # the tool results' images: the user's turn shows them
    for j, block in enumerate(content):
        where = f"{param}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, where)})
        elif kind == "image":
            parts.append(_image_part(block, where))
        elif kind == "document" and role == "user":  # a paragraph of its own
            parts.append({"type": "text", "text": _document(block, where) + "\n\n"})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(block, where))
        elif kind == "tool_result" and role == "user":
            result, images = _result(block, where)
            results.append(result)
            shown += images
        else:
            raise bad_request(f"content block type {kind!r} is not supported in a {role} "
                              "message", f"{where}.type", "unsupported_parameter")  # fmt: skip
    out = results
    parts = shown + parts
    if parts or calls or not results:
        chat: dict[str, Any] = {"role": role, "content": _content(parts)}
        if calls:
            chat["tool_calls"] = calls
        out = [*results, chat]
    return out


def _content(parts: list[dict]) -> str | list[dict] | None:
    """Text parts alone as one string (what every chat template takes); with images, the
    parts."""
    if any(p["type"] != "text" for p in parts):
        return parts
    return "".join(p["text"] for p in parts) if parts else None


def _text(block: dict, param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request("a text block needs `text`, a string", f"{param}.text")
    return text


def _image_part(block: dict, param: str) -> dict:
    return {"type": "image_url", "image_url": {"url": _image_url(block, param)}}


def _document(block: dict, param: str) -> str:
    """A ``document`` block's text, after its ``title`` and ``context`` (each a paragraph
    of its own): plain-text and content sources; PDFs are not read here (400)."""
    if (block.get("citations") or {}).get("enabled"):
        raise bad_request("citations are not supported", f"{param}.citations",
                          "unsupported_parameter")  # fmt: skip
    src = block.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "text" and isinstance(src.get("data"), str):  # type: ignore[union-attr]
        text = src["data"]  # type: ignore[index]
    elif kind == "content":
        inner = src.get("content")  # type: ignore[union-attr]
        if not isinstance(inner, str | list):
            raise bad_request("a content source needs content: a string or text blocks",
                              f"{param}.source.content")  # fmt: skip
        text = _text_blocks(inner, f"{param}.source.content",
                            "a content source may hold text blocks only",
                            "unsupported_parameter")  # fmt: skip
    else:
        raise bad_request("a document source must be plain text ({'type': 'text', "
                          "'media_type': 'text/plain', 'data'}) or content ({'type': "
                          "'content', 'content'}); PDF documents are not supported",
                          f"{param}.source", "unsupported_parameter")  # fmt: skip
    head = [v for v in (block.get("title"), block.get("context")) if isinstance(v, str) and v]
    return "\n\n".join([*head, text])


def _image_url(block: dict, param: str) -> str:
    src = block.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64":
        media, data = src.get("media_type"), src.get("data")  # type: ignore[union-attr]
        if not isinstance(media, str) or not isinstance(data, str):
            raise bad_request("a base64 image source needs media_type and data",
                              f"{param}.source")  # fmt: skip
        return f"data:{media};base64,{data}"
    if kind == "url" and isinstance(src.get("url"), str):  # type: ignore[union-attr]
        return src["url"]  # type: ignore[index]
    raise bad_request("an image source must be {'type': 'base64', 'media_type', 'data'} or "
                      "{'type': 'url', 'url'}", f"{param}.source")  # fmt: skip


def _call(block: dict, param: str) -> dict:
    name, cid, args = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not name or not isinstance(cid, str) or not cid:
        raise bad_request("a tool_use block needs id and name", param)
    if not isinstance(args, dict):
        raise bad_request("a tool_use block's input must be an object", f"{param}.input")
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}  # fmt: skip


def _result(block: dict, param: str) -> tuple[dict, list[dict]]:
    """A ``tool_result`` as a ``tool`` message (its text) and its images' parts, which the
    user's turn shows (a tool message holds text only in chat templates; vLLM does the
    same)."""
    cid = block.get("tool_use_id")
    if not isinstance(cid, str) or not cid:
        raise bad_request("a tool_result block needs tool_use_id", f"{param}.tool_use_id")
    content = block.get("content", "")
    images: list[dict] = []
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(_text(part, f"{param}.content.{k}"))
            elif kind == "image":
                images.append(_image_part(part, f"{param}.content.{k}"))
            elif kind == "document":
                texts.append(_document(part, f"{param}.content.{k}"))
            else:
                raise bad_request("a tool_result's content may hold text, image and document "
                                  "blocks", f"{param}.content.{k}.type",
                                  "unsupported_parameter")  # fmt: skip
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise bad_request("a tool_result's content must be a string or content blocks",
                          f"{param}.content")  # fmt: skip
    return {"role": "tool", "tool_call_id": cid, "content": content}, images


def _tool(tool: object, param: str) -> dict:
    """An Anthropic client tool as chat's function tool (server tools are not run here)."""
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(f"tool type {kind!r} is not supported: only client tools "
                          "(name, description, input_schema) are", f"{param}.type",
                          "unsupported_parameter")  # fmt: skip
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str) or not name:
        raise bad_request("a tool needs a name", f"{param}.name")
    if not isinstance(schema, dict):
        raise bad_request("a tool needs input_schema, a JSON Schema object",
                          f"{param}.input_schema")  # fmt: skip
    fn: dict[str, Any] = {"name": name, "parameters": schema}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict, tools: list[dict] | None) -> tuple[str | dict, bool]:
    """Chat's tool_choice for Anthropic's, and whether calls may come in parallel."""
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind in TOOL_CHOICES:
        return TOOL_CHOICES[kind], parallel
    if kind == "tool":
        name = choice.get("name")
        names = [t["function"]["name"] for t in tools or []]
        if not isinstance(name, str) or name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not in `tools`",
                              "tool_choice.name")  # fmt: skip
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad_request("tool_choice.type must be 'auto', 'any', 'tool' or 'none'",
                      "tool_choice.type")  # fmt: skip


def _thinking(thinking: dict) -> bool:
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise bad_request("thinking.type must be 'enabled', 'adaptive', 'between_tools' or "
                          "'disabled'", "thinking.type")  # fmt: skip
    return kind != "disabled"


def _budget(thinking: dict | None) -> int | None:
    """``thinking.budget_tokens`` of an ``enabled`` thinking: chat's (vLLM's)
    ``thinking_token_budget``, as vLLM maps it."""
    if not thinking or thinking.get("type") != "enabled" or "budget_tokens" not in thinking:
        return None
    budget = thinking["budget_tokens"]
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise bad_request("thinking.budget_tokens must be a non-negative integer",
                          "thinking.budget_tokens")  # fmt: skip
    return budget


# Anthropic's effort levels as the reasoning_effort a chat template reads
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def _effort(config: dict | None) -> str | None:
    effort = (config or {}).get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise bad_request(f"output_config.effort must be one of {', '.join(EFFORTS)}",
                          "output_config.effort")  # fmt: skip
    return EFFORTS[effort]


def _user(metadata: dict | None) -> str | None:
    user = (metadata or {}).get("user_id")
    return user if isinstance(user, str) else None


def _output_format(req: MessagesRequest) -> dict | None:
    """Anthropic's structured output (``output_config.format``, or the beta's
    ``output_format``: ``{"type": "json_schema", "schema"}``) as chat's ``response_format``."""
    fmt, param = (req.output_config or {}).get("format"), "output_config.format"
    if fmt is None:
        fmt, param = req.output_format, "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):  # fmt: skip
        raise bad_request(f"{param} must be {{'type': 'json_schema', 'schema': {{...}}}}", param)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# --------------------------------------------------------------------------------------
def usage_body(usage: Usage | None, prompt_tokens: int = 0) -> dict:
    """Anthropic's usage: ``input_tokens`` are those not read from the prefix cache
    (``cache_read_input_tokens``), as Anthropic counts them. ``prompt_tokens``: the
    prompt's length, before the request's usage is known."""
    if usage is None:
        return {"input_tokens": prompt_tokens, "output_tokens": 0,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}  # fmt: skip
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def stop_of(last: TokenFrame, req: MessagesRequest, calls: int) -> tuple[str, str | None]:
    """The message's ``stop_reason`` and ``stop_sequence`` from its terminal frame: a
    length stop short of ``max_tokens`` is the context window's end."""
    if last.finish_reason == "length":
        if last.usage is not None and last.usage.completion_tokens < req.max_tokens:
            return WINDOW_FULL, None
        return MAX_TOKENS, None
    if calls:
        return TOOL_USE, None
    if isinstance(last.stop_reason, str) and last.stop_reason in (req.stop_sequences or []):
        return STOP_SEQUENCE, last.stop_reason
    return END_TURN, None


class ContentBlocks:
    """A message's content blocks, built from its parser's events (or plain text):
    :meth:`events` gives the stream's ``content_block_*`` events for a batch of them,
    :attr:`content` the blocks. Thinking is a ``thinking`` block, text a ``text`` block,
    each call a ``tool_use`` block (its ``input`` the parsed arguments once it closes);
    a block closes when one of another kind opens."""

    def __init__(self) -> None:
        self.content: list[dict] = []
        self._open = False  # the last block is still open (deltas go to it)
        self._calls: dict[int, int] = {}  # the parser's call index -> its block's index
        self._args: dict[int, str] = {}  # a tool_use block's index -> its argument text

    @property
    def calls(self) -> int:
        return len(self._calls)

    def events(self, parsed: list[Event]) -> list[dict]:
        out: list[dict] = []
        for ev in parsed:
            if isinstance(ev, Reasoning | Text):
                if not ev.text:
                    continue
                kind = "thinking" if isinstance(ev, Reasoning) else "text"
                if not (self._open and self.content[-1]["type"] == kind):
                    block: dict[str, Any] = {"type": kind, kind: ""}
                    if kind == "thinking":
                        block["signature"] = ""  # nothing signs a local model's thinking
                    self._start(out, block)
                self.content[-1][kind] += ev.text
                out.append(_event("content_block_delta", index=len(self.content) - 1,
                                  delta={"type": f"{kind}_delta", kind: ev.text}))  # fmt: skip
            elif isinstance(ev, CallStart):
                self._start(out, {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
                self._calls[ev.index] = len(self.content) - 1
                self._args[len(self.content) - 1] = ""
            elif isinstance(ev, CallArgs):
                index = self._calls[ev.index]
                self._args[index] += ev.text
                delta = {"type": "input_json_delta", "partial_json": ev.text}
                out.append(_event("content_block_delta", index=index, delta=delta))
        return out

    def finish(self) -> list[dict]:
        """Close the open block."""
        out: list[dict] = []
        self._close(out)
        return out

    def _start(self, out: list[dict], block: dict) -> None:
        self._close(out)
        self.content.append(block)
        self._open = True
        out.append(_event("content_block_start", index=len(self.content) - 1,
                          content_block=dict(block)))  # fmt: skip

    def _close(self, out: list[dict]) -> None:
        if not self._open:
            return
        self._open = False
        index, block = len(self.content) - 1, self.content[-1]
        if block["type"] == "tool_use":
            block["input"] = _arguments(self._args[index], block["name"])
        out.append(_event("content_block_stop", index=index))


def _arguments(text: str, name: str) -> dict:
    """A call's argument text as the object ``tool_use.input`` must be; ``{}`` for text
    that is not one (an output cut off inside the call: the stream's deltas still carry
    what there was)."""
    try:
        args = json.loads(text) if text else {}
    except ValueError:
        args = None
    if not isinstance(args, dict):
        log.warning("tool %r: its arguments are not a JSON object; input left empty", name)
        return {}
    return args


def rfc3339(ts: int | None) -> str | None:
    """A Unix time as the RFC 3339 UTC time Anthropic's objects carry (``...Z``)."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def cursor_page(ids: list[str], limit: int, after_id: str | None,
                before_id: str | None) -> tuple[list[str], bool]:  # fmt: skip
    """Anthropic's cursor paging over ``ids`` (in listing order): the page after
    ``after_id``, or the last ``limit`` before ``before_id``, and whether more lie beyond
    it; a 400 for a cursor not in ``ids``."""
    for name, cursor in (("after_id", after_id), ("before_id", before_id)):
        if cursor is not None and cursor not in ids:
            raise bad_request(f"{name} {cursor!r} names nothing listed", name)
    lo = ids.index(after_id) + 1 if after_id is not None else 0
    hi = ids.index(before_id) if before_id is not None else len(ids)
    window = ids[lo:hi]
    page = window[-limit:] if before_id is not None and after_id is None else window[:limit]
    return page, len(window) > len(page)


def page_body(items: list[dict], has_more: bool) -> dict:
    """A page of Anthropic's list endpoints."""
    return {"data": items, "has_more": has_more,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None}  # fmt: skip


def _event(kind: str, **fields: object) -> dict:
    return {"type": kind, **fields}


def message_body(msg_id: str, model: str, content: list[dict], stop: tuple[str | None,
                 str | None], usage: dict) -> dict:  # fmt: skip
    """A Message object."""
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }
