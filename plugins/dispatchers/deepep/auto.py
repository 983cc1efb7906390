"""`deepep-auto`: DeepEP's normal mode for extend steps, its low-latency mode for decode steps.

One buffer serves both modes. Every EP rank must pick the same mode for a step, so the
choice reads only what all ranks agree on: the step's forward mode and token counts
(under DP attention the engine shares them before the step; see ForwardBatch). A decode
step larger than the low-latency buffer goes the normal way.
"""

from __future__ import annotations

import attrs
import torch

from moeplex.interfaces import CONTIGUOUS, MASKED, Dispatched, Dispatcher, ExpertOutput, MoEContext

from .buffers import BufferPool, check_low_latency, check_normal
from .low_latency import (
    DeepEPLowLatencyDispatcher,
    LowLatencyHandle,
    LowLatencyMode,
    PendingLowLatency,
    PendingLowLatencyCombine,
)
from .normal import NormalMode


def low_latency_step(batch, max_tokens: int) -> bool:
    """Whether a step goes the low-latency way; the same answer on every EP rank."""
    if batch is None:  # no step to read (a bare dispatch): the mode that takes any size
        return False
    all_decode = batch.global_all_decode
    if all_decode is None:
        all_decode = not batch.mode.is_extend and batch.num_tokens > 0
    counts = batch.global_num_tokens or (batch.num_tokens,)
    return bool(all_decode) and max(counts) <= max_tokens


class DeepEPAutoDispatcher(Dispatcher):
    name = "deepep-auto"
    # the low-latency mode's capabilities, with what the normal mode adds for extend steps
    caps = attrs.evolve(
        DeepEPLowLatencyDispatcher.caps,
        layout=CONTIGUOUS,
        other_layouts=frozenset({MASKED}),
        single_rank=False,  # the normal mode's intranode kernels need 2, 4 or 8 ranks
        needs_host_sync=True,  # in extend steps; decode steps, the ones captured in graphs, have none
    )

    def __init__(self, ctx: MoEContext, buffers: BufferPool | None = None):
        super().__init__(ctx)
        check_normal(ctx, self.name)
        check_low_latency(ctx, self.name)
        self.buffers = buffers if buffers is not None else BufferPool()  # one buffer, both modes
        deep_ep, buffer, plan = self.buffers.make(ctx, self.name, normal=True, low_latency=True)
        self.normal = NormalMode(ctx, deep_ep, buffer)
        self.low_latency = LowLatencyMode(ctx, buffer, plan.ll_tokens_per_rank, self.name)

    def dispatch_start(self, hidden, topk_ids, topk_weights, batch=None):
        mode = self.low_latency if low_latency_step(batch, self.low_latency.max_tokens) else self.normal
        return mode.dispatch_start(hidden, topk_ids, topk_weights)

    def dispatch_finish(self, pending) -> Dispatched:
        mode = self.low_latency if isinstance(pending, PendingLowLatency) else self.normal
        return mode.dispatch_finish(pending)

    def combine_start(self, output: ExpertOutput, handle):
        mode = self.low_latency if isinstance(handle, LowLatencyHandle) else self.normal
        return mode.combine_start(output, handle)

    def combine_finish(self, pending) -> torch.Tensor:
        mode = self.low_latency if isinstance(pending, PendingLowLatencyCombine) else self.normal
        return mode.combine_finish(pending)
