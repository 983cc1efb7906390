"""Load imbalance across EP ranks: our balancers run on a synthetic (Zipf-like) or recorded expert load.

The balancer places from a calibration load (the law's expectation, or the recorded counts); a batch is then
drawn from the same law, each logical expert's pairs spread evenly over its replicas (the replica selector),
and balancedness = mean GPU pairs / busiest GPU pairs is averaged over layers. Small batches are noisier:
that is the decode-time imbalance EPLB cannot remove.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..moe.rebalance import PlacementShape
from ..registry import lookup

LAYERS = 4  # independent layer draws averaged (each layer its own hot experts)


def read_expert_load(path: str) -> torch.Tensor:
    """A recorded expert load as [layers, experts] counts: our `logical_count` files (what `moeplex eplb` reads),
    or a `load_history` of per-step `logical_expert_load` [layers][experts] (vLLM's EPLB recorder, the format of
    the expert-load.json in the ADRS EPLB case study), summed over its steps."""
    import json

    from ..moe.load_report import read_load

    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and "load_history" in data:
        steps = [entry["logical_expert_load"] for entry in data["load_history"]]
        if not steps:
            raise ValueError(f"{path}: load_history is empty")
        load = torch.tensor(steps, dtype=torch.float64).sum(0)
        if load.dim() != 2 or (load < 0).any():
            raise ValueError(f"{path}: each logical_expert_load must be [layers][experts] of non-negative counts")
        return load
    return read_load(path)[1]


@dataclass(frozen=True)
class ExpertLoad:
    """A law over logical experts: Zipf(skew) at seeded random positions, or recorded counts [L, E]."""

    experts: int
    skew: float = 1.0
    recorded: torch.Tensor | None = None
    seed: int = 0

    def law(self) -> torch.Tensor:
        if self.recorded is not None:
            counts = self.recorded.to(torch.float64)
            return counts / counts.sum(-1, keepdim=True).clamp_min(1e-12)
        gen = torch.Generator().manual_seed(self.seed)
        ranks = torch.arange(1, self.experts + 1, dtype=torch.float64)
        weights = ranks ** (-self.skew)
        rows = [weights[torch.randperm(self.experts, generator=gen)] for _ in range(LAYERS)]
        law = torch.stack(rows)
        return law / law.sum(-1, keepdim=True)


def balancedness(
    load: ExpertLoad, pairs_per_gpu: float, ep: int, slots: int, balancer: str, num_nodes: int = 1, num_groups: int = 1, seed: int = 0
) -> float:
    """Mean over max GPU pairs for a batch of `pairs_per_gpu` x `ep` pairs under `balancer`'s placement.

    `balancer` is a registered balancer name (static, eplb, eplb-vec); `slots` physical experts
    (experts + redundant).
    """
    if ep <= 1:
        return 1.0
    if load.recorded is None:  # a synthetic law is fixed by its parameters: draw it once per question
        return _synthetic(load.experts, load.skew, load.seed, round(pairs_per_gpu), ep, slots, balancer, num_nodes, num_groups, seed)
    return _balancedness(load, pairs_per_gpu, ep, slots, balancer, num_nodes, num_groups, seed)


@lru_cache(maxsize=1024)
def _synthetic(experts, skew, law_seed, pairs_per_gpu, ep, slots, balancer, num_nodes, num_groups, seed) -> float:
    load = ExpertLoad(experts, skew, None, law_seed)
    return _balancedness(load, pairs_per_gpu, ep, slots, balancer, num_nodes, num_groups, seed)


def _balancedness(load: ExpertLoad, pairs_per_gpu, ep, slots, balancer, num_nodes, num_groups, seed) -> float:
    law = load.law()
    layers, experts = law.shape
    if slots % ep or slots < experts:
        raise ValueError(f"{slots} physical experts do not split over {ep} EP ranks with at least one slot per logical expert")
    shape = PlacementShape(layers, experts, slots, num_groups, num_nodes, ep)
    placement = shape.plan(lookup("balancer", balancer)(), law * 1e6)
    gen = torch.Generator().manual_seed(seed + 1)
    total = max(1, int(round(pairs_per_gpu * ep)))
    values = []
    for layer in range(layers):
        # a batch's pairs per expert: Poisson around the law (the multinomial's limit for many experts),
        # O(experts) rather than O(pairs) to draw
        counts = torch.poisson(law[layer] * total, generator=gen)
        phy2log = placement.phy2log[layer].long()
        per_slot = counts[phy2log] / placement.logcnt[layer].to(torch.float64)[phy2log]
        per_gpu = per_slot.view(ep, slots // ep).sum(-1)
        values.append(float(per_gpu.mean() / per_gpu.max()))
    return sum(values) / len(values)
