"""The API's checks of a structured output's JSON schema: a 400 naming the field and the
problem (code invalid_structured_output) for a schema that is not JSON or not a JSON
Schema, and for one using a keyword xgrammar would ignore; the rest passes as it came."""

from __future__ import annotations

import json

import pytest

from api.errors import OpenAIError
from api.schemas import checked_schema

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _refused(schema: object) -> str:
    with pytest.raises(OpenAIError) as e:
        checked_schema(schema, "guided_json")
    err = e.value
    assert err.status == 400 and err.param == "guided_json"
    assert err.code == "invalid_structured_output" and err.message.startswith("guided_json ")
    return err.message


def test_a_valid_schema_passes_as_its_text() -> None:
    assert checked_schema(OBJ, "p") == json.dumps(OBJ)
    text = ' {"type": "string"} '
    assert checked_schema(text, "p") == text
    assert checked_schema(True, "p") == "true"
    # a property may be called like a keyword xgrammar ignores
    named = {"type": "object", "properties": {"not": {"type": "boolean"},
                                              "uniqueItems": {"type": "integer"}}}  # fmt: skip
    checked_schema(named, "p")
    checked_schema({"type": "integer", "multipleOf": 5}, "p")  # enforced on integers
    checked_schema({"allOf": [OBJ]}, "p")
    checked_schema({"type": "array", "uniqueItems": False}, "p")


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ("{nope", "is not valid JSON"),
        ("[1, 2]", "must be a JSON Schema (an object), got list"),
        ({"type": "strnig"}, "is not a valid JSON Schema: 'strnig' is not valid"),
        ({"properties": {"a": {"minimum": "3"}}},
         "is not a valid JSON Schema: '3' is not of type 'number' (at properties/a/minimum)"),
    ],
)  # fmt: skip
def test_what_is_not_a_schema_is_refused_saying_why(schema: object, says: str) -> None:
    assert says in _refused(schema)


@pytest.mark.parametrize(
    ("schema", "keyword", "where"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems", ""),
        ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                    "contains": {"const": "x"}}}},
         "contains", "properties/tags"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf", ""),
        ({"allOf": [OBJ, {"required": ["a"]}]}, "allOf", ""),
        ({"anyOf": [{"type": "string", "pattern": "^a+$", "maxLength": 3}]}, "maxLength",
         "anyOf/0"),
        ({"$defs": {"x": {"not": {"type": "null"}}}, "$ref": "#/$defs/x"}, "not", "$defs/x"),
        ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "if", ""),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", ""),
        ({"type": "array", "prefixItems": [{"type": "array", "uniqueItems": True}]},
         "uniqueItems", "prefixItems/0"),
    ],
)  # fmt: skip
def test_a_keyword_xgrammar_ignores_is_refused_naming_it(
    schema: dict, keyword: str, where: str
) -> None:
    msg = _refused(schema)
    assert f"uses {keyword!r}" in msg and "cannot enforce" in msg, msg
    assert (f"(at {where})" in msg) if where else "(at " not in msg, msg


def test_every_schema_of_the_corpus_passes() -> None:
    """The corpus the structured-output tests run (tests/data/json_schemas.json)."""
    from pathlib import Path

    corpus = json.loads((Path(__file__).parents[2] / "data" / "json_schemas.json").read_text())
    for c in corpus:
        assert checked_schema(c["schema"], "p") == json.dumps(c["schema"]), c["name"]
