"""`static`: the identity placement; redundant slots (if any) repeat experts 0, 1, ... in order."""

from __future__ import annotations

import torch

from moeplex.interfaces import Balancer, BalancerCaps, Placement


class StaticBalancer(Balancer):
    caps = BalancerCaps(hierarchical=False, supports_redundancy=True)

    def rebalance(self, load, num_physical, num_groups, num_nodes, num_gpus) -> Placement:
        num_layers, num_logical = load.shape[-2:]
        if num_physical < num_logical:
            raise ValueError(f"{num_physical} physical slots cannot hold {num_logical} logical experts")
        phy2log = (torch.arange(num_physical) % num_logical).expand(num_layers, -1).clone()
        return Placement.from_phy2log(phy2log, num_logical)
