"""`torch`: the reference MoE kernel, a loop over experts in plain torch, for every layout and weight format."""

from __future__ import annotations

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


class TorchMoEKernel(MoEKernel):
    caps = KernelCaps(
        layouts=frozenset(ALL_LAYOUTS),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        weight_formats=frozenset({BF16, FP8_BLOCK}),
        fp8_payload=True,  # reads rows from layout.fp8 when the dispatcher sent them as fp8
    )

    def prepare_weights(self, weights: ExpertWeights):
        if weights.format == FP8_BLOCK:
            return dequantize_blocks(weights.w13, weights.w13_scale), dequantize_blocks(weights.w2, weights.w2_scale)
        return weights.w13, weights.w2

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
        out = torch.zeros(hidden.shape[0], weights[1].shape[1], dtype=torch.float32, device=hidden.device)
        for expert in torch.unique(layout.topk_ids[layout.topk_ids >= 0]).tolist():
            token, k = (layout.topk_ids == expert).nonzero(as_tuple=True)
            y = _expert(hidden[token], weights, expert).float() * layout.topk_weights[token, k, None].float()
            out.index_add_(0, token, y)
        return ExpertOutput(out.to(hidden.dtype), weights_applied=True, summed=True)


def _activations(hidden: torch.Tensor, fp8: Fp8Payload | None) -> torch.Tensor:
    return hidden if fp8 is None else dequantize_activations(fp8).to(hidden.dtype)


def _expert(x: torch.Tensor, weights, expert: int) -> torch.Tensor:
    w13, w2 = weights
    gate, up = F.linear(x, w13[expert].to(x.dtype)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2[expert].to(x.dtype))
