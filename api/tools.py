"""Tool calling, above the engine: the request's tools and choice, the constraint a choice
puts on the output, and the output read back as OpenAI's ``tool_calls``.

An engine never sees a tool. The tools reach the prompt through the chat template
(:meth:`api.tokenization.PromptBuilder.chat_prompt`); a choice that forces calls becomes a
structured-output constraint (:class:`kvbm.protocol.StructuredOutput`, as JSON Schema), so
the calls always parse and their arguments match the function's ``parameters``:

* a named function (``{"type": "function", "function": {"name": "f"}}``): the output is
  f's arguments (its ``parameters`` schema); the response's call is ``f`` with that text.
* ``required``: the output is a JSON array of ``{"name": <one of the tools>,
  "parameters": <its schema>}`` objects, at least one, exactly one when
  ``parallel_tool_calls`` is false (vLLM's approach).
* ``auto``: the model's own format is parsed (:mod:`api.tool_parsers`, the deployment's
  ``tool_call_parser``). Free text is free; where a tool is ``strict: true`` (OpenAI's;
  the OpenAI Agents SDK's default) and the format is one of :data:`STRICT_FORMATS`, every
  call the model opens is constrained (an xgrammar structural tag triggered by the
  format's opening): its name is one of the tools' and a strict tool's arguments match
  its schema (vLLM's ``--tool-strict-level auto``). A request's own structured output
  takes precedence; an engine without structured outputs serves it unconstrained
  (``StructuredOutput.best_effort``). ``none``: the tools are still rendered (vLLM's
  default) and the output is plain content.

``finish_reason`` is ``tool_calls`` when ``auto`` or ``required`` produced calls (for
``required``, when the output ended on its own, not on ``length``), as vLLM and OpenAI
answer; a named choice answers ``stop``, as OpenAI does for a forced function.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from api.errors import bad_request
from api.protocol import ChatCompletionRequest
from api.tool_parsers import (
    PARSERS,
    CallArgs,
    CallStart,
    Event,
    NamedParser,
    Reasoning,
    RequiredParser,
    Text,
    ToolParser,
)
from kvbm.protocol import Sampling, StructuredOutput

CHOICES = ("none", "auto", "required")


@dataclass(slots=True)
class ToolPlan:
    """What a request's tools ask of its output."""

    tools: list[dict]  # OpenAI's tool objects, as the template gets them
    choice: str  # none | auto | required | named
    name: str | None = None  # the named function
    parallel: bool = True
    parser_name: str = "hermes"  # for auto
    schemas: dict[str, dict] = field(default_factory=dict)  # function name -> parameters
    strict: frozenset[str] = frozenset()  # the functions marked ``strict: true``

    @property
    def constraint(self) -> StructuredOutput | None:
        """The structured output that enforces the choice (None: free text)."""
        if self.choice == "named":
            assert self.name is not None
            return StructuredOutput(json_schema=json.dumps(self.schemas[self.name]))
        if self.choice == "required":
            return StructuredOutput(json_schema=json.dumps(required_schema(self)))
        if self.choice == "auto" and self.strict and self.parser_name in STRICT_FORMATS:
            return strict_calls(self)
        return None

    def parser(self) -> ToolParser | None:
        """A fresh output parser (one per choice of the request); None for ``none``."""
        if self.choice == "named":
            assert self.name is not None
            return NamedParser(self.name)
        if self.choice == "required":
            return RequiredParser()
        if self.choice == "auto":
            parser = PARSERS[self.parser_name]()
            parser.schemas = self.schemas
            return parser
        return None

    def finish_reason(self, engine_reason: str | None, calls: int) -> str | None:
        if calls and (
            self.choice == "auto" or (self.choice == "required" and engine_reason == "stop")
        ):
            return "tool_calls"
        return engine_reason


def tool_plan(req: ChatCompletionRequest, parser_name: str) -> ToolPlan | None:
    """The request's tools and choice, checked (400 naming the field); None when it has
    no tools. ``tool_choice`` defaults to ``auto`` with tools (OpenAI's default)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools: `tools` is empty or missing", "tool_choice")
        return None
    schemas = tool_schemas(req.tools)
    strict = frozenset(t["function"]["name"] for t in req.tools
                       if (t.get("function") or {}).get("strict") is True)  # fmt: skip
    plan = ToolPlan(
        list(req.tools),
        "auto",
        parallel=req.parallel_tool_calls,
        parser_name=parser_name,
        schemas=schemas,
        strict=strict,
    )
    if choice is None or choice in CHOICES:
        plan.choice = choice or "auto"
        return plan
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(named, str):
            raise bad_request(
                "tool_choice.function.name must name a function", "tool_choice.function.name"
            )
        if named not in schemas:
            raise bad_request(
                f"tool_choice names {named!r}, which is not in `tools` ({', '.join(schemas)})",
                "tool_choice.function.name",
            )
        plan.choice, plan.name = "named", named
        return plan
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def tool_schemas(tools: list[dict]) -> dict[str, dict]:
    """Each function tool's parameters schema by its name, the tools checked (a 400
    naming the field: a tool that is not a function, a name missing or used twice)."""
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        name, params = _function(tool, f"tools.{i}")
        if name in schemas:
            raise bad_request(f"two tools are named {name!r}", f"tools.{i}.function.name")
        schemas[name] = params
    return schemas


def constrain(sampling: Sampling, plan: ToolPlan | None) -> Sampling:
    """The sampling with the choice's constraint. A forced choice (``required``, named)
    overrides the request's own (``response_format``, ``structured_outputs``,
    ``guided_*``), as vLLM's does: its output is the call, with no text for a format to
    shape (an agent SDK sends both, its output type beside a forced first call). Strict
    auto calls give way to the request's own constraint."""
    spec = plan.constraint if plan is not None else None
    if spec is None or (spec.best_effort and sampling.structured is not None):
        return sampling
    return sampling.model_copy(update={"structured": spec})


# auto calls' formats a strict tool's schema can constrain (tool_call_parser names)
STRICT_FORMATS = ("hermes", "qwen3_coder", "llama3_json")


def _call_format(parser: str, name: str) -> tuple[str, str, str, str]:
    """A function's call in an auto format: (the opening that triggers a call, the text
    before its arguments, the arguments' style, the text after them)."""
    quoted = json.dumps(name)
    if parser == "hermes":
        return ("<tool_call>", f'<tool_call>\n{{"name": {quoted}, "arguments": ', "json",
                "}\n</tool_call>")  # fmt: skip
    if parser == "qwen3_coder":
        return ("<tool_call>", f"<tool_call>\n<function={name}>\n", "qwen_xml",
                "</function>\n</tool_call>")  # fmt: skip
    return '{"name": ', f'{{"name": {quoted}, "parameters": ', "json", "}"  # llama3_json


def strict_calls(plan: ToolPlan) -> StructuredOutput:
    """``auto`` with strict tools: free text, and each call the model opens in its format
    constrained to one of the tools, a strict one's arguments to its schema (any object
    for the others); one call only without parallel calls."""
    tags, trigger = [], ""
    for name, schema in plan.schemas.items():
        trigger, begin, style, end = _call_format(plan.parser_name, name)
        args = schema if name in plan.strict else {"type": "object"}
        # at most one whitespace character in a row: a bounded schema always finishes
        content = {"type": "json_schema", "json_schema": args, "style": style,
                   "max_whitespace_cnt": 1}  # fmt: skip
        tags.append({"type": "tag", "begin": begin, "content": content, "end": end})
    fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
           "stop_after_first": not plan.parallel}  # fmt: skip
    return StructuredOutput(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}),
                            param="tools", best_effort=True)  # fmt: skip


def required_schema(plan: ToolPlan) -> dict:
    """``required``: a JSON array of calls, each ``{"name", "parameters"}`` of one tool
    (vLLM's shape); one call at most unless parallel calls are allowed."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, params in plan.schemas.items()
    ]
    schema: dict = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if not plan.parallel:
        schema["maxItems"] = 1
    return schema


# --------------------------------------------------------------------------------------
# The output, in chat completions' shapes


class ChatOutput:
    """One choice's chat output through its parser (tool calls; a reasoning model's
    thinking, api.reasoning): stream deltas as it comes, and the whole message at the end
    (the same events, so they always agree). ``plan``: the request's tools, if any."""

    def __init__(self, plan: ToolPlan | None, parser: ToolParser) -> None:
        self.plan = plan
        self.parser = parser
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict] = []
        self._finished = False

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self.parser.feed(text))

    def finish(self) -> list[dict]:
        self._finished = True
        return self._deltas(self.parser.finish())

    def finish_reason(self, engine_reason: str | None) -> str | None:
        assert self._finished, "finish_reason() before the output was parsed (it counts calls)"
        if self.plan is None:
            return engine_reason
        return self.plan.finish_reason(engine_reason, len(self.calls))

    def message(self, text: str) -> dict:
        """The non-streamed message for the whole output ``text``."""
        self.feed(text)
        self.finish()
        msg: dict = {"role": "assistant", "content": "".join(self.content) or None}
        if self.calls:
            msg["tool_calls"] = self.calls
        elif msg["content"] is None:
            msg["content"] = ""
        if self.reasoning:  # vLLM's field, and the older name DeepSeek's API still uses
            msg["reasoning"] = msg["reasoning_content"] = "".join(self.reasoning)
        return msg

    def _deltas(self, events: list[Event]) -> list[dict]:
        """Stream deltas for ``events`` (consecutive pieces of one kind merged)."""
        out: list[dict] = []
        for ev in events:
            if isinstance(ev, Reasoning):
                self.reasoning.append(ev.text)
                if out and "reasoning" in out[-1]:
                    out[-1]["reasoning"] += ev.text
                    out[-1]["reasoning_content"] += ev.text
                else:
                    out.append({"reasoning": ev.text, "reasoning_content": ev.text})
            elif isinstance(ev, Text):
                self.content.append(ev.text)
                if out and "content" in out[-1]:
                    out[-1]["content"] += ev.text
                else:
                    out.append({"content": ev.text})
            elif isinstance(ev, CallStart):
                self.calls.append(
                    {
                        "id": ev.id,
                        "type": "function",
                        "function": {"name": ev.name, "arguments": ""},
                    }
                )
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": ev.index,
                                "id": ev.id,
                                "type": "function",
                                "function": {"name": ev.name, "arguments": ""},
                            }
                        ]
                    }
                )
            elif isinstance(ev, CallArgs):
                self.calls[ev.index]["function"]["arguments"] += ev.text
                last = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
                if last is not None and last["index"] == ev.index:
                    last["function"]["arguments"] += ev.text
                else:
                    out.append(
                        {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}
                    )
        return out


def _function(tool: object, param: str) -> tuple[str, dict]:
    """A tool's function name and parameters schema (``{"type": "object",
    "properties": {}}`` when it takes none)."""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(
            "only function tools are supported ({'type': 'function', 'function': {...}})",
            f"{param}.type",
        )
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request("a tool needs function.name", f"{param}.function.name")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise bad_request(
            "function.parameters must be a JSON Schema object", f"{param}.function.parameters"
        )
    return fn["name"], params
