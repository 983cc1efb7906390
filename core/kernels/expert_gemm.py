"""moeplex's C++ expert GEMM for a few rows per expert (csrc/expert_gemm.cpp): each expert's gate/up and down
weights streamed once per call for all the rows it received, SiLU(gate) * up and the routing weight applied in
registers, the pairs summed per token in fp32.

At decode sizes (1-16 rows per expert) the experts' weights are the step's largest read, and what decides its time
is how close that read comes to the core's memory bandwidth: oneDNN's and MKL's small-M GEMMs reach 6-12 GB/s on
an AMD EPYC whose core streams ~17 (results/cpu_throughput.md); this kernel, reading a layout packed for streaming
(`pack_for_streaming`), reaches that. It is one of the ways CpuExperts times (the `streamed` way), offered where
the kernel builds (`streams`); on a processor with Intel AMX its bf16 tile form is another (`streamed_tiles`).
"""

from __future__ import annotations

import torch

from . import cpu_ext

KERNEL = "expert_gemm"
DTYPES = (torch.float32, torch.bfloat16)


def streams(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the kernel runs these expert weights (w13 [E, 2I, H], w2 [E, H, I] on CPU, fp32 or bf16, I and H
    multiples of 16) and builds on this machine."""
    return (
        w13.device.type == "cpu"
        and w13.dim() == 3
        and w2.dim() == 3
        and w13.dtype == w2.dtype
        and w13.dtype in DTYPES
        and w13.shape[1] % 32 == 0
        and w13.shape[2] % 16 == 0
        and cpu_ext.load_kernel(KERNEL)
    )


def pack_for_streaming(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout (a copy), blocks of 16 output columns, each block one contiguous run: w13 as
    [E, I/16, H, 32], for every input column the block's 16 gate then 16 up weights; w2 as [E, H/16, I, 16]. bf16
    weights on a processor with AVX-512 BF16 go in pairs along the reduction ([E, I/16, H/2, 64] and
    [E, H/16, I/2, 32], each column's two weights side by side) for its bf16 dot product."""
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if w13.dtype == torch.bfloat16 and cpu_ext.ops(KERNEL).experts_bf16_pairs():
        gate_up = w13.view(experts, 2, inter // 16, 16, hidden // 2, 2).permute(0, 2, 4, 1, 3, 5)
        down = w2.view(experts, hidden // 16, 16, inter // 2, 2).permute(0, 1, 3, 2, 4)
        return (gate_up.reshape(experts, inter // 16, hidden // 2, 64).contiguous(),
                down.reshape(experts, hidden // 16, inter // 2, 32).contiguous())
    gate_up = w13.view(experts, 2, inter // 16, 16, hidden).permute(0, 2, 4, 1, 3)
    gate_up = gate_up.reshape(experts, inter // 16, hidden, 32).contiguous()
    down = w2.view(experts, hidden // 16, 16, inter).permute(0, 1, 3, 2).contiguous()
    return gate_up, down


def streams_on_tiles(packed: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether the kernel's AMX tile form runs these packed weights (a processor with Intel AMX, bf16 weights packed
    in pairs, H and I multiples of 32): `streamed_experts(..., tiles=True)`."""
    return cpu_ext.load_kernel(KERNEL) and cpu_ext.ops(KERNEL).experts_tiles_take(*packed)


def streamed_experts(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor],
    tiles: bool = False,
) -> torch.Tensor:
    """hidden [T, H], topk_ids/topk_weights [T, k] (ids of -1: other ranks' pairs) -> [T, H] in hidden's dtype: the
    sum over each token's pairs of weight * expert(token), on weights from `pack_for_streaming`; with `tiles` on the
    AMX tile unit (`streams_on_tiles`)."""
    pairs = packed[0].shape[-1] == 64  # bf16 pairs: the activations go in as bf16 too
    x = hidden.to(torch.bfloat16 if pairs else torch.float32).contiguous()
    out = cpu_ext.ops(KERNEL).moe_experts(x, topk_ids.long().contiguous(), topk_weights.float().contiguous(), *packed,
                                          tiles)
    return out.to(hidden.dtype)
