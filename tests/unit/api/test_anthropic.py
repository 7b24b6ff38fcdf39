"""Anthropic's Messages API: the request as a chat request, the output as content blocks
and stream events (api/anthropic.py), read by the installed anthropic package's own
models and stream accumulator; errors in Anthropic's shape (api/errors.py)."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from api.anthropic import (
    ContentBlocks,
    MessagesBody,
    MessagesRequest,
    chat_request,
    cursor_page,
    message_body,
    stop_of,
    usage_body,
)
from api.errors import OpenAIError, anthropic_error_body, anthropic_path, shaped_error
from api.middleware import presented_key
from api.tool_parsers import CallArgs, CallStart, HermesParser, Reasoning, Text
from kvbm.protocol import TokenFrame, Usage

TOOL = {"name": "get_weather", "description": "Weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip


def req(**kw: object) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesRequest.model_validate({**body, **kw})


def refused(**kw: object) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        chat_request(req(**kw))
    assert e.value.status == 400
    return e.value


def test_system_blocks_and_plain_messages() -> None:
    chat = chat_request(req(system=[{"type": "text", "text": "Be brief."},
                                    {"type": "text", "text": "Be kind.", "cache_control": {}}],
                            stop_sequences=["\n\n"], metadata={"user_id": "u1"},
                            temperature=0.5, top_k=4))  # fmt: skip
    msgs = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert msgs == [{"role": "system", "content": "Be brief.\nBe kind."},
                    {"role": "user", "content": "hi"}]  # fmt: skip
    assert (chat.max_tokens, chat.stop, chat.user, chat.temperature, chat.top_k) == (
        8, ["\n\n"], "u1", 0.5, 4)  # fmt: skip
    assert chat.add_generation_prompt and not chat.continue_final_message


def test_tool_use_and_results_become_chat_turns() -> None:
    """An assistant's tool_use blocks are its tool_calls; a user turn's tool_result blocks
    are tool messages before the rest of that turn; earlier thinking is dropped."""
    chat = chat_request(req(tools=[TOOL], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "4 C"}, {"type": "text", "text": "rain"}]},
            {"type": "text", "text": "And Rome?"}]},
    ]))  # fmt: skip
    msgs = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert msgs == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "4 C\nrain", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And Rome?"},
    ]  # fmt: skip
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": TOOL["input_schema"],
        "description": "Weather"}}]  # fmt: skip


def test_documents_and_tool_result_images() -> None:
    """A plain-text or content document is text of the user's turn (title and context
    first); a tool result's images are shown in the user's turn after the tool messages,
    before the rest of it."""
    png = {"type": "base64", "media_type": "image/png", "data": "iVBO"}
    chat = chat_request(req(messages=[
        {"role": "user", "content": [
            {"type": "document", "title": "Notes", "context": "From Ann",
             "source": {"type": "text", "media_type": "text/plain", "data": "Buy milk."}},
            {"type": "document", "source": {"type": "content", "content": [
                {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}},
            {"type": "text", "text": "Summarise."}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "taken"}, {"type": "image", "source": png},
                {"type": "document", "source": {"type": "content", "content": "log"}}]},
            {"type": "text", "text": "What is in it?"}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t2", "name": "shot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t2", "content": [
                {"type": "image", "source": png}]}]},
    ]))  # fmt: skip
    msgs = [m.model_dump(exclude_none=True) for m in chat.messages]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}
    text = "Notes\n\nFrom Ann\n\nBuy milk.\n\na\nb\n\nSummarise."
    assert msgs[0] == {"role": "user", "content": text}
    assert msgs[2] == {"role": "tool", "content": "taken\nlog", "tool_call_id": "t1"}
    assert msgs[3]["role"] == "user" and [p["type"] for p in msgs[3]["content"]] == [
        "image_url", "text"]  # fmt: skip
    assert msgs[3]["content"][0]["image_url"] == image["image_url"]
    assert msgs[5:] == [{"role": "tool", "content": "", "tool_call_id": "t2"},
                        {"role": "user", "content": [image]}]  # fmt: skip


def test_images_prefill_and_choices() -> None:
    chat = chat_request(req(messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}},
            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
            {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "It is"},
    ]))  # fmt: skip
    parts = chat.messages[0].content
    assert isinstance(parts, list)
    assert [p.image_url for p in parts[:2]] == [{"url": "data:image/png;base64,AAAA"},
                                                {"url": "https://x/y.png"}]  # fmt: skip
    # a last assistant message is continued, not answered
    assert chat.continue_final_message and not chat.add_generation_prompt
    cases = [({"type": "auto"}, "auto", True), ({"type": "any"}, "required", True),
             ({"type": "none"}, "none", True),
             ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
              {"type": "function", "function": {"name": "get_weather"}}, False)]  # fmt: skip
    for choice, want, parallel in cases:
        chat = chat_request(req(tools=[TOOL], tool_choice=choice))
        assert (chat.tool_choice, chat.parallel_tool_calls) == (want, parallel)


def test_thinking_effort_and_output_format() -> None:
    assert chat_request(req(thinking={"type": "disabled"})).chat_template_kwargs == {
        "enable_thinking": False}  # fmt: skip
    on = chat_request(req(thinking={"type": "enabled", "budget_tokens": 2048}))
    assert on.chat_template_kwargs == {"enable_thinking": True}
    assert chat_request(req()).chat_template_kwargs is None  # the template's default
    assert chat_request(req(output_config={"effort": "max"})).reasoning_effort == "high"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for kw in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
               {"output_format": {"type": "json_schema", "schema": schema}}):  # fmt: skip
        fmt = chat_request(req(**kw)).response_format
        assert fmt == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


@pytest.mark.parametrize(("kw", "param"), [
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages.0.content.0.source"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "JVBE"}}]}]},
     "messages.0.content.0.source"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "citations": {
        "enabled": True}, "source": {"type": "text", "data": "x"}}]}]},
     "messages.0.content.0.citations"),
    ({"messages": [{"role": "assistant", "content": [{"type": "document", "source": {
        "type": "text", "data": "x"}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
     "messages.0.content.0.source"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                                 "content": [{"type": "image"}]}]}]},
     "messages.0.content.0.content.0.source"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                                 "content": [{"type": "search_result"}]}]}]},
     "messages.0.content.0.content.0.type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"thinking": {"type": "lots"}}, "thinking.type"),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
    ({"output_config": {"effort": "huge"}}, "output_config.effort"),
    ({"system": [{"type": "image"}]}, "system.0.type"),
])  # fmt: skip
def test_refusals_name_the_field(kw: dict, param: str) -> None:
    assert refused(**kw).param == param


def test_count_tokens_body_needs_no_max_tokens() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    body = MessagesBody.model_validate({"model": "m", "tools": [TOOL], "messages": msgs})
    chat = chat_request(body)
    assert chat.max_tokens is None and chat.tools is not None
    # what renders the prompt counts: count_tokens takes vLLM's chat_template_kwargs too
    kw = {"model": "m", "messages": msgs, "chat_template_kwargs": {"x": 1}}
    assert chat_request(MessagesBody.model_validate(kw)).chat_template_kwargs == {"x": 1}


# --------------------------------------------------------------------------------------
# The output


def stream(blocks: ContentBlocks, parsed: list, last: TokenFrame, r: MessagesRequest) -> Message:
    """Events for ``parsed`` (one event per piece) read by the anthropic package's own
    stream accumulator, from message_start to message_stop."""
    head = message_body("msg_1", "m", [], (None, None), usage_body(None, 5))
    events = [{"type": "message_start", "message": head}]
    for ev in parsed:
        events += blocks.events([ev])
    events += blocks.finish()
    reason, seq = stop_of(last, r, blocks.calls)
    events += [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                "usage": usage_body(last.usage)}, {"type": "message_stop"}]  # fmt: skip
    adapter = TypeAdapter(RawMessageStreamEvent)
    snap, bufs = None, {}
    for e in events:
        snap = accumulate_event(event=adapter.validate_python(e), current_snapshot=snap,
                                json_bufs=bufs)  # fmt: skip
    assert snap is not None
    return snap


def test_blocks_streamed_and_whole_agree() -> None:
    """Thinking, text, then two calls: the accumulated stream equals the whole message,
    which the anthropic package's Message model reads."""
    parsed = [Reasoning("let me "), Reasoning("see"), Text("Sure."), Text(" Here:"),
              CallStart(0, "call_a", "get_weather"), CallArgs(0, '{"city": '),
              CallArgs(0, '"Oslo"}'), CallStart(1, "call_b", "get_weather"),
              CallArgs(1, '{"city": "Rome"}')]  # fmt: skip
    usage = Usage(prompt_tokens=5, completion_tokens=20, cached_tokens=2)
    last = TokenFrame(9, [], done=True, finish_reason="stop", usage=usage)
    r = req()
    streamed = stream(ContentBlocks(), parsed, last, r)
    whole = ContentBlocks()
    whole.events(parsed)
    whole.finish()
    body = message_body("msg_1", "m", whole.content, stop_of(last, r, whole.calls),
                        usage_body(last.usage))  # fmt: skip
    msg = Message.model_validate(body)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert msg.content[0].thinking == "let me see"  # type: ignore[union-attr]
    assert msg.content[1].text == "Sure. Here:"  # type: ignore[union-attr]
    assert [(b.id, b.input) for b in msg.content[2:]] == [  # type: ignore[union-attr]
        ("call_a", {"city": "Oslo"}), ("call_b", {"city": "Rome"})]  # fmt: skip
    assert msg.stop_reason == "tool_use"
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens,
            msg.usage.output_tokens) == (3, 2, 20)  # fmt: skip
    assert streamed.model_dump(exclude={"usage"}) == msg.model_dump(exclude={"usage"})
    assert streamed.usage.output_tokens == 20 and streamed.usage.input_tokens == 3


def test_hermes_output_through_the_blocks() -> None:
    """The default tool parser's text: content first, then the call, fed in pieces."""
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'  # noqa: E501
    parser, blocks = HermesParser(), ContentBlocks()
    for i in range(0, len(text), 7):
        blocks.events(parser.feed(text[i : i + 7]))
    blocks.events(parser.finish())
    blocks.finish()
    assert blocks.content[0] == {"type": "text", "text": "Let me check.\n"}
    assert blocks.content[1]["name"] == "get_weather"
    assert blocks.content[1]["input"] == {"city": "Rome"}


def test_stop_reasons() -> None:
    def frame(reason: str, stop: object = None, n: int = 8) -> TokenFrame:
        return TokenFrame(1, [], done=True, finish_reason=reason, stop_reason=stop,  # type: ignore[arg-type]
                          usage=Usage(prompt_tokens=3, completion_tokens=n))  # fmt: skip

    r = req(stop_sequences=["END"])
    assert stop_of(frame("length"), r, 0) == ("max_tokens", None)
    assert stop_of(frame("length", n=5), r, 0) == ("model_context_window_exceeded", None)
    assert stop_of(frame("stop", "END"), r, 0) == ("stop_sequence", "END")
    assert stop_of(frame("stop", 2), r, 0) == ("end_turn", None)  # EOS
    assert stop_of(frame("stop"), r, 1) == ("tool_use", None)


def test_cut_off_call_keeps_an_object_input() -> None:
    blocks = ContentBlocks()
    blocks.events([CallStart(0, "c", "f"), CallArgs(0, '{"city": "Os')])
    blocks.finish()
    assert blocks.content[0]["input"] == {}


# --------------------------------------------------------------------------------------
# Errors and keys


def test_errors_in_anthropics_shape_on_its_paths() -> None:
    assert anthropic_path("/v1/messages") and anthropic_path("/v1/messages/count_tokens")
    assert not anthropic_path("/v1/chat/completions")
    body = shaped_error({"path": "/v1/messages"}, 429, "slow down", "requests", None, "rate")
    assert body == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    openai_req = {"path": "/v1/completions", "headers": [(b"authorization", b"Bearer k")]}
    assert shaped_error(openai_req, 400, "bad", "invalid_request_error", "n")["error"][
        "param"] == "n"  # fmt: skip
    # an Anthropic client's request elsewhere (its models list) gets Anthropic's shape too
    on_models = {"path": "/v1/models/x", "headers": [(b"anthropic-version", b"2023-06-01")]}
    assert shaped_error(on_models, 404, "no", "invalid_request_error")["type"] == "error"
    kinds = {s: anthropic_error_body(s, "x")["error"]["type"] for s in (400, 401, 404, 500, 503)}
    assert kinds == {400: "invalid_request_error", 401: "authentication_error",
                     404: "not_found_error", 500: "api_error", 503: "overloaded_error"}  # fmt: skip
    assert json.dumps(anthropic_error_body(400, "m", "max_tokens")["error"]["param"]) == (
        '"max_tokens"')  # fmt: skip


def test_presented_key_reads_either_header() -> None:
    def scope(*headers: tuple[bytes, bytes]) -> dict:
        return {"headers": list(headers)}

    assert presented_key(scope((b"authorization", b"Bearer k1"))) == b"k1"
    assert presented_key(scope((b"x-api-key", b"k2"))) == b"k2"
    assert presented_key(scope((b"authorization", b"Basic zz"), (b"x-api-key", b"k3"))) == b"k3"
    assert presented_key(scope((b"authorization", b"k4"))) == b""
    assert presented_key(scope()) == b""


def test_cursor_pages() -> None:
    ids = ["a", "b", "c", "d", "e"]
    assert cursor_page(ids, 2, None, None) == (["a", "b"], True)
    assert cursor_page(ids, 2, "b", None) == (["c", "d"], True)
    assert cursor_page(ids, 2, "c", None) == (["d", "e"], False)
    assert cursor_page(ids, 2, None, "d") == (["b", "c"], True)  # the last 2 before d
    assert cursor_page(ids, 5, None, "c") == (["a", "b"], False)
    assert cursor_page(ids, 5, "a", "d") == (["b", "c"], False)
    with pytest.raises(OpenAIError) as e:
        cursor_page(ids, 2, "zz", None)
    assert e.value.param == "after_id"
