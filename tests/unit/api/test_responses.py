"""The Responses API's request as a chat request, and its output as a Response object and
as stream events (api/responses.py), read by the installed openai package's own models and
stream accumulator."""

from __future__ import annotations

import json

import pytest
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from api.errors import OpenAIError
from api.responses import (
    OutputItems,
    ResponsesRequest,
    chat_request,
    input_items,
    response_body,
)
from api.tool_parsers import CallStart, HermesParser, NamedParser, Text
from kvbm.protocol import Usage

FN = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": True,
}


def test_input_items_become_chat_messages() -> None:
    req = ResponsesRequest(
        model="m",
        instructions="Be brief.",
        max_output_tokens=7,
        temperature=0.5,
        text={
            "format": {
                "type": "json_schema",
                "name": "W",
                "schema": {"type": "object"},
                "strict": True,
            }
        },
        tools=[FN],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        store=True,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather here?"},
                    {
                        "type": "input_image",
                        "image_url": "data:image/png;base64,AAAA",
                        "detail": "low",
                    },
                ],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": "get_weather",
                "arguments": '{"city": "Rome"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "It rains."}],
            },
        ],
    )
    chat = chat_request(req)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert chat.messages[0].content == "Be brief."
    parts = chat.messages[1].content
    assert [p.type for p in parts] == ["text", "image_url"]  # type: ignore[union-attr]
    assert parts[1].image_url == {"url": "data:image/png;base64,AAAA", "detail": "low"}  # type: ignore[index]
    calls = chat.messages[2].tool_calls or []
    assert [(c.id, c.function.name) for c in calls] == [
        ("call_1", "get_weather"),
        ("call_2", "get_weather"),
    ]
    assert chat.messages[3].tool_call_id == "call_1" and chat.messages[3].content == "rain"
    assert chat.max_tokens == 7 and chat.temperature == 0.5 and not chat.parallel_tool_calls
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "W", "schema": {"type": "object"}, "strict": True},
    }
    assert chat.tools == [
        {
            "type": "function",
            "function": {k: FN[k] for k in ("name", "description", "parameters", "strict")},
        }
    ]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat_request(ResponsesRequest(model="m", input="hi")).messages[0].role == "user"
    salted = chat_request(ResponsesRequest(model="m", input="hi", cache_salt="t1"))
    assert salted.cache_salt == "t1"


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"conversation": {"name": "c"}}, "conversation"),  # neither an id nor {"id": ...}
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content.0.type",
        ),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ],
)
def test_refusals(patch: dict, param: str) -> None:
    body = {"model": "m", "input": "x", **patch}
    with pytest.raises(OpenAIError) as e:
        chat_request(ResponsesRequest(**body))
    assert e.value.status == 400 and e.value.param == param


EVENTS = TypeAdapter(ResponseStreamEvent)


def stream_and_whole(parser_factory, text: str, pieces: list[str], status: str):  # type: ignore[no-untyped-def]
    """Events for ``text`` fed in ``pieces`` (wrapped as the route wraps them) and the
    non-streamed output for ``text`` whole."""
    req = ResponsesRequest(model="m", input="x", tools=[FN])
    usage = Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2)
    items = OutputItems()
    head = response_body(req, "resp_1", 1, "m", [], "in_progress", None)
    events = [
        items.event("response.created", response=head),
        items.event("response.in_progress", response=head),
    ]
    parser = parser_factory()
    for p in pieces:
        events += items.events(parser.feed(p) if parser else [Text(p)])
    events += items.events(parser.finish() if parser else []) + items.finish(status)
    final = response_body(req, "resp_1", 1, "m", items.output, status, usage)
    events.append(items.event("response.completed", response=final))
    whole = OutputItems()
    parser = parser_factory()
    whole.events(parser.feed(text) if parser else [Text(text)])
    whole.events(parser.finish() if parser else [])
    whole.finish(status)
    return events, response_body(req, "resp_1", 1, "m", whole.output, status, usage)


@pytest.mark.parametrize(
    ("factory", "text", "status", "kinds"),
    [
        (lambda: None, "Hello there", "completed", ["message"]),
        (lambda: None, "", "incomplete", ["message"]),
        (
            HermesParser,
            'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
            "completed",
            ["message", "function_call"],
        ),
        (lambda: NamedParser("get_weather"), '{"city": "Rome"}', "completed", ["function_call"]),
    ],
)
def test_stream_events_rebuild_the_response(factory, text: str, status: str, kinds) -> None:  # type: ignore[no-untyped-def]
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)] or [""]
    events, body = stream_and_whole(factory, text, pieces, status)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    whole = Response.model_validate(body)
    assert [o.type for o in whole.output] == kinds and whole.status == status
    assert whole.usage is not None and whole.usage.input_tokens == 5
    assert whole.usage.input_tokens_details.cached_tokens == 2
    state = ResponseStreamState(input_tools=[FN], text_format=omit)  # type: ignore[arg-type]
    for e in events:
        state.handle_event(EVENTS.validate_python(json.loads(json.dumps(e))))
    final = state._completed_response
    assert final is not None
    strip = {"id", "call_id"}  # random per output
    got = [{k: v for k, v in o.to_dict().items() if k not in strip} for o in final.output]
    want = [{k: v for k, v in o.to_dict().items() if k not in strip} for o in whole.output]
    for g in got:
        g.pop("parsed_arguments", None)
        for p in g.get("content", []):
            p.pop("parsed", None)
    assert got == want
    if "function_call" in kinds:
        call = next(o for o in final.output if o.type == "function_call")
        assert call.name == "get_weather" and json.loads(call.arguments)["city"]
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    if kinds[0] == "message":
        i = types.index("response.output_item.added")
        assert types[i + 1] == "response.content_part.added"
    if kinds == ["message"]:
        assert types[-4:-1] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
        ]


def test_history_sits_between_the_instructions_and_the_input() -> None:
    """previous_response_id's turns: after this request's instructions, before its
    input; output items (an assistant message's output_text, a function call) read back
    as the assistant's turn."""
    history = [
        {"id": "msg_a_0", "type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "first"}]},
        {"id": "msg_b", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "reply", "annotations": []}]},
        {"id": "fc_b_1", "type": "function_call", "call_id": "c1", "name": "f",
         "arguments": "{}", "status": "completed"},
    ]  # fmt: skip
    req = ResponsesRequest(model="m", input="next", instructions="sys",
                           previous_response_id="resp_b")  # fmt: skip
    msgs = chat_request(req, history).messages
    assert [m.role for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2].tool_calls is not None and msgs[2].tool_calls[0].function.name == "f"
    assert msgs[-1].content == "next"


def test_input_items_get_ids_and_a_string_becomes_a_message() -> None:
    items = input_items(ResponsesRequest(model="m", input="hi"), "resp_abc")
    assert items == [{"type": "message", "role": "user", "id": "msg_abc_in0",
                      "content": [{"type": "input_text", "text": "hi"}]}]  # fmt: skip
    given = [{"role": "user", "content": "a"},
             {"type": "function_call_output", "call_id": "c", "output": "x"},
             {"id": "mine", "role": "user", "content": "b"}]  # fmt: skip
    ids = [i["id"] for i in input_items(ResponsesRequest(model="m", input=given), "resp_z")]
    assert ids == ["msg_z_in0", "fco_z_in1", "mine"]
    assert "id" not in given[0]  # the request's own items are left as they were


def test_include_and_top_logprobs_become_chat_logprobs() -> None:
    want = chat_request(ResponsesRequest(model="m", input="x", top_logprobs=3,
                                         include=["message.output_text.logprobs"]))  # fmt: skip
    assert (want.logprobs, want.top_logprobs) == (True, 3)
    alone = chat_request(ResponsesRequest(model="m", input="x", top_logprobs=3))
    assert alone.logprobs is None  # top_logprobs counts only with the include
    quiet = chat_request(ResponsesRequest(model="m", input="x",
                                          include=["reasoning.encrypted_content"]))  # fmt: skip
    assert quiet.logprobs is None  # accepted, adds nothing
    with pytest.raises(OpenAIError) as e:
        chat_request(ResponsesRequest(model="m", input="x", include=["a", "b"]))
    assert e.value.param == "include.0"


def test_logprob_entries_go_with_the_text_they_became() -> None:
    """Entries fed before text wait for it; a call or reasoning event drops them (those
    tokens were not output text); the part and the done event hold every text entry."""
    items = OutputItems("t")
    items.pending = [{"token": "a"}]
    out = items.events([Text("")])  # no text yet: the entry waits
    items.pending += [{"token": "b"}]
    out += items.events([Text("ab")])
    delta = [e for e in out if e["type"] == "response.output_text.delta"]
    assert [x["token"] for x in delta[0]["logprobs"]] == ["a", "b"]
    added = next(e for e in out if e["type"] == "response.content_part.added")
    assert added["part"]["logprobs"] == []  # as it was when it was added
    items.pending = [{"token": "<call>"}]
    out = items.events([CallStart(0, "c1", "f")])
    assert items.pending == []
    done = next(e for e in items.finish("completed") + out
                if e["type"] == "response.output_text.done")  # fmt: skip
    assert [x["token"] for x in done["logprobs"]] == ["a", "b"]
    assert [x["token"] for x in items.output[0]["content"][0]["logprobs"]] == ["a", "b"]
