"""The per-token SSE chunk comes from a template; it must equal the chunk built in full."""

from __future__ import annotations

import json

import pytest

from api.sse import Formatter as _Formatter
from api.sse import sse_event as _data
from kvbm.protocol import TokenFrame

TEXTS = ["a", " the", '"quoted" \\ back', "\n\t", "é中🙂", "\u2028\u0085", "\x00", "", "null"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_text_event_equals_the_full_chunk(kind: str, include_usage: bool) -> None:
    fmt = _Formatter(kind, "cmpl-0123456789abcdef0123456789abcdef", 'model "x"')
    for text in TEXTS:
        event = fmt.text_event(text, include_usage)
        assert event == _data(fmt.chunk(fmt.text_delta(text), None, include_usage))
        assert event.startswith(b"data: ") and event.endswith(b"\r\n\r\n")
        line = event[6:-4]
        assert b"\n" not in line and b"\r" not in line and line.isascii()
        body = json.loads(line)
        got = (
            body["choices"][0]["delta"]["content"] if kind == "chat" else body["choices"][0]["text"]
        )
        assert got == text


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_each_choice_has_its_own_template(kind: str) -> None:
    """n > 1: a choice's per-token chunk carries its index, and equals its full chunk."""
    fmt = _Formatter(kind, "cmpl-0123456789abcdef0123456789abcdef", "m")
    for index in (0, 3, 1, 3, 0):
        event = fmt.text_event("x", False, index)
        assert event == _data(fmt.chunk(fmt.text_delta("x"), None, False, index=index))
        assert json.loads(event[6:-4])["choices"][0]["index"] == index


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_whole_body_of_choices(kind: str) -> None:
    fmt = _Formatter(kind, "cmpl-0123456789abcdef0123456789abcdef", "m")
    usage = {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    body = fmt.whole([fmt.choice(i, f"t{i}", "stop", None) for i in range(2)], usage)
    assert body == {**fmt.full("t0", "stop", None, usage),
                    "choices": [fmt.choice(0, "t0", "stop", None),
                                fmt.choice(1, "t1", "stop", None)]}  # fmt: skip
    assert [c["index"] for c in body["choices"]] == [0, 1]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_continuous_usage_rides_on_every_chunk(kind: str) -> None:
    """vLLM's continuous_usage_stats: each choice's prompt and its tokens so far."""
    fmt = _Formatter(kind, "cmpl-0123456789abcdef0123456789abcdef", "m")
    fmt.continuous_usage([4, 7])
    assert fmt.chunk(fmt.empty_delta(), None, True)["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}  # fmt: skip
    fmt.counted(1, [TokenFrame(0, [5, 6]), TokenFrame(1, [7])])
    body = json.loads(fmt.text_event("ab", True, 1)[6:-4])
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    lp = json.loads(fmt.logprobs_event("c", '{"content": []}', True, 0)[6:-4])
    assert lp["usage"]["completion_tokens"] == 0 and lp["choices"][0]["logprobs"] == {
        "content": []}  # fmt: skip
    plain = _Formatter(kind, "cmpl-0123456789abcdef0123456789abcdef", "m")
    plain.counted(0, [TokenFrame(0, [5])])  # nothing kept without it
    assert plain.chunk(plain.empty_delta(), "stop", True)["usage"] is None


def test_chat_echo_starts_the_content() -> None:
    fmt = _Formatter("chat", "chatcmpl-0123456789abcdef0123456789abcdef", "m", echo="Once")
    assert fmt.role_delta() == {"role": "assistant", "content": "Once"}
    assert fmt.choice(0, " upon", "stop", None)["message"]["content"] == "Once upon"
    msg = {"role": "assistant", "content": None, "tool_calls": []}
    assert fmt.choice(0, "", "tool_calls", None, msg)["message"]["content"] == "Once"
