"""The llguidance backend: constraints become llguidance grammars (Lark-like, with JSON schemas and regexes as
lexer-level rules), matched by its Rust parser; masks for a batch are filled in parallel by an LLExecutor."""

from __future__ import annotations

import json
from typing import Any, Sequence

import llguidance
import llguidance.torch
import torch

from moeplex.interfaces import (
    EBNF, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint, GrammarBackend, GrammarBackendCaps, GrammarError,
    GrammarMatcher, GrammarVocab,
)

_FORMATS = {REGEX: "regex", EBNF: "gbnf"}
_COMPACT = {"whitespace_flexible": False}  # compact JSON: a model never wanders into unbounded whitespace


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, inner: llguidance.LLMatcher, eos_ids: frozenset[int]):
        self.inner = inner
        self.eos_ids = eos_ids

    def accept(self, token: int) -> bool:
        # consume_token puts the matcher in a permanent error state on a forbidden token: check first (an end token,
        # which validate_tokens never counts, is allowed where the output may end)
        allowed = self.inner.is_accepting() if token in self.eos_ids else self.inner.validate_tokens([token]) == 1
        return allowed and self.inner.consume_token(token)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.inner, bitmask, row)

    def is_terminated(self) -> bool:
        return self.inner.is_stopped()

    def rollback(self, count: int) -> None:
        if count and not self.inner.rollback(count):
            raise ValueError(f"llguidance could not roll back {count} tokens: {self.inner.get_error()}")


class LLGuidanceBackend(GrammarBackend):
    caps = GrammarBackendCaps(rollback=True, batch_fill=True)

    def __init__(self, vocab: GrammarVocab):
        super().__init__(vocab)
        self.tokenizer = llguidance.LLTokenizer(
            vocab.tokenizer.to_str(), n_vocab=vocab.vocab_size, eos_token=list(vocab.eos_ids) or None
        )
        self.executor = llguidance.LLExecutor()

    def compile(self, constraint: Constraint) -> Any:
        """The grammar text, validated; llguidance builds its parser per matcher (with the GIL dropped)."""
        try:
            if constraint.kind in (JSON_OBJECT, JSON_SCHEMA):
                schema = constraint.text if constraint.kind == JSON_SCHEMA else json.dumps({"type": "object"})
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
            elif constraint.kind in _FORMATS:
                grammar = llguidance.grammar_from(_FORMATS[constraint.kind], constraint.text)
            else:
                raise GrammarError(f"llguidance does not compile constraints of kind {constraint.kind!r}")
        except ValueError as exc:
            raise GrammarError(f"the {constraint.kind} does not compile: {exc}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise GrammarError(f"the {constraint.kind} does not compile: {messages[0]}")
        return grammar

    def matcher(self, compiled: Any) -> LLGuidanceMatcher:
        inner = llguidance.LLMatcher(self.tokenizer, compiled, log_level=0)
        if inner.is_error():
            raise GrammarError(inner.get_error())
        return LLGuidanceMatcher(inner, frozenset(self.vocab.eos_ids))

    def fill_masks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        llguidance.torch.fill_next_token_bitmask_par(self.executor, [(m.inner, r) for m, r in zip(matchers, rows)], bitmask)
