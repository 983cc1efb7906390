"""Where a checkpoint tensor goes: the contract between the modules that hold weights and the loader.

A module states, per tensor name, the Target that receives it (its full shape in the checkpoint, a copy into
the parameter or None when another rank holds it, the slice this rank reads, and whether fp8 values and
block scales are taken as stored). Models and MoE layers declare targets; models/loader.py fills them.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch


class CheckpointError(ValueError):
    """A checkpoint that does not hold what the model expects; the message names the tensor or file."""


@attrs.frozen
class Target:
    shape: tuple[int, ...]  # of the whole tensor in the checkpoint
    copy: Callable[[torch.Tensor], None] | None  # None: the tensor belongs to another rank
    select: tuple[int, int, int] | None = None  # (dim, start, length): read only this slice
    # takes an fp8 checkpoint's values and block scales as stored (a block-aligned slice); None: `copy`
    # gets the weight dequantized
    copy_fp8: Callable[[torch.Tensor, torch.Tensor], None] | None = None


def shard_of(param: torch.Tensor) -> tuple[int, int, int] | None:
    """(dim, rank, size) when `param` holds one tensor-parallel slice (set by the parallel layers)."""
    return getattr(param, "tp_shard", None)


def parameter_target(param: torch.Tensor) -> Target:
    def copy(tensor: torch.Tensor) -> None:
        param.data.copy_(tensor)

    shard = shard_of(param)
    if shard is None:
        return Target(tuple(param.shape), copy)
    dim, rank, size = shard
    full = list(param.shape)
    full[dim] *= size
    return Target(tuple(full), copy, (dim, rank * param.shape[dim], param.shape[dim]))
