"""`dense`: every expert computes every received row in one batched matmul, and the routing masks the result.

It does E times the arithmetic of a routed kernel but runs no per-expert loop and moves
no rows around, which is the faster trade for tiny models on a CPU. It uses moeplex
only through its public plugin API, `moeplex.interfaces`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeplex.interfaces import (
    BF16,
    CONTIGUOUS,
    MASKED,
    STANDARD,
    ContiguousLayout,
    ExpertOutput,
    ExpertWeights,
    KernelCaps,
    MaskedLayout,
    MoEKernel,
    StandardLayout,
)


def _experts(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, equation_in: str) -> torch.Tensor:
    """SiLU-gated experts. `equation_in` says how rows meet w13 [E, 2I, H] ('mh' for shared rows, 'emh' per expert)."""
    gate_up = torch.einsum(f"{equation_in},eih->emi", rows, w13)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.einsum("emi,ehi->emh", F.silu(gate) * up, w2)  # [E, M, H]


class DenseMoEKernel(MoEKernel):
    caps = KernelCaps(
        layouts=frozenset({STANDARD, CONTIGUOUS, MASKED}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        weight_formats=frozenset({BF16}),
    )

    def prepare_weights(self, weights: ExpertWeights):
        return weights.w13, weights.w2

    def apply(self, layout, weights) -> ExpertOutput:
        if layout.fp8 is not None:
            raise ValueError("dense computes on unquantized activations; pair it with a dispatcher that sends them")
        w13, w2 = (w.to(layout.hidden.dtype) for w in weights)
        if isinstance(layout, StandardLayout):
            return self._standard(layout, w13, w2)
        if isinstance(layout, ContiguousLayout):
            return self._contiguous(layout, w13, w2)
        if isinstance(layout, MaskedLayout):
            return self._masked(layout, w13, w2)
        raise TypeError(f"dense does not accept the {type(layout).__name__}")

    def _standard(self, layout: StandardLayout, w13, w2) -> ExpertOutput:
        every = _experts(layout.hidden, w13, w2, "mh")  # [E, N, H]
        # mixing[n, e] = sum of the top-k weights with which token n chose local expert e
        chosen = layout.topk_ids >= 0
        mixing = torch.zeros(layout.num_rows, layout.num_local_experts, dtype=torch.float32, device=every.device)
        mixing.scatter_add_(1, layout.topk_ids.clamp_min(0), torch.where(chosen, layout.topk_weights.float(), 0.0))
        out = torch.einsum("ne,enh->nh", mixing, every.float())
        return ExpertOutput(out.to(layout.hidden.dtype), weights_applied=True, summed=True)

    def _contiguous(self, layout: ContiguousLayout, w13, w2) -> ExpertOutput:
        every = _experts(layout.hidden, w13, w2, "mh")  # [E, M, H]
        own = torch.nn.functional.one_hot(layout.expert_index.long().clamp_min(0), layout.num_local_experts)
        own = own * (layout.expert_index >= 0).unsqueeze(1)  # padding rows take no expert
        out = torch.einsum("me,emh->mh", own.to(every.dtype), every)
        return ExpertOutput(out, weights_applied=False, summed=False)

    def _masked(self, layout: MaskedLayout, w13, w2) -> ExpertOutput:
        out = _experts(layout.hidden, w13, w2, "emh")  # each expert on its own rows
        rows = torch.arange(out.shape[1], device=out.device)
        valid = rows.unsqueeze(0) < layout.counts.to(out.device).unsqueeze(1)
        return ExpertOutput(out * valid.unsqueeze(-1).to(out.dtype), weights_applied=False, summed=False)
