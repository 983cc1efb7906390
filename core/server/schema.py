"""Request bodies declared as fields: one declaration both validates a body and describes it in OpenAPI.

A value of null counts as absent (OpenAI clients send null for unset options). A field nobody declared is
dropped by `prune` before parsing and named back to the client (vLLM's behaviour: clients written for other
servers send extras), unless the server is strict (`--strict-request-fields`): then `parse` refuses it, so a
misspelt option (`max_token`) is a 400 naming it rather than a silent default.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import attrs

from .errors import bad_request


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an empty array" if not value else "an array"
    return "an object"


class Kind:
    """A JSON type: how to recognise it, how to describe it to a person and in JSON Schema."""

    def __init__(self, describe: str, accepts: Callable[[Any], bool], schema: dict, only_type: type | None = None):
        """`only_type`: a value is accepted exactly when its type is this one (lists of it are checked in C)."""
        self.describe = describe
        self.accepts = accepts
        self._schema = schema
        self.only_type = only_type

    def schema(self) -> dict:
        return dict(self._schema)

    def read(self, value: Any, param: str) -> Any:
        if not self.accepts(value):
            raise bad_request(f"{param} must be {self.describe}, got {json_type(value)}", param)
        return value


def _finite_number(value: Any) -> bool:
    return type(value) is int or (type(value) is float and math.isfinite(value))


class Text(Kind):
    """A JSON string that is text: JSON's \\ud800 escapes can spell a lone UTF-16 surrogate, which no
    tokenizer or UTF-8 encoder accepts."""

    def read(self, value: Any, param: str) -> Any:
        super().read(value, param)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            at = exc.start
            raise bad_request(
                f"{param} is not valid text: it holds a lone UTF-16 surrogate (U+{ord(value[at]):04X}) at character {at}", param
            ) from None
        return value


INTEGER = Kind("an integer", lambda v: type(v) is int, {"type": "integer"}, int)
NUMBER = Kind("a number", _finite_number, {"type": "number"})
BOOLEAN = Kind("a boolean", lambda v: type(v) is bool, {"type": "boolean"}, bool)
STRING = Text("a string", lambda v: type(v) is str, {"type": "string"}, str)
OBJECT = Kind("an object", lambda v: type(v) is dict, {"type": "object"}, dict)


class ListOf(Kind):
    def __init__(self, item: Kind, describe: str, min_items: int = 0):
        only = {item.only_type} if item.only_type is not None else None
        super().__init__(
            describe + (" (at least one)" if min_items else ""),
            (lambda v: type(v) is list and len(v) >= min_items and set(map(type, v)) <= only) if only else
            (lambda v: type(v) is list and len(v) >= min_items and all(item.accepts(x) for x in v)),
            {},
        )
        self.item, self.min_items = item, min_items

    def schema(self) -> dict:
        return {"type": "array", "items": self.item.schema(), "minItems": self.min_items}

    def read(self, value: Any, param: str) -> list:
        super().read(value, param)
        if type(self.item) is Kind:  # accepted is read: a token-id prompt's items need no second look, nor names
            return list(value)
        return [self.item.read(x, f"{param}[{i}]") for i, x in enumerate(value)]


class MapOf(Kind):
    """A JSON object whose keys are the data (logit_bias: token id -> bias), each value of one kind."""

    def __init__(self, value: Kind, describe: str):
        super().__init__(describe, lambda v: type(v) is dict and all(value.accepts(x) for x in v.values()), {})
        self.value = value

    def schema(self) -> dict:
        return {"type": "object", "additionalProperties": self.value.schema()}

    def read(self, value: Any, param: str) -> dict:
        super().read(value, param)
        return {key: self.value.read(x, f"{param}.{key}") for key, x in value.items()}


class AnyOf(Kind):
    def __init__(self, *kinds: Kind):
        names = [k.describe for k in kinds]
        super().__init__(", ".join(names[:-1]) + " or " + names[-1], lambda v: any(k.accepts(v) for k in kinds), {})
        self.kinds = kinds

    def schema(self) -> dict:
        return {"anyOf": [k.schema() for k in self.kinds]}

    def read(self, value: Any, param: str) -> Any:
        super().read(value, param)
        return next(k for k in self.kinds if k.accepts(value)).read(value, param)


class ObjectOf(Kind):
    def __init__(self, fields: Sequence["Field"], describe: str = "an object"):
        super().__init__(describe, lambda v: type(v) is dict, {})
        self.fields = tuple(fields)

    def schema(self) -> dict:
        return json_schema(self.fields)

    def read(self, value: Any, param: str) -> dict:
        super().read(value, param)
        return parse(value, self.fields, f"{param}.")


@attrs.frozen
class Field:
    name: str
    kind: Kind
    default: Any = None
    description: str = ""
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False  # the minimum itself is out of range
    choices: tuple = ()  # the only values accepted (for an OpenAI option this server does not implement: its no-op values)
    refused: str = ""  # why any value but null is a 400 (a field other servers take that this one cannot honour)

    def read(self, value: Any, where: str) -> Any:
        param = where + self.name
        if value is None:
            if self.required:
                raise bad_request(f"{param} is required", param)
            return self.default
        if self.refused:
            raise bad_request(f"{param} is not supported: {self.refused}", param, "unsupported_value")
        value = self.kind.read(value, param)
        if self.choices and value not in self.choices:
            shown = ", ".join(repr(v) for v in self.choices)
            raise bad_request(f"{param}={value!r} is not supported; accepted values: {shown}", param, "unsupported_value")
        self._check_range(value, param)
        return value

    def _check_range(self, value: Any, param: str) -> None:
        if self.minimum is not None and (value < self.minimum or (self.exclusive_minimum and value == self.minimum)):
            bound = f"> {self.minimum}" if self.exclusive_minimum else f">= {self.minimum}"
            raise bad_request(f"{param} must be {bound}, got {value}", param)
        if self.maximum is not None and value > self.maximum:
            raise bad_request(f"{param} must be <= {self.maximum}, got {value}", param)

    def schema(self) -> dict:
        schema = self.kind.schema()
        if self.description:
            schema["description"] = self.description
        if self.default is not None:
            schema["default"] = self.default
        if self.choices:
            schema["enum"] = list(self.choices)
        if self.minimum is not None:
            schema["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = self.minimum
        if self.maximum is not None:
            schema["maximum"] = self.maximum
        return schema


def parse(body: Any, fields: Sequence[Field], where: str = "") -> dict[str, Any]:
    """The values of `fields` in a JSON object (defaults filled in), or a 400 naming the first problem."""
    if type(body) is not dict:
        raise bad_request(f"{where.rstrip('.') or 'the request body'} must be a JSON object, got {json_type(body)}")
    names = [f.name for f in fields]
    # an unknown key set to null is as absent as a known one (SDKs echo back null fields of earlier answers)
    unknown = [key for key, value in body.items() if key not in names and value is not None]
    if unknown:
        raise bad_request(
            f"unknown field {where}{unknown[0]!r}; accepted fields: {', '.join(names)}", where + unknown[0], "unknown_field"
        )
    return {f.name: f.read(body.get(f.name), where) for f in fields}


def json_schema(fields: Sequence[Field]) -> dict:
    return {
        "type": "object",
        "properties": {f.name: f.schema() for f in fields},
        "required": [f.name for f in fields if f.required],
        "additionalProperties": False,
    }


def prune(body: Any, fields: Sequence[Field], where: str = "") -> tuple[Any, list[str]]:
    """`body` without the keys no field declares (at any depth of declared objects), and their dotted names."""
    if type(body) is not dict:
        return body, []
    declared = {f.name: f for f in fields}
    kept, ignored = {}, []
    for key, value in body.items():
        field = declared.get(key)
        if field is None:
            if value is not None:
                ignored.append(where + key)
            continue
        kept[key], inner = _prune_value(value, field.kind, f"{where}{key}")
        ignored += inner
    return kept, ignored


def _prune_value(value: Any, kind: Kind, where: str) -> tuple[Any, list[str]]:
    if isinstance(kind, ObjectOf) and type(value) is dict:
        return prune(value, kind.fields, where + ".")
    if isinstance(kind, ListOf) and type(value) is list and _holds_objects(kind.item):
        pruned = [_prune_value(item, kind.item, f"{where}[{i}]") for i, item in enumerate(value)]
        return [v for v, _ in pruned], [name for _, names in pruned for name in names]
    if isinstance(kind, AnyOf):
        objects = [k for k in kind.kinds if isinstance(k, (ObjectOf, ListOf)) and k.accepts(value)]
        loose = [k for k in kind.kinds if isinstance(k, (ObjectOf, ListOf))]
        for k in objects or loose:
            return _prune_value(value, k, where)
    return value, []


def _holds_objects(kind: Kind) -> bool:
    """Whether a value of `kind` can hold a JSON object, where undeclared keys would be pruned."""
    if isinstance(kind, ObjectOf):
        return True
    if isinstance(kind, ListOf):
        return _holds_objects(kind.item)
    return isinstance(kind, AnyOf) and any(_holds_objects(k) for k in kind.kinds)
