"""The one executor of a forward step: the batch, maybe cut into micro-batches, through the layer programs."""

from __future__ import annotations

import attrs
import torch

from .forward_batch import ForwardBatch
from .interfaces import BatchMeta, OverlapStrategy
from .kv_cache import KVPool


@attrs.frozen
class PairRows:
    """An MoE layer's output left as its tokens' top-k pair rows, routed weights applied but not summed yet:
    rows [N * top_k, H], token n's pairs at rows n * top_k ... The next layer's norm sums them in its own kernel
    (the sum kernel's launch saved); `total` is the same sum anywhere else."""

    rows: torch.Tensor
    top_k: int

    def total(self) -> torch.Tensor:
        """[N, H]: each token's pair rows summed in fp32 and rounded once, as the MoE kernel's own sum does."""
        return self.rows.view(-1, self.top_k, self.rows.shape[-1]).float().sum(1).to(self.rows.dtype)


def add(hidden: torch.Tensor, addend: torch.Tensor | PairRows) -> torch.Tensor:
    return hidden + (addend.total() if isinstance(addend, PairRows) else addend)


@attrs.define
class StepState:
    """What one (micro-)batch carries through the layer stack."""

    hidden: torch.Tensor
    batch: ForwardBatch
    kv: KVPool
    shared_during_dispatch: bool = False  # the overlap strategy's choice, read by MoE layers
    # an addend of `hidden` not added yet: a layer's MLP output, which the next layer's norm adds in its own
    # kernel (one launch fewer per layer); `settle` adds it where no layer follows
    pending: torch.Tensor | PairRows | None = None

    def settle(self) -> torch.Tensor:
        """`hidden` with any pending addend added."""
        if self.pending is not None:
            self.hidden, self.pending = add(self.hidden, self.pending), None
        return self.hidden


def micro_batch_ranges(cuts, num_tokens: int) -> list[tuple[int, int]]:
    bounds = [0, *cuts, num_tokens]
    return list(zip(bounds[:-1], bounds[1:]))


def step_cuts(strategy: OverlapStrategy, batch: ForwardBatch) -> list[int] | None:
    """Where this rank cuts its batch.

    batch.overlap_split None: the strategy decides alone (one rank, or ranks holding the same
    batch). True/False: all ranks agreed beforehand (DP attention); a rank that must split but
    has nothing to cut runs two empty micro-batches, so its collectives match the others'.
    """
    split = batch.overlap_split
    if split is False:
        return None
    cuts = strategy.cuts(BatchMeta(batch.mode, batch.extend_lens))
    if split and cuts is None:
        return [batch.num_tokens]
    return None if cuts is None else list(cuts)


def run_layers(model, batch: ForwardBatch, kv: KVPool, strategy: OverlapStrategy) -> torch.Tensor:
    """[T, H] hidden states after the last layer (micro-batches put back in token order)."""
    return run_program(model.layers_program, model.model.embed_tokens(batch.input_ids), batch, kv, strategy)


def run_program(program, hidden: torch.Tensor, batch: ForwardBatch, kv: KVPool, strategy: OverlapStrategy) -> torch.Tensor:
    """`program(state)` (layer programs with yield points) over `hidden` [T, H], cut into the strategy's
    micro-batches; returns the final hidden states [T, H] in token order."""
    shared_during_dispatch = strategy.caps.shared_during_dispatch
    cuts = step_cuts(strategy, batch)
    if cuts is None:
        states = [StepState(hidden, batch, kv, shared_during_dispatch)]
    else:
        states = [
            StepState(hidden[a:b], batch.slice_tokens(a, b), kv, shared_during_dispatch)
            for a, b in micro_batch_ranges(cuts, batch.num_tokens)
        ]
    strategy.run([program(state) for state in states])
    return states[0].settle() if len(states) == 1 else torch.cat([s.settle() for s in states])
