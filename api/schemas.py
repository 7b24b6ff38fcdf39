"""A structured output's JSON schema, checked in the API before anything is sent.

Two checks, each a 400 naming the request field (``param``) and what is wrong, with code
``invalid_structured_output`` (the code the engine uses for a spec xgrammar cannot compile):

* the schema is a valid JSON Schema of its dialect (``$schema``; 2020-12 when it names
  none), by the ``jsonschema`` package's metaschema check: a misspelt type, a bound that
  is not a number;
* it uses no keyword xgrammar 0.2.8 compiles but does not enforce (the output could break
  it): as vLLM's OpenAI server with ``guided_decoding_backend: xgrammar`` refuses them (with
  ``auto`` it falls back to another backend; Conveyor has only xgrammar).

What only the compiler can tell (an unresolvable ``$ref``, say) comes back from the engine
on the request's first frame, as a 400 too. Both checks are cached by the schema's text:
clients send the same schema again and again.
"""

from __future__ import annotations

import functools
import json

from jsonschema.exceptions import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for

from api.errors import OpenAIError, bad_request

CODE = "invalid_structured_output"

# keywords xgrammar 0.2.8 accepts and ignores (measured: it lets an instance that breaks
# them through); ``multipleOf`` only off integers, ``allOf`` only with several subschemas,
# length bounds only beside a ``pattern`` (which then wins)
UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if",
              "dependentRequired", "dependentSchemas", "dependencies")  # fmt: skip
# where subschemas sit: one, a list of them, or a map of names to them
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties",
        "unevaluatedItems", "not", "if", "then", "else", "contains", "propertyNames")  # fmt: skip
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def checked_schema(schema: object, param: str) -> str:
    """The schema's JSON text (``schema``: an object, or JSON text); raises a 400 naming
    ``param`` when it is not JSON, not a schema, or uses what xgrammar does not enforce."""
    if isinstance(schema, str):
        text = schema
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise _bad(f"{param} is not valid JSON: {e}", param) from None
    else:
        text = json.dumps(schema)
    if not isinstance(schema, dict | bool):
        raise _bad(f"{param} must be a JSON Schema (an object), got {type(schema).__name__}",
                   param)  # fmt: skip
    problem = _problem(text) if isinstance(schema, dict) else None
    if problem is not None:
        raise _bad(f"{param} {problem}", param)
    return text


@functools.lru_cache(maxsize=512)
def _problem(text: str) -> str | None:
    """What is wrong with this schema (the end of a sentence naming the field), or None."""
    schema = json.loads(text)
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        return f"is not a valid JSON Schema: {e.message}{_at(list(e.absolute_path))}"
    found = _unenforced(schema, [])
    if found is not None:
        keyword, path = found
        return (f"uses {keyword!r}{_at(path)}, which the xgrammar backend cannot enforce; "
                "leave it out (or check it on the output)")  # fmt: skip
    return None


def _unenforced(schema: object, path: list) -> tuple[str, list] | None:
    """The first keyword (and where) in ``schema`` or its subschemas that xgrammar ignores."""
    if not isinstance(schema, dict):
        return None
    for key in UNENFORCED:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            return key, path
    if "multipleOf" in schema and (schema.get("type") != "integer"
                                   or not float(schema["multipleOf"]).is_integer()):  # fmt: skip
        return "multipleOf", path
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf", path
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return "minLength" if "minLength" in schema else "maxLength", path
    subs: list[tuple[object, list]] = []
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            subs.append((schema[key], [*path, key]))
    for key in _LIST:
        if isinstance(schema.get(key), list):
            subs += [(s, [*path, key, i]) for i, s in enumerate(schema[key])]
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            subs += [(s, [*path, key, name]) for name, s in schema[key].items()]
    for sub, where in subs:
        if (found := _unenforced(sub, where)) is not None:
            return found
    return None


def _at(path: list) -> str:
    return f" (at {'/'.join(map(str, path))})" if path else ""


def _bad(message: str, param: str) -> OpenAIError:
    return bad_request(message, param, CODE)
