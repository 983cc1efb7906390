"""`triton`: the fused MoE kernel as a moeplex MoEKernel."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from moeplex.interfaces import (
    ALL_LAYOUTS,
    BF16,
    FP8_BLOCK,
    ContiguousLayout,
    ExpertOutput,
    ExpertWeights,
    KernelCaps,
    MaskedLayout,
    MoEContext,
    MoEKernel,
    StandardLayout,
)

from .align import ONE_LAUNCH_MAX_PAIRS
from .configs import MoETiles, TileConfig, TileTables, device_name, dtype_name
from .fused import (
    PreparedWeights,
    activations,
    masked_expert_index,
    moe_grouped_rows,
    moe_standard,
    moe_standard_grouped_mm,
)
from .kernel import grouped_gemm_kernel

# Triton decides when it decorates a kernel whether it will compile it for the GPU or interpret it
# on the CPU (TRITON_INTERPRET=1); the capabilities follow that decision rather than re-reading it.
INTERPRETED = isinstance(grouped_gemm_kernel, InterpretedFunction)
# The interpreter's bf16 arithmetic is wrong, so bf16 is only offered to compiled kernels.
_DTYPES = {torch.float32, torch.float16} if INTERPRETED else {torch.float32, torch.float16, torch.bfloat16}

CONTIGUOUS_ALIGNMENT = 128  # a multiple of every BLOCK_M, so contiguous groups never need sorting
# From this many rows per expert, bf16 standard-layout GEMMs run faster through torch._grouped_mm (CUTLASS) than
# through the Triton kernel on the H200 (benchmarks/results/fused_moe_h200_routing.md); below it the fused kernel wins.
GROUPED_MM_MIN_ROWS = 256
# Between these rows per expert the library path's GEMM 1 runs through the Triton kernel's gated GEMM, which reads
# the rows by index and fuses SiLU-and-multiply (two passes over the rows fewer than gather + CUTLASS + SiLU), in
# this tile. On the H100 (benchmarks/results/fused_moe_large_m_h100_s23.md) it takes 1606 µs against those three
# passes' 1776 at 510 rows per expert (EP8-global M=16384) and 1566 against 1714 at 512; at 133 its padding to
# whole tiles loses, and from ~1000 the Triton GEMM's gap to CUTLASS's (~6% at 510 rows, ~20% at 4096) outgrows the
# passes it saves.
GATED_GEMM1_MIN_ROWS = 384
GATED_GEMM1_MAX_ROWS = 1024
GATED_GEMM1_TILE = TileConfig(64, 256, 64, group_m=32, num_warps=8, num_stages=3, tma=True)


def _grouped_mm_runs(device: torch.device) -> bool:
    """torch._grouped_mm's CUTLASS kernels need sm90 (Hopper)."""
    return (not INTERPRETED and hasattr(torch, "_grouped_mm") and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0))


class TritonMoEKernel(MoEKernel):
    caps = KernelCaps(
        layouts=frozenset(ALL_LAYOUTS),
        dtypes=frozenset(_DTYPES),
        weight_formats=frozenset({BF16, FP8_BLOCK}),
        alignment=CONTIGUOUS_ALIGNMENT,
        fp8_payload=True,  # reads rows from layout.fp8 when the dispatcher sent them as fp8
        needs_gpu=not INTERPRETED,
        graph_safe=True,  # no host sync: counts stay on the device and grids come from shapes
    )

    def __init__(self, ctx: MoEContext, tables: TileTables | None = None):
        super().__init__(ctx)
        self.tables = tables or TileTables(device_name(ctx.device, INTERPRETED))
        # rows per expert from which bf16 standard layouts take the library GEMMs (inf: never)
        self.grouped_mm_min_rows = GROUPED_MM_MIN_ROWS if _grouped_mm_runs(ctx.device) else float("inf")
        # rows per expert from which, and up to which, the library path's GEMM 1 is the Triton gated GEMM
        self.gated_gemm1_rows = (GATED_GEMM1_MIN_ROWS, GATED_GEMM1_MAX_ROWS)
        # up to this many routed pairs the standard layout is sorted in one launch, not three (0: never)
        self.one_launch_align_pairs = ONE_LAUNCH_MAX_PAIRS

    def prepare_weights(self, weights: ExpertWeights) -> PreparedWeights:
        return PreparedWeights.from_expert_weights(weights)

    def apply(self, layout, weights: PreparedWeights) -> ExpertOutput:
        return self._apply(layout, weights, sum_pairs=True)

    def apply_unsummed(self, layout, weights: PreparedWeights) -> ExpertOutput:
        """`apply`, but the standard layout's weighted pair rows come back unsummed ([N, K, H]) where the path
        computes them anyway, for a caller that sums them in a kernel of its own (moeplex.moe.MoERuntime's
        `sums_topk_later`); the library path, which sums in its gather's order, still returns [N, H]."""
        return self._apply(layout, weights, sum_pairs=False)

    def _apply(self, layout, weights: PreparedWeights, sum_pairs: bool) -> ExpertOutput:
        acts = activations(layout.hidden, layout.fp8, weights)
        rows_per_expert = self.rows_per_expert(layout)
        if isinstance(layout, StandardLayout) and self._library_gemms(layout, rows_per_expert, weights, acts):
            low, high = self.gated_gemm1_rows
            gate_up = GATED_GEMM1_TILE if low <= rows_per_expert < high else None
            hidden = moe_standard_grouped_mm(acts.values, layout.topk_ids, layout.topk_weights, layout.routed_pairs,
                                             weights, gate_up)
            return ExpertOutput(hidden, weights_applied=True, summed=True)
        tiles = self.tiles(rows_per_expert, acts.out_dtype, weights)
        if isinstance(layout, StandardLayout):
            hidden = moe_standard(acts, layout.topk_ids, layout.topk_weights, weights, tiles, self.one_launch_align_pairs,
                                  sum_pairs)
            return ExpertOutput(hidden, weights_applied=True, summed=sum_pairs)
        if isinstance(layout, ContiguousLayout):
            hidden = moe_grouped_rows(acts, layout.expert_index, layout.alignment, weights, tiles)
            return ExpertOutput(hidden, weights_applied=False, summed=False)
        if isinstance(layout, MaskedLayout):
            num_experts, max_rows = layout.hidden.shape[:2]
            expert_index = masked_expert_index(layout.counts, max_rows)
            hidden = moe_grouped_rows(acts, expert_index, max_rows, weights, tiles)
            return ExpertOutput(hidden.view(num_experts, max_rows, -1), weights_applied=False, summed=False)
        raise TypeError(f"unknown layout {type(layout).__name__}")

    def _library_gemms(self, layout: StandardLayout, rows_per_expert: float, weights, acts) -> bool:
        """Whether torch._grouped_mm runs the GEMMs: bf16 and many rows per expert, whatever share of the rows'
        top-k is local. The path's grouping is a counting sort (group.py), O(pairs) at one int read per pair, and
        the bytes it moves beyond the fused kernel's (a gather, the GEMM outputs read back) scale with the local
        pairs, not the rows: so rows per expert alone decides, as under local routing (an argsort of all N x K ids
        once made EP8's global routing, an eighth of them local, an exception: fused_moe_h200_routing.md)."""
        return (bool(layout.routed_pairs) and rows_per_expert >= self.grouped_mm_min_rows
                and not weights.fp8 and acts.values.dtype == torch.bfloat16)

    def rows_per_expert(self, layout) -> float:
        """The rows a local expert receives this step, as the host knows it without a sync.

        The dispatcher's count where it has one (`routed_pairs`, `expected_rows`); otherwise, for the
        standard layout, uniform routing of every row's top-k over all EP ranks, and for the grouped
        layouts their row count (an upper bound: it includes the alignment padding).
        """
        experts = layout.num_local_experts
        if isinstance(layout, MaskedLayout):
            return float(layout.expected_rows or layout.hidden.shape[1])
        if layout.routed_pairs:
            return layout.routed_pairs / experts
        if isinstance(layout, StandardLayout):
            return layout.num_rows * self.ctx.top_k / self.ctx.ep_size / experts
        return layout.num_rows / experts

    def tiles(self, rows_per_expert: float, dtype: torch.dtype, weights: PreparedWeights) -> MoETiles:
        return self.tables.pick(
            rows_per_expert,
            dtype=dtype_name(dtype, weights.fp8),
            num_experts=weights.num_experts,
            intermediate=weights.intermediate_size,
            hidden=weights.hidden_size,
        )
