"""A reasoning model's thinking split from its answer: the same events however the text
is cut into pieces (tags split anywhere), the answer on to the tool parser, thinking kept
or dropped, an output that opens without ``<think>`` under a grammar, and the chat
message and Responses items they make."""

from __future__ import annotations

import json

import pytest

from api.protocol import ChatCompletionRequest
from api.reasoning import ThinkParser, output_parser, thinks
from api.responses import OutputItems
from api.tool_parsers import CallArgs, CallStart, Event, HermesParser, Reasoning, Text
from api.tools import ChatOutput


def _joined(events: list[Event]) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, calls as (name, arguments)) of a run of events."""
    thinking = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Text))
    names = {e.index: e.name for e in events if isinstance(e, CallStart)}
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, CallArgs):
            args[e.index] = args.get(e.index, "") + e.text
    return thinking, content, [(names[i], args[i]) for i in sorted(names)]


def _run(parser: ThinkParser, pieces: list[str]) -> list[Event]:
    out: list[Event] = []
    for p in pieces:
        out += parser.feed(p)
    return out + parser.finish()


def _splits(text: str) -> list[list[str]]:
    """The text whole, a character at a time, and cut at every single place."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


CASES = [
    # (output, reasoning, content)
    ("<think>plan it</think>the answer", "plan it", "the answer"),
    ("plan it</think>the answer", "plan it", "the answer"),  # <think> was in the prompt
    ("\n<think>a < b </th not yet</think>x</think>y", "a < b </th not yet", "x</think>y"),
    ("still thinking <", "still thinking <", ""),  # never closed: all reasoning
    ("<thi", "<thi", ""),
    ("", "", ""),
    ("<think>why</think>{}", "why", "{}"),  # a grammar's answer after the thinking
]


@pytest.mark.parametrize(("text", "thinking", "content"), CASES)
def test_every_split_gives_the_same_events(text: str, thinking: str, content: str) -> None:
    for pieces in _splits(text) if text else [[""]]:
        got = _joined(_run(ThinkParser(None), pieces))
        assert got == (thinking, content, []), pieces


def test_the_answer_goes_on_to_the_tool_parser() -> None:
    text = ('<think>I need the weather</think><tool_call>{"name": "weather", '
            '"arguments": {"city": "Oslo"}}</tool_call>')  # fmt: skip
    for pieces in _splits(text)[:40]:
        thinking, content, calls = _joined(_run(ThinkParser(HermesParser()), pieces))
        assert thinking == "I need the weather" and content == ""
        assert [(n, json.loads(a)) for n, a in calls] == [("weather", {"city": "Oslo"})]


def test_dropped_thinking_and_thinking_turned_off() -> None:
    assert _joined(_run(ThinkParser(None, keep=False), ["a</think>b"])) == ("", "b", [])
    assert thinks("qwen3", {"enable_thinking": False}) is False
    assert thinks("deepseek_r1", {"enable_thinking": False}) is True
    assert thinks(None, None) is False
    msgs = [{"role": "user", "content": "hi"}]
    req = ChatCompletionRequest(model="m", messages=msgs)  # type: ignore[arg-type]
    p = output_parser("deepseek_r1", None, req)
    assert isinstance(p, ThinkParser) and p.keep
    off = ChatCompletionRequest(model="m", messages=msgs,  # type: ignore[arg-type]
                                chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert output_parser("qwen3", None, off) is None
    dropped = ChatCompletionRequest(model="m", messages=msgs,  # type: ignore[arg-type]
                                    include_reasoning=False)  # fmt: skip
    p = output_parser("deepseek_r1", None, dropped)
    assert isinstance(p, ThinkParser) and not p.keep


def test_chat_message_and_deltas_carry_reasoning() -> None:
    whole = ChatOutput(None, ThinkParser(None)).message("<think>hmm</think>Hi")
    assert whole == {"role": "assistant", "content": "Hi", "reasoning": "hmm",
                     "reasoning_content": "hmm"}  # fmt: skip
    out = ChatOutput(None, ThinkParser(None))
    deltas = out.feed("hm") + out.feed("m</thi") + out.feed("nk>H") + out.feed("i") + out.finish()
    assert "".join(d.get("reasoning", "") for d in deltas) == "hmm"
    assert "".join(d.get("content", "") for d in deltas) == "Hi"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert out.finish_reason("stop") == "stop"
    plain = ChatOutput(None, ThinkParser(None)).message("no end")
    assert plain["content"] == "" and plain["reasoning"] == "no end"


def test_responses_items_put_reasoning_first() -> None:
    items = OutputItems("x")
    parser = ThinkParser(None)
    events = items.events(parser.feed("<think>so</think>Yes")) + items.events(parser.finish())
    events += items.finish("completed")
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    rs, msg = items.output
    assert rs == {"id": "rs_x_0", "type": "reasoning", "status": "completed", "summary": [],
                  "content": [{"type": "reasoning_text", "text": "so"}]}  # fmt: skip
    assert msg["content"][0]["text"] == "Yes" and msg["id"] == "msg_x_1"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
