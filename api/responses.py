"""OpenAI's Responses API: the request as a chat request, the output as a Response object
and as the Responses stream's events.

A ``POST /v1/responses`` body is turned into the :class:`ChatCompletionRequest` it means
(:func:`chat_request`): ``instructions`` a system message first, ``input`` messages with
``input_text`` / ``input_image`` parts, ``function_call`` items an assistant turn's
``tool_calls``, ``function_call_output`` items ``tool`` messages; function ``tools`` and
``tool_choice`` in chat's shape; ``text.format`` as ``response_format``;
``max_output_tokens`` as ``max_tokens``. From there it runs exactly as a chat request does
(prompt, sampling, tool constraint, runner). A ``previous_response_id``'s conversation
comes in as ``history``: the stored turns' input and output items, before ``input`` (and
after this request's ``instructions``: a previous response's are not carried over, as in
OpenAI's API). Storing, and ``background``, are the route's (:mod:`api.routes_responses`).

The output goes through the same tool parser a chat request's does; :class:`OutputItems`
turns its events into output items (a ``message`` with one ``output_text`` part, then
``function_call`` items) and, streamed, into the Responses events, numbered by
``sequence_number``. A non-streamed Response is the same builder fed the whole text, so
both give the same items.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.errors import bad_request
from api.protocol import ChatCompletionRequest, ChatMessage
from api.tool_parsers import CallArgs, CallStart, Event, Reasoning, Text
from kvbm.protocol import MAX_LOGPROBS, Usage

# an input item's id prefix, by its type (input_items lists every item with an id)
ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the include that adds logprobs
# OpenAI's other includables: about hosted tools Conveyor does not run, images kept as
# sent, and reasoning it returns in the clear; accepted, and they add nothing
INCLUDABLE = frozenset({
    OUTPUT_LOGPROBS, "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "file_search_call.results", "message.input_image.image_url", "reasoning.encrypted_content",
    "web_search_call.action.sources", "web_search_call.results",
})  # fmt: skip


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields ignored, as in chat

    model: str = Field(min_length=1)
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool | None = None  # None: stored (OpenAI's default) where the store is on
    metadata: dict | None = None
    user: str | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: Any = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    reasoning: dict | None = None  # {"effort", "summary"}: effort reaches the template
    # vLLM's extensions, as in chat
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    cache_salt: str | None = Field(None, min_length=1, max_length=1000)
    worker_id: str | None = Field(None, min_length=1, max_length=200)
    # vLLM's sampling extensions of the Responses API: chat's fields, passed on as they are
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: dict | None = None
    chat_template_kwargs: dict | None = None


# vLLM's sampling fields of a Responses request that chat takes under the same names
PASSED_ON = ("presence_penalty", "frequency_penalty", "logit_bias", "stop", "stop_token_ids",
             "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
             "structured_outputs", "chat_template_kwargs")  # fmt: skip


def chat_request(req: ResponsesRequest, history: list[dict] | None = None) -> ChatCompletionRequest:
    """The chat request a Responses request means, ``history`` (the items of the turns its
    ``previous_response_id`` or ``conversation`` continues) before its input; 400 naming
    the field it cannot take."""
    conversation_id(req)  # a 400 for a malformed one, or one beside previous_response_id
    for i, what in enumerate(req.include or []):
        if what not in INCLUDABLE:
            raise bad_request(f"include value {what!r} is not one of "
                              f"{', '.join(sorted(INCLUDABLE))}", f"include.{i}")  # fmt: skip
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    for i, item in enumerate(history or []):
        _add_item(messages, item, f"{_history_param(req)} (item {i})")
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            _add_item(messages, item, f"input.{i}")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _text_format(req.text),
        "seed": req.seed,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "priority": req.priority,
        "cache_salt": req.cache_salt,
        "worker_id": req.worker_id,
        "reasoning_effort": (req.reasoning or {}).get("effort"),
        **{name: getattr(req, name) for name in PASSED_ON},
    }
    if wants_logprobs(req):  # vLLM's rule: top_logprobs counts only with the include
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.tools:
        body["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    try:
        return ChatCompletionRequest(**body)
    except ValidationError as e:
        err = e.errors()[0]
        if err["loc"] and err["loc"][0] == "reasoning_effort":
            raise bad_request(f"reasoning.effort: {err['msg']}", "reasoning.effort") from None
        if err["loc"] and err["loc"][0] in PASSED_ON:  # named as the request names it
            loc = ".".join(str(p) for p in err["loc"])
            raise bad_request(f"{loc}: {err['msg']}", loc) from None
        loc = ".".join(str(p) for p in err["loc"])
        raise bad_request(f"input: {err['msg']} ({loc})", "input") from None


# --------------------------------------------------------------------------------------
class OutputItems:
    """A response's output items, built from its tool parser's events (or plain text):
    :meth:`events` gives the stream events for a batch of them, :meth:`items` the output.

    A reasoning model's thinking is a ``reasoning`` item first (api.reasoning). One
    ``message`` item holds the content (it opens at the first text; an output with
    nothing else still has one, empty); each call is a ``function_call`` item after it.
    Items close in order: a call's start closes the message. Item ids are the response's
    (``id_base``) and their place: the same frames give the same events, so a background
    response's stream can be read again from its frame log."""

    def __init__(self, id_base: str | None = None) -> None:
        self._id_base = id_base if id_base is not None else secrets.token_hex(8)
        self.output: list[dict] = []
        self._open: dict | None = None  # the item still streaming
        self._calls: dict[int, dict] = {}  # call index -> its item
        self.seq = 0
        # the logprob entries of tokens fed whose text has not come out yet (the output
        # text's next delta carries them; a reasoning or call event drops them: those
        # tokens were not output text)
        self.pending: list[dict] = []

    def events(self, parsed: list[Event]) -> list[dict]:
        out: list[dict] = []
        for ev in parsed:
            if not isinstance(ev, Text):
                self.pending = []
            if isinstance(ev, Reasoning):
                item = self._reasoning(out)
                item["content"][0]["text"] += ev.text
                out.append(self._part_event("response.reasoning_text.delta", item,
                                            delta=ev.text))  # fmt: skip
            elif isinstance(ev, Text):
                if not ev.text:
                    continue
                msg = self._message(out)
                lps, self.pending = self.pending, []
                msg["content"][0]["text"] += ev.text
                msg["content"][0]["logprobs"] += lps
                out.append(self._part_event("response.output_text.delta", msg, delta=ev.text,
                                            logprobs=lps))  # fmt: skip
            elif isinstance(ev, CallStart):
                self._close(out)
                item = {
                    "id": f"fc_{self._id_base}_{len(self.output)}",
                    "type": "function_call",
                    "status": "in_progress",
                    "call_id": ev.id,
                    "name": ev.name,
                    "arguments": "",
                }
                self._calls[ev.index] = item
                self.output.append(item)
                self._open = item
                out.append(
                    self._event(
                        "response.output_item.added",
                        output_index=len(self.output) - 1,
                        item=dict(item),
                    )
                )
            elif isinstance(ev, CallArgs):
                item = self._calls[ev.index]
                item["arguments"] += ev.text
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self.output.index(item),
                        delta=ev.text,
                    )
                )
        return out

    def finish(self, status: str) -> list[dict]:
        """Close what is open (an output with no item gets its empty message)."""
        out: list[dict] = []
        if not self.output:
            self._message(out)
        self._close(out, status)
        return out

    def _reasoning(self, out: list[dict]) -> dict:
        """The open reasoning item (a reasoning model's thinking), opened if need be."""
        if self._open is not None and self._open["type"] == "reasoning":
            return self._open
        self._close(out)
        item: dict[str, Any] = {"id": f"rs_{self._id_base}_{len(self.output)}",
                                "type": "reasoning", "status": "in_progress", "summary": [],
                                "content": []}  # fmt: skip
        self.output.append(item)
        self._open = item
        out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                               item=_copy(item)))  # fmt: skip
        part = {"type": "reasoning_text", "text": ""}
        item["content"].append(part)
        out.append(self._part_event("response.content_part.added", item, part=dict(part)))
        return item

    def _message(self, out: list[dict]) -> dict:
        if self._open is not None and self._open["type"] == "message":
            return self._open
        self._close(out)
        msg: dict[str, Any] = {
            "id": f"msg_{self._id_base}_{len(self.output)}",
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.output.append(msg)
        self._open = msg
        index = len(self.output) - 1
        out.append(self._event("response.output_item.added", output_index=index, item=_copy(msg)))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        msg["content"].append(part)
        out.append(self._part_event("response.content_part.added", msg, part=_part_copy(part)))
        return msg

    def _close(self, out: list[dict], status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = self.output.index(item)
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self._part_event("response.output_text.done", item, text=part["text"],
                                        logprobs=list(part["logprobs"])))  # fmt: skip
            out.append(self._part_event("response.content_part.done", item, part=_part_copy(part)))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self._part_event("response.reasoning_text.done", item, text=part["text"]))
            out.append(self._part_event("response.content_part.done", item, part=dict(part)))
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))

    def _part_event(self, kind: str, msg: dict, **fields: object) -> dict:
        """An event about a message's (or a reasoning item's) only text part."""
        return self._event(kind, item_id=msg["id"], output_index=self.output.index(msg),
                           content_index=0, **fields)  # fmt: skip

    def _event(self, kind: str, **fields: object) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def event(self, kind: str, **fields: object) -> dict:
        """A lifecycle event (``response.created``, ``response.completed``, ``error``...)
        numbered after the others."""
        return self._event(kind, **fields)


def response_body(
    req: ResponsesRequest,
    rid: str,
    created: int,
    model: str,
    output: list[dict],
    status: str,
    usage: Usage | None,
    stored: bool = False,
) -> dict:
    """The Response object (``status``: in_progress, completed, incomplete or failed;
    ``stored``: whether the store keeps it)."""
    u = usage or Usage()
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": None
        if req.reasoning is None
        else {"effort": req.reasoning.get("effort"), "summary": req.reasoning.get("summary")},
        "store": stored,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "top_logprobs": req.top_logprobs or 0,
        "usage": None
        if usage is None
        else {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        },
        "user": req.user,
        "metadata": req.metadata or {},
        "background": bool(req.background),
        "conversation": {"id": cid} if (cid := conversation_id(req)) else None,
    }


def created_now() -> int:
    return int(time.time())


def input_items(req: ResponsesRequest, response_id: str) -> list[dict]:
    """The request's ``input`` as items, each with an id (a string input is one user
    message), as a stored turn keeps them and ``input_items`` lists them. A made id is
    ``<prefix>_<response>_in<i>``, apart from the output items' ``<prefix>_<response>_<i>``
    (a conversation holds both)."""
    if isinstance(req.input, str):
        text = [{"type": "input_text", "text": req.input}]
        raw: list[dict] = [{"type": "message", "role": "user", "content": text}]
    else:
        raw = [dict(item) for item in req.input]
    tag = response_id.removeprefix("resp_")
    for i, item in enumerate(raw):
        kind = item.get("type", "message" if "role" in item else "item")
        item.setdefault("type", kind)
        if not item.get("id"):
            item["id"] = f"{ITEM_ID_PREFIX.get(kind, 'item')}_{tag}_in{i}"
    return raw


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether the output text carries its tokens' logprobs (the include asks for them)."""
    return OUTPUT_LOGPROBS in (req.include or ())


def conversation_id(req: ResponsesRequest) -> str | None:
    """The conversation a request belongs to (``conversation``: its id, or ``{"id": ...}``);
    400 for anything else."""
    conv = req.conversation
    if conv is None:
        return None
    cid = conv.get("id") if isinstance(conv, dict) else conv
    if not isinstance(cid, str) or not cid:
        raise bad_request('conversation must be a conversation id or {"id": ...}',
                          "conversation")  # fmt: skip
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id and conversation cannot be used together",
                          "conversation")  # fmt: skip
    return cid


def _history_param(req: ResponsesRequest) -> str:
    return "conversation" if req.conversation is not None else "previous_response_id"


def stored_item(item: object, param: str) -> dict:
    """An item a client adds to a conversation, checked as a Responses input item would be
    (a 400 naming ``param``), with its ``type`` and an ``id`` (its own, else a new one), as
    :func:`conversation_item` keeps it."""
    if not isinstance(item, dict):
        raise bad_request("an item must be an object", param)
    out = dict(item)
    kind = out.setdefault("type", "message" if "role" in out else None)
    _add_item([], out, param)  # a 400 for what a conversation could not render
    if not out.get("id"):
        out["id"] = f"{ITEM_ID_PREFIX.get(str(kind), 'item')}_{secrets.token_hex(24)}"
    return conversation_item(out)


def conversation_item(item: dict) -> dict:
    """An item (with its type and id) as a conversation keeps it: listed as input_items
    lists it (:func:`listed_item`), with a ``status``."""
    out = listed_item(item)
    if out.get("type") in ITEM_ID_PREFIX:
        out = {**out, "status": out.get("status", "completed")}
    return out


def listed_item(item: dict) -> dict:
    """An input item as OpenAI lists it: a message's string content as one text part
    (``output_text`` for the assistant's, else ``input_text``)."""
    if item.get("type") == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        return item | {"content": [{"type": part, "text": item["content"]}]}
    return item


# --------------------------------------------------------------------------------------
def _add_item(messages: list[dict], item: dict, param: str) -> None:
    """One ``input`` item into chat messages (a function call joins the assistant turn
    just before it, or opens one)."""
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        content = item.get("content")
        if isinstance(content, list):
            content = [_part(p, f"{param}.content.{j}") for j, p in enumerate(content)]
        messages.append({"role": role, "content": content})
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        out = item.get("output", "")
        if isinstance(out, list):
            out = "".join(p.get("text", "") for p in out if isinstance(p, dict))
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": out})
    elif kind == "reasoning":
        return  # a reasoning model's notes: this API produces none, and renders none
    else:
        raise bad_request(
            f"input item type {kind!r} is not supported (message, function_call, "
            "function_call_output)",
            f"{param}.type",
            "unsupported_parameter",
        )
    try:
        ChatMessage(**messages[-1])
    except ValidationError as e:
        raise bad_request(f"input item: {e.errors()[0]['msg']}", param) from None


def _part(part: object, param: str) -> dict:
    if not isinstance(part, dict):
        raise bad_request("a content part must be an object", param)
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise bad_request(
                "input_image needs image_url (file_id is not supported)",
                f"{param}.image_url",
                "unsupported_parameter",
            )
        spec = {"url": url}
        if part.get("detail") is not None:
            spec["detail"] = part["detail"]
        return {"type": "image_url", "image_url": spec}
    raise bad_request(
        f"content part type {kind!r} is not supported (input_text, input_image)",
        f"{param}.type",
        "unsupported_content",
    )


def _tool(tool: dict, param: str) -> dict:
    if tool.get("type") != "function":
        raise bad_request(
            f"tool type {tool.get('type')!r} is not supported (function tools only)",
            f"{param}.type",
            "unsupported_parameter",
        )
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, dict):
        if choice.get("type") == "function":
            return {"type": "function", "function": {"name": choice.get("name")}}
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "name": ...}',
            "tool_choice",
        )
    return choice


def _text_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request(
                "text.format.schema must be a JSON Schema object", "text.format.schema"
            )
        return {
            "type": "json_schema",
            "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt
            },
        }
    raise bad_request(
        f"text.format type {kind!r} is not one of text, json_object, json_schema",
        "text.format.type",
    )


def _copy(item: dict) -> dict:
    out = dict(item)
    if "content" in out:
        out["content"] = [_part_copy(p) for p in out["content"]]
    return out


def _part_copy(part: dict) -> dict:
    """A content part as an event shows it then (its logprobs list grows later)."""
    out = dict(part)
    if "logprobs" in out:
        out["logprobs"] = list(out["logprobs"])
    return out
