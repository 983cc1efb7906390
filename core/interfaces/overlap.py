"""Overlap strategy contract: how the operations of one forward step are ordered.

The model writes each layer once as a generator that yields at its yield points
(after attention, after launching dispatch, after launching combine, ...). The
core's executor turns the batch into one or more micro-batch programs; a strategy
decides whether to split and how the programs interleave.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Iterator, Sequence

import attrs


@attrs.frozen
class OverlapCaps:
    needs_async_halves: bool = False  # only pays when the dispatcher's waits cost no compute
    min_tokens: int = 0  # default: below this many tokens per step the core runs without splitting
    needs_multi_rank: bool = False
    shared_during_dispatch: bool = False  # run shared experts while the routed tokens' dispatch is in flight
    transfers_in_flight: int = 1  # dispatches it keeps launched and unfinished at once (two micro-batches: 2)


@attrs.frozen
class BatchMeta:
    """CPU-side facts about one step, equal on every DP rank that must agree on a plan."""

    mode: Any  # ForwardMode
    extend_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


class OverlapStrategy(abc.ABC):
    """Contract: logits equal those of `none` for every batch."""

    caps: ClassVar[OverlapCaps]

    def __init__(self, min_tokens: int | None = None):
        self.min_tokens = self.caps.min_tokens if min_tokens is None else min_tokens

    def cuts(self, meta: BatchMeta) -> Sequence[int] | None:
        """`plan`, unless the step is below the token threshold (then the core runs it whole)."""
        if meta.num_tokens < self.min_tokens:
            return None
        return self.plan(meta)

    @abc.abstractmethod
    def plan(self, meta: BatchMeta) -> Sequence[int] | None:
        """Token offsets at which to cut the batch into micro-batches, or None to run it whole.

        A pure function of CPU-side metadata, so every DP rank derives the same plan.
        """

    def run(self, programs: Sequence[Iterator[Any]]) -> None:
        """Drive the micro-batch programs to completion (default: one after another)."""
        for program in programs:
            for _ in program:
                pass
