"""A chat request's tools: the fields (OpenAI's tools, tool_choice, parallel_tool_calls), what tool_choice asks of
the output, and the generated text read back as content and tool calls.

`required` and a named function constrain the output with the grammar, so the arguments always satisfy the
function's JSON schema: a named function's output is its arguments object; `required`'s is a JSON array of
{"name", "arguments"} objects, one of the declared functions each (one at most without parallel_tool_calls).
`auto` leaves the model free and reads its calls in its family's format (--tool-call-parser); `none` reads none.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import attrs

from ...interfaces import JSON_SCHEMA, Constraint
from ..errors import bad_request
from ..schema import BOOLEAN, OBJECT, STRING, AnyOf, Field, ListOf, ObjectOf
from .parsers import ToolCall, ToolCallParser, complete_items, named_calls

FUNCTION = ObjectOf(
    [
        Field("name", STRING, None, "the function's name", required=True),
        Field("description", STRING, None, "what it does (shown to the model by the chat template)"),
        Field("parameters", OBJECT, None, "a JSON Schema of its arguments object"),
        Field("strict", BOOLEAN, None, "accepted; arguments always follow the schema under required or a named choice"),
    ],
    describe="a function object",
)
TOOL = ObjectOf(
    [Field("type", STRING, None, "function", required=True, choices=("function",)), Field("function", FUNCTION, None, required=True)],
    describe="a tool object",
)
NAMED = ObjectOf(
    [
        Field("type", STRING, None, "function", required=True, choices=("function",)),
        Field("function", ObjectOf([Field("name", STRING, None, required=True)]), None, required=True),
    ],
    describe="a named tool choice",
)
MODES = ("none", "auto", "required")


def tool_fields() -> list[Field]:
    return [
        Field("tools", ListOf(TOOL, "an array of tools"), None, "functions the model may call"),
        Field("tool_choice", AnyOf(STRING, NAMED), None,
              "none, auto (the default with tools), required, or {\"type\": \"function\", \"function\": {\"name\"}}"),
        Field("parallel_tool_calls", BOOLEAN, True, "whether one answer may call several tools"),
    ]


def _parameters(function: dict) -> dict:
    return function["parameters"] if function["parameters"] is not None else {"type": "object"}


@attrs.frozen
class ToolPlan:
    tools: list[dict] | None  # as the chat template takes them
    mode: str  # none, auto, required or named
    name: str | None = None  # the named function
    constraint: Constraint | None = None

    @classmethod
    def of(cls, values: dict) -> "ToolPlan":
        tools, choice = values["tools"], values["tool_choice"]
        if not tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return cls(None, "none")
        functions = {t["function"]["name"]: t["function"] for t in tools}
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            if name not in functions:
                raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
            schema = _parameters(functions[name])
            return cls(tools, "named", name, Constraint(JSON_SCHEMA, json.dumps(schema, sort_keys=True)))
        mode = choice or "auto"
        if mode not in MODES:
            raise bad_request(f"tool_choice={mode!r} is not supported; accepted: none, auto, required, or a named function",
                              "tool_choice", "unsupported_value")
        if mode != "required":
            return cls(tools, mode)
        call = {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "arguments": _parameters(f)},
             "required": ["name", "arguments"], "additionalProperties": False}
            for name, f in functions.items()
        ]}
        schema = {"type": "array", "items": call, "minItems": 1}
        if not values["parallel_tool_calls"]:
            schema["maxItems"] = 1
        return cls(tools, mode, None, Constraint(JSON_SCHEMA, json.dumps(schema, sort_keys=True)))

    @property
    def constrained(self) -> bool:
        return self.constraint is not None

    def split(self, text: str, parser: ToolCallParser | None) -> tuple[str, list[ToolCall]]:
        """The generated text as (content, tool calls): complete calls only, so an output cut by max_tokens gives
        the calls it finished and no content (the grammar made it all calls)."""
        if self.mode == "named":
            try:
                json.loads(text)
            except ValueError:  # cut by max_tokens inside the arguments
                return "", []
            return "", [ToolCall(self.name, text)]
        if self.mode == "required":
            return "", named_calls(complete_items(text))
        if self.mode == "auto" and parser is not None:
            return parser.split(text)
        return text, []


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    entry = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
    return entry if index is None else {"index": index, **entry}
