"""Layout adapters: turn a dispatcher's layout into the one a kernel accepts, and the output back.

Adapters are keyed by (from, to). Each returns the converted layout and a function
that turns the kernel's ExpertOutput back into an output of the source layout.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch

from ..interfaces import (
    CONTIGUOUS,
    MASKED,
    STANDARD,
    ContiguousLayout,
    ExpertOutput,
    Fp8Payload,
    Layout,
    MaskedLayout,
    StandardLayout,
)

Restore = Callable[[ExpertOutput], ExpertOutput]


def _pairs_by_expert(layout: StandardLayout):
    """Valid (token, k) pairs sorted by local expert: flat pair ids, their experts, per-expert counts."""
    flat_ids = layout.topk_ids.reshape(-1)
    valid = (flat_ids >= 0).nonzero().squeeze(1)
    experts = flat_ids[valid]
    order = torch.argsort(experts, stable=True)
    pairs, experts = valid[order], experts[order]
    counts = torch.bincount(experts, minlength=layout.num_local_experts)
    return pairs, experts, counts


def _rank_within_expert(experts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(experts.numel(), device=experts.device) - starts[experts]


def _unsorted(hidden_rows: torch.Tensor, pairs: torch.Tensor, layout: StandardLayout) -> torch.Tensor:
    """Scatter per-pair rows back to [N, K, H] (zeros where the pair was not routed here)."""
    n, k = layout.topk_ids.shape
    out = hidden_rows.new_zeros(n * k, hidden_rows.shape[-1])
    out[pairs] = hidden_rows
    return out.view(n, k, hidden_rows.shape[-1])


def _moved_fp8(fp8: Fp8Payload | None, source: torch.Tensor, shape: tuple[int, ...], where: tuple) -> Fp8Payload | None:
    """The fp8 payload's rows moved like the hidden rows (zeros, scale 0, on padding)."""
    if fp8 is None:
        return None
    values = fp8.values.new_zeros(*shape, fp8.values.shape[-1])
    scales = fp8.scales.new_zeros(*shape, fp8.scales.shape[-1])
    values[where] = fp8.values[source]
    scales[where] = fp8.scales[source]
    return Fp8Payload(values, scales, fp8.group_size)


@attrs.frozen
class ContiguousPlan:
    """Where every routed (row, k) pair of a standard layout goes in the contiguous layout."""

    pairs: torch.Tensor  # [P] flat pair ids (row * K + k) of the pairs with an id, sorted by expert
    rows: torch.Tensor  # [P] their row in the contiguous layout
    expert_index: torch.Tensor  # [M] int32 local expert of each contiguous row, -1 on padding
    top_k: int

    @property
    def sources(self) -> torch.Tensor:
        """[P] the standard-layout row of every pair."""
        return self.pairs // self.top_k


def plan_contiguous(
    topk_ids: torch.Tensor, num_local_experts: int, alignment: int, counts: list[int] | None = None
) -> ContiguousPlan:
    """Group the pairs of local expert ids `topk_ids` [N, K] (-1: elsewhere) per expert, padded to `alignment`.

    `counts`, the pairs per local expert when the host already knows them (as DeepEP's
    dispatch reports), saves the one host sync that sizes the result.
    """
    layout = StandardLayout(topk_ids.new_empty(topk_ids.shape[0], 0), topk_ids, topk_ids, num_local_experts)
    pairs, experts, device_counts = _pairs_by_expert(layout)
    padded = (device_counts + alignment - 1) // alignment * alignment
    group_start = torch.cumsum(padded, 0) - padded
    rows = group_start[experts] + _rank_within_expert(experts, device_counts)
    if counts is None:
        total = int(padded.sum())
    else:
        total = sum(-(-count // alignment) * alignment for count in counts)
    expert_index = torch.full((total,), -1, dtype=torch.int32, device=topk_ids.device)
    expert_index[rows] = experts.to(torch.int32)
    return ContiguousPlan(pairs, rows, expert_index, topk_ids.shape[1])


def standard_to_contiguous(layout: StandardLayout, alignment: int) -> tuple[ContiguousLayout, Restore]:
    plan = plan_contiguous(layout.topk_ids, layout.num_local_experts, alignment)
    rows, source, total = plan.rows, plan.sources, plan.expert_index.shape[0]
    hidden = layout.hidden.new_zeros(total, layout.hidden.shape[1])
    hidden[rows] = layout.hidden[source]
    fp8 = _moved_fp8(layout.fp8, source, (total,), (rows,))
    converted = ContiguousLayout(hidden, plan.expert_index, layout.num_local_experts, alignment, fp8,
                                 routed_pairs=plan.pairs.numel())

    def restore(output: ExpertOutput) -> ExpertOutput:
        return ExpertOutput(_unsorted(output.hidden[rows], plan.pairs, layout), weights_applied=False, summed=False)

    return converted, restore


def standard_to_masked(layout: StandardLayout, alignment: int) -> tuple[MaskedLayout, Restore]:
    pairs, experts, counts = _pairs_by_expert(layout)
    max_rows = max(layout.num_rows, 1)
    max_rows = (max_rows + alignment - 1) // alignment * alignment
    slot = _rank_within_expert(experts, counts)
    source = pairs // layout.topk_ids.shape[1]
    hidden = layout.hidden.new_zeros(layout.num_local_experts, max_rows, layout.hidden.shape[1])
    hidden[experts, slot] = layout.hidden[source]
    fp8 = _moved_fp8(layout.fp8, source, (layout.num_local_experts, max_rows), (experts, slot))
    expected = -(-pairs.numel() // max(layout.num_local_experts, 1)) if layout.num_rows else 0
    converted = MaskedLayout(hidden, counts.to(torch.int32), fp8, expected_rows=min(expected, max_rows))

    def restore(output: ExpertOutput) -> ExpertOutput:
        return ExpertOutput(_unsorted(output.hidden[experts, slot], pairs, layout), weights_applied=False, summed=False)

    return converted, restore


ADAPTERS = {
    (STANDARD, CONTIGUOUS): standard_to_contiguous,
    (STANDARD, MASKED): standard_to_masked,
}


def _identity(output: ExpertOutput) -> ExpertOutput:
    return output


class LayoutAdapter:
    """Chosen once at start-up for a (dispatcher layouts, kernel) pair; a layout the kernel takes passes as it is."""

    def __init__(self, sources, accepted: frozenset[str], alignment: int):
        sources = (sources,) if isinstance(sources, str) else tuple(sources)
        self.targets = {}
        for source in sources:
            target = source if source in accepted else next(
                (to for (frm, to) in ADAPTERS if frm == source and to in accepted), None
            )
            if target is None:
                raise ValueError(f"no adapter turns the {source} layout into any of {sorted(accepted)}")
            self.targets[source] = target
        self.alignment = alignment

    @staticmethod
    def can_adapt(source: str, accepted: frozenset[str]) -> bool:
        return source in accepted or any(frm == source and to in accepted for (frm, to) in ADAPTERS)

    def __call__(self, layout: Layout) -> tuple[Layout, Restore]:
        target = self.targets[layout.name]
        if target == layout.name:
            return layout, _identity
        return ADAPTERS[(layout.name, target)](layout, self.alignment)
