"""Tools and the Responses API through the whole pipeline, with the official openai client
and LangChain against the cluster `make serve` runs (real workers, real HTTP).

Tool prompts are checked against Hugging Face's apply_chat_template and generate on the
same checkpoint; forced tool calls (``required``, a named function) against their
functions' ``parameters`` with jsonschema, streamed and not. Those need structured outputs
in the engine (the constraint the API turns a forced choice into): they run once the
reference engine lists ``structured_outputs`` in its features, and are skipped, visibly,
until then.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from transformers import AutoTokenizer, LlavaForConditionalGeneration

from tests.integration.conftest import Cluster, base_env, start_api
from tests.integration.test_openai_api import hf_greedy
from workers.engine import Engine

pytestmark = pytest.mark.integration

needs_structured = pytest.mark.skipif(
    "structured_outputs" not in Engine.supports,
    reason="the reference engine does not serve structured outputs yet (the constraint "
    "behind tool_choice 'required' / named, json_schema)",
)

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Rome", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
NOTE_PARAMS = {
    "type": "object",
    "properties": {
        "text": {"type": "string", "maxLength": 12},
        "urgent": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]},
                 "maxItems": 2},
    },
    "required": ["text", "urgent"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "take_note", "description": "Note something",
                                      "parameters": NOTE_PARAMS}},
]  # fmt: skip
PARAMS = {"get_weather": WEATHER_PARAMS, "take_note": NOTE_PARAMS}
HISTORY = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"},
]  # fmt: skip


@pytest.fixture(scope="module")
def hf(cluster: Cluster) -> tuple:
    tok = AutoTokenizer.from_pretrained(cluster.model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(cluster.model_dir).eval()
    return tok, model


def template_ids(hf: tuple, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """HF's prompt ids, the call arguments as objects (as vLLM hands them to templates)."""
    msgs = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]  # fmt: skip
        msgs.append(m)
    out = hf[0].apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def streamed(client: openai.OpenAI, **kw: object) -> tuple[dict, str | None]:
    """A streamed chat completion joined as a client joins it: (message, finish_reason)."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert call["id"] is None, "a call's id comes once, first"
                    call["id"], call["name"] = tc.id, tc.function.name
                assert call["id"] is not None, "argument text before the call's id and name"
                call["arguments"] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    return {"content": content or None, "calls": [calls[i] for i in sorted(calls)]}, reason


def whole(resp) -> dict:  # type: ignore[no-untyped-def]
    msg = resp.choices[0].message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in msg.tool_calls or []]  # fmt: skip
    return {"content": msg.content, "calls": calls}


def same_calls(a: dict, b: dict) -> bool:
    """Equal but for the calls' ids (random per request)."""

    def strip(m: dict) -> dict:
        return {**m, "calls": [{k: v for k, v in c.items() if k != "id"} for c in m["calls"]]}

    return strip(a) == strip(b)


# --------------------------------------------------------------------------------------
# Chat completions


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_tool_round_trip_renders_and_runs(cluster: Cluster, hf: tuple, choice: str) -> None:
    """Tools, an assistant turn's tool calls and the tool's result go through the chat
    template exactly as HF renders them, and the model carries on from there (greedy, as
    HF generates it). ``none`` renders the tools too (vLLM's default) and parses nothing."""
    client = cluster.client()
    ids = template_ids(hf, HISTORY, TOOLS)
    kw = dict(model=cluster.model_name, messages=HISTORY, tools=TOOLS, tool_choice=choice,
              max_tokens=12, temperature=0)  # fmt: skip
    resp = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert resp.usage.prompt_tokens == len(ids)
    expected = hf[0].decode(hf_greedy(hf, ids, 12), skip_special_tokens=True)
    got = whole(resp)
    # a random-weight model writes no <tool_call>: its text is the content, whole
    assert got == {"content": expected, "calls": []}
    assert resp.choices[0].finish_reason == "length"
    msg, reason = streamed(client, **kw)
    assert same_calls(msg, got) and reason == "length"


def test_tokenize_counts_the_tools_as_chat_does(cluster: Cluster, hf: tuple) -> None:
    """vLLM's /tokenize with tools: the ids HF's template gives, the count a chat request
    with the same messages and tools reports as its prompt_tokens."""
    body = {"model": cluster.model_name, "messages": HISTORY, "tools": TOOLS}
    r = httpx.post(f"{cluster.url}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == template_ids(hf, HISTORY, TOOLS)
    chat = cluster.client().chat.completions.create(
        model=cluster.model_name, messages=HISTORY, tools=TOOLS, max_tokens=1)  # type: ignore[arg-type]  # fmt: skip
    assert r.json()["count"] == chat.usage.prompt_tokens  # type: ignore[union-attr]
    plain = httpx.post(f"{cluster.url}/tokenize", json={**body, "tools": None}).json()
    assert plain["count"] < r.json()["count"]  # the tools' listing counts
    bad = httpx.post(f"{cluster.url}/tokenize", json={**body, "tools": [{"type": "web"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools.0.type"


def test_tool_refusals(cluster: Cluster) -> None:
    client = cluster.client()
    base = dict(model=cluster.model_name, messages=[{"role": "user", "content": "hi"}],
                max_tokens=2)  # fmt: skip
    for kw, param in [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
         "messages.0.tool_calls.0.function.arguments"),
    ]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{**base, **kw})  # type: ignore[call-overload]
        assert e.value.body["param"] == param, e.value.body  # type: ignore[index]


def forced(cluster: Cluster, choice: object, parallel: bool = True) -> tuple[dict, str | None]:
    """A forced tool call, streamed and not (greedy: the same output); both checked equal
    and every call's arguments valid against its function's parameters."""
    client = cluster.client()
    kw = dict(model=cluster.model_name, messages=[{"role": "user", "content": "Do it."}],
              tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, max_tokens=200,
              temperature=0)  # fmt: skip
    resp = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    got, reason = whole(resp), resp.choices[0].finish_reason
    msg, stream_reason = streamed(client, **kw)
    assert same_calls(msg, got) and stream_reason == reason
    assert got["calls"], got
    for call in got["calls"]:
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
    return got, reason


@needs_structured
def test_named_tool_choice(cluster: Cluster) -> None:
    got, reason = forced(cluster, {"type": "function", "function": {"name": "take_note"}})
    assert [c["name"] for c in got["calls"]] == ["take_note"] and got["content"] is None
    assert reason == "stop"  # as OpenAI answers a forced function


@needs_structured
@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice(cluster: Cluster, parallel: bool) -> None:
    got, reason = forced(cluster, "required", parallel)
    assert reason == "tool_calls" and got["content"] is None
    if not parallel:
        assert len(got["calls"]) == 1


@needs_structured
def test_strict_tools_leave_free_text_free(cluster: Cluster) -> None:
    """``strict: true`` tools under ``auto`` constrain only the calls the model opens
    (tests/unit/workers/test_structured.py finishes one to its schema): a greedy answer
    that opens none is the model's free text, the unconstrained completion of the same
    rendered prompt, streamed and not."""
    strict = [{"type": t["type"], "function": {**t["function"], "strict": True}}
              for t in TOOLS]  # fmt: skip
    client = cluster.client(max_retries=0)
    msgs = [{"role": "user", "content": "Weather?"}]
    kw = dict(model=cluster.model_name, messages=msgs, max_tokens=24, temperature=0)
    prompt = httpx.post(f"{cluster.url}/tokenize",
                        json={"messages": msgs, "tools": strict}).json()["tokens"]  # fmt: skip
    free = client.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=24,
                                     temperature=0).choices[0].text  # fmt: skip
    got = whole(client.chat.completions.create(tools=strict, **kw))  # type: ignore[call-overload]
    assert got["content"] == free and not got["calls"]
    msg, _ = streamed(client, tools=strict, **kw)
    assert same_calls(msg, got)


@needs_structured
def test_auto_parses_the_models_calls(cluster: Cluster) -> None:
    """``auto`` with the default model's own format forced on its output (a regex): the
    hermes parser finds the call, streamed and not, and the content before it."""
    client = cluster.client()
    regex = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "(Oslo|Rome)", "unit": "celsius"\}\}\n</tool_call>')  # fmt: skip
    kw = dict(model=cluster.model_name, messages=[{"role": "user", "content": "Weather?"}],
              tools=TOOLS, max_tokens=300, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})  # fmt: skip
    resp = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    got = whole(resp)
    assert got["content"] == "Let me check.\n" and resp.choices[0].finish_reason == "tool_calls"
    assert [c["name"] for c in got["calls"]] == ["get_weather"]
    jsonschema.validate(json.loads(got["calls"][0]["arguments"]), WEATHER_PARAMS)
    msg, reason = streamed(client, **kw)
    assert same_calls(msg, got) and reason == "tool_calls"


ARGS_RE = r'\{"city": "(Oslo|Rome)", "unit": "celsius"\}'
OTHER_FORMATS = {
    # Llama 4's pythonic calls, Mistral's v11 form and Qwen3-Coder's XML (its days typed
    # as the schema's integer), each forced on the output
    "pythonic": (r'\[get_weather\(city="(Oslo|Rome)", unit="celsius"\)\]', ""),
    "mistral": (r'Checking\.\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "(Oslo|Rome)", '
                r'"unit": "celsius"\}', "Checking."),
    "qwen3_coder": (r"Checking\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                    r"(Oslo|Rome)\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n"
                    r"<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>",
                    "Checking.\n"),
    # GLM-4.5's <arg_key> pairs (days typed by the schema), Kimi K2's and DeepSeek's tokens
    "glm45": (r"Checking\.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>"
              r"(Oslo|Rome)</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>celsius"
              r"</arg_value>\n<arg_key>days</arg_key>\n<arg_value>[1-7]</arg_value>"
              r"\n</tool_call>", "Checking."),
    "kimi_k2": (r"Checking\." + re.escape("<|tool_calls_section_begin|><|tool_call_begin|>"
                "functions.get_weather:0<|tool_call_argument_begin|>") + ARGS_RE
                + re.escape("<|tool_call_end|><|tool_calls_section_end|>"), "Checking."),
    "deepseek_v3": (r"Checking\." + re.escape(
        "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>"
        "function<\uff5ctool\u2581sep\uff5c>get_weather\n```json\n") + ARGS_RE + re.escape(
        "\n```<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>"),
        "Checking."),
}  # fmt: skip


@needs_structured
@pytest.mark.parametrize("parser", sorted(OTHER_FORMATS))
def test_auto_with_the_other_parsers(cluster: Cluster, parser: str,
                                     tmp_path_factory: pytest.TempPathFactory) -> None:  # fmt: skip
    """CONVEYOR_TOOL_CALL_PARSER names the format: an API process with it, on the
    session's workers, reads the calls out of output forced into that format."""
    regex, content = OTHER_FORMATS[parser]
    env = base_env(cluster.redis_url, cluster.model_dir, CONVEYOR_TOOL_CALL_PARSER=parser)
    api, url = start_api(f"api-{parser}", env, tmp_path_factory.mktemp(parser))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        kw = dict(model=cluster.model_name, messages=[{"role": "user", "content": "Weather?"}],
                  tools=TOOLS, max_tokens=300, temperature=0,
                  extra_body={"structured_outputs": {"regex": regex}})  # fmt: skip
        resp = client.chat.completions.create(**kw)  # type: ignore[call-overload]
        got = whole(resp)
        assert (got["content"] or "") == content
        assert resp.choices[0].finish_reason == "tool_calls"
        assert [c["name"] for c in got["calls"]] == ["get_weather"]
        jsonschema.validate(json.loads(got["calls"][0]["arguments"]), WEATHER_PARAMS)
        msg, reason = streamed(client, **kw)
        assert same_calls(msg, got) and reason == "tool_calls"
    finally:
        api.stop()


# --------------------------------------------------------------------------------------
# Responses API


def test_responses_text(cluster: Cluster, hf: tuple) -> None:
    """``client.responses.create`` (stream and not) and ``client.responses.stream`` give the
    chat pipeline's greedy text, as output items the openai package reads."""
    client = cluster.client()
    kw = dict(model=cluster.model_name, instructions="Be brief.", input="Hello, world!",
              max_output_tokens=10, temperature=0)  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello, world!"}]  # fmt: skip
    ids = template_ids(hf, messages, None)
    expected = hf[0].decode(hf_greedy(hf, ids, 10), skip_special_tokens=True)
    resp = client.responses.create(**kw)  # type: ignore[call-overload]
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.output_text == expected and [o.type for o in resp.output] == ["message"]
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.input_tokens == len(ids) and resp.usage.output_tokens == 10
    events = list(client.responses.create(stream=True, **kw))  # type: ignore[call-overload]
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected and events[-1].response.output_text == expected
    with client.responses.stream(**kw) as stream:  # type: ignore[call-overload]
        final = stream.get_final_response()
    assert final.output_text == expected and final.usage.output_tokens == 10


def test_responses_tool_round_trip(cluster: Cluster, hf: tuple) -> None:
    """function_call and function_call_output items render as the chat history they mean."""
    client = cluster.client()
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
    resp = client.responses.create(
        model=cluster.model_name, instructions="You help.", tools=tools,  # type: ignore[arg-type]
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Oslo", "unit": "celsius"}'},
               {"type": "function_call_output", "call_id": "call_1",
                "output": "4 degrees, rain"}],
        max_output_tokens=12, temperature=0)  # fmt: skip
    ids = template_ids(hf, HISTORY, [{"type": "function", "function": {
        "name": t["name"], "parameters": t["parameters"]}} for t in tools])  # fmt: skip
    assert resp.usage.input_tokens == len(ids)
    assert resp.output_text == hf[0].decode(hf_greedy(hf, ids, 12), skip_special_tokens=True)


def test_responses_refusals(cluster: Cluster) -> None:
    client = cluster.client()
    with pytest.raises(openai.NotFoundError) as nf:  # served (test_conversations.py)
        client.responses.create(model=cluster.model_name, input="x",
                                conversation="conv_123")  # fmt: skip
    assert nf.value.body["param"] == "conversation"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:  # a hosted tool: not run here
        client.responses.create(model=cluster.model_name, input="x",
                                tools=[{"type": "web_search"}])  # type: ignore[list-item]  # fmt: skip
    assert e.value.body["param"] == "tools.0.type"  # type: ignore[index]


class Weather(BaseModel):
    city: str = Field(max_length=10)
    rainy: bool


@needs_structured
def test_responses_json_schema_and_function_tools(cluster: Cluster) -> None:
    client = cluster.client()
    base = dict(model=cluster.model_name, input="Weather?", max_output_tokens=120,
                temperature=0)  # fmt: skip
    with client.responses.stream(text_format=Weather, **base) as stream:  # type: ignore[call-overload]
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Weather)
    parsed = client.responses.parse(text_format=Weather, **base)  # type: ignore[call-overload]
    assert parsed.output_parsed == final.output_parsed
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS,
              "strict": True}]  # fmt: skip
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        resp = client.responses.create(tools=tools, tool_choice=choice, **base)  # type: ignore[call-overload]
        calls = [o for o in resp.output if o.type == "function_call"]
        assert [c.name for c in calls] == ["get_weather"] and calls[0].call_id
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
        with client.responses.stream(tools=tools, tool_choice=choice, **base) as stream:  # type: ignore[call-overload]
            streamed_calls = [o for o in stream.get_final_response().output
                              if o.type == "function_call"]  # fmt: skip
        assert [c.arguments for c in streamed_calls] == [c.arguments for c in calls]


# --------------------------------------------------------------------------------------
# LangChain


def chat_model(cluster: Cluster, **kw: object) -> ChatOpenAI:
    settings = {"temperature": 0, "max_tokens": 120, **kw}
    return ChatOpenAI(
        model=cluster.model_name, base_url=f"{cluster.url}/v1", api_key="unused", **settings
    )  # type: ignore[arg-type]


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(description="the city", max_length=10)
    days: int = Field(ge=1, le=7)


class TakeNote(BaseModel):
    """Note something down."""

    text: str = Field(max_length=12)
    urgent: bool


def test_langchain_bind_tools_auto_runs(cluster: Cluster) -> None:
    """bind_tools with its default choice, and a tool round trip in LangChain's messages."""
    llm = chat_model(cluster, max_tokens=8).bind_tools([GetWeather, TakeNote])
    out = llm.invoke([HumanMessage("Weather in Oslo?")])
    assert isinstance(out, AIMessage) and out.content and out.tool_calls == []
    call = {"name": "GetWeather", "args": {"city": "Oslo", "days": 2}, "id": "call_1"}
    history = [HumanMessage("Weather in Oslo?"), AIMessage("", tool_calls=[call]),
               ToolMessage("4 degrees", tool_call_id="call_1")]  # fmt: skip
    again = llm.invoke(history)
    assert isinstance(again, AIMessage) and again.response_metadata["finish_reason"] == "length"


@needs_structured
@pytest.mark.parametrize("choice", ["required", "TakeNote", "any"])
def test_langchain_bind_tools_forced(cluster: Cluster, choice: str) -> None:
    llm = chat_model(cluster).bind_tools([GetWeather, TakeNote], tool_choice=choice)
    out = llm.invoke("Do something.")
    assert out.tool_calls, out
    for call in out.tool_calls:
        model = {"GetWeather": GetWeather, "TakeNote": TakeNote}[call["name"]]
        model.model_validate(call["args"])
    if choice == "TakeNote":
        assert [c["name"] for c in out.tool_calls] == ["TakeNote"]
    chunks = list(llm.stream("Do something."))
    joined = chunks[0]
    for c in chunks[1:]:
        joined += c
    assert [(c["name"], c["args"]) for c in joined.tool_calls] == [
        (c["name"], c["args"]) for c in out.tool_calls]  # fmt: skip


@needs_structured
def test_langchain_structured_output(cluster: Cluster) -> None:
    structured = chat_model(cluster).with_structured_output(TakeNote, method="json_schema")
    note = structured.invoke("Note that the sky is blue.")
    assert isinstance(note, TakeNote)
    with_raw = chat_model(cluster).with_structured_output(TakeNote, method="json_schema",
                                                          include_raw=True)  # fmt: skip
    out = with_raw.invoke("Note that the sky is blue.")
    assert out["parsing_error"] is None and out["parsed"] == note


def test_langchain_responses_api(cluster: Cluster, hf: tuple) -> None:
    """LangChain's Responses API path (use_responses_api) against the same server."""
    llm = chat_model(cluster, max_tokens=10, use_responses_api=True)
    out = llm.invoke([HumanMessage("Hello, world!")])
    ids = template_ids(hf, [{"role": "user", "content": "Hello, world!"}], None)
    assert out.text == hf[0].decode(hf_greedy(hf, ids, 10), skip_special_tokens=True)


def _logprob_entries(lp) -> list[tuple[str, float, list[str]]]:  # type: ignore[no-untyped-def]
    return [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in lp.content]


@needs_structured
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_logprobs_beside_tool_calls(cluster: Cluster, tool_choice: str) -> None:
    """Logprobs with tools (as vLLM serves them): a whole answer carries every generated
    token's logprob beside its tool calls; a stream carries the same entries, each batch's
    in a chunk of its own (empty delta), so joined they equal the whole answer's, and the
    calls are the same. With n = 2, every choice's tokens are there."""
    client = cluster.client()
    choice = ("required" if tool_choice == "required"
              else {"type": "function", "function": {"name": "take_note"}})  # fmt: skip
    kw = dict(model=cluster.model_name, messages=[{"role": "user", "content": "Note it."}],
              tools=TOOLS, tool_choice=choice, max_tokens=300, temperature=0, logprobs=True,
              top_logprobs=2)  # fmt: skip
    r = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    want = _logprob_entries(r.choices[0].logprobs)
    reason = "tool_calls" if tool_choice == "required" else "stop"  # a forced function's
    assert r.choices[0].message.tool_calls and r.choices[0].finish_reason == reason
    assert len(want) == r.usage.completion_tokens > 0
    assert all(lp <= 0 and len(top) == 2 for _, lp, top in want)

    got, calls, usage = [], {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={  # type: ignore[call-overload]
            "include_usage": True}, **kw):  # fmt: skip
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                assert not c.delta.content and not c.delta.tool_calls, "logprobs ride alone"
                got += _logprob_entries(c.logprobs)
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": None, "arguments": ""})
                call["name"] = call["name"] or tc.function.name
                call["arguments"] += tc.function.arguments or ""
    # the same tokens; logprobs equal up to float noise (another batch shape can move a
    # float32 log-softmax's last digits)
    assert [(t, top) for t, _, top in got] == [(t, top) for t, _, top in want]
    assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-3)
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in r.choices[0].message.tool_calls]  # fmt: skip
    assert usage is not None and usage.completion_tokens == len(want)

    per_choice: dict[int, int] = {}
    for chunk in client.chat.completions.create(stream=True, n=2, stream_options={  # type: ignore[call-overload]
            "include_usage": True}, **kw):  # fmt: skip
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                per_choice[c.index] = per_choice.get(c.index, 0) + len(c.logprobs.content)
    assert per_choice == {0: len(want), 1: len(want)}  # greedy: both as the single one
    assert usage is not None and usage.completion_tokens == 2 * len(want)
