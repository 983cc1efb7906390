"""Rank functions for the launcher's fault tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeplex.parallel import init_parallel


def world_sum(rank, parallel_config) -> int:
    init_parallel(parallel_config, rank, torch.device("cpu"))
    total = torch.ones(1)
    dist.all_reduce(total)
    return int(total.item())
