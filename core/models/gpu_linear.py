"""Dense projections of a few rows on a GPU: cuBLAS (F.linear) or the Triton GEMV (moeplex.kernels.gemv), whichever
ran faster at the layer's shape on this card, timed when the model finishes loading.

At one to four rows (decode at batch 1-4) a projection's time is its weight's bytes plus what the kernel wastes
around them, and which kernel wastes less depends on the shape and the card: cuBLAS runs some shapes as a split-K
GEMM and a reduce, two launches (benchmarks/gemv_small_m.py times both ways per shape). So each distinct weight shape
is timed once per card (`measured_choice`, kept for later processes), at 1, 2 and 4 rows, with the weight cold as
a decode step meets it; a layer whose shape gains gets a `GemvChoice`, which `parallel_layers.project` consults
at each call.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
from torch import nn

from ..kernels.cpu import measured_choice
from ..kernels.gemv import MAX_ROWS, GemvTiles, fits, gemv

log = logging.getLogger(__name__)

ROWS = (1, 2, 4)  # the row counts timed; 3 rows take 4's choice
TILINGS = (GemvTiles(8, 512, 4, 3), GemvTiles(16, 512, 4, 3), GemvTiles(4, 1024, 4, 3))
CALLS = 16  # calls in one timed loop, cycling through copies of the weight so that none is found in L2
ROUNDS = 3  # replays of each way's graph, interleaved; the fastest counts
MIN_GAIN = 0.95  # the GEMV is taken where it needs at most this share of cuBLAS's time
AGREEMENT = 1e-2  # the GEMV's largest difference from cuBLAS over the output's range (bf16 rounds at 2^-8)


class GemvChoice:
    """The tiling the GEMV runs with at each row count where it beat cuBLAS (absent: cuBLAS)."""

    def __init__(self, tiles: dict[int, GemvTiles]):
        self.by_rows = tiles

    def tiles(self, rows: int) -> GemvTiles | None:
        if rows > MAX_ROWS:
            return None
        return self.by_rows.get(min(r for r in ROWS if r >= rows))


def gemv_or_none(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 choice: GemvChoice) -> torch.Tensor | None:
    """The GEMV's F.linear(x, weight, bias) where `choice` takes this many rows, else None (the caller's way)."""
    if x.dim() != 2:
        return None
    tiles = choice.tiles(x.shape[0])
    return gemv(x, weight, bias, tiles) if tiles is not None and fits(x, weight) else None


class GpuLinears:
    """Gives each dense projection on a GPU (modules with `gemv_choice`) the GEMV where it was measured faster."""

    def choose(self, model: nn.Module) -> int:
        """Returns how many layers take the GEMV at some row count."""
        chosen = 0
        for module in model.modules():
            if not hasattr(module, "gemv_choice"):
                continue
            weight = module.weight
            module.gemv_choice = None
            if weight.device.type != "cuda" or weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float16):
                continue
            winners = self.winners(weight)
            if winners:
                module.gemv_choice = GemvChoice(winners)
                chosen += 1
        return chosen

    def winners(self, weight: torch.Tensor) -> dict[int, GemvTiles]:
        card = torch.cuda.get_device_name(weight.device)
        key = f"{card} triton {triton.__version__} {tuple(weight.shape)} {weight.dtype} rows {ROWS}"
        try:
            found = measured_choice("gpu linear", key, lambda: self._measure(weight.detach()))
        except torch.cuda.OutOfMemoryError:  # no room for the timing's copies of the weight: cuBLAS, not remembered
            torch.cuda.empty_cache()
            log.warning("GPU linear %s: no memory to time the GEMV against cuBLAS; cuBLAS it is", tuple(weight.shape))
            return {}
        return {int(rows): GemvTiles(*t) for rows, t in found.items()}

    def _measure(self, weight: torch.Tensor) -> dict[str, list[int]]:
        l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
        copies = [weight] + [weight.clone() for _ in range(min(CALLS, -(-3 * l2 // weight.nbytes)) - 1)]
        gen = torch.Generator().manual_seed(0)
        found, graphs = {}, []
        for rows in ROWS:
            x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
            tilings = [t for t in TILINGS if agrees(x, weight, t)]
            if not tilings:
                continue
            ways = [lambda w, x=x: F.linear(x, w)] + [lambda w, x=x, t=t: gemv(x, w, None, t) for t in tilings]
            graphs = [_captured(way, copies) for way in ways]
            best = [float("inf")] * len(ways)
            for _ in range(ROUNDS):
                for i, graph in enumerate(graphs):
                    best[i] = min(best[i], _timed(graph))
            fastest = min(range(1, len(ways)), key=best.__getitem__)
            if best[fastest] < best[0] * MIN_GAIN:
                t = tilings[fastest - 1]
                found[str(rows)] = [t.block_n, t.block_k, t.num_warps, t.num_stages]
        del copies, graphs
        torch.cuda.empty_cache()  # the copies' memory goes back before the KV pool is sized
        log.info("GPU linear %s %s: the Triton GEMV faster at %s rows", tuple(weight.shape),
                 str(weight.dtype).removeprefix("torch."), [int(r) for r in found] or "no")
        return found


def agrees(x: torch.Tensor, weight: torch.Tensor, tiles: GemvTiles) -> bool:
    """Whether the GEMV at this tiling gives cuBLAS's x @ weight.T on this card, to the output's rounding (both sum in
    fp32 and round once; no fp32 copy of a large weight is made): a tiling that does not is never timed, let alone
    taken (the interpreter's tests cannot vouch for every card's compiler)."""
    exact = F.linear(x, weight).float()
    error = (gemv(x, weight, None, tiles).float() - exact).abs().max().item()
    scale = max(exact.abs().max().item(), 1e-6)
    if error <= AGREEMENT * scale:
        return True
    log.warning("GPU linear %s: the Triton GEMV at %s is off by %.3g of its output's range at %d rows; not used",
                tuple(weight.shape), tiles, error / scale, x.shape[0])
    return False


def _captured(way, copies: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
    """CALLS calls of `way`, each on the next copy of the weight, captured as one CUDA graph (timed by replaying it:
    eager calls would time the host's launches, which a decode step's graph does not pay)."""
    for copy in copies[:2]:  # compiles outside the capture
        way(copy)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(CALLS):
            way(copies[call % len(copies)])
    graph.replay()
    return graph


def _timed(graph: torch.cuda.CUDAGraph) -> float:
    """Seconds per call of one replay."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / CALLS
