"""Sampling parameters of one request.

Values are checked in Python floats (float64) but the sampler computes in float32, where a valid but
tiny temperature or top_p underflows (1e-40 -> 0, 1/1e-40 -> inf). So a temperature below
GREEDY_TEMPERATURE is greedy (as vLLM and SGLang treat it) and the sampler always keeps a row's most
likely token whatever its top_p; no value that passes here can make a row unsampleable.
"""

from __future__ import annotations

import math

import attrs

from .interfaces.grammar import Constraint

GREEDY_TEMPERATURE = 1e-5  # below this a temperature is greedy: 1/t stays far from float32's limits
# stop strings are matched against every step's new text: bounded so that costs O(new text + these), not more
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512


def _finite(attribute, value) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value}")


def _non_negative(instance, attribute, value):
    _finite(attribute, value)
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _probability(instance, attribute, value):
    _finite(attribute, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value}")


def _positive_top_p(instance, attribute, value):
    _finite(attribute, value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value}")


def _stops(instance, attribute, value):
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(value)} strings; at most {MAX_STOP_STRINGS} are accepted")
    longest = max(value, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise ValueError(f"stop strings are at most {MAX_STOP_CHARS} characters; one has {len(longest)}")


def _top_k(instance, attribute, value):
    if value == 0 or value < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {value}")


def _penalty(instance, attribute, value):
    _finite(attribute, value)
    if not -2.0 <= value <= 2.0:
        raise ValueError(f"{attribute.name} must be in [-2, 2], got {value}")


def _repetition(instance, attribute, value):
    _finite(attribute, value)
    if value <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {value}")


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """A token id -> bias map (JSON keys are strings) as sorted (id, bias) pairs; ids are checked against the
    vocabulary where the vocabulary is known (the server)."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, dict) else value
    pairs = {}
    for token, bias in items:
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {token!r}") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"logit_bias values must be numbers, got {bias!r} for token {token_id}")
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
        pairs[token_id] = float(bias)
    return tuple(sorted(pairs.items()))


def _tuple(value):
    if value is None:
        return ()
    if isinstance(value, (str, int)):
        return (value,)
    return tuple(value)


@attrs.frozen
class SamplingParams:
    max_new_tokens: int = attrs.field(default=128, validator=_non_negative)
    temperature: float = attrs.field(default=1.0, validator=_non_negative)  # below GREEDY_TEMPERATURE: greedy
    top_p: float = attrs.field(default=1.0, validator=_positive_top_p)
    top_k: int = attrs.field(default=-1, validator=_top_k)
    min_p: float = attrs.field(default=0.0, validator=_probability)
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_tuple, validator=_stops)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_tuple)
    ignore_eos: bool = False
    logprobs: int = attrs.field(default=0, validator=_non_negative)  # top-K log-probabilities per step
    constraint: Constraint | None = None  # structured output: a JSON schema, regex or grammar the output follows
    constraint_after: str = ""  # the constraint starts once the output holds this text ("</think>": the answer)
    # penalties and biases (docs/serving.md gives each one's source): OpenAI's additive ones over the generated
    # tokens, the multiplicative repetition penalty over prompt and output (vLLM, SGLang), a per-token bias
    frequency_penalty: float = attrs.field(default=0.0, validator=_penalty)
    presence_penalty: float = attrs.field(default=0.0, validator=_penalty)
    repetition_penalty: float = attrs.field(default=1.0, validator=_repetition)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    allowed_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_tuple)  # vLLM's: only these may be drawn
    min_tokens: int = attrs.field(default=0, validator=_non_negative)  # EOS and stops are masked/ignored until then
    include_stop_str_in_output: bool = False  # keep a matched stop string at the end of the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    prompt_logprobs: int | None = None  # top-K logprobs of every prompt token from prompt_logprobs_start on
    prompt_logprobs_start: int = attrs.field(default=0, validator=_non_negative)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before filtering (penalties, biases, min_tokens)."""
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0 or self.logit_bias
            or self.allowed_token_ids or self.min_tokens
        )

    @property
    def counts_tokens(self) -> bool:
        """Whether the sampler keeps this request's token counts on the device (the penalties read them)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
