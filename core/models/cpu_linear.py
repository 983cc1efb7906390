"""Dense projections on a CPU: torch's `F.linear` (MKL's GEMMs) or oneDNN's linear on weights packed once,
whichever this processor runs faster at the layer's shape, measured when the model finishes loading.

On an AMD EPYC without AMX, MKL's fp32 GEMMs of 8-64 rows run 1.25-1.7x slower than oneDNN's (at one row
they tie); on a Xeon the two are close. So the choice is timed, not assumed: `CpuLinears` times both at
three row counts (a decode step of one request, a decode batch, a prefill chunk) once per machine for each
distinct weight shape and dtype (kept for every later process: `measured_choice`), and a layer whose shape gains gets a packed copy of its weight (`onednn_weight`); each call
takes the way measured fastest at the nearest row count. The packed copy doubles that weight's memory; it
is made only where it wins and only while it fits (at most a quarter of the free host memory), and a model whose weights then change (none of the dense ones do) would pack
again by calling `pack` again.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu import measured_choice, measuring_clock, onednn_runs, packed_copy_fits

log = logging.getLogger(__name__)

ROWS = (1, 32, 512)  # the row counts timed: one decoding request, a decode batch, a prefill chunk
ROUNDS = 3  # timed calls of each way at each row count, interleaved; the fastest counts


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed) -> torch.Tensor:
    """F.linear, or oneDNN's linear where the layer was packed and the measurement chose it for this many rows."""
    if packed is not None and x.dtype == weight.dtype and x.dim() == 2 and x.shape[0] and packed.wins(x.shape[0]):
        return packed_linear(x, packed.weight, bias)
    return F.linear(x, weight, bias)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def plain_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


class Packed:
    """A weight packed for oneDNN and the row counts at which it beat F.linear."""

    def __init__(self, weight: torch.Tensor, faster: tuple[bool, ...]):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.faster = faster

    def wins(self, rows: int) -> bool:
        at = min(range(len(ROWS)), key=lambda i: abs(math.log(rows / ROWS[i])))
        return self.faster[at]


class CpuLinears:
    """Packs the layers whose shape runs faster through oneDNN, measured once per machine and shape (measured_choice)."""

    def pack(self, model: nn.Module) -> int:
        """Give every dense projection of `model` on a CPU (modules with `onednn_weight`) its packing, or none;
        returns how many were packed."""
        packed = 0
        for module in model.modules():
            if not hasattr(module, "onednn_weight"):
                continue
            weight = module.weight
            module.onednn_weight = None
            if weight.device.type != "cpu" or weight.dim() != 2 or not onednn_runs(weight.dtype):
                continue
            faster = self.faster(weight)
            if any(faster) and packed_copy_fits(weight.nbytes):
                module.onednn_weight = Packed(weight.detach(), faster)
                packed += 1
        return packed

    def faster(self, weight: torch.Tensor) -> tuple[bool, ...]:
        key = f"{tuple(weight.shape)} {weight.dtype} rows {ROWS}"
        return tuple(measured_choice("linear", key, lambda: list(self._measure(weight.detach()))))

    def _measure(self, weight: torch.Tensor) -> tuple[bool, ...]:
        clock = measuring_clock()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        gen = torch.Generator().manual_seed(0)
        faster = []
        for rows in ROWS:
            x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)
            ways = (lambda: plain_linear(x, weight), lambda: packed_linear(x, packed))
            best = [float("inf"), float("inf")]
            for round in range(ROUNDS + 1):  # the first round warms up
                for i, way in enumerate(ways):
                    start = clock()
                    way()
                    if round:
                        best[i] = min(best[i], clock() - start)
            faster.append(best[1] < best[0] * 0.95)  # a clear gain only: the packed copy costs memory
        log.info("CPU linear %s %s: oneDNN's packed weight faster at %s rows", tuple(weight.shape),
                 str(weight.dtype).removeprefix("torch."), [r for r, f in zip(ROWS, faster) if f] or "no")
        return tuple(faster)
