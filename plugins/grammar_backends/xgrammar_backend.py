"""The xgrammar backend: JSON schemas, regexes and EBNF compiled to xgrammar's pushdown automata, masks filled
for a whole batch by xgrammar's own thread pool (BatchGrammarMatcher)."""

from __future__ import annotations

from typing import Any, Sequence

import re

import torch
import xgrammar as xgr

from moeplex.interfaces import (
    EBNF, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint, GrammarBackend, GrammarBackendCaps, GrammarError,
    GrammarMatcher, GrammarVocab,
)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:12: Check failed: ...: ")."""
    text = str(exc).strip()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?", "", text) or type(exc).__name__


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, compiled: xgr.CompiledGrammar):
        self.inner = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        return self.inner.accept_token(token)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def rollback(self, count: int) -> None:
        self.inner.rollback(count)


class XGrammarBackend(GrammarBackend):
    caps = GrammarBackendCaps(rollback=True, batch_fill=True)

    def __init__(self, vocab: GrammarVocab):
        super().__init__(vocab)
        from transformers import PreTrainedTokenizerFast  # xgrammar reads the vocabulary's byte encoding from it

        tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab.tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab.vocab_size, stop_token_ids=list(vocab.eos_ids) or None
        )
        # moeplex keeps its own cache (keyed by the constraint); xgrammar's would hold a second copy
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, constraint: Constraint) -> Any:
        try:
            if constraint.kind in (JSON_OBJECT, JSON_SCHEMA):
                schema = constraint.text if constraint.kind == JSON_SCHEMA else '{"type": "object"}'
                # compact JSON: a model never wanders into unbounded whitespace
                return self.compiler.compile_json_schema(schema, any_whitespace=False)
            if constraint.kind == REGEX:
                return self.compiler.compile_regex(constraint.text)
            if constraint.kind == EBNF:
                return self.compiler.compile_grammar(constraint.text)
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError or its own errors for a bad input
            raise GrammarError(f"the {constraint.kind} does not compile: {_reason(exc)}") from None
        raise GrammarError(f"xgrammar does not compile constraints of kind {constraint.kind!r}")

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(compiled)

    def fill_masks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        self.batch.batch_fill_next_token_bitmask([m.inner for m in matchers], bitmask, list(rows))
