"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the
whole pipeline, with the official anthropic client against the session cluster (real
workers, real HTTP).

Prompts are checked against Hugging Face's apply_chat_template of the chat messages they
mean, and outputs against HF's greedy generate on the same checkpoint (or, for images,
against /v1/chat/completions on the same input); forced tool calls against their tools'
``input_schema`` with jsonschema, streamed and not."""

from __future__ import annotations

import base64
import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.integration import test_tools_api
from tests.integration.conftest import Cluster
from tests.integration.test_openai_api import hf_greedy
from tests.integration.test_tools_api import HISTORY, TOOLS, template_ids
from tests.media_server import encode, picture

pytestmark = pytest.mark.integration
hf = test_tools_api.hf  # the checkpoint in HF's classes, a module fixture

# the tools of test_tools_api, as Anthropic's client sends them
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
SCHEMAS = {t["name"]: t["input_schema"] for t in A_TOOLS}
# test_tools_api's HISTORY, as Anthropic's messages
A_HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "call_1", "name": "get_weather",
         "input": {"city": "Oslo", "unit": "celsius"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "call_1", "content": "4 degrees, rain"}]},
]  # fmt: skip


def client(cluster: Cluster, **kw: object) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0, **kw)  # type: ignore[arg-type]


def greedy(hf: tuple, ids: list[int], n: int) -> str:
    return hf[0].decode(hf_greedy(hf, ids, n), skip_special_tokens=True)


def blocks(msg: anthropic.types.Message) -> list[dict]:
    """A message's content but for the calls' ids (random per request)."""
    return [b.model_dump(exclude={"id"}) for b in msg.content]


def streamed(c: anthropic.Anthropic, **kw: object) -> tuple[list[str], anthropic.types.Message]:
    """The raw event types of a streamed message, and the message the client's own
    accumulator makes of them."""
    with c.messages.stream(**kw) as s:  # type: ignore[arg-type]
        types = [e.type for e in s]
        return types, s.get_final_message()


def test_text_streamed_and_not(cluster: Cluster, hf: tuple) -> None:
    """A system prompt and a user turn render as HF renders the chat; the text is HF's
    greedy text, whole and streamed; usage and count_tokens count the same prompt."""
    c = client(cluster)
    kw = dict(model=cluster.model_name, max_tokens=10, system="Be brief.",
              messages=[{"role": "user", "content": "Hello, world!"}],
              extra_body={"temperature": 0})  # fmt: skip
    ids = template_ids(hf, [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hello, world!"}], None)  # fmt: skip
    expected = greedy(hf, ids, 10)
    msg = c.messages.create(**kw)  # type: ignore[call-overload]
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == expected  # type: ignore[union-attr]
    assert (msg.stop_reason, msg.stop_sequence, msg.model) == ("max_tokens", None,
                                                               cluster.model_name)  # fmt: skip
    u = msg.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == len(ids) and u.output_tokens == 10
    types, final = streamed(c, **kw)
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types.count("content_block_start") == types.count("content_block_stop") == 1
    assert final.content[0].text == expected and final.stop_reason == "max_tokens"  # type: ignore[union-attr]
    # the second run of the same prompt reads it from the prefix cache, as Anthropic counts
    assert final.usage.output_tokens == 10 and final.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(ids)
    count = c.messages.count_tokens(model=cluster.model_name, system="Be brief.",
                                    messages=kw["messages"])  # type: ignore[arg-type]  # fmt: skip
    assert count.input_tokens == len(ids)


def test_tool_history_renders_as_chat_does(cluster: Cluster, hf: tuple) -> None:
    """tool_use and tool_result blocks are the chat history test_tools_api renders: the
    same template ids, the same greedy continuation."""
    c = client(cluster)
    ids = template_ids(hf, HISTORY, TOOLS)
    msg = c.messages.create(model=cluster.model_name, max_tokens=12, system="You help.",
                            tools=A_TOOLS, messages=A_HISTORY,  # type: ignore[arg-type]
                            extra_body={"temperature": 0})  # fmt: skip
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == len(ids)
    # a random-weight model writes no <tool_call>: its text is all there is
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == greedy(hf, ids, 12)  # type: ignore[union-attr]
    count = c.messages.count_tokens(model=cluster.model_name, system="You help.",
                                    tools=A_TOOLS, messages=A_HISTORY)  # type: ignore[arg-type]  # fmt: skip
    assert count.input_tokens == len(ids)


@pytest.mark.parametrize("choice", [
    {"type": "any"}, {"type": "tool", "name": "take_note"},
    {"type": "any", "disable_parallel_tool_use": True},
])  # fmt: skip
def test_forced_tool_use(cluster: Cluster, choice: dict) -> None:
    """``any`` and a named tool force calls (the grammar behind chat's ``required`` and
    named choices): tool_use blocks whose input fits the tool's schema, streamed and not
    the same, ``stop_reason: tool_use``."""
    c = client(cluster)
    kw = dict(model=cluster.model_name, max_tokens=200, tools=A_TOOLS, tool_choice=choice,
              messages=[{"role": "user", "content": "Do it."}],
              extra_body={"temperature": 0})  # fmt: skip
    msg = c.messages.create(**kw)  # type: ignore[call-overload]
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert calls and msg.stop_reason == "tool_use", msg
    for call in calls:
        jsonschema.validate(call.input, SCHEMAS[call.name])
    if choice["type"] == "tool":
        assert [b.name for b in calls] == ["take_note"]
    if choice.get("disable_parallel_tool_use"):
        assert len(calls) == 1
    types, final = streamed(c, **kw)
    assert "content_block_delta" in types
    assert blocks(final) == blocks(msg) and final.stop_reason == "tool_use"


def test_auto_reads_the_models_calls_into_blocks(cluster: Cluster) -> None:
    """``auto``, the default model's own format forced on its output (structured_outputs,
    vLLM's extension): a text block, then the call as a tool_use block."""
    c = client(cluster)
    regex = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "(Oslo|Rome)", "unit": "celsius"\}\}\n</tool_call>')  # fmt: skip
    kw = dict(model=cluster.model_name, max_tokens=300, tools=A_TOOLS,
              messages=[{"role": "user", "content": "Weather?"}],
              extra_body={"temperature": 0, "structured_outputs": {"regex": regex}})  # fmt: skip
    msg = c.messages.create(**kw)  # type: ignore[call-overload]
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[0].text == "Let me check.\n"  # type: ignore[union-attr]
    call = msg.content[1]
    assert call.name == "get_weather" and call.input["unit"] == "celsius"  # type: ignore[union-attr, index]
    assert msg.stop_reason == "tool_use"
    types, final = streamed(c, **kw)
    assert blocks(final) == blocks(msg) and final.stop_reason == "tool_use"
    assert types.count("content_block_start") == 2
    # text the parser holds back (it could open a call) comes out at the end, whole
    kw["extra_body"] = {"temperature": 0, "structured_outputs": {"regex": r"Hi <tool"}}
    msg = c.messages.create(**kw)  # type: ignore[call-overload]
    assert [(b.type, b.text) for b in msg.content] == [("text", "Hi <tool")]  # type: ignore[union-attr]
    assert msg.stop_reason == "end_turn" and blocks(streamed(c, **kw)[1]) == blocks(msg)


def test_structured_output_format(cluster: Cluster) -> None:
    """``output_config.format`` (a JSON schema) constrains the text."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "rainy": {"type": "boolean"}},
              "required": ["city", "rainy"], "additionalProperties": False}  # fmt: skip
    msg = client(cluster).messages.create(
        model=cluster.model_name, max_tokens=200, messages=[{"role": "user", "content": "?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"temperature": 0})  # fmt: skip
    jsonschema.validate(json.loads(msg.content[0].text), schema)  # type: ignore[union-attr]
    assert msg.stop_reason == "end_turn"


def test_stop_sequence_and_prefill(cluster: Cluster, hf: tuple) -> None:
    """A stop sequence out of the greedy text ends it there (``stop_sequence`` names it);
    a last assistant message is continued (HF's continue_final_message) and the content
    is only what was added."""
    c = client(cluster)
    user = [{"role": "user", "content": "Tell me."}]
    ids = template_ids(hf, user, None)
    text = greedy(hf, ids, 16)
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip())
    msg = c.messages.create(model=cluster.model_name, max_tokens=16, messages=user,  # type: ignore[arg-type]
                            stop_sequences=[stop, "never-there"],
                            extra_body={"temperature": 0})  # fmt: skip
    assert msg.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)

    prefilled = [*user, {"role": "assistant", "content": "Well,"}]
    out = hf[0].apply_chat_template(prefilled, continue_final_message=True, tokenize=True)
    pids = list(out["input_ids"] if hasattr(out, "keys") else out)
    msg = c.messages.create(model=cluster.model_name, max_tokens=8, messages=prefilled,  # type: ignore[arg-type]
                            extra_body={"temperature": 0})  # fmt: skip
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == len(pids)
    assert msg.content[0].text == greedy(hf, pids, 8)  # type: ignore[union-attr]


def test_max_tokens_past_the_window(cluster: Cluster, hf: tuple) -> None:
    """max_tokens beyond the context window runs to its end and says so
    (``model_context_window_exceeded``), as Anthropic's API does, where chat answers 400."""
    c = client(cluster)

    def ids(n: int) -> list[int]:
        return template_ids(hf, [{"role": "user", "content": " ".join(["sun"] * n)}], None)

    n = 2048 * 100 // (len(ids(100)) - len(ids(0)))
    while len(ids(n)) > 2048 - 6:  # a prompt a few tokens short of the window
        n -= 1
    prompt, words = ids(n), " ".join(["sun"] * n)
    room = 2048 - len(prompt)
    assert 0 < room < 20, room
    msg = c.messages.create(model=cluster.model_name, max_tokens=4096,
                            messages=[{"role": "user", "content": words}],
                            extra_body={"temperature": 0})  # fmt: skip
    assert msg.stop_reason == "model_context_window_exceeded"
    assert msg.usage.output_tokens == room
    assert msg.content[0].text == greedy(hf, prompt, room)  # type: ignore[union-attr]


def test_image_block_as_chat_sees_it(cluster: Cluster) -> None:
    """A base64 image block is the chat request's data-URL image: the same prompt tokens
    and the same greedy text as /v1/chat/completions."""
    png = encode(picture(seed=5), "PNG")
    data = base64.b64encode(png).decode()
    msg = client(cluster).messages.create(
        model=cluster.model_name, max_tokens=8, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data}},
            {"type": "text", "text": "What is it?"}]}])  # fmt: skip
    chat = cluster.client().chat.completions.create(
        model=cluster.model_name, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
            {"type": "text", "text": "What is it?"}]}])  # type: ignore[list-item]  # fmt: skip
    assert msg.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == (
        chat.usage.prompt_tokens)  # type: ignore[union-attr]  # fmt: skip


def test_a_text_document_is_text_of_the_turn(cluster: Cluster) -> None:
    """A plain-text document block (title first) is text of the user's turn: the same
    greedy answer as chat given that text."""
    msg = client(cluster).messages.create(
        model=cluster.model_name, max_tokens=8, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "document", "title": "Notes", "source": {
                "type": "text", "media_type": "text/plain", "data": "Buy milk."}},
            {"type": "text", "text": "Summarise."}]}])  # fmt: skip
    chat = cluster.client().chat.completions.create(
        model=cluster.model_name, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "Notes\n\nBuy milk.\n\nSummarise."}])  # fmt: skip
    assert msg.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]


def test_errors_in_anthropics_shape(cluster: Cluster) -> None:
    """Bad requests are 4xx in Anthropic's error shape, naming the field; nothing runs."""
    c = client(cluster)
    base = dict(model=cluster.model_name, max_tokens=4,
                messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    for kw, param in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "base64", "data": "JVBERi0=",
                                            "media_type": "application/pdf"}}]}]},
         "messages.0.content.0.source"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}]}]},
         "messages.0.content.0.image_url"),
    ]:  # fmt: skip
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(**{**base, **kw})  # type: ignore[call-overload]
        body = e.value.body
        assert body["type"] == "error", body  # type: ignore[index]
        assert body["error"]["type"] == "invalid_request_error", body  # type: ignore[index]
        assert body["error"]["param"] == param and body["error"]["message"], body  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as nf:
        c.messages.create(**{**base, "model": "no-such-model"})  # type: ignore[call-overload]
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    # the OpenAI paths keep OpenAI's shape
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json={**base, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
