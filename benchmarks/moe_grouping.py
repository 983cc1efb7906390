"""Where the `triton` kernel's library path (torch._grouped_mm) spends its time, stage by stage, at EP shapes.

    python3 benchmarks/moe_grouping.py --shape deepseek-v3-ep8 --routing global local --tokens 4096 16384
    TRITON_INTERPRET=1 python3 benchmarks/moe_grouping.py --device cpu --shape tiny --tokens 16 --runs 1  # on CPU

Issue #31 target 5: EP8-global M=16384 within 1.05x of the bare grouped GEMMs. One row per routing and M: the
grouping of the local pairs as the path did it before (an argsort of all N x K ids, a scatter_add count) and as
it does now (group.py's counting sort), then each later stage alone (gather, GEMM 1, SiLU-and-multiply, GEMM 2,
weighted pair sum), the padded grouping and the gated GEMM 1 that replace the gather, GEMM 1 and SiLU from
GATED_GEMM1_MIN_ROWS rows per expert (plugin.py), and the whole path both ways. On the GPU each figure is ColdTimer's
median (fused_moe.py: L2 emptied first); on CPU a median of wall times, only to show that the script runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import attrs
import torch
from fused_moe import SHAPES, ColdTimer, Shape, make_layout

from moeplex.interfaces.kernels import gather_rows, weighted_pair_sum
from moeplex.plugins.moe_kernels.triton_moe.finish import silu_mul
from moeplex.plugins.moe_kernels.triton_moe.fused import PreparedWeights, moe_standard_grouped_mm
from moeplex.plugins.moe_kernels.triton_moe.group import align_local_pairs, group_local_pairs
from moeplex.plugins.moe_kernels.triton_moe.kernel import grouped_gemm
from moeplex.plugins.moe_kernels.triton_moe.plugin import GATED_GEMM1_TILE

TINY = Shape(experts=128, ep_size=8, hidden=64, intermediate=32, top_k=8)  # local routing needs >= top_k here


def argsort_grouping(topk_ids: torch.Tensor, routed_pairs: int, num_experts: int):
    """The path's grouping before the counting sort (kept here to compare against)."""
    ids = topk_ids.reshape(-1).long()
    key = torch.where(ids >= 0, ids, num_experts)
    order = torch.argsort(key)[:routed_pairs]
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:-1], 0, dtype=torch.int32)
    valid = torch.arange(routed_pairs, device=ids.device).masked_fill(key[order] == num_experts, -1)
    return order // topk_ids.shape[1], torch.full_like(ids, -1).index_copy_(0, order, valid), offs


def wall_timer(fn, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def row(shape: Shape, tokens: int, routing: str, weights: PreparedWeights, timer, device: str,
        dtype: torch.dtype) -> str:
    layout = make_layout(shape, tokens, seed=tokens, routing=routing, device=device, dtype=dtype)
    ids, pairs, experts = layout.topk_ids, layout.routed_pairs, shape.local_experts
    w13, w2 = weights.w13.transpose(1, 2), weights.w2.transpose(1, 2)
    grouped = group_local_pairs(ids, experts, pairs)
    rows = gather_rows(layout.hidden, grouped.token)
    gate_up = torch._grouped_mm(rows, w13, offs=grouped.offs)
    inter = silu_mul(gate_up)
    down = torch._grouped_mm(inter, w2, offs=grouped.offs)
    pair_row = grouped.pair_row.view(ids.shape)
    tile = GATED_GEMM1_TILE if device == "cuda" else attrs.evolve(GATED_GEMM1_TILE, block_m=16, block_n=16, block_k=16,
                                                                   num_stages=1, tma=False)
    align, _ = align_local_pairs(ids, experts, pairs, tile.block_m)
    padded_inter = torch.empty(align.num_slots, inter.shape[1], dtype=dtype, device=device)
    stages = {
        "argsort grouping (before)": lambda: argsort_grouping(ids, pairs, experts),
        "counting sort (now)": lambda: group_local_pairs(ids, experts, pairs),
        "gather": lambda: gather_rows(layout.hidden, grouped.token),
        "GEMM 1": lambda: torch._grouped_mm(rows, w13, offs=grouped.offs),
        "SiLU-and-mul": lambda: silu_mul(gate_up),
        "GEMM 2": lambda: torch._grouped_mm(inter, w2, offs=grouped.offs),
        "pair sum": lambda: weighted_pair_sum(down, pair_row, layout.topk_weights, layout.hidden.dtype),
        "padded counting sort": lambda: align_local_pairs(ids, experts, pairs, tile.block_m),
        "gated GEMM 1 (Triton, by index)": lambda: grouped_gemm(layout.hidden, weights.w13, padded_inter, align, tile,
                                                                a_row_div=ids.shape[1], gated=True, in_place=True),
    }
    us = {name: 1e3 * timer(fn) for name, fn in stages.items()}
    whole = 1e3 * timer(lambda: moe_standard_grouped_mm(layout.hidden, ids, layout.topk_weights, pairs, weights))
    gated = 1e3 * timer(lambda: moe_standard_grouped_mm(layout.hidden, ids, layout.topk_weights, pairs, weights, tile))
    cells = " | ".join(f"{value:.1f}" for value in us.values())
    return f"| {routing} | {tokens} | {pairs} | {cells} | {whole:.1f} | {gated:.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES) + ["tiny"], default="deepseek-v3-ep8")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--routing", choices=["global", "local"], nargs="+", default=["global", "local"])
    parser.add_argument("--runs", type=int, default=3,
                        help="wall-time runs per figure on CPU (the GPU takes ColdTimer's)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: fp32 under TRITON_INTERPRET=1, tiny sizes only (checks the script, times nothing)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device is visible (--device cpu checks the script)")
    shape = TINY if args.shape == "tiny" else SHAPES[args.shape]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    gen = torch.Generator(device=args.device).manual_seed(0)
    e, h, i = shape.local_experts, shape.hidden, shape.intermediate
    w13 = torch.randn(e, 2 * i, h, device=args.device, generator=gen).to(dtype) / h**0.5
    w2 = torch.randn(e, h, i, device=args.device, generator=gen).to(dtype) / i**0.5
    weights = PreparedWeights(w13, w2)
    timer = ColdTimer() if args.device == "cuda" else lambda fn: wall_timer(fn, args.runs)
    names = ["argsort grouping (before)", "counting sort (now)", "gather", "GEMM 1", "SiLU-and-mul", "GEMM 2",
             "pair sum", "padded counting sort", "gated GEMM 1 (Triton, by index)"]
    print(f"## the library path by stage, {args.shape} ({e} local experts, H={h}, I={i}), {args.device}\n")
    columns = " | ".join(f"{name} µs" for name in names)
    print(f"| routing | M | pairs here | {columns} | whole path, CUTLASS GEMM 1 µs | whole path, gated GEMM 1 µs |")
    print("|---" * (len(names) + 5) + "|")
    for routing in args.routing:
        for tokens in args.tokens:
            print(row(shape, tokens, routing, weights, timer, args.device, dtype), flush=True)


if __name__ == "__main__":
    main()
