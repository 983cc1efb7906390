"""`deepgemm`: DeepSeek's FP8 grouped GEMMs (DeepGEMM) for the contiguous and masked layouts.

Experts compute in fp8 with DeepSeek-V3's recipe: activations quantized per row in
128-wide groups, weights in 128x128 blocks, bf16 out. GEMM 1 (gate and up) ->
SiLU-and-mul fused with the fp8 quantization of its result -> GEMM 2 (down).
bf16 expert weights are quantized once in `prepare_weights`; fp8-block weights are
used as they are. The contiguous layout is what DeepEP's normal mode gives after its
rows are grouped per expert (prefill); the masked layout is DeepEP's low-latency
receive buffer (decode), which needs no host sync and so is CUDA-graph safe.

DeepGEMM is a dependency the user installs (Hopper, CUDA 12.3+); its kernels compile
on first use of each shape and are cached in DG_JIT_CACHE_DIR.
"""

from __future__ import annotations

import importlib

import attrs
import torch

from moeplex.interfaces import (
    BF16,
    CONTIGUOUS,
    FP8_BLOCK,
    ContiguousLayout,
    ExpertOutput,
    ExpertWeights,
    KernelCaps,
    MaskedLayout,
    MoEContext,
    MoEKernel,
)
from moeplex.interfaces.kernels import BLOCK, quantize_blocks, quantize_rows, silu_mul_quantize

MASKED = "masked"
ALIGNMENT = 128  # DeepGEMM's get_mk_alignment_for_contiguous_layout() on Hopper


@attrs.frozen
class Fp8Experts:
    """w13 [E, 2I, H] and w2 [E, H, I] in fp8 with fp32 scales per 128x128 block."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]


def quantize_experts(weights: ExpertWeights) -> Fp8Experts:
    """The experts in the fp8-block format: as given, or quantized expert by expert (bounded extra memory)."""
    if weights.format == FP8_BLOCK:
        return Fp8Experts(
            weights.w13.contiguous(), weights.w13_scale.float().contiguous(),
            weights.w2.contiguous(), weights.w2_scale.float().contiguous(),
        )
    parts = []
    for w in (weights.w13, weights.w2):
        pairs = [quantize_blocks(w[e]) for e in range(w.shape[0])]
        values = torch.stack([v for v, _ in pairs]) if pairs else torch.empty_like(w, dtype=torch.float8_e4m3fn)
        scales = torch.stack([s for _, s in pairs]) if pairs else w.new_empty(0, dtype=torch.float32)
        parts += [values.contiguous(), scales.float().contiguous()]
    return Fp8Experts(*parts)


def check_shapes(hidden_size: int, intermediate_size: int) -> None:
    for name, size in (("hidden", hidden_size), ("expert intermediate", intermediate_size)):
        if size % BLOCK:
            raise ValueError(f"deepgemm needs the {name} size to be a multiple of {BLOCK}, not {size}")


class DeepGemmMoEKernel(MoEKernel):
    caps = KernelCaps(
        layouts=frozenset({CONTIGUOUS, MASKED}),
        dtypes=frozenset({torch.bfloat16}),
        weight_formats=frozenset({BF16, FP8_BLOCK}),
        alignment=ALIGNMENT,
        needs_gpu=True,
        graph_safe=True,  # no host sync: the masked path reads its counts on the device
        fp8_compute=True,
        fp8_payload=True,  # reads rows from layout.fp8 when the dispatcher sent them as fp8
        requires=("deep_gemm",),
        min_compute_capability=(9, 0),
    )

    def __init__(self, ctx: MoEContext):
        super().__init__(ctx)
        check_shapes(ctx.hidden_size, ctx.intermediate_size)
        self.dg = importlib.import_module("deep_gemm")

    def prepare_weights(self, weights: ExpertWeights) -> Fp8Experts:
        return quantize_experts(weights)

    def apply(self, layout, weights: Fp8Experts) -> ExpertOutput:
        if isinstance(layout, ContiguousLayout):
            return ExpertOutput(self._contiguous(layout, weights), weights_applied=False, summed=False)
        if isinstance(layout, MaskedLayout):
            return ExpertOutput(self._masked(layout, weights), weights_applied=False, summed=False)
        raise TypeError(f"deepgemm takes the contiguous and masked layouts, not {type(layout).__name__}")

    def _contiguous(self, layout: ContiguousLayout, w: Fp8Experts) -> torch.Tensor:
        rows = layout.num_rows
        out = torch.empty(rows, w.hidden_size, dtype=torch.bfloat16, device=layout.hidden.device)
        if rows == 0:
            return out
        if layout.alignment % ALIGNMENT:
            raise ValueError(f"deepgemm needs expert groups aligned to {ALIGNMENT} rows, not {layout.alignment}")
        a = _activations(layout)
        index = layout.expert_index.to(torch.int32).contiguous()
        gate_up = torch.empty(rows, 2 * w.intermediate_size, dtype=torch.bfloat16, device=out.device)
        self.dg.m_grouped_fp8_gemm_nt_contiguous(a, (w.w13, w.w13_scale), gate_up, index)
        act = silu_mul_quantize(gate_up)
        self.dg.m_grouped_fp8_gemm_nt_contiguous(act, (w.w2, w.w2_scale), out, index)
        return out

    def _masked(self, layout: MaskedLayout, w: Fp8Experts) -> torch.Tensor:
        experts, max_rows = layout.hidden.shape[:2]
        if max_rows % ALIGNMENT:  # a tile's store would run into the next expert's rows
            raise ValueError(f"deepgemm needs the masked layout's rows per expert to be a multiple of {ALIGNMENT}, "
                             f"not {max_rows}")
        out = torch.empty(experts, max_rows, w.hidden_size, dtype=torch.bfloat16, device=layout.hidden.device)
        expected = layout.expected_rows or max_rows
        counts = layout.counts.to(torch.int32).contiguous()
        a = _activations(layout, counts)
        gate_up = torch.empty(experts, max_rows, 2 * w.intermediate_size, dtype=torch.bfloat16, device=out.device)
        self.dg.m_grouped_fp8_gemm_nt_masked(a, (w.w13, w.w13_scale), gate_up, counts, expected)
        act = silu_mul_quantize(gate_up, counts)
        self.dg.m_grouped_fp8_gemm_nt_masked(act, (w.w2, w.w2_scale), out, counts, expected)
        return out


def _activations(layout, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's rows in fp8 with per-row 128-group scales: the payload it came with, or quantized here
    (only the counted rows of a masked layout)."""
    if layout.fp8 is not None:
        if layout.fp8.group_size != BLOCK:
            raise ValueError(f"deepgemm needs fp8 activations scaled per {BLOCK} columns, not {layout.fp8.group_size}")
        return layout.fp8.values, layout.fp8.scales.float()
    return quantize_rows(layout.hidden, counts)
