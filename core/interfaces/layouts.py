"""The token layouts that travel between a dispatcher and a MoE kernel.

Each layout is one small tagged type. A dispatcher produces one of them; a kernel
declares which it accepts; the core converts between them with the adapters in
`moeplex.moe.adapters` when the two differ.

A layout with an fp8 payload may carry `hidden` only for its shape and compute dtype:
a dispatcher that received fp8 rows alone sets it to `placeholder(...)`, an expanded
view of one element. Kernels read the rows from the payload then.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

STANDARD = "standard"
CONTIGUOUS = "contiguous"
MASKED = "masked"
ALL_LAYOUTS = (STANDARD, CONTIGUOUS, MASKED)


@attrs.frozen
class Fp8Payload:
    """Quantized activations: fp8 values plus one fp32 scale per 128-wide group of each row."""

    values: torch.Tensor
    scales: torch.Tensor
    group_size: int = 128


def placeholder(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of `shape` that takes no memory: where only the payload holds the rows."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


@attrs.frozen
class StandardLayout:
    """Received tokens [N, H] with their local top-k expert ids (-1: not on this rank) and weights.

    `routed_pairs` is the count of ids >= 0 where the host knows it without a sync (0: unknown), for
    kernels that pick tiles by the rows each expert receives.
    """

    name: ClassVar[str] = STANDARD
    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_local_experts: int
    fp8: Fp8Payload | None = None
    routed_pairs: int = 0

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0]


@attrs.frozen
class ContiguousLayout:
    """Rows grouped per local expert, each group padded to `alignment` rows.

    `expert_index[m]` is the local expert of row m, or -1 on padding rows. `routed_pairs` is the count
    of rows that are not padding where the host knows it (0: unknown).
    """

    name: ClassVar[str] = CONTIGUOUS
    hidden: torch.Tensor
    expert_index: torch.Tensor
    num_local_experts: int
    alignment: int
    fp8: Fp8Payload | None = None
    routed_pairs: int = 0

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0]


@attrs.frozen
class MaskedLayout:
    """[local_experts, max_rows, H] with the valid row count of every expert (graph-safe).

    `expected_rows` is a hint of the typical count (0: unknown), for kernels that pick tiles by it.
    """

    name: ClassVar[str] = MASKED
    hidden: torch.Tensor
    counts: torch.Tensor
    fp8: Fp8Payload | None = None
    expected_rows: int = 0

    @property
    def num_local_experts(self) -> int:
        return self.hidden.shape[0]

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0] * self.hidden.shape[1]


Layout = StandardLayout | ContiguousLayout | MaskedLayout


@attrs.frozen
class Dispatched:
    """What a dispatcher hands to the kernel: a layout plus the handle combine needs.

    The handle is opaque to everyone but the dispatcher that made it; it is passed
    back explicitly so one dispatcher instance can serve several micro-batches.
    """

    layout: Layout
    handle: Any


@attrs.frozen
class ExpertOutput:
    """A kernel's result, in the shape of the layout it was given.

    For the standard layout: [N, H] when `summed`, else [N, K, H].
    For the contiguous layout: [M, H] per row.  For the masked layout: [E, max_rows, H].
    `weights_applied` and `summed` tell combine what is left to do.
    """

    hidden: torch.Tensor
    weights_applied: bool
    summed: bool


def reduce_standard(output: ExpertOutput, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Finish a standard-layout ExpertOutput into [N, H]: apply what the kernel left undone.

    Pairs whose id is -1 contribute nothing whatever the kernel wrote for them.
    """
    if output.summed:
        if not output.weights_applied:
            raise ValueError("an ExpertOutput cannot be summed over top-k without the top-k weights applied")
        return output.hidden
    hidden = output.hidden
    if output.weights_applied:
        weights = (topk_ids >= 0).to(hidden.dtype)
    else:
        weights = torch.where(topk_ids >= 0, topk_weights, 0).to(hidden.dtype)
    return torch.einsum("nkh,nk->nh", hidden, weights)
