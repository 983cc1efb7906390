"""`torch`: the reference MoE kernel in plain torch, for every layout and weight format.

The standard layout (the one-rank CPU path) on CPU in bf16/fp16 where oneDNN runs them, at decode
sizes (at most 128 tokens, at least as many pairs as experts), runs every expert on every token
through weights packed once for oneDNN: gate/up of all experts as one GEMM, the routing weights
(zero for the experts a token did not pick) folded into the activations, the down projections of all
experts as one GEMM over [tokens, experts * I]. It reads each weight once, in the layout oneDNN's
AMX kernels want, with no padding and no per-call reorder (2-3.4x faster than the padded batched
matmuls below at 4-128 tokens; 2x slower at 512). Otherwise it sorts its (token, expert) pairs by
expert once and runs the experts over the sorted rows, on CPU one of two ways chosen by measurement
(`benchmarks/cpu_moe_layer.py`, results in `benchmarks/results/cpu_throughput.md`):
- bf16/fp16 where oneDNN runs them (AVX-512-BF16 / AMX), once at least half the experts got rows: the
  rows padded per expert into [experts, most rows rounded up to 16, H] and one `torch.bmm` per
  projection, which oneDNN runs as a batched matmul (1.5-2x faster than `torch._grouped_mm` from 16
  decode tokens, whose bf16 path is a loop of small matmuls slower than fp32's);
- otherwise one `torch._grouped_mm` call per projection (1.3-2x faster than a loop of small GEMMs).
Other devices take a loop over the experts that got rows.
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
        if w13.device.type == "cpu" and w13.dtype == w2.dtype and _onednn_runs(w13.dtype):
            return PackedExperts(w13, w2)
        return w13, w2

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
        if isinstance(weights, PackedExperts) and weights.takes(hidden, layout.topk_ids):
            out = weights.every_expert(hidden, layout.topk_ids, layout.topk_weights)
            return ExpertOutput(out, weights_applied=True, summed=True)
        ids = layout.topk_ids.flatten()
        counts = torch.bincount(ids + 1, minlength=layout.num_local_experts + 1).tolist()  # bin 0: other ranks'
        pairs = ids.argsort(stable=True)[counts[0] :]  # this rank's pairs, expert by expert
        token = pairs // layout.topk_ids.shape[1]
        y = _grouped_experts(hidden.index_select(0, token), counts[1:], weights)
        y = y.float() * layout.topk_weights.flatten()[pairs, None].float()
        out = torch.zeros(hidden.shape[0], y.shape[1], dtype=torch.float32, device=hidden.device)
        return ExpertOutput(out.index_add_(0, token, y).to(hidden.dtype), weights_applied=True, summed=True)


class PackedExperts(tuple):
    """The (w13, w2) pair, and copies of both packed once for oneDNN's linear (bf16/fp16 on CPU): gate/up of
    every expert as one [E * 2I, H] weight, the down projections side by side as one [H, E * I] weight.
    The packed copies double the experts' memory; they serve decode-sized batches (`takes`)."""

    MAX_TOKENS = 128  # measured: 2-3.4x over the padded batched matmuls at 4-128 tokens, 2x slower at 512

    def __new__(cls, w13: torch.Tensor, w2: torch.Tensor):
        self = super().__new__(cls, (w13, w2))
        experts, hidden, inter = w2.shape
        self.gate_up = torch.ops.mkldnn._reorder_linear_weight(w13.reshape(experts * 2 * inter, hidden))
        self.down = torch.ops.mkldnn._reorder_linear_weight(w2.permute(1, 0, 2).reshape(hidden, experts * inter))
        return self

    def takes(self, hidden: torch.Tensor, topk_ids: torch.Tensor) -> bool:
        """Decode sizes in the weights' dtype with at least as many pairs as experts (most of them hit)."""
        return hidden.dtype == self[0].dtype and topk_ids.numel() >= self[0].shape[0] and hidden.shape[0] <= self.MAX_TOKENS

    def every_expert(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """sum over a token's pairs of weight * expert(token): every expert runs on every token and the
        experts it did not pick (ids of -1: other ranks' pairs) get weight 0."""
        tokens, experts = hidden.shape[0], self[0].shape[0]
        if tokens == 0:  # oneDNN's linear takes no empty batch
            return hidden.new_zeros(0, self[1].shape[1])
        gate_up = torch.ops.mkldnn._linear_pointwise(hidden, self.gate_up, None, "none", [], "")
        gate, up = gate_up.view(tokens, experts, 2, -1).unbind(2)
        picked = topk_ids >= 0
        dense = hidden.new_zeros(tokens, experts).scatter_add_(
            1, topk_ids.clamp_min(0), torch.where(picked, topk_weights, 0).to(hidden.dtype)
        )
        act = F.silu(gate).mul_(up).mul_(dense[:, :, None])
        # an expert a token did not pick can overflow (fp16: inf), and inf x 0 is NaN: such rows are zero
        act.masked_fill_(dense[:, :, None] == 0, 0)
        return torch.ops.mkldnn._linear_pointwise(act.reshape(tokens, -1), self.down, None, "none", [], "")


def _activations(hidden: torch.Tensor, fp8: Fp8Payload | None) -> torch.Tensor:
    return hidden if fp8 is None else dequantize_activations(fp8).to(hidden.dtype)


def _grouped_experts(x: torch.Tensor, counts: list[int], weights) -> torch.Tensor:
    """Rows x [sum(counts), H] sorted by expert, counts[e] of them for expert e -> [sum(counts), H_out]."""
    w13, w2 = weights
    if _use_padded_bmm(x, counts, weights):
        return _padded_bmm(x, counts, weights)
    if _use_grouped_mm(x, weights):
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    rows = [_expert(group, weights, e) for e, group in enumerate(x.split(counts)) if group.shape[0]]
    return torch.cat(rows) if rows else x.new_empty(0, w2.shape[1])


def _padded_bmm(x: torch.Tensor, counts: list[int], weights) -> torch.Tensor:
    """_grouped_experts with each expert's rows padded to the most any expert got: two batched matmuls."""
    w13, w2 = weights
    experts, rows = len(counts), -(-max(counts) // 16) * 16  # oneDNN builds a kernel per new shape (~1 ms)
    count = torch.tensor(counts, device=x.device)
    expert = torch.repeat_interleave(torch.arange(experts, device=x.device), count, output_size=x.shape[0])
    first = count.cumsum(0) - count  # each expert's first row in x
    slot = expert * rows + torch.arange(x.shape[0], device=x.device) - first[expert]
    padded = x.new_zeros(experts * rows, x.shape[1]).index_copy_(0, slot, x).view(experts, rows, x.shape[1])
    gate, up = torch.bmm(padded, w13.transpose(1, 2)).chunk(2, dim=-1)
    return torch.bmm(F.silu(gate) * up, w2.transpose(1, 2)).view(experts * rows, w2.shape[1]).index_select(0, slot)


def _use_padded_bmm(x: torch.Tensor, counts: list[int], weights) -> bool:
    # measured on a Xeon with AMX: the batched matmul reads every expert's weights, so it needs half of
    # them hit to beat _grouped_mm (at 1-4 decode tokens it is 1.2-4x slower); the padding is bounded so
    # one crowded expert cannot blow the rows up
    if not (x.device.type == "cpu" and _onednn_runs(x.dtype) and all(w.dtype == x.dtype for w in weights)):
        return False
    hit = sum(1 for c in counts if c)
    return 2 * hit >= len(counts) and len(counts) * max(counts) <= 8 * x.shape[0]


@functools.cache
def _onednn_runs(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()


def _use_grouped_mm(x: torch.Tensor, weights) -> bool:
    # on CPU torch._grouped_mm takes any dtype and strides; on GPUs it wants bf16 and aligned strides
    return x.device.type == "cpu" and all(w.dtype == x.dtype for w in weights)


def _expert(x: torch.Tensor, weights, expert: int) -> torch.Tensor:
    w13, w2 = weights
    gate, up = F.linear(x, w13[expert].to(x.dtype)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2[expert].to(x.dtype))
