"""What every MoE plugin learns when it is set up."""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.frozen
class MoEContext:
    """The shape of the expert-parallel world a dispatcher or kernel serves.

    Physical expert p lives on EP rank p // num_local_experts.
    """

    hidden_size: int
    intermediate_size: int
    num_physical_experts: int
    top_k: int
    dtype: torch.dtype
    device: torch.device
    ep_rank: int = 0
    ep_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup of the EP ranks; None for one rank
    max_tokens_per_rank: int = 8192  # the most tokens one rank dispatches in one step (fixed buffers)
    dispatch_fp8: bool = False  # send activations as fp8 with 128-wide group scales where the dispatcher can

    def __attrs_post_init__(self):
        if self.num_physical_experts % self.ep_size:
            raise ValueError(
                f"{self.num_physical_experts} physical experts cannot be split evenly over {self.ep_size} EP ranks"
            )

    @property
    def num_local_experts(self) -> int:
        return self.num_physical_experts // self.ep_size

    @property
    def first_local_expert(self) -> int:
        return self.ep_rank * self.num_local_experts
