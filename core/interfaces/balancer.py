"""Balancer contract: where the replicas of every logical expert live."""

from __future__ import annotations

import abc
from typing import ClassVar

import attrs
import torch


@attrs.frozen
class BalancerCaps:
    hierarchical: bool = False  # packs expert groups onto nodes before GPUs
    supports_redundancy: bool = True  # can place more physical slots than logical experts


@attrs.frozen
class Placement:
    """Logical-to-physical expert placement of every MoE layer.

    phy2log[L, P]: the logical expert in each physical slot.
    log2phy[L, E, R]: the physical slots of each logical expert, -1 padded.
    logcnt[L, E]: how many replicas each logical expert has.
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logcnt.shape[1]

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_logical: int) -> "Placement":
        """Derive log2phy and logcnt from phy2log (replicas in increasing slot order)."""
        phy2log = phy2log.to(torch.int64)
        num_layers, num_physical = phy2log.shape
        logcnt = torch.zeros(num_layers, num_logical, dtype=torch.int64)
        logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        max_replicas = int(logcnt.max()) if logcnt.numel() else 1
        log2phy = torch.full((num_layers, num_logical, max_replicas), -1, dtype=torch.int64)
        # replica rank of each slot among the slots holding the same logical expert
        order = torch.argsort(phy2log * num_physical + torch.arange(num_physical), dim=1)
        sorted_log = torch.gather(phy2log, 1, order)
        starts = torch.cumsum(logcnt, dim=1) - logcnt
        replica = torch.arange(num_physical).expand(num_layers, -1) - torch.gather(starts, 1, sorted_log)
        layer = torch.arange(num_layers).unsqueeze(1).expand(-1, num_physical)
        log2phy[layer, sorted_log, replica] = order
        return cls(phy2log=phy2log, log2phy=log2phy, logcnt=logcnt)

    @classmethod
    def identity(cls, num_layers: int, num_logical: int) -> "Placement":
        phy2log = torch.arange(num_logical).expand(num_layers, -1).clone()
        return cls.from_phy2log(phy2log, num_logical)

    def check(self, num_gpus: int) -> None:
        """Raise ValueError unless the placement keeps the balancer contract."""
        if self.num_physical % num_gpus:
            raise ValueError(f"{self.num_physical} physical slots do not divide over {num_gpus} GPUs")
        if (self.logcnt < 1).any():
            layer, expert = (self.logcnt < 1).nonzero()[0].tolist()
            raise ValueError(f"layer {layer}: logical expert {expert} has no replica")
        counted = torch.zeros_like(self.logcnt)
        counted.scatter_add_(1, self.phy2log, torch.ones_like(self.phy2log))
        if not torch.equal(counted, self.logcnt):
            raise ValueError("logcnt does not count the replicas in phy2log")
        for layer in range(self.num_layers):
            for expert in range(self.num_logical):
                slots = self.log2phy[layer, expert, : int(self.logcnt[layer, expert])]
                if (slots < 0).any() or (self.phy2log[layer, slots] != expert).any():
                    raise ValueError(f"layer {layer}: log2phy of expert {expert} does not invert phy2log")
                if (self.log2phy[layer, expert, int(self.logcnt[layer, expert]) :] != -1).any():
                    raise ValueError(f"layer {layer}: log2phy of expert {expert} is not -1 padded")

    def gpu_loads(self, load: torch.Tensor, num_gpus: int) -> torch.Tensor:
        """[L, num_gpus] load of each GPU when each expert's load is split evenly over its replicas."""
        load = load.reshape(-1, self.num_layers, self.num_logical).sum(0).double()
        per_slot = torch.gather(load / self.logcnt, 1, self.phy2log)
        return per_slot.reshape(self.num_layers, num_gpus, -1).sum(-1)

    def balancedness(self, load: torch.Tensor, num_gpus: int) -> torch.Tensor:
        """[L] mean GPU load / max GPU load (1.0 is perfect)."""
        gpu = self.gpu_loads(load, num_gpus)
        return gpu.mean(-1) / gpu.max(-1).values.clamp_min(1e-12)


class Balancer(abc.ABC):
    """A pure, deterministic CPU function from expert load to a Placement.

    Contract: every logical expert keeps >= 1 replica, each GPU gets exactly
    num_physical / num_gpus slots, and phy2log / log2phy invert each other.
    """

    caps: ClassVar[BalancerCaps]

    @abc.abstractmethod
    def rebalance(
        self, load: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
    ) -> Placement:
        """`load`: [L, E] or [steps, L, E] token counts per logical expert."""
