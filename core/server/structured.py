"""Structured-output request fields: OpenAI's response_format and SGLang's native json_schema / regex / ebnf,
read into one Constraint that the front end compiles (off the event loop, cached) before any engine sees it, so
a schema that cannot compile is a 400 naming the problem."""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

from ..grammar.book import make_backend
from ..grammar.compiler import GrammarCompiler
from ..interfaces import EBNF, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint, GrammarError
from ..registry import lookup
from .errors import bad_request
from .schema import BOOLEAN, OBJECT, STRING, Field, ObjectOf

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


class ConstraintChecker:
    """The front end's own compiler: a constraint that does not compile is refused before it reaches a rank.
    Called from the thread that plans a request (never the event loop); the backend is built on first use."""

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
