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


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[V] bools -> [ceil(V/32)] int32 words, bit t % 32 of word t // 32."""
    words = -(-allowed.numel() // 32)
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[: allowed.numel()] = allowed.long()
    packed = (bits.view(words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _json_safe_tokens(info: xgr.TokenizerInfo, vocab_size: int) -> torch.Tensor:
    """The tokens compact JSON may hold: none with a raw control byte (below 0x20), which JSON allows neither
    between values (compact: no newlines or tabs) nor inside strings (they must be escaped), while xgrammar's
    string rule lets them through; special tokens (the end tokens) stay."""
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    special = set(info.special_token_ids) | set(info.stop_token_ids)
    for token, text in enumerate(info.decoded_vocab[:vocab_size]):
        allowed[token] = token in special or not any(b < 0x20 for b in text)
    return _pack(allowed)


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, compiled: xgr.CompiledGrammar, json_safe: torch.Tensor | None):
        self.inner = xgr.GrammarMatcher(compiled)
        self.json_safe = json_safe  # for a JSON constraint: the tokens JSON may hold at all

    def accept(self, token: int) -> bool:
        return self.inner.accept_token(token)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_next_token_bitmask(bitmask, row)
        if self.json_safe is not None:
            bitmask[row] &= self.json_safe

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def rollback(self, count: int) -> None:
        self.inner.rollback(count)


class XGrammarBackend(GrammarBackend):
    # a GrammarMatcher terminates only on accepting a stop token (terminate_without_stop_token is off)
    caps = GrammarBackendCaps(rollback=True, batch_fill=True, ends_at_end_token=True)

    def __init__(self, vocab: GrammarVocab):
        super().__init__(vocab)
        if not vocab.eos_ids:  # xgrammar then finds stop tokens of its own, which the engine does not know
            self.caps = GrammarBackendCaps(rollback=True, batch_fill=True)
        from transformers import PreTrainedTokenizerFast  # xgrammar reads the vocabulary's byte encoding from it

        # xgrammar takes every vocabulary entry as text, special added tokens (bos, pad, chat markers) included, so
        # a JSON string could hold "<|pad|>" that the detokenizer then drops; an empty entry is never allowed
        detected = xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=vocab.tokenizer), vocab_size=vocab.vocab_size,
            stop_token_ids=list(vocab.eos_ids) or None,
        )
        encoded = [""] * vocab.vocab_size
        for text, token in vocab.tokenizer.get_vocab(with_added_tokens=True).items():
            if token < vocab.vocab_size:
                encoded[token] = text
        for token, added in vocab.tokenizer.get_added_tokens_decoder().items():
            if added.special and token < vocab.vocab_size:
                encoded[token] = ""
        info = xgr.TokenizerInfo.from_vocab_and_metadata(encoded, detected.dump_metadata())
        # moeplex keeps its own cache (keyed by the constraint); xgrammar's would hold a second copy
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()
        self.json_safe = _json_safe_tokens(info, vocab.vocab_size)

    def compile(self, constraint: Constraint) -> Any:
        try:
            if constraint.kind in (JSON_OBJECT, JSON_SCHEMA):
                schema = constraint.text if constraint.kind == JSON_SCHEMA else '{"type": "object"}'
                # compact JSON: a model never wanders into unbounded whitespace
                return self.compiler.compile_json_schema(schema, any_whitespace=False), True
            if constraint.kind == REGEX:
                return self.compiler.compile_regex(constraint.text), False
            if constraint.kind == EBNF:
                return self.compiler.compile_grammar(constraint.text), False
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError or its own errors for a bad input
            raise GrammarError(f"the {constraint.kind} does not compile: {_reason(exc)}") from None
        raise GrammarError(f"xgrammar does not compile constraints of kind {constraint.kind!r}")

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        grammar, is_json = compiled
        return XGrammarMatcher(grammar, self.json_safe if is_json else None)

    def accept_tokens(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[bool]:
        return list(self.batch.batch_accept_token([m.inner for m in matchers], list(tokens)))

    def fill_masks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        self.batch.batch_fill_next_token_bitmask([m.inner for m in matchers], bitmask, list(rows))
        json_rows = [row for m, row in zip(matchers, rows) if m.json_safe is not None]
        if len(json_rows) == bitmask.shape[0]:  # every row (the usual batch of JSON requests): one op in place
            bitmask.bitwise_and_(self.json_safe)
        elif json_rows:
            bitmask[json_rows] &= self.json_safe
