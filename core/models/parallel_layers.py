"""Tensor-parallel linear layers: each rank holds a slice and reads only that slice from the checkpoint."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import Group


def mark_shard(param: torch.Tensor, dim: int, tp: Group) -> None:
    param.tp_shard = (dim, tp.rank, tp.size)


def _split(total: int, tp: Group, what: str) -> int:
    if total % tp.size:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {tp.size}")
    return total // tp.size


def column_linear(in_features: int, out_features: int, tp: Group = Group(), bias: bool = False, what: str = "output size") -> nn.Linear:
    """Output features split over the ranks; no communication."""
    layer = nn.Linear(in_features, _split(out_features, tp, what), bias=bias)
    if tp.size > 1:
        mark_shard(layer.weight, 0, tp)
        if bias:
            mark_shard(layer.bias, 0, tp)
    return layer


class RowLinear(nn.Module):
    """Input features split over the ranks; partial products summed by all-reduce, bias added once."""

    def __init__(self, in_features: int, out_features: int, tp: Group = Group(), bias: bool = False, what: str = "input size"):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, _split(in_features, tp, what)), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        if tp.size > 1:
            mark_shard(self.weight, 1, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias
