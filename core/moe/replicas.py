"""Replica selector: logical expert ids -> physical slots, with tensor operations only (no host sync)."""

from __future__ import annotations

import torch

from ..config import DISPATCH_ALGORITHMS, SPREAD
from ..interfaces import Placement


class ReplicaSelector:
    """Holds the device copy of a Placement's maps.

    `static` sends every token to an expert's first replica; `spread` sends token t's k-th choice
    to replica (t + k) mod count, which shares a hot expert's tokens evenly among its copies
    (consecutive tokens take consecutive replicas) and spreads even a one-token decode batch. The maps live in
    buffers of a fixed shape (room for `max_replicas` per expert) that a new placement is copied
    into, so a captured CUDA graph keeps reading the current maps.
    """

    def __init__(self, placement: Placement, device: torch.device, algorithm: str = SPREAD, max_replicas: int | None = None):
        if algorithm not in DISPATCH_ALGORITHMS:
            raise ValueError(f"dispatch algorithm must be one of {', '.join(DISPATCH_ALGORITHMS)}, got {algorithm!r}")
        self.algorithm = algorithm
        width = max_replicas or placement.log2phy.shape[2]
        self.log2phy = torch.full((placement.num_layers, placement.num_logical, width), -1, dtype=torch.int64, device=device)
        self.logcnt = torch.zeros(placement.num_layers, placement.num_logical, dtype=torch.int64, device=device)
        self.update(placement)

    def update(self, placement: Placement) -> None:
        """Point every MoE layer at `placement` (called between steps)."""
        replicas = placement.log2phy.shape[2]
        if placement.log2phy.shape[:2] != self.log2phy.shape[:2] or replicas > self.log2phy.shape[2]:
            raise ValueError(
                f"a placement of log2phy shape {tuple(placement.log2phy.shape)} does not fit the selector's "
                f"{tuple(self.log2phy.shape)}"
            )
        self.log2phy.fill_(-1)
        self.log2phy[:, :, :replicas].copy_(placement.log2phy)
        self.logcnt.copy_(placement.logcnt)
        self.placement = placement
        logical = torch.arange(placement.num_logical)
        # one replica per expert, in the slot of its own id: selection is the identity and costs no kernels
        # (graphs are never captured where the placement can change: EPLB records the load every step)
        self.identity = bool((placement.logcnt == 1).all() and (placement.log2phy[:, :, 0].cpu() == logical).all())

    def __call__(self, layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return logical_ids
        valid = logical_ids >= 0
        ids = logical_ids.clamp_min(0)
        if self.algorithm == SPREAD:
            token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
            k = torch.arange(ids.shape[1], device=ids.device)
            replica = (token + k) % self.logcnt[layer][ids]
        else:
            replica = torch.zeros_like(ids)
        physical = self.log2phy[layer][ids, replica]
        return torch.where(valid, physical, -1)
