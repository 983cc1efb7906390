"""JSON schemas of the kinds real APIs send (nested objects, bounded arrays, enums, anyOf, patterns, numbers with
ranges, required and optional fields, additionalProperties: false), and regexes and EBNF grammars, for the
structured-output validity tests. Strings are bounded so that random-weight models can finish."""

from __future__ import annotations

S = {"type": "string", "maxLength": 6}  # a short string
CLOSED = {"additionalProperties": False}


def obj(properties: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            **CLOSED, **extra}


SCHEMAS = [
    obj({"name": S}),
    obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"unit": {"type": "string", "enum": ["c", "f"]}, "value": {"type": "integer", "minimum": -50, "maximum": 50}}),
    obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}}),
    obj({"point": obj({"x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}})}),
    obj({"user": obj({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "role": {"enum": ["admin", "guest"]}})}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}}),
    obj({"value": {"anyOf": [{"enum": ["none"]}, obj({"n": {"type": "integer", "minimum": 0, "maximum": 5}})]}}),
    obj({"a": {"type": "integer", "minimum": 0, "maximum": 3}, "b": {"type": "boolean"}}, required=["a"]),
    obj({"id": {"enum": [1, 2, 3]}, "note": S}, required=["id"]),
    obj({"items": {"type": "array", "items": obj({"sku": {"enum": ["x1", "y2"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                   "minItems": 1, "maxItems": 2}}),
    obj({"level": {"type": "integer", "enum": [1, 2, 3, 4]}}),
    obj({"status": {"const": "done"}}),
    obj({"ratio": {"type": "integer", "minimum": 0, "maximum": 100}, "flag": {"type": "boolean"}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"enum": [0, 1]}, "minItems": 2, "maxItems": 2},
                    "minItems": 2, "maxItems": 2}}),
    obj({"nothing": {"type": "null"}}),
    obj({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    obj({"outer": obj({"inner": obj({"leaf": {"enum": ["x", "y"]}})})}),
    obj({"lang": {"enum": ["en", "fr", "de"]}, "formal": {"type": "boolean"}, "max": {"type": "integer", "minimum": 1, "maximum": 3}}),
    obj({"weekday": {"enum": ["mon", "tue", "wed", "thu", "fri"]}}, required=[]),
    obj({"hex": {"type": "string", "pattern": "^[0-9a-f]{4}$"}}),
    obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 10}}),
    obj({"coords": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 3, "maxItems": 3}}),
    obj({"event": {"anyOf": [obj({"click": {"type": "boolean"}}), obj({"key": {"enum": ["a", "b"]}})]}}),
    obj({"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]$"}, "stable": {"type": "boolean"}}),
    {"type": "array", "items": {"enum": ["up", "down"]}, "minItems": 1, "maxItems": 3},
    {"enum": ["alpha", "beta", "gamma"]},
]

REGEXES = [
    r"[a-z]{3}-[0-9]{2}",
    r"(yes|no|maybe)",
    r"[0-9]{3}\.[0-9]{2}",
    r"#[0-9a-f]{6}",
    r"(GET|POST) /[a-z]{1,5}",
]

EBNF_GRAMMARS = [
    ('root ::= "yes" | "no"', {"yes", "no"}),
    ('root ::= digit digit "-" digit\ndigit ::= [0-9]', None),
    ('root ::= "(" item ("," item)? ")"\nitem ::= [a-c]', None),
]
