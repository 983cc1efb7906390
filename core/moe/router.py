"""Routers: top-k over logical experts, as each architecture defines it."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import router_gemv
from ..kernels.topk import RouterSpec, route_topk


class Router(nn.Module):
    """hidden [T, H] -> (topk_ids [T, K] logical experts, topk_weights [T, K] fp32).

    The gate weight stays fp32 whatever the model dtype, as the reference implementations keep it.
    `fused`: scores, group and expert top-k and the weights in one Triton kernel after the linear
    (set on CUDA by MoECausalLM.use_fused_kernels).
    """

    fused = False
    fewer_launches = False  # and, for a small batch, the GEMV too (MoECausalLM.use_fused_kernels)

    def __init__(self, hidden_size: int, spec: RouterSpec):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        if spec.correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(spec.num_experts, dtype=torch.float32), requires_grad=False
            )
        # the one-launch router's ticket counter (kernels/router_gemv.py): this router's launches never overlap
        self.register_buffer("launch_counter", torch.zeros(1, dtype=torch.int32), persistent=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = getattr(self, "e_score_correction_bias", None)
        if self.fused and self.fewer_launches and router_gemv.fits(hidden.shape[0]):
            return router_gemv.route_small_batch(hidden, self.weight, self.spec, self.launch_counter, bias)
        logits = torch.nn.functional.linear(hidden.float(), self.weight.float())
        if self.fused:
            return route_topk(logits, self.spec, bias)
        if self.spec.scoring == "sigmoid":
            ids, weights = self._grouped_sigmoid(logits)
        else:
            ids, weights = self._softmax(logits)
        return ids, weights * self.spec.scaling_factor

    def _softmax(self, logits):
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights

    def _grouped_sigmoid(self, logits):
        spec = self.spec
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float() if spec.correction_bias else scores
        if spec.num_groups > 1:
            grouped = choice.view(-1, spec.num_groups, spec.num_experts // spec.num_groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.topk(group_scores, spec.topk_groups, dim=-1).indices
            group_mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
            choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights
