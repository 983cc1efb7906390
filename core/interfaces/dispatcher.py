"""Dispatcher contract: how routed tokens reach their expert ranks and come back."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import attrs
import torch

from . import deprecation
from .context import MoEContext
from .layouts import ALL_LAYOUTS, Dispatched, ExpertOutput


@attrs.frozen
class DispatcherCaps:
    layout: str  # the layout dispatch_finish produces
    multi_rank: bool  # works with more than one EP rank
    single_rank: bool = True  # works with exactly one EP rank
    needs_gpu: bool = False
    graph_safe: bool = False  # can be captured in a CUDA graph
    needs_host_sync: bool = False  # reads device values on the host during dispatch
    fixed_max_tokens: bool = False  # buffers sized by MoEContext.max_tokens_per_rank
    fp8_payload: bool = False  # sends rows as fp8 values + 128-wide scales when MoEContext.dispatch_fp8
    async_halves: bool = False  # waiting in *_finish costs no compute (receive hooks)
    requires: tuple[str, ...] = ()  # Python modules it imports when an instance is made
    min_compute_capability: tuple[int, int] | None = None  # e.g. (9, 0): Hopper or newer
    hidden_sizes: frozenset[int] | None = None  # the hidden sizes it can move (None: any)
    max_top_k: int | None = None  # the most experts a token may pick (None: any)
    other_layouts: frozenset[str] = frozenset()  # layouts it produces in some steps besides `layout`
    max_in_flight: int = 2  # dispatches (or combines) one instance can have launched and not yet finished
    # Deprecated in 0.2.0 (API 2), removed in 0.4.0: accepted and ignored, since combine does what the kernel's
    # ExpertOutput leaves undone whatever a dispatcher declares (True, what every dispatcher does, was the rule).
    combine_applies_weights: bool | None = deprecation.field(deprecation.COMBINE_APPLIES_WEIGHTS)

    def __attrs_post_init__(self):
        deprecation.warn_fields(self, stacklevel=3)
        unknown = {self.layout, *self.other_layouts} - set(ALL_LAYOUTS)
        if unknown:
            raise ValueError(f"unknown layouts {sorted(unknown)}; layouts are {', '.join(ALL_LAYOUTS)}")

    @property
    def layouts(self) -> tuple[str, ...]:
        """Every layout dispatch_finish may produce, `layout` first."""
        return (self.layout, *sorted(self.other_layouts - {self.layout}))


class Dispatcher(abc.ABC):
    """Moves each token to the ranks holding its physical experts, and the results back.

    Contract: with identity experts, combine(dispatch(x)) == sum_k w_k * x on every
    source rank, for any routing (idle experts, ranks receiving nothing, ids of -1).
    The handle inside `Dispatched` is passed explicitly to combine, so one instance
    can serve two micro-batches in flight at once.
    """

    caps: ClassVar[DispatcherCaps]

    def __init__(self, ctx: MoEContext):
        self.ctx = ctx

    @abc.abstractmethod
    def dispatch_start(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, batch: Any = None
    ) -> Any:
        """Launch the dispatch of `hidden` [T, H] routed to physical `topk_ids` [T, K]; return a pending object."""

    @abc.abstractmethod
    def dispatch_finish(self, pending: Any) -> Dispatched:
        """Wait for a launched dispatch and return the received tokens in `caps.layout`."""

    @abc.abstractmethod
    def combine_start(self, output: ExpertOutput, handle: Any) -> Any:
        """Launch sending the experts' output back to the tokens' source ranks."""

    @abc.abstractmethod
    def combine_finish(self, pending: Any) -> torch.Tensor:
        """Wait for a launched combine; return [T, H] on the source rank: sum_k w_k * expert_k(x)."""

    def dispatch(self, hidden, topk_ids, topk_weights, batch=None) -> Dispatched:
        return self.dispatch_finish(self.dispatch_start(hidden, topk_ids, topk_weights, batch))

    def combine(self, output: ExpertOutput, handle: Any) -> torch.Tensor:
        return self.combine_finish(self.combine_start(output, handle))
