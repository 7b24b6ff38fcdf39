"""Tool choice -> constraint, and the output as chat's tool_calls (api/tools.py)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from api.errors import OpenAIError
from api.protocol import ChatCompletionRequest
from api.tools import ChatOutput, constrain, tool_plan
from kvbm.protocol import Sampling, StructuredOutput

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "days": {"type": "integer", "minimum": 1},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters


def req(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **kw)


def refused(param: str, **kw: object) -> None:
    with pytest.raises(OpenAIError) as e:
        tool_plan(req(**kw), "hermes")
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_choices() -> None:
    assert tool_plan(req(), "hermes") is None
    assert tool_plan(req(tool_choice="none"), "hermes") is None
    auto = tool_plan(req(tools=[WEATHER]), "llama3_json")
    assert auto is not None and auto.choice == "auto" and auto.constraint is None
    assert type(auto.parser()).__name__ == "Llama3JsonParser"
    none = tool_plan(req(tools=[WEATHER], tool_choice="none"), "hermes")
    assert none is not None and none.parser() is None and none.constraint is None
    named = tool_plan(
        req(tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "now"}}),
        "hermes",
    )
    assert named is not None and named.choice == "named" and named.name == "now"
    assert named.constraint == StructuredOutput(
        json_schema=json.dumps({"type": "object", "properties": {}})
    )


def test_refusals() -> None:
    refused("tool_choice", tool_choice="required")  # no tools
    refused("tool_choice", tools=[WEATHER], tool_choice="sometimes")
    refused(
        "tool_choice.function.name",
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "other"}},
    )
    refused("tools.1.function.name", tools=[WEATHER, WEATHER])
    refused("tools.0.type", tools=[{"type": "code_interpreter"}])
    refused(
        "tools.0.function.parameters",
        tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}],
    )


def test_required_schema_accepts_calls_and_nothing_else() -> None:
    plan = tool_plan(req(tools=[WEATHER, NOW], tool_choice="required"), "hermes")
    assert plan is not None and plan.constraint is not None
    schema = json.loads(plan.constraint.json_schema or "")
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "now", "parameters": {}},
    ]
    jsonschema.validate(ok, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"days": 2}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "now"}],
        [{"name": "now", "parameters": {}, "extra": 1}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_plan(
        req(tools=[WEATHER, NOW], tool_choice="required", parallel_tool_calls=False), "hermes"
    )
    assert single is not None and single.constraint is not None
    one = json.loads(single.constraint.json_schema or "")
    assert one["maxItems"] == 1 and one["minItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, one)


def test_constrain() -> None:
    plan = tool_plan(req(tools=[WEATHER], tool_choice="required"), "hermes")
    s = constrain(Sampling(), plan)
    assert s.structured == plan.constraint and Sampling().structured is None
    assert constrain(Sampling(), tool_plan(req(tools=[WEATHER]), "hermes")).structured is None
    # a forced choice overrides the request's own constraint (vLLM's rule)
    own = Sampling(structured=StructuredOutput(json_object=True))
    assert constrain(own, plan).structured == plan.constraint


def reassemble(deltas: list[dict]) -> dict:
    """A message from stream deltas, as a client joins them (by index)."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"function": {"arguments": ""}})
            if "id" in tc:
                call.update(id=tc["id"], type=tc["type"])
                call["function"]["name"] = tc["function"]["name"]
            call["function"]["arguments"] += tc["function"].get("arguments", "")
    msg: dict = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    elif msg["content"] is None:
        msg["content"] = ""
    return msg


@pytest.mark.parametrize(
    ("choice", "text", "reason", "calls"),
    [
        (
            "auto",
            'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
            "tool_calls",
            1,
        ),
        ("auto", "no call here", "stop", 0),
        (
            "required",
            '[{"name":"get_weather","parameters":{"city":"A"}},{"name":"now","parameters":{}}]',
            "tool_calls",
            2,
        ),
        ({"type": "function", "function": {"name": "get_weather"}}, '{"city":"B"}', "stop", 1),
    ],
)
def test_stream_reassembles_to_the_message(
    choice: object, text: str, reason: str, calls: int
) -> None:
    plan = tool_plan(req(tools=[WEATHER, NOW], tool_choice=choice), "hermes")
    assert plan is not None
    whole = ChatOutput(plan, plan.parser())  # type: ignore[arg-type]
    message = whole.message(text)
    assert len(message.get("tool_calls", [])) == calls
    assert whole.finish_reason("stop") == reason
    rng = random.Random(7)
    for _ in range(20):
        out = ChatOutput(plan, plan.parser())  # type: ignore[arg-type]
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        deltas = []
        for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True):
            deltas += out.feed(text[i:j])
        deltas += out.finish()
        got = reassemble(deltas)
        for c, w in zip(got.get("tool_calls", []), message.get("tool_calls", []), strict=True):
            c["id"] = w["id"]  # ids are random per request
        assert got == message
        first = [d for d in deltas if "tool_calls" in d][:1]
        if first:  # a call's first delta: id, type and name, then argument text
            tc = first[0]["tool_calls"][0]
            assert tc["type"] == "function" and tc["id"].startswith("call_")
    if calls:
        for call in message["tool_calls"]:
            json.loads(call["function"]["arguments"])


def test_required_cut_by_length_is_not_tool_calls() -> None:
    plan = tool_plan(req(tools=[WEATHER], tool_choice="required"), "hermes")
    out = ChatOutput(plan, plan.parser())  # type: ignore[arg-type, union-attr]
    msg = out.message('[{"name":"get_weather","parameters":{"ci')
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"ci'
    assert out.finish_reason("length") == "length"


NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 6},
                                     "urgent": {"type": "boolean"}},
    "required": ["text", "urgent"], "additionalProperties": False}}}  # fmt: skip


@pytest.mark.parametrize("choice", ["required", "required-single", "named"])
def test_constraints_compile_and_parse_back(tiny_model_dir, choice: str) -> None:  # type: ignore[no-untyped-def]
    """Each forced choice's constraint compiles with the engine's grammar compiler
    (xgrammar) for the default model's tokenizer, and random walks through its token
    masks read back as calls whose arguments parse and validate."""
    structured = pytest.importorskip("workers.structured")  # the engine's structured outputs
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    compiler = structured.GrammarCompiler(tok, tok.get_vocab_size(), [eos])
    kw: dict = {"tool_choice": "required"}
    if choice == "required-single":
        kw["parallel_tool_calls"] = False
    if choice == "named":
        kw["tool_choice"] = {"type": "function", "function": {"name": "note"}}
    plan = tool_plan(req(tools=[WEATHER, NOTE], **kw), "hermes")
    assert plan is not None and plan.constraint is not None
    grammar = compiler.compile(plan.constraint)
    xgr = compiler._xgr
    gen = torch.Generator().manual_seed(0)
    finished = 0
    for _ in range(8):
        matcher = xgr.GrammarMatcher(grammar)
        mask = xgr.allocate_token_bitmask(1, tok.get_vocab_size())
        ids: list[int] = []
        while not matcher.is_terminated() and len(ids) < 400:
            matcher.fill_next_token_bitmask(mask)
            logits = torch.randn(1, tok.get_vocab_size(), generator=gen)
            xgr.apply_token_bitmask_inplace(logits, mask)
            ids.append(int(logits.argmax()))
            assert matcher.accept_token(ids[-1])
        if not matcher.is_terminated():
            continue  # an unbounded array of calls that has not closed yet
        finished += 1
        out = ChatOutput(plan, plan.parser())  # type: ignore[arg-type]
        msg = out.message(tok.decode([i for i in ids if i != eos]))
        assert msg["tool_calls"] and out.finish_reason("stop") in ("tool_calls", "stop")
        if choice != "required":
            assert len(msg["tool_calls"]) == 1
        for call in msg["tool_calls"]:
            params = plan.schemas[call["function"]["name"]]
            jsonschema.validate(json.loads(call["function"]["arguments"]), params)
    assert finished >= 4


def test_strict_tools_constrain_auto_calls_where_the_format_allows() -> None:
    """``auto`` with a ``strict: true`` tool: a best-effort structural tag (calls opened by
    the format's trigger, a strict tool's arguments its schema, the others any object);
    none without strict tools or for a format it cannot constrain; a request's own
    structured output wins; no parallel calls: the first call ends the tags."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}},
             {"type": "function", "function": {"name": "g"}}]  # fmt: skip

    def plan(parser: str = "hermes", **kw: object):  # type: ignore[no-untyped-def]
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],  # type: ignore[list-item]
                                    tools=kw.pop("tools", tools), **kw)  # type: ignore[arg-type]  # fmt: skip
        return tool_plan(req, parser)

    spec = plan().constraint
    assert spec.best_effort and spec.param == "tools"
    fmt = json.loads(spec.structural_tag)["format"]
    assert fmt["triggers"] == ["<tool_call>"] and not fmt["stop_after_first"]
    assert [(t["begin"], t["content"]["json_schema"]) for t in fmt["tags"]] == [
        ('<tool_call>\n{"name": "f", "arguments": ', schema),
        ('<tool_call>\n{"name": "g", "arguments": ', {"type": "object"})]  # fmt: skip
    assert json.loads(plan(parallel_tool_calls=False).constraint.structural_tag)[
        "format"]["stop_after_first"]  # fmt: skip
    qwen = json.loads(plan("qwen3_coder").constraint.structural_tag)["format"]["tags"][0]
    assert qwen["begin"] == "<tool_call>\n<function=f>\n" and qwen["content"]["style"] == "qwen_xml"
    assert plan("pythonic").constraint is None
    assert plan(tools=tools[1:]).constraint is None
    assert plan(tool_choice="none").constraint is None
    own = Sampling(structured=StructuredOutput(regex="a+"))
    assert constrain(own, plan()) is own
    assert constrain(Sampling(), plan()).structured == spec
