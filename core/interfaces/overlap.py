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
    min_tokens: int = 0  # below this many tokens per step the core runs without splitting
    needs_multi_rank: bool = False


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
