"""A drafter's own decode steps in CUDA graphs: DrafterContext.graphs_for.

A drafter that runs layers of its own (nextn: the MTP layer, once per chained draft) runs them as decode
batches of one row per request, many small kernels each: the launch cost the target's decode graphs remove.
`graphs_for(step, width)` captures such a step once per padded batch size over the same static inputs the
target's graphs read (DecodeInputs, shared: the two never replay at once) plus a static [max_bs, width] input
of its own for the rows' hidden states, and returns a GraphedStep that replays it for the decode batches that
fit. Padding rows decode at position 0 in the KV pool's scratch page, as the target's padding does.

The engine offers graphs where its target's decode graphs were captured (the same reasons rule both out:
a CPU, an attention backend that reads host lengths, a dispatcher or MoE kernel that is not graph-safe).
A capture that fails on the GPU is logged in one line and the drafter runs eagerly: graphs are only speed.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import attrs
import torch

from ..cuda_graph import Capture, DecodeInputs, padded_size
from ..forward_batch import ForwardBatch, ForwardMode

log = logging.getLogger(__name__)

# step(batch, hidden [B, width]) -> tensors with one row per token of the batch
Step = Callable[[ForwardBatch, torch.Tensor], Sequence[torch.Tensor]]


class EagerStep:
    """A drafter step where no graph is captured: called as it is."""

    def __init__(self, step: Step):
        self.step = step

    def can_replay(self, rows: int) -> bool:
        return False

    def __call__(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.step(batch, hidden))


class GraphedStep:
    """One captured drafter step per batch size; a decode batch that fits replays the smallest holding it.

    `capture` turns a step function into a replay function (CudaGraphCapture on the GPU; the CPU tests pass
    one that calls the step again, which checks everything but the capture itself). `records_load`: whether
    the expert-load recorder is on now (its counts would include the padding rows; then the step runs eagerly).
    """

    def __init__(self, step: Step, width: int, dtype: torch.dtype, inputs: DecodeInputs, sizes: Sequence[int],
                 capture: Capture, world_size: int = 1, records_load: Callable[[], bool] = lambda: False):
        self.step, self.inputs, self.records_load = step, inputs, records_load
        self.hidden = torch.zeros(inputs.max_bs, width, dtype=dtype, device=inputs.input_ids.device)
        self.replays: dict[int, Callable[[], Sequence[torch.Tensor]]] = {}
        for size in sorted(sizes, reverse=True):  # largest first: the smaller graphs reuse its memory
            batch = attrs.evolve(inputs.batch(size), global_num_tokens=(size,) * world_size, global_all_decode=True)
            hidden = self.hidden[:size]
            self.replays[size] = capture(lambda batch=batch, hidden=hidden: tuple(step(batch, hidden)))
        self.sizes = sorted(self.replays)

    def can_replay(self, rows: int) -> bool:
        """Whether a decode batch of `rows` rows (with pages the static inputs hold) would replay a graph now."""
        return 0 < rows <= self.sizes[-1] and not self.records_load()

    def size_for(self, batch: ForwardBatch) -> int | None:
        if batch.mode != ForwardMode.DECODE or not self.inputs.fits(batch) or not self.can_replay(batch.batch_size):
            return None
        return padded_size(batch.batch_size, self.sizes)

    def __call__(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's outputs for the batch's rows: replayed (copies, the graph's own are overwritten by the next
        replay) where the batch fits, else the step run eagerly."""
        size = self.size_for(batch)
        if size is None:
            return tuple(self.step(batch, hidden))
        count = batch.batch_size
        self.inputs.load(batch, size)
        self.hidden[:count].copy_(hidden)
        self.hidden[count:size].zero_()  # padding rows: a larger batch may have left real states there
        return tuple(out[:count].clone() for out in self.replays[size]())


def graphs_for(step: Step, width: int, dtype: torch.dtype, target_graphs, capture: Capture, world_size: int = 1,
               records_load: Callable[[], bool] = lambda: False) -> EagerStep | GraphedStep:
    """The drafter's step over the target graphs' static inputs and sizes (eager where the target has no graphs,
    or where the capture fails)."""
    if target_graphs is None:
        return EagerStep(step)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            graphed = GraphedStep(step, width, dtype, target_graphs.inputs, target_graphs.sizes, capture, world_size,
                                  records_load)
    except Exception as error:  # a performance feature never stops start-up
        log.warning("the drafter's steps run without CUDA graphs: capturing them failed (%s: %s)",
                    type(error).__name__, error)
        return EagerStep(step)
    log.info("captured CUDA graphs for the drafter's steps of %s rows in %.1f s", graphed.sizes,
             time.perf_counter() - start)
    return graphed
