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

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
