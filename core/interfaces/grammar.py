"""Grammar backend contract: how a structured-output constraint (a JSON schema, a regex, an EBNF grammar)
becomes a mask over the vocabulary at every decoding step.

The engine builds one backend at start-up with the model's vocabulary (`GrammarVocab`). Per request with a
constraint it calls `compile` (in a worker thread, cached by the constraint's text: compile must be
thread-safe and must not hold the GIL for long, or the step loop and the HTTP server stall behind it), then
`matcher(compiled)` for the request's own state. Each step, for the rows of constrained requests, it calls
`fill_masks` (one call for the whole batch, so a backend can spread the rows over its own threads) into a
bitmask of int32 words, `[rows, ceil(vocab_size / 32)]`, bit `t % 32` of word `t // 32` set where token t is
allowed; the core applies it on the logits' device just before sampling. Then `accept(token)` advances the
matcher by the token sampled; `rollback(n)` undoes the last n accepted tokens (rejected speculative drafts).

Contract (moeplex.conformance's grammar_backend suite): a token the mask allows is accepted and one it forbids
is refused; generation that follows the mask ends in text that satisfies the constraint; rollback restores
the state exactly; compiling a large schema leaves other Python threads running; an invalid schema, regex or
grammar raises GrammarError saying what is wrong.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Sequence

import attrs
import torch

JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object)
JSON_SCHEMA = "json_schema"  # text: a JSON Schema document
REGEX = "regex"  # text: a regular expression the whole output matches
EBNF = "ebnf"  # text: a grammar in the GBNF dialect of EBNF (llama.cpp's; rule `root` starts)
CONSTRAINT_KINDS = (JSON_OBJECT, JSON_SCHEMA, REGEX, EBNF)


class GrammarError(ValueError):
    """A constraint that cannot compile; the message is shown to the client (a 400)."""


@attrs.frozen
class Constraint:
    """What a request's output must satisfy. `text` is the schema (JSON text), regex or grammar; empty for
    json_object. Frozen and hashable: the compile cache is keyed by it."""

    kind: str = attrs.field(validator=attrs.validators.in_(CONSTRAINT_KINDS))
    text: str = ""


@attrs.frozen
class GrammarBackendCaps:
    kinds: frozenset[str] = frozenset(CONSTRAINT_KINDS)  # constraint kinds it compiles
    rollback: bool = True  # matcher.rollback(n) undoes accepted tokens (speculative drafts need it)
    batch_fill: bool = False  # fill_masks fills many rows in parallel (threads inside the backend)
    # a matcher accepts every token its mask allows and is terminated exactly once it accepted an end token
    # (vocab.eos_ids): the engine then reads a step's outcome off the mask and feeds the tokens in a worker thread
    ends_at_end_token: bool = False


@attrs.frozen
class GrammarVocab:
    """The model's vocabulary as a backend needs it. `tokenizer` is a `tokenizers.Tokenizer` (the model's
    tokenizer.json); `vocab_size` is the logits' width (it may exceed the tokenizer's: those ids are never
    allowed); `eos_ids` end a generation (allowed once the constraint is complete)."""

    tokenizer: Any
    vocab_size: int
    eos_ids: tuple[int, ...] = ()

    @property
    def bitmask_words(self) -> int:
        return -(-self.vocab_size // 32)


class GrammarMatcher(abc.ABC):
    """One request's position in its grammar."""

    @abc.abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) when the grammar forbids it."""

    @abc.abstractmethod
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words on the CPU)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """Whether the output is complete (an end token was accepted, or nothing may follow)."""

    def rollback(self, count: int) -> None:
        """Undo the last `count` accepted tokens (GrammarBackendCaps.rollback)."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back")


class GrammarBackend(abc.ABC):
    caps: ClassVar[GrammarBackendCaps]

    def __init__(self, vocab: GrammarVocab):
        self.vocab = vocab

    @abc.abstractmethod
    def compile(self, constraint: Constraint) -> Any:
        """The compiled form of `constraint` (shared by every matcher of it); GrammarError when it is invalid.
        Called from worker threads, concurrently."""

    @abc.abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of the compiled grammar."""

    def fill_masks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Fill bitmask[rows[i]] for matchers[i]; a backend with a batch API overrides this."""
        for matcher, row in zip(matchers, rows):
            matcher.fill_mask(bitmask, row)

    def accept_tokens(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[bool]:
        """matchers[i].accept(tokens[i]) for every i (a step's tokens); a backend with a batch API overrides this."""
        return [matcher.accept(token) for matcher, token in zip(matchers, tokens)]
