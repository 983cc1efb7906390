"""Tensor-parallel linear layers: each rank holds a slice and reads only that slice from the checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import Group
from ..targets import Target
from .cpu_linear import linear
from .gpu_linear import gemv_or_none


def project(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """x through `layer`'s weight by the way measured fastest for it: the GEMV on a GPU at a few rows
    (gpu_linear.py), oneDNN's packed weight on a CPU (cpu_linear.py), else F.linear."""
    choice = layer.gemv_choice  # None off a GPU: the CPU's step pays one attribute read for it
    out = gemv_or_none(x, layer.weight, bias, choice) if choice is not None else None
    return out if out is not None else linear(x, layer.weight, bias, layer.onednn_weight)


def mark_shard(param: torch.Tensor, dim: int, tp: Group) -> None:
    param.tp_shard = (dim, tp.rank, tp.size)


def _split(total: int, tp: Group, what: str) -> int:
    if total % tp.size:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {tp.size}")
    return total // tp.size


class Linear(nn.Linear):
    """nn.Linear that takes the way measured fastest for its shape (`project`)."""

    onednn_weight = None  # cpu_linear.py
    gemv_choice = None  # gpu_linear.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self, self.bias)


def column_linear(in_features: int, out_features: int, tp: Group = Group(), bias: bool = False, what: str = "output size") -> nn.Linear:
    """Output features split over the ranks; no communication."""
    layer = Linear(in_features, _split(out_features, tp, what), bias=bias)
    if tp.size > 1:
        mark_shard(layer.weight, 0, tp)
        if bias:
            mark_shard(layer.bias, 0, tp)
    return layer


class RowLinear(nn.Module):
    """Input features split over the ranks; partial products summed by all-reduce, bias added once."""

    onednn_weight = None  # cpu_linear.py
    gemv_choice = None  # gpu_linear.py

    def __init__(self, in_features: int, out_features: int, tp: Group = Group(), bias: bool = False, what: str = "input size"):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, _split(in_features, tp, what)), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        if tp.size > 1:
            mark_shard(self.weight, 1, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(project(x, self, None))
        return out if self.bias is None else out + self.bias


class MergedColumnLinear(nn.Module):
    """Column-parallel projections of one input computed as one GEMM: forward returns each part's output.

    The checkpoint keeps the parts apart under their own names (q_proj, k_proj, v_proj; gate_proj,
    up_proj); each loads into its rows of the merged weight. One launch reads the same bytes as
    several: at decode batch sizes each GEMM costs its launch more than its bytes. A part has its
    own group (GQA key-value heads may be replicated over fewer ranks than the queries).
    """

    onednn_weight = None  # cpu_linear.py
    gemv_choice = None  # gpu_linear.py

    def __init__(self, in_features: int, parts: dict[str, tuple[int, Group]], bias: bool = False, what: str = "output size"):
        super().__init__()
        self.parts = {name: (_split(out, group, f"{name} {what}"), group) for name, (out, group) in parts.items()}
        self.sizes = [rows for rows, _ in self.parts.values()]
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(self.sizes)), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return project(x, self, self.bias).split(self.sizes, dim=-1)

    def part_names(self, parent: str) -> list[str]:
        """Checkpoint names of the parts' weights; `parent` is the prefix of the module holding this one."""
        return [f"{parent}{name}.weight" for name in self.parts]

    def checkpoint_targets(self, parent: str) -> dict[str, Target]:
        """Checkpoint name -> Target for each part's weight (and bias): its rows of this rank's slice."""
        targets = {}
        first = 0
        for name, (rows, group) in self.parts.items():
            for kind, param in (("weight", self.weight), ("bias", self.bias)):
                if param is not None:
                    full = (rows * group.size, *param.shape[1:])
                    select = (0, group.rank * rows, rows) if group.size > 1 else None
                    targets[f"{parent}{name}.{kind}"] = Target(full, param.data[first : first + rows].copy_, select)
            first += rows
        return targets
