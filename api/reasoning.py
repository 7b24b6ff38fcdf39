"""A reasoning model's thinking, split from its answer (vLLM's ``--reasoning-parser``).

Reasoning models (DeepSeek-R1, Qwen3 and their kin) think first, then answer: their output
is ``<think>`` ... ``</think>`` and then the answer, and their chat templates usually open
the ``<think>`` in the prompt, so the output starts inside it. With
``CONVEYOR_REASONING_PARSER`` set, each choice's output goes through a
:class:`ThinkParser`: the text up to ``</think>`` comes out as :class:`Reasoning` events
(chat's ``reasoning`` field, the Responses API's ``reasoning`` item) and the rest goes on
to the request's tool parser, or out as content. The tags are matched in the text, not as
token ids, so a tag split over several frames (or tokens) is found all the same; the
text that may be the start of a tag is held back until the next piece tells.

Parsers (vLLM's names; both start in the thinking part, a leading ``<think>`` dropped):
``deepseek_r1`` (an output that never closes its thinking is all reasoning) and ``qwen3``
(the same, unless ``chat_template_kwargs: {"enable_thinking": false}`` turned thinking off:
then all of it is the answer). A grammar-constrained output (structured outputs, a forced
tool choice) thinks first too, as vLLM lets it: the grammar applies from the token after
``</think>`` (``StructuredOutput.after``, set where the request is started).
"""

from __future__ import annotations

from api.protocol import ChatCompletionRequest
from api.tool_parsers import Event, Reasoning, Text, ToolParser, partial_suffix
from api.tools import ToolPlan

THINK_START, THINK_END = "<think>", "</think>"


class ThinkParser(ToolParser):
    """The thinking part of an output as :class:`Reasoning` events; the rest through
    ``inner`` (a tool parser), or as :class:`Text`. The output starts inside the thinking
    (its ``<think>`` was in the prompt, or it opens with one). ``keep`` False: the thinking
    is dropped (vLLM's ``include_reasoning: false``)."""

    def __init__(self, inner: ToolParser | None, keep: bool = True) -> None:
        super().__init__()
        self.inner = inner
        self.keep = keep
        self._thinking = True
        self._started = False  # the opening is past (a leading tag dropped, or none)
        self._held = ""  # text that may be the start of a tag

    @property
    def calls(self) -> int:
        return self.inner.calls if self.inner is not None else 0

    @calls.setter
    def calls(self, _: int) -> None:  # ToolParser's __init__ sets it
        pass

    def feed(self, text: str) -> list[Event]:
        if not self._thinking:
            return self._answer(text)
        text = self._held + text
        self._held = ""
        if not self._started:  # a leading <think> (after whitespace) is markup
            stripped = text.lstrip()
            if THINK_START.startswith(stripped) and stripped != THINK_START:
                self._held = text  # "", "<thi": wait for the rest
                return []
            self._started = True
            if stripped.startswith(THINK_START):
                text = stripped[len(THINK_START) :]
        end = text.find(THINK_END)
        if end >= 0:
            self._thinking = False
            return self._think(text[:end]) + self._answer(text[end + len(THINK_END) :])
        keep = partial_suffix(text, THINK_END)  # "</th" at the end: maybe the tag
        self._held = text[len(text) - keep :] if keep else ""
        return self._think(text[: len(text) - keep])

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        out = self._think(held) if self._thinking and held else []
        if self.inner is not None:
            out += self.inner.finish()
        return out

    def _think(self, text: str) -> list[Event]:
        return [Reasoning(text)] if text and self.keep else []

    def _answer(self, text: str) -> list[Event]:
        if self.inner is not None:
            return self.inner.feed(text)
        return [Text(text)] if text else []


def thinks(parser: str | None, chat_template_kwargs: dict | None) -> bool:
    """Whether a request's output may hold thinking to split off: a parser is set and the
    request did not turn thinking off (qwen3's ``enable_thinking: false``)."""
    if parser is None:
        return False
    return not (parser == "qwen3"
                and (chat_template_kwargs or {}).get("enable_thinking") is False)  # fmt: skip


def output_parser(
    name: str | None, plan: ToolPlan | None, req: ChatCompletionRequest
) -> ToolParser | None:  # fmt: skip
    """The parser one choice's output of ``req`` goes through: the tool plan's (if any),
    behind a :class:`ThinkParser` where the output may hold thinking (:func:`thinks`;
    ``name``: the reasoning parser set, if any). Such an output is thinking from its first
    token, a constrained one too: its grammar waits for the end of thinking
    (``StructuredOutput.after``). None: the text is all content."""
    tools = plan.parser() if plan is not None else None
    if not thinks(name, req.chat_template_kwargs):
        return tools
    return ThinkParser(tools, keep=req.include_reasoning)
