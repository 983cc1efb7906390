"""`torch`: the reference MoE kernel in plain torch, for every layout and weight format.

On a CPU the standard layout (the one-rank path) runs through `CpuExperts` (cpu_experts.py): the fastest
of up to four ways for the layer's shape and dtype, measured on its weights when they are prepared, once
per shape (the processors the engine meets differ more than the models do). Other devices, and
activations in another dtype than the weights, sort the pairs by expert once and loop over the experts
that got rows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moeplex.interfaces import (
    ALL_LAYOUTS,
    BF16,
    FP8_BLOCK,
    ContiguousLayout,
    ExpertOutput,
    ExpertWeights,
    Fp8Payload,
    KernelCaps,
    MaskedLayout,
    MoEKernel,
    StandardLayout,
)
from moeplex.interfaces.kernels import dequantize_activations, dequantize_blocks

from .cpu_experts import CpuExperts, sorted_pairs


class TorchMoEKernel(MoEKernel):
    caps = KernelCaps(
        layouts=frozenset(ALL_LAYOUTS),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        weight_formats=frozenset({BF16, FP8_BLOCK}),
        fp8_payload=True,  # reads rows from layout.fp8 when the dispatcher sent them as fp8
    )

    def prepare_weights(self, weights: ExpertWeights):
        if weights.format == FP8_BLOCK:
            w13, w2 = dequantize_blocks(weights.w13, weights.w13_scale), dequantize_blocks(weights.w2, weights.w2_scale)
        else:
            w13, w2 = weights.w13, weights.w2
        if w13.device.type != "cpu" or w13.dtype != w2.dtype:
            return w13, w2
        return CpuExperts(w13, w2, self.ctx.top_k)

    def apply(self, layout, weights) -> ExpertOutput:
        hidden = _activations(layout.hidden, layout.fp8)
        if isinstance(layout, StandardLayout):
            return self._standard(layout, hidden, weights)
        if isinstance(layout, ContiguousLayout):
            out = hidden.new_zeros(hidden.shape[0], weights[1].shape[1])
            for expert in range(layout.num_local_experts):
                rows = (layout.expert_index == expert).nonzero().squeeze(1)
                if rows.numel():
                    out[rows] = _expert(hidden[rows], weights, expert)
            return ExpertOutput(out, weights_applied=False, summed=False)
        if isinstance(layout, MaskedLayout):
            out = hidden.new_zeros(*hidden.shape[:2], weights[1].shape[1])
            for expert, count in enumerate(layout.counts.tolist()):
                if count:
                    out[expert, :count] = _expert(hidden[expert, :count], weights, expert)
            return ExpertOutput(out, weights_applied=False, summed=False)
        raise TypeError(f"unknown layout {type(layout).__name__}")

    def _standard(self, layout: StandardLayout, hidden: torch.Tensor, weights) -> ExpertOutput:
        if isinstance(weights, CpuExperts) and weights.takes(hidden):
            out = weights.run(hidden, layout.topk_ids, layout.topk_weights)
        else:
            out = sorted_pairs(hidden, layout.topk_ids, layout.topk_weights, layout.num_local_experts,
                               functools.partial(_expert_loop, weights=weights))
        return ExpertOutput(out, weights_applied=True, summed=True)


def _activations(hidden: torch.Tensor, fp8: Fp8Payload | None) -> torch.Tensor:
    return hidden if fp8 is None else dequantize_activations(fp8).to(hidden.dtype)


def _expert_loop(x: torch.Tensor, counts: list[int], weights) -> torch.Tensor:
    """Rows sorted by expert, counts[e] of them for expert e: one GEMM pair per expert that got rows."""
    rows = [_expert(group, weights, e) for e, group in enumerate(x.split(counts)) if group.shape[0]]
    return torch.cat(rows) if rows else x.new_empty(0, weights[1].shape[1])


def _expert(x: torch.Tensor, weights, expert: int) -> torch.Tensor:
    w13, w2 = weights
    gate, up = F.linear(x, w13[expert].to(x.dtype)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2[expert].to(x.dtype))
