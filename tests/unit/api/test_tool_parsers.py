"""Tool-call parsers (api/tool_parsers.py): what each reads out of a model's text, and that
any split of the text into stream pieces gives the same content and calls as the whole."""

from __future__ import annotations

import random
from typing import get_args

import pytest

from api.tool_parsers import (
    PARSERS,
    CallArgs,
    CallStart,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    PythonicParser,
    Qwen3CoderParser,
    RequiredParser,
    Text,
    ToolParser,
    parser_for_template,
)
from tasks.settings import ToolCallParser


def run(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) from feeding ``pieces`` then finishing."""
    events = []
    for p in pieces:
        events += parser.feed(p)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Text))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, CallStart):
            # OpenAI's form of id, or Kimi K2's own (functions.<name>:<index>)
            assert e.index == len(calls) and e.id.startswith(("call_", "functions."))
            calls[e.index] = [e.name, ""]
        elif isinstance(e, CallArgs):
            assert e.index in calls, "arguments before their call's start"
            calls[e.index][1] += e.text
    return content, [(n, a) for n, a in calls.values()]


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def same_in_pieces(make, text: str) -> tuple[str, list[tuple[str, str]]]:  # type: ignore[no-untyped-def]
    """The parse of ``text`` whole, checked equal for one character at a time and for
    random splits."""
    whole = run(make(), [text])
    assert run(make(), list(text)) == whole
    rng = random.Random(len(text))
    for _ in range(30):
        assert run(make(), splits(text, rng)) == whole
    return whole


HERMES = [
    (
        'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"note": "a } and \\" inside"}}\n</tool_call>\n<tool_call>{"name":"now","arguments":{}}'
        "</tool_call>",
        (
            "Let me look. ",
            [("get_weather", '{"city": "Paris", "note": "a } and \\" inside"}'), ("now", "{}")],
        ),
    ),
    (
        "plain text with < and <tool and </tool_call>",
        ("plain text with < and <tool and </tool_call>", []),
    ),
    # an unclosed last block counts when it parses; a broken one leaves it all content
    ('<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}', ("", [("f", '{"a": [1, 2]}')])),
    (
        'x<tool_call>{"name": "f", "arguments": {"a": ',
        ('x<tool_call>{"name": "f", "arguments": {"a": ', []),
    ),
    ('<tool_call>{"nam": "f"}</tool_call>', ('<tool_call>{"nam": "f"}</tool_call>', [])),
    # a block that does not parse is dropped once another one is a call
    ('<tool_call>oops</tool_call><tool_call>{"name": "g"}</tool_call>', ("", [("g", "{}")])),
    # arguments written as a JSON string: its content
    (
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        ("", [("f", '{"a": 1}')]),
    ),
]


@pytest.mark.parametrize(("text", "expected"), HERMES)
def test_hermes(text: str, expected: tuple) -> None:
    assert same_in_pieces(HermesParser, text) == expected


LLAMA = [
    (
        '  {"name": "f", "parameters": {"x": [1, "]"]}}; {"name": "g", "arguments": {"y": 2}}',
        ("", [("f", '{"x": [1, "]"]}'), ("g", '{"y": 2}')]),
    ),
    ('<|python_tag|>{"name": "f", "parameters": {}}', ("", [("f", "{}")])),
    ("Hello {there}", ("Hello {there}", [])),
    ("{not json", ("{not json", [])),
    ('{"name": "f", "parameters": {"a": 1}} trailing words', ("", [("f", '{"a": 1}')])),
]


@pytest.mark.parametrize(("text", "expected"), LLAMA)
def test_llama3_json(text: str, expected: tuple) -> None:
    assert same_in_pieces(Llama3JsonParser, text) == expected


PYTHONIC = [
    (
        '[get_weather(city="Paris", units=None, days=[1, 2]), now()]',
        ("", [("get_weather", '{"city": "Paris", "units": null, "days": [1, 2]}'), ("now", "{}")]),
    ),  # fmt: skip
    (
        '<|python_start|>[f(flag=True, s="a ] b")]<|python_end|>',
        ("", [("f", '{"flag": true, "s": "a ] b"}')]),
    ),
    ("  [f(x={'k': (1, 2)})]", ("", [("f", '{"x": {"k": [1, 2]}}')])),
    ("The answer is [1, 2].", ("The answer is [1, 2].", [])),
    ("[1, 2]", ("[1, 2]", [])),  # a list, not calls: content
    ("[f(1)]", ("[f(1)]", [])),  # positional arguments
    ("[f(x=y)]", ("[f(x=y)]", [])),  # a name, not a literal
    ("[f(x=1", ("[f(x=1", [])),  # cut short
]


@pytest.mark.parametrize(("text", "expected"), PYTHONIC)
def test_pythonic(text: str, expected: tuple) -> None:
    assert same_in_pieces(PythonicParser, text) == expected


MISTRAL = [
    (
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "now", "arguments": {}}]',
        ("Sure. ", [("get_weather", '{"city": "Paris"}'), ("now", "{}")]),
    ),
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "t": "}"}[TOOL_CALLS]now[ARGS]{}',
        ("", [("get_weather", '{"city": "Oslo", "t": "}"}'), ("now", "{}")]),
    ),
    ('[TOOL_CALLS]{"name": "f", "arguments": "{\\"a\\": 1}"}', ("", [("f", '{"a": 1}')])),
    ("a [TOOL or [TOOLS]", ("a [TOOL or [TOOLS]", [])),
    ("[TOOL_CALLS] not json", ("[TOOL_CALLS] not json", [])),
    ('[TOOL_CALLS]f[ARGS]{"a": ', ('[TOOL_CALLS]f[ARGS]{"a": ', [])),  # cut short
]


@pytest.mark.parametrize(("text", "expected"), MISTRAL)
def test_mistral(text: str, expected: tuple) -> None:
    assert same_in_pieces(MistralParser, text) == expected


def test_pythonic_and_mistral_stream_content_and_wait_for_calls() -> None:
    p = PythonicParser()
    assert p.feed("  ") == [] and p.feed("Hi [") == [Text("  Hi [")]
    q = PythonicParser()
    assert q.feed('[f(a="x"') == [] and q.feed(")") == []
    got = q.feed("]")
    assert [type(e) for e in got] == [CallStart, CallArgs] and q.feed("tail") == []
    m = MistralParser()
    assert m.feed("Hi [TOOL") == [Text("Hi ")]
    assert m.feed("_CALLS]f[ARGS]{") == []
    assert [type(e) for e in m.feed("}")] == [CallStart, CallArgs]


def test_content_streams_before_the_calls() -> None:
    """Content goes out as it comes, holding back only what may start a tag."""
    p = HermesParser()
    assert p.feed("Hello") == [Text("Hello")]
    assert p.feed(" <tool") == [Text(" ")]
    assert p.feed("box") == [Text("<toolbox")]
    q = Llama3JsonParser()
    assert q.feed("  ") == [] and q.feed("Hi") == [Text("  Hi")]


REQUIRED = [
    (
        '[{"name":"f","parameters":{"a":1,"s":"x\\"]}"}},{"name":"g","parameters":{}}]',
        ("", [("f", '{"a":1,"s":"x\\"]}"}'), ("g", "{}")]),
    ),
    ('[ {"parameters": {"q": true}, "name": "h"} ]', ("", [("h", '{"q": true}')])),
    ('[{"name":"f","parameters":{"a":1', ("", [("f", '{"a":1')])),  # cut by max_tokens
    ('[{"name":"f","parameters":12.5e3}]', ("", [("f", "12.5e3")])),
    ('[{"name":"f"}]', ("", [("f", "{}")])),
]


@pytest.mark.parametrize(("text", "expected"), REQUIRED)
def test_required(text: str, expected: tuple) -> None:
    assert same_in_pieces(RequiredParser, text) == expected


def test_required_streams_arguments_as_they_come() -> None:
    p = RequiredParser()
    first = p.feed('[{"name": "f", "parameters": {"a"')
    assert [type(e) for e in first] == [CallStart, CallArgs] and first[1].text == '{"a"'
    assert p.feed(": 1}") == [CallArgs(0, ": 1}")]
    assert p.feed("}]") == [] and p.finish() == []


def test_named() -> None:
    assert same_in_pieces(lambda: NamedParser("f"), '{"a": [1, 2]}') == (
        "",
        [("f", '{"a": [1, 2]}')],
    )
    assert run(NamedParser("f"), []) == ("", [("f", "")])  # the call even with no text


def test_parser_for_template() -> None:
    assert set(PARSERS) == set(get_args(ToolCallParser))  # what the setting may name
    qwen3_coder = "<tool_call>\n<function=' ~ name ~ '>\n<parameter="
    assert parser_for_template(qwen3_coder) == "qwen3_coder"
    assert parser_for_template("... <tool_call> ...") == "hermes"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("{{- '[TOOL_CALLS]' + tool_calls|tojson }}") == "mistral"
    assert parser_for_template("{{- '<|python_start|>' }}") == "pythonic"
    assert parser_for_template(None) == "hermes"


SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "metric": {"type": "boolean"}, "hours": {"type": "array"}, "where": {"type": "object"},
    "note": {"type": ["string", "null"]}, "maybe": {"type": ["integer", "null"]}}}}  # fmt: skip


def _qwen3() -> Qwen3CoderParser:
    p = Qwen3CoderParser()
    p.schemas = SCHEMAS
    return p


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
         "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
         "Let me look.\n", [("get_weather", '{"city": "Oslo", "days": 3}')]),
        # every type by the schema; a string keeps its inner newlines and a "3"
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan\nJosé 3\n</parameter>\n"
         "<parameter=temp>\n21.5\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
         "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=where>\n{'lat': 1}\n"
         "</parameter>\n<parameter=note>\nnull\n</parameter>\n<parameter=maybe>\nnull\n"
         "</parameter>\n</function>\n</tool_call>", "",
         [("get_weather", '{"city": "San\\nJosé 3", "temp": 21.5, "metric": true, '
                          '"hours": [1, 2], "where": {"lat": 1}, "note": null, '
                          '"maybe": null}')]),
        # an unknown function or parameter: strings; text that is not its type: as written
        ("<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>\n"
         "</tool_call><tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n"
         "</parameter>\n</function>\n</tool_call>", "",
         [("other", '{"n": "5"}'), ("get_weather", '{"days": "three"}')]),
        # an unclosed last block and parameter still count; no function at all: content
        ("<tool_call>\n<function=get_weather>\n<parameter=days>\n2", "",
         [("get_weather", '{"days": 2}')]),
        ("<tool_call>not a call</tool_call>", "<tool_call>not a call</tool_call>", []),
        ("no calls here", "no calls here", []),
    ],
)  # fmt: skip
def test_qwen3_coder(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert same_in_pieces(_qwen3, text) == (content, calls)


# DeepSeek's, Kimi's and GLM's formats (their tokens spelled as the models write them)
B, E = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CB, CE = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
DEEPSEEK_V3 = [
    (f"Let me check.{B}{CB}function{SEP}get_weather\n```json\n{{\"city\": \"Oslo\"}}\n```{CE}"
     f"{CB}function{SEP}now\n```json\n{{}}\n```{CE}{E}",
     ("Let me check.", [("get_weather", '{"city": "Oslo"}'), ("now", "{}")])),
    ("no calls here", ("no calls here", [])),
    (f"{B}{CB}function{SEP}f\n```json\n{{broken\n```{CE}{E}",  # nothing parses: content
     (f"{B}{CB}function{SEP}f\n```json\n{{broken\n```{CE}{E}", [])),
]  # fmt: skip
DEEPSEEK_V31 = [
    (f"ok{B}{CB}get_weather{SEP}{{\"city\": \"Oslo\"}}{CE}{CB}now{SEP}{{}}{CE}{E}",
     ("ok", [("get_weather", '{"city": "Oslo"}'), ("now", "{}")])),
]  # fmt: skip
KIMI = [
    ('Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
     '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>'
     'functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>',
     ("Sure.", [("get_weather", '{"city": "Oslo"}'), ("now", "{}")])),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "expected"), [
    *(("deepseek_v3", t, x) for t, x in DEEPSEEK_V3),
    *(("deepseek_v31", t, x) for t, x in DEEPSEEK_V31),
    *(("kimi_k2", t, x) for t, x in KIMI),
])  # fmt: skip
def test_deepseek_and_kimi(name: str, text: str, expected: tuple) -> None:
    assert same_in_pieces(PARSERS[name], text) == expected


def test_kimi_keeps_the_models_call_ids() -> None:
    events = PARSERS["kimi_k2"]().feed(KIMI[0][0])
    assert [e.id for e in events if isinstance(e, CallStart)] == ["functions.get_weather:0",
                                                                  "functions.now:1"]  # fmt: skip


def test_glm45_values_typed_by_the_schema() -> None:
    def make() -> ToolParser:
        p = PARSERS["glm45"]()
        p.schemas = {"book": {"properties": {"city": {"type": "string"},
                                             "nights": {"type": "integer"},
                                             "tags": {"type": "array"}}}}  # fmt: skip
        return p

    text = ("Booking.<tool_call>book\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
            "<arg_key>nights</arg_key>\n<arg_value>3</arg_value>\n<arg_key>tags</arg_key>\n"
            '<arg_value>["a", "b"]</arg_value>\n</tool_call>'
            "<tool_call>now\n</tool_call>")  # fmt: skip
    content, calls = same_in_pieces(make, text)
    assert content == "Booking."
    assert calls == [("book", '{"city": "Oslo", "nights": 3, "tags": ["a", "b"]}'), ("now", "{}")]


def test_parser_for_the_new_templates() -> None:
    assert parser_for_template("{{ '<tool_call>' }}{{ '<arg_key>' }}") == "glm45"
    assert parser_for_template(f"{CB}{{{{ name }}}}\n```json") == "deepseek_v3"
    assert parser_for_template(f"{CB}{{{{ name }}}}{SEP}") == "deepseek_v31"
    assert parser_for_template("<|tool_call_begin|>functions.x:0") == "kimi_k2"
