"""Structured-output request fields: OpenAI's response_format and SGLang's native json_schema / regex / ebnf,
read into one Constraint that the front end compiles (off the event loop, cached) before any engine sees it, so
a schema that cannot compile is a 400 naming the problem."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any, Callable

from ..grammar.book import make_backend
from ..grammar.compiler import GrammarCompiler
from ..interfaces import EBNF, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint, GrammarError
from ..registry import lookup
from .errors import bad_request
from .schema import BOOLEAN, OBJECT, STRING, AnyOf, Field, ListOf, ObjectOf

JSON_SCHEMA_SPEC = ObjectOf(
    [
        Field("name", STRING, None, "the schema's name (a label; not checked)"),
        Field("description", STRING, None, "what the output is for (a label; not checked)"),
        Field("schema", OBJECT, None, "the JSON Schema the output follows"),
        Field("strict", BOOLEAN, None, "accepted; the output always follows the schema"),
    ],
    describe="an object with the JSON schema",
)
RESPONSE_FORMAT = ObjectOf(
    [
        Field("type", STRING, None, "text, json_object (any JSON object) or json_schema", required=True,
              choices=("text", JSON_OBJECT, JSON_SCHEMA)),
        Field("json_schema", JSON_SCHEMA_SPEC, None, "with type json_schema: {name, schema, strict}"),
    ],
    describe="a response format object",
)


def response_format_field() -> Field:
    return Field("response_format", RESPONSE_FORMAT, None,
                 "constrain the output: {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                 "{\"name\", \"schema\", \"strict\"}}")


NATIVE_FIELDS = (
    Field("json_schema", STRING, None, "the output follows this JSON Schema (given as a JSON string)"),
    Field("regex", STRING, None, "the output matches this regular expression"),
    Field("ebnf", STRING, None, "the output follows this EBNF grammar (GBNF dialect, rule root starts)"),
)


JSON_SPEC = AnyOf(STRING, OBJECT)
CHOICES = ListOf(STRING, "an array of strings", min_items=1)
STRUCTURED_OUTPUTS = ObjectOf(
    [
        Field("json", JSON_SPEC, None, "a JSON Schema (object or JSON text)"),
        Field("regex", STRING, None, "a regular expression"),
        Field("choice", CHOICES, None, "the output is one of these strings"),
        Field("grammar", STRING, None, "an EBNF grammar (GBNF dialect)"),
        Field("json_object", BOOLEAN, None, "any JSON object"),
    ],
    describe="vLLM's structured outputs object",
)
# vLLM's names for the same constraints, on both OpenAI endpoints
GUIDED_FIELDS = (
    Field("guided_json", JSON_SPEC, None, "vLLM: the output follows this JSON Schema"),
    Field("guided_regex", STRING, None, "vLLM: the output matches this regular expression"),
    Field("guided_choice", CHOICES, None, "vLLM: the output is one of these strings"),
    Field("guided_grammar", STRING, None, "vLLM: the output follows this EBNF grammar (GBNF dialect)"),
    Field("structured_outputs", STRUCTURED_OUTPUTS, None, "vLLM: one of json, regex, choice, grammar, json_object"),
    Field("guided_decoding_backend", STRING, None, "accepted and ignored: --grammar-backend chooses the backend"),
    Field("guided_whitespace_pattern", STRING, None, refused="the grammar backend decides the whitespace in JSON"),
)


def _json_schema(value) -> Constraint:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return Constraint(JSON_SCHEMA, text)


def _one_of_choices(choices: list[str]) -> Constraint:
    return Constraint(REGEX, "(" + "|".join(re.escape(c) for c in choices) + ")")


def from_guided(values: dict) -> list[tuple[str, Constraint]]:
    """The constraints vLLM's fields ask for, each with the field that asked."""
    out = []
    readers = (("guided_json", _json_schema), ("guided_regex", lambda v: Constraint(REGEX, v)),
               ("guided_choice", _one_of_choices), ("guided_grammar", lambda v: Constraint(EBNF, v)))
    for name, read in readers:
        if values.get(name) is not None:
            out.append((name, read(values[name])))
    spec = values.get("structured_outputs") or {}
    readers = (("json", _json_schema), ("regex", lambda v: Constraint(REGEX, v)), ("choice", _one_of_choices),
               ("grammar", lambda v: Constraint(EBNF, v)), ("json_object", lambda v: Constraint(JSON_OBJECT) if v else None))
    for name, read in readers:
        if spec.get(name) is not None and read(spec[name]) is not None:
            out.append((f"structured_outputs.{name}", read(spec[name])))
    return out


def request_constraint(values: dict) -> tuple[Constraint | None, str]:
    """(the one constraint an OpenAI request asks for, the field that asked), from response_format or vLLM's
    fields; asking through two of them is a 400."""
    asked = from_guided(values)
    given = from_response_format(values["response_format"])
    if given is not None:
        asked.insert(0, ("response_format", given))
    if len(asked) > 1:
        raise bad_request(f"give one structured-output constraint; got {', '.join(name for name, _ in asked)}",
                          asked[1][0])
    return (asked[0][1], asked[0][0]) if asked else (None, "response_format")


def from_response_format(value: dict | None) -> Constraint | None:
    if value is None or value["type"] == "text":
        return None
    if value["type"] == JSON_OBJECT:
        return Constraint(JSON_OBJECT)
    spec = value["json_schema"]
    if spec is None or spec["schema"] is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format.json_schema")
    return Constraint(JSON_SCHEMA, json.dumps(spec["schema"], sort_keys=True))


def from_native(sampling: dict) -> Constraint | None:
    given = [name for name in (JSON_SCHEMA, REGEX, EBNF) if sampling.get(name) is not None]
    if len(given) > 1:
        raise bad_request(f"give at most one of json_schema, regex and ebnf; got {', '.join(given)}", "sampling_params")
    if not given:
        return None
    return Constraint(given[0], sampling[given[0]])


class PlanInThread(Exception):
    """Planning on the event loop would wait for a grammar compile (or the backend's first load): plan in a thread."""


class ConstraintChecker:
    """The front end's own compiler: a constraint that does not compile is refused before it reaches a rank.
    The backend is built on first use. A compile takes milliseconds to seconds, so on the event loop (where small
    requests are planned: handlers.py) only a constraint compiled already is checked; any other raises
    PlanInThread, and the request is planned again in a thread, the compile already under way."""

    def __init__(self, make: Callable[[], GrammarCompiler], speculative: bool):
        self._make = make
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self.speculative = speculative

    @classmethod
    def for_engine(cls, config, tokenizer: Any, vocab_size: int, eos_ids) -> "ConstraintChecker":
        def make() -> GrammarCompiler:  # the plugin and its library load with the first constrained request
            backend_cls = lookup("grammar_backend", config.grammar_backend)
            return GrammarCompiler(make_backend(backend_cls, tokenizer, vocab_size, eos_ids))

        return cls(make, config.speculative)

    def check(self, constraint: Constraint | None, param: str) -> None:
        if constraint is None:
            return
        if _on_event_loop() and (self._compiler is None or not self._compiler.done(constraint)):
            if self._compiler is not None:
                self._compiler.submit(constraint)  # (its compile starts now, in the compiler's pool)
            raise PlanInThread()
        with self._lock:
            if self._compiler is None:
                try:
                    self._compiler = self._make()
                except GrammarError as exc:
                    raise bad_request(f"{param}: {exc}", param) from None
        if self.speculative and not self._compiler.backend.caps.rollback:
            raise bad_request(f"{param}: the grammar backend cannot roll back rejected speculative drafts; serve "
                              "structured outputs with another --grammar-backend or without speculative decoding", param)
        try:
            self._compiler.check(constraint)
        except GrammarError as exc:
            raise bad_request(f"{param}: {exc}", param, "invalid_grammar") from None


def _on_event_loop() -> bool:
    """Whether this thread runs an asyncio event loop (the front end's), where nothing may wait."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
