"""The per-token SSE chunk comes from a template; it must equal the chunk built in full."""

from __future__ import annotations

import json

import pytest

from api.sse import Formatter as _Formatter
from api.sse import sse_event as _data

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
