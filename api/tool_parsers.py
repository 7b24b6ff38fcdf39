"""Tool calls out of a model's text, streamed: one parser per request (per choice).

A parser is fed the output text as it arrives (:meth:`ToolParser.feed`) and closed once
(:meth:`ToolParser.finish`); it returns events: :class:`Text` (content), :class:`CallStart`
(a call's index, id and function name) and :class:`CallArgs` (a piece of that call's
argument text, verbatim from the output); :class:`Reasoning` comes from
:class:`api.reasoning.ThinkParser`, which sits in front of a tool parser. A non-streamed
response is the same parser fed the whole text at once, so a stream's pieces always
reassemble to exactly the non-streamed message: every parser here gives the same events,
joined, however the text is split.

Parsers for ``tool_choice: "auto"``, one per model family (vLLM's ``--tool-call-parser``
names): ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after
optional content), ``llama3_json`` (the whole output is ``{"name": ..., "parameters": ...}``
objects, ``;``-separated, after an optional ``<|python_tag|>``), ``pythonic`` (Llama 4's
``[f(a=1), g()]``), ``mistral`` (content, then ``[TOOL_CALLS]`` and the calls, in
Mistral's JSON-array or ``name[ARGS]{...}`` form), ``qwen3_coder`` (Qwen3-Coder's
``<tool_call><function=f><parameter=a>...</parameter></function></tool_call>``, values
typed by the function's schema), ``deepseek_v3`` and ``deepseek_v31`` (DeepSeek's call
tokens), ``kimi_k2`` (Kimi K2's, its call ids kept) and ``glm45`` (GLM-4.5's
``<arg_key>``/``<arg_value>`` pairs). A call is announced once its
block is complete and parses (a free-running model may break its JSON halfway); when an
output that looked like tool calls yields none, all of it is content after all.

Parsers for the constrained choices (the grammar guarantees their shape, so their argument
text streams as it comes): :class:`NamedParser` (the output is the named function's
arguments) and :class:`RequiredParser` (a JSON array of ``{"name", "parameters"}`` objects).
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass

# --------------------------------------------------------------------------------------
# Events


@dataclass(slots=True)
class Text:
    text: str


@dataclass(slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(slots=True)
class CallArgs:
    index: int
    text: str


@dataclass(slots=True)
class Reasoning:
    """A reasoning model's thinking (api.reasoning.ThinkParser): not content."""

    text: str


Event = Text | CallStart | CallArgs | Reasoning


def call_id() -> str:
    """A tool call's id, in OpenAI's form (``call_`` and 24 random characters)."""
    return "call_" + secrets.token_hex(12)


class ToolParser:
    """Base: ``feed`` text, then ``finish`` once; ``calls`` counts the calls announced.
    ``schemas``: the request's functions' parameter schemas, by name (set by the tool
    plan), for formats whose argument values carry no types of their own."""

    schemas: dict[str, dict] = {}  # noqa: RUF012 - replaced per parser, never mutated

    def __init__(self) -> None:
        self.calls = 0

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def _call(self, name: str, args: str, id_: str | None = None) -> list[Event]:
        i = self.calls
        self.calls += 1
        return [CallStart(i, id_ or call_id(), name), CallArgs(i, args)]


# --------------------------------------------------------------------------------------
# "auto": the model's own format


class _ContentThenCalls(ToolParser):
    """Content until the first ``MARK``, streamed as it comes (holding back only what may
    be the start of ``MARK``); from ``MARK`` on, the tool part (``_held``), which the
    subclass reads with :meth:`_calls`."""

    MARK = ""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # content not yet sent (a possible start of MARK)
        self._in_tools = False
        self._held = ""  # everything from the first MARK on: content if no call parses
        self._pos = 0  # in _held: where the next call is looked for

    def feed(self, text: str) -> list[Event]:
        if self._in_tools:
            self._held += text
            return self._calls()
        self._buf += text
        at = self._buf.find(self.MARK)
        if at < 0:  # keep back what may be the start of MARK
            keep = partial_suffix(self._buf, self.MARK)
            out, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            return [Text(out)] if out else []
        events: list[Event] = [Text(self._buf[:at])] if at else []
        self._in_tools, self._held, self._buf = True, self._buf[at:], ""
        return events + self._calls()

    def _calls(self) -> list[Event]:
        raise NotImplementedError


class HermesParser(_ContentThenCalls):
    """``content<tool_call>{"name": "f", "arguments": {...}}</tool_call>...``: content is
    the text before the first ``<tool_call>``; each complete block whose body is a JSON
    object with a string ``name`` (and ``arguments``, ``{}`` when absent) is a call; text
    between and after blocks, and blocks that do not parse, are dropped. An unclosed last
    block counts if its body parses. No call at all: the whole output is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    MARK = OPEN

    def finish(self) -> list[Event]:
        if not self._in_tools:
            return [Text(self._buf)] if self._buf else []
        events: list[Event] = []
        start = self._held.find(self.OPEN, self._pos)
        if start >= 0:  # an unclosed last block
            events += self._parse(self._held[start + len(self.OPEN) :])
        if self.calls == 0:
            events.append(Text(self._held))
        return events

    def _calls(self) -> list[Event]:
        events: list[Event] = []
        while True:
            start = self._held.find(self.OPEN, self._pos)
            if start < 0:
                return events
            end = self._held.find(self.CLOSE, start)
            if end < 0:
                return events
            events += self._parse(self._held[start + len(self.OPEN) : end])
            self._pos = end + len(self.CLOSE)

    def _parse(self, body: str) -> list[Event]:
        call = _call_object(body.strip(), ("arguments",))
        return self._call(*call) if call else []


class Qwen3CoderParser(HermesParser):
    """Qwen3-Coder's XML calls, in ``<tool_call>`` blocks after optional content::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Oslo
        </parameter>
        </function>
        </tool_call>

    A parameter's value is raw text (one newline either side dropped), typed by the
    function's schema (:func:`_typed`, as vLLM's ``qwen3_coder`` parser types it); the
    arguments are that object as JSON. Blocks are read as Hermes's are."""

    def _parse(self, body: str) -> list[Event]:
        fn = _XML_FUNCTION.fullmatch(body.strip())
        if fn is None:
            return []
        name = fn.group(1).strip()
        props = (self.schemas.get(name) or {}).get("properties") or {}
        args = {}
        for m in _XML_PARAMETER.finditer(fn.group(2)):
            key = m.group(1).strip()
            value = m.group(2).removeprefix("\n").removesuffix("\n")
            args[key] = _typed(value, props.get(key))
        return self._call(name, json.dumps(args, ensure_ascii=False))


class DeepSeekV3Parser(HermesParser):
    """DeepSeek-V3's and R1's calls (vLLM's ``deepseek_v3``): content, then::

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
        ```json
        {"city": "Oslo"}
        ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

    each call's arguments the JSON object in its fenced block. Blocks are read as
    Hermes's are (the delimiters are DeepSeek's tokens; ``｜`` and ``▁`` are U+FF5C and
    U+2581)."""

    MARK = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
    OPEN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
    CLOSE = "<\uff5ctool\u2581call\u2581end\uff5c>"
    SEP = "<\uff5ctool\u2581sep\uff5c>"

    def _parse(self, body: str) -> list[Event]:
        _, sep, rest = body.partition(self.SEP)  # the type ("function") before it
        name, _, fenced = rest.partition("\n")
        args = fenced.strip().removeprefix("```json").removesuffix("```").strip()
        if not sep or not name.strip() or _members(args) is None:
            return []
        return self._call(name.strip(), args)


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1's calls (vLLM's ``deepseek_v31``): as V3's, without the type and the
    fence: ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>``."""

    def _parse(self, body: str) -> list[Event]:
        name, sep, args = body.partition(self.SEP)
        if not sep or not name.strip() or _members(args.strip()) is None:
            return []
        return self._call(name.strip(), args.strip())


class KimiK2Parser(HermesParser):
    """Kimi K2's calls (vLLM's ``kimi_k2``): content, then::

        <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
        <|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>...
        <|tool_calls_section_end|>

    The call's id is the model's own (``functions.get_weather:0``, which Kimi's template
    writes back in the next turn), its name the part between the last ``.`` and ``:``."""

    MARK = "<|tool_calls_section_begin|>"
    OPEN, CLOSE = "<|tool_call_begin|>", "<|tool_call_end|>"
    ARGS = "<|tool_call_argument_begin|>"

    def _parse(self, body: str) -> list[Event]:
        ident, sep, args = body.partition(self.ARGS)
        ident, args = ident.strip(), args.strip()
        name = ident.split(":", 1)[0].rsplit(".", 1)[-1]
        if not sep or not name or _members(args) is None:
            return []
        return self._call(name, args, ident)


class Glm45Parser(HermesParser):
    """GLM-4.5's and 4.6's calls (vLLM's ``glm45``), in ``<tool_call>`` blocks after
    optional content::

        <tool_call>get_weather
        <arg_key>city</arg_key>
        <arg_value>Oslo</arg_value>
        </tool_call>

    A value is raw text typed by the function's schema (as Qwen3-Coder's are)."""

    def _parse(self, body: str) -> list[Event]:
        name, _, rest = body.partition("<arg_key>")
        name = name.strip()
        if not name or "\n" in name or "<" in name:
            return []
        props = (self.schemas.get(name) or {}).get("properties") or {}
        args = {}
        for m in _GLM_ARG.finditer("<arg_key>" + rest if rest else ""):
            key = m.group(1).strip()
            args[key] = _typed(m.group(2), props.get(key))
        return self._call(name, json.dumps(args, ensure_ascii=False))


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>)?", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                            re.DOTALL)  # fmt: skip


def _typed(value: str, schema: object) -> object:
    """A parameter's text as its schema's type says (JSON for objects and arrays, Python's
    literal syntax as a fallback); the text itself where it does not parse as that type, or
    the schema says only string or nothing. ``null`` is None where another type is allowed."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    types = {kinds} if isinstance(kinds, str) else set(kinds or [])
    if not types or types <= {"string"}:
        return value
    text = value.strip()
    if text.lower() == "null":
        return None
    try:
        if types & {"integer"} and re.fullmatch(r"[-+]?\d+", text):
            return int(text)
        if types & {"number", "integer"}:
            number = float(text)
            return int(number) if number.is_integer() and types & {"integer"} else number
        if "boolean" in types and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if types & {"object", "array"}:
            try:
                return json.loads(text)
            except ValueError:
                return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    return value


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calls: an output that starts (after whitespace) with
    ``<|python_tag|>`` or ``{`` is ``;``-separated JSON objects, each with a string ``name``
    and ``parameters`` (or ``arguments``); parsing stops at the first one that does not
    parse. Any other output is content, streamed as it comes; one that yields no call is
    content whole."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode: str | None = None  # None: undecided, "text", "tools"
        self._pos = 0  # in _buf (tools): where the next object starts
        self._stopped = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return []  # undecided yet
            tools = head.startswith(self.TAG) or head.startswith("{")
            self._mode = "tools" if tools else "text"
            if tools:
                self._pos = len(self._buf) - len(head)
                if head.startswith(self.TAG):
                    self._pos += len(self.TAG)
        if self._mode == "text":
            out, self._buf = self._buf, ""
            return [Text(out)] if out else []
        return self._objects()

    def finish(self) -> list[Event]:
        if self._mode != "tools":
            return [Text(self._buf)] if self._buf else []
        return [] if self.calls else [Text(self._buf)]

    def _objects(self) -> list[Event]:
        events: list[Event] = []
        while not self._stopped:
            i = _skip(self._buf, self._pos, " \t\r\n;")
            if i >= len(self._buf):
                return events
            if self._buf[i] != "{":
                self._stopped = True
                break
            end = _value_end(self._buf, i)
            if end is None:
                return events
            call = _call_object(self._buf[i:end], ("parameters", "arguments"))
            if call is None:
                self._stopped = True
                break
            events += self._call(*call)
            self._pos = end
        return events


class PythonicParser(ToolParser):
    """Pythonic tool calls (Llama 4, Llama 3.2; vLLM's ``pythonic``): an output that starts
    (after whitespace, and an optional ``<|python_start|>``) with ``[`` is a Python list of
    calls, ``[get_weather(city="Paris"), now()]``: keyword arguments whose values are
    literals (Python's spelling of JSON's values). The list is read once it closes: its
    calls come then, their arguments as JSON. Any other output is content, streamed as it
    comes; a list that does not read as calls is content whole."""

    START, END = "<|python_start|>", "<|python_end|>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode: str | None = None  # None: undecided, "text", "tools"
        self._done = False  # the list was read (what follows is dropped)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if head.startswith(self.START):
                head = head[len(self.START) :].lstrip()
            elif self.START.startswith(head):
                return []  # undecided yet ("", "<|python")
            if not head:
                return []
            self._mode = "tools" if head.startswith("[") else "text"
        if self._mode == "text":
            out, self._buf = self._buf, ""
            return [Text(out)] if out else []
        if self._done or not self._buf.rstrip().endswith("]"):
            return []
        return self._read()

    def finish(self) -> list[Event]:
        if self._mode != "tools":
            return [Text(self._buf)] if self._buf else []
        events = [] if self._done else self._read()
        return events if self.calls else [Text(self._buf)]

    def _read(self) -> list[Event]:
        body = self._buf.strip().removeprefix(self.START).removesuffix(self.END).strip()
        calls = _pythonic_calls(body)
        if calls is None:
            return []
        self._done = True
        return [ev for name, args in calls for ev in self._call(name, args)]


def _pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """``[f(a=1), g()]`` as ``[(name, JSON arguments)]``; None unless ``text`` is exactly a
    list of calls by name with literal keyword arguments."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List):
        return None
    out = []
    for call in tree.elts:
        if not isinstance(call, ast.Call) or call.args or not isinstance(call.func, ast.Name):
            return None
        if any(kw.arg is None for kw in call.keywords):  # **kwargs
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
            out.append((call.func.id, json.dumps(args)))
        except (ValueError, TypeError, SyntaxError):  # not a literal, or not JSON's
            return None
    return out


class MistralParser(_ContentThenCalls):
    """Mistral's tool calls (vLLM's ``mistral``): content, then ``[TOOL_CALLS]`` and the
    calls, in either of Mistral's forms: a JSON array of ``{"name", "arguments"}`` objects
    (older tokenizers), or ``name[ARGS]{...}`` per call, each after its own
    ``[TOOL_CALLS]`` (v11 and later). A call is announced once its JSON is complete and
    parses. No call at all: the whole output is content."""

    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self) -> None:
        super().__init__()
        self._stopped = False

    def finish(self) -> list[Event]:
        if not self._in_tools:
            return [Text(self._buf)] if self._buf else []
        return [] if self.calls else [Text(self._held)]

    def _calls(self) -> list[Event]:
        events: list[Event] = []
        while not self._stopped:
            i = _skip(self._held, self._pos, " \t\r\n")
            if self._held.startswith(self.MARK, i):
                i = _skip(self._held, i + len(self.MARK), " \t\r\n")
            if i >= len(self._held):
                return events
            if self._held[i] in "[{":  # the JSON form: one array (or one object)
                end = _value_end(self._held, i)
                if end is None:
                    return events
                events += self._json_calls(self._held[i:end])
                self._pos, self._stopped = end, True
                return events
            args = self._held.find(self.ARGS, i)  # the v11 form: name[ARGS]{...}
            if args < 0:
                return events
            j = _skip(self._held, args + len(self.ARGS), " \t\r\n")
            if j >= len(self._held):
                return events
            name, raw = self._held[i:args].strip(), self._held[j:]
            if not raw.startswith("{") or not name:
                self._stopped = True
                break
            end = _value_end(raw, 0)
            if end is None:
                return events
            if _members(raw[:end]) is None:  # not one JSON object
                self._stopped = True
                break
            events += self._call(name, raw[:end])  # the arguments as the model wrote them
            self._pos = j + end
        return events

    def _json_calls(self, text: str) -> list[Event]:
        try:
            value = json.loads(text)
        except ValueError:
            return []
        items = value if isinstance(value, list) else [value]
        events: list[Event] = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return events
            args = item.get("arguments", {})
            if isinstance(args, str):
                events += self._call(item["name"], args)
            elif isinstance(args, dict):
                events += self._call(item["name"], json.dumps(args))
            else:
                return events
        return events


# --------------------------------------------------------------------------------------
# "required" and a named function: output shaped by a grammar


class NamedParser(ToolParser):
    """The output is the arguments of the one function named by ``tool_choice``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.calls == 0:
            self.calls = 1
            events.append(CallStart(0, call_id(), self._name))
        if text:
            events.append(CallArgs(0, text))
        return events

    def finish(self) -> list[Event]:
        return self.feed("")


class RequiredParser(ToolParser):
    """The output is ``[{"name": "f", "parameters": {...}}, ...]``: each element a call,
    announced once its name is read, its ``parameters`` text streamed verbatim as it comes
    (held back only while the name is still unknown). Scanned character by character, so
    any split of the text gives the same events; scanning stops at the first character the
    shape does not allow (a grammar makes that the end of the output)."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"
        self._key = ""  # the member being read
        self._scan: _ValueScan | None = None  # the value being read
        self._name: str | None = None  # of the element being read
        self._started = False  # its CallStart is out
        self._pending = ""  # its parameters text read before its name
        self._args_seen = False  # its parameters member was read

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for ch in text:
            self._step(ch, events)
        return events

    def finish(self) -> list[Event]:
        return []

    def _step(self, ch: str, out: list[Event]) -> None:
        st = self._state
        if st == "value":
            assert self._scan is not None
            used = self._scan.push(ch)
            if used:
                self._value_text(ch, out)
            if self._scan.done:
                self._value_end(out)
                if not used:
                    self._step(ch, out)
            return
        if ch in " \t\r\n" and st != "key":
            return
        if st == "start":
            self._state = "element_first" if ch == "[" else "stop"
        elif st in ("element", "element_first"):
            if ch == "{":
                self._state, self._name, self._started = "member", None, False
                self._pending, self._args_seen = "", False
            elif ch == "]" and st == "element_first":
                self._state = "stop"
            else:
                self._state = "stop"
        elif st == "member":
            if ch == '"':
                self._state, self._scan = "key", _ValueScan()
                self._scan.push(ch)
            else:
                self._state = "stop"
        elif st == "key":
            assert self._scan is not None
            self._scan.push(ch)
            if self._scan.done:
                self._key = json.loads(self._scan.text)
                self._state = "colon"
        elif st == "colon":
            self._state, self._scan = ("value", _ValueScan()) if ch == ":" else ("stop", None)
        elif st == "after_value":
            if ch == ",":
                self._state = "member"
            elif ch == "}":
                self._element_end(out)
                self._state = "after_element"
            else:
                self._state = "stop"
        elif st == "after_element":
            self._state = "element" if ch == "," else "stop"

    def _value_text(self, ch: str, out: list[Event]) -> None:
        if self._key != "parameters":
            return
        if self._started:
            _append_args(out, self.calls - 1, ch)
        else:
            self._pending += ch

    def _value_end(self, out: list[Event]) -> None:
        assert self._scan is not None
        if self._key == "parameters":
            self._args_seen = True
        if self._key == "name" and self._name is None:
            name = json.loads(self._scan.text) if self._scan.text[:1] == '"' else None
            if isinstance(name, str):
                self._name = name
                self._started = True
                out.append(CallStart(self.calls, call_id(), name))
                self.calls += 1
                if self._pending:
                    _append_args(out, self.calls - 1, self._pending)
                    self._pending = ""
        self._state, self._scan = "after_value", None

    def _element_end(self, out: list[Event]) -> None:
        if self._started and not self._args_seen:  # no parameters member: no arguments
            _append_args(out, self.calls - 1, "{}")
        self._name = None


def _append_args(out: list[Event], index: int, text: str) -> None:
    """Add argument text, merged into the previous event when it is the same call's."""
    if out and isinstance(out[-1], CallArgs) and out[-1].index == index:
        out[-1].text += text
    else:
        out.append(CallArgs(index, text))


# --------------------------------------------------------------------------------------
# JSON scanning: where a value ends, and the raw text of an object's members


class _ValueScan:
    """Reads one JSON value a character at a time: ``push`` says whether the character
    belongs to the value; ``done`` once it ended. A number or literal ends at the first
    character that cannot continue it (not consumed); strings, objects and arrays at their
    closing character. Validity beyond nesting is not checked (``json.loads`` does that)."""

    __slots__ = ("text", "done", "_depth", "_in_str", "_esc", "_scalar")

    def __init__(self) -> None:
        self.text = ""
        self.done = False
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._scalar = False

    def push(self, ch: str) -> bool:
        if self.done:
            return False
        if not self.text:
            if ch in " \t\r\n":
                return False
            self.text = ch
            if ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth = 1
            else:
                self._scalar = True
            return True
        if self._scalar:
            if ch in "+-.0123456789eEtruefalsn":
                self.text += ch
                return True
            self.done = True
            return False
        self.text += ch
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                if self._depth == 0:
                    self.done = True
        elif ch == '"':
            self._in_str = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self.done = True
        return True


def _value_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array starting at ``text[start]``, or None
    while it is unfinished."""
    scan = _ValueScan()
    for i in range(start, len(text)):
        scan.push(text[i])
        if scan.done:
            return i + 1
    return None


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


_DECODER = json.JSONDecoder()


def _members(text: str) -> dict[str, tuple[object, str]] | None:
    """A JSON object's members as ``name -> (value, raw text of the value)``; None unless
    ``text`` is exactly one JSON object."""
    try:
        i = _skip(text, 0, " \t\r\n")
        if text[i : i + 1] != "{":
            return None
        out: dict[str, tuple[object, str]] = {}
        i = _skip(text, i + 1, " \t\r\n")
        if text[i : i + 1] == "}":
            i += 1
        else:
            while True:
                if text[i : i + 1] != '"':
                    return None
                key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
                i = _skip(text, i, " \t\r\n")
                if text[i : i + 1] != ":":
                    return None
                i = _skip(text, i + 1, " \t\r\n")
                value, end = _DECODER.raw_decode(text, i)
                out[key] = (value, text[i:end])
                i = _skip(text, end, " \t\r\n")
                if text[i : i + 1] == ",":
                    i = _skip(text, i + 1, " \t\r\n")
                    continue
                if text[i : i + 1] != "}":
                    return None
                i += 1
                break
        return out if _skip(text, i, " \t\r\n") == len(text) else None
    except (ValueError, IndexError):
        return None


def _call_object(text: str, arg_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, raw argument text)`` of a call object, or None. The arguments are kept as
    the model wrote them (an object's text; a JSON string's content when the model wrote
    the arguments as an encoded string); ``{}`` when absent."""
    members = _members(text)
    if members is None or not isinstance(members.get("name", (None,))[0], str):
        return None
    name = members["name"][0]
    for key in arg_keys:
        if key in members:
            value, raw = members[key]
            if isinstance(value, str):  # arguments sent as a JSON-encoded string
                return name, value  # type: ignore[return-value]
            if not isinstance(value, dict):
                return None
            return name, raw  # type: ignore[return-value]
    return name, "{}"  # type: ignore[return-value]


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# --------------------------------------------------------------------------------------
# The registry: vLLM's names

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
    "mistral": MistralParser,
    "qwen3_coder": Qwen3CoderParser,
    "deepseek_v3": DeepSeekV3Parser,
    "deepseek_v31": DeepSeekV31Parser,
    "kimi_k2": KimiK2Parser,
    "glm45": Glm45Parser,
}


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's tool-call format asks for: ``qwen3_coder`` for one that
    writes ``<function=...>`` / ``<parameter=...>`` calls, ``mistral`` for one that
    writes ``[TOOL_CALLS]``, ``pythonic`` for Llama 4's ``<|python_start|>``,
    ``llama3_json`` for ``<|python_tag|>`` or Llama 3's ``"parameters"`` calls,
    ``glm45`` for ``<arg_key>``, ``deepseek_v3`` / ``deepseek_v31`` for DeepSeek's call
    tokens (V3's fenced JSON or V3.1's bare), ``kimi_k2`` for Kimi's, else ``hermes``
    (``<tool_call>`` blocks, the most common format, and the default model's)."""
    t = template or ""
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<arg_key>" in t:
        return "glm45"
    if DeepSeekV3Parser.OPEN in t:
        return "deepseek_v3" if "```json" in t else "deepseek_v31"
    if KimiK2Parser.OPEN in t:
        return "kimi_k2"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_start|>" in t:
        return "pythonic"
    if "<|python_tag|>" in t or ("<|eot_id|>" in t and "parameters" in t):
        return "llama3_json"
    return "hermes"
