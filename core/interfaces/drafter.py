"""Drafter contract: how speculative decoding proposes tokens for the target model to verify.

Each decode step the engine asks the drafter for up to `num_draft_tokens` tokens per request, runs one
target forward over (last token + drafts) per request through the paged cache, accepts the longest
prefix the target agrees with (greedy) or passes rejection sampling (temperature > 0), and tells the
drafter what was accepted. Output equals non-speculative decoding whatever the drafter proposes;
a good drafter only makes it faster.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Sequence

import attrs
import torch


@attrs.frozen
class DrafterCaps:
    needs_weights: bool = False  # uses the checkpoint's MTP (NextN) layers
    needs_hidden: bool = False  # reads the target's last hidden states (MTP chains do)
    gives_probs: bool = False  # returns draft probabilities (rejection sampling with q); else drafts are point masses
    architectures: frozenset[str] | None = None  # model_type values it supports; None: every architecture


@attrs.define
class DraftRequest:
    """What a drafter sees of one request: its ids so far and where its KV ends."""

    rid: str
    token_ids: Sequence[int]  # prompt + accepted output, the last one not yet through the target
    num_cached: int


@attrs.define
class Drafts:
    tokens: list[list[int]]  # per request, 0..num_draft_tokens proposed ids
    probs: torch.Tensor | None = None  # [requests, num_draft_tokens, vocab] draft distributions (gives_probs)


class Drafter(abc.ABC):
    caps: ClassVar[DrafterCaps]

    def __init__(self, num_steps: int, num_draft_tokens: int):
        self.num_steps = num_steps
        self.num_draft_tokens = num_draft_tokens

    def bind(self, engine_view: Any) -> None:
        """Called once at start-up with the engine's model, KV pool and config (weights, own KV)."""

    @abc.abstractmethod
    def propose(self, requests: Sequence[DraftRequest], hidden: torch.Tensor | None = None) -> Drafts:
        """Draft tokens for each request (fewer, or none, where it has nothing good to say)."""

    def accepted(self, rid: str, num_accepted: int) -> None:
        """How many of the request's drafts the target accepted this step (before the bonus token)."""

    def finished(self, rid: str) -> None:
        """The request ended or was preempted: drop anything kept for it."""
