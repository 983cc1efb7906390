"""Replica selector: logical expert ids -> physical slots, with tensor operations only (no host sync)."""

from __future__ import annotations

import torch

from ..interfaces import Placement


class ReplicaSelector:
    """Holds the device copy of a Placement's maps.

    With one replica per expert the choice is static; with several, token t uses
    replica t mod count, which spreads a hot expert's tokens evenly over its copies.
    """

    def __init__(self, placement: Placement, device: torch.device):
        self.update(placement, device)

    def update(self, placement: Placement, device: torch.device) -> None:
        self.placement = placement
        self.log2phy = placement.log2phy.to(device)
        self.logcnt = placement.logcnt.to(device)
        self.has_replicas = bool((placement.logcnt > 1).any())

    def __call__(self, layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
        valid = logical_ids >= 0
        ids = logical_ids.clamp_min(0)
        if self.has_replicas:
            token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
            replica = token % self.logcnt[layer][ids]
        else:
            replica = torch.zeros_like(ids)
        physical = self.log2phy[layer][ids, replica]
        return torch.where(valid, physical, -1)
