"""Tile and launch-shape sweep behind the library path's gated GEMM 1 and pair sum (issue #31 target 5).

    python3 benchmarks/large_m_probe.py 16384 4096      # GPU only

At EP8-global DeepSeek-V3 shapes (rank 0 of 8: 32 local experts, H=7168, I=2048, bf16): the Triton kernel's gated
GEMM 1 reading rows by index (plugin.py's GATED_GEMM1_TILE and its neighbours) against gather + torch._grouped_mm
+ SiLU-and-multiply, and the weighted pair sum at several launch shapes. Each figure is one ColdTimer median
(fused_moe.py); the tile chosen is checked against the CUTLASS path's intermediate rows before it is timed.
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from fused_moe import SHAPES, ColdTimer, make_layout

from moeplex.interfaces.kernels import gather_rows, weighted_pair_sum
from moeplex.kernels.permute import _weighted_pair_sum_kernel
from moeplex.plugins.moe_kernels.triton_moe.configs import TileConfig
from moeplex.plugins.moe_kernels.triton_moe.finish import silu_mul
from moeplex.plugins.moe_kernels.triton_moe.group import align_local_pairs, group_local_pairs
from moeplex.plugins.moe_kernels.triton_moe.kernel import grouped_gemm

GEMM1_TILES = [  # block_m, block_n, block_k, group_m, warps, stages (weights through TMA)
    (128, 128, 64, 8, 8, 4), (128, 128, 64, 16, 8, 4), (128, 128, 64, 32, 8, 4),
    (64, 256, 64, 8, 8, 3), (64, 256, 64, 16, 8, 3), (64, 256, 64, 32, 8, 3),
]
PAIR_SUM_SHAPES = [(1024, 4), (1024, 2), (512, 1), (1024, 1), (2048, 2), (512, 2)]  # columns per program, warps


@triton.jit
def _pair_sum_row_kernel(rows_ptr, pair_row_ptr, weight_ptr, out_ptr, cols, stride_r, stride_o,
                         TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """A variant: one program a token, its K indices read once, the columns in a loop."""
    token = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, TOP_K)
    rows = tl.load(pair_row_ptr + token * TOP_K + ks).to(tl.int64)
    weights = tl.load(weight_ptr + token * TOP_K + ks).to(tl.float32)
    for first in range(0, cols, BLOCK):
        c = first + tl.arange(0, BLOCK)
        ok = (rows[:, None] >= 0) & (c[None, :] < cols)
        values = tl.load(rows_ptr + rows[:, None] * stride_r + c[None, :], mask=ok, other=0.0).to(tl.float32)
        acc = tl.sum(tl.where(ok, weights[:, None] * values, 0.0), axis=0)
        tl.store(out_ptr + token * stride_o + c, acc.to(out_ptr.dtype.element_ty), mask=c < cols)


def main() -> None:
    shape = SHAPES["deepseek-v3-ep8"]
    timer = ColdTimer()
    e, h, i = shape.local_experts, shape.hidden, shape.intermediate
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=gen).to(torch.bfloat16) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", generator=gen).to(torch.bfloat16) / i**0.5
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for tokens in [int(t) for t in sys.argv[1:]] or [16384]:
        layout = make_layout(shape, tokens, seed=tokens, routing="global")
        ids, pairs, top_k = layout.topk_ids, layout.routed_pairs, layout.topk_ids.shape[1]
        grouped = group_local_pairs(ids, e, pairs)
        rows = gather_rows(layout.hidden, grouped.token)
        ref_inter = silu_mul(torch._grouped_mm(rows, w13t, offs=grouped.offs))
        res = {
            "counting sort": timer(lambda: group_local_pairs(ids, e, pairs)),
            "padded counting sort (128)": timer(lambda: align_local_pairs(ids, e, pairs, 128)),
            "GEMM 1 CUTLASS": timer(lambda: torch._grouped_mm(rows, w13t, offs=grouped.offs)),
            "gather + GEMM 1 CUTLASS + SiLU": timer(
                lambda: silu_mul(torch._grouped_mm(gather_rows(layout.hidden, grouped.token), w13t, offs=grouped.offs))),
        }
        for bm, bn, bk, gm, warps, stages in GEMM1_TILES:
            tile = TileConfig(bm, bn, bk, gm, warps, stages, tma=True)
            align, padded = align_local_pairs(ids, e, pairs, bm)
            inter = torch.empty(align.num_slots, i, dtype=torch.bfloat16, device="cuda")
            name = f"gated GEMM 1 {bm}x{bn}x{bk} group {gm}, {warps} warps, {stages} stages"
            try:
                run = lambda: grouped_gemm(layout.hidden, w13, inter, align, tile, a_row_div=top_k, gated=True,
                                           in_place=True)
                run()
                local = grouped.pair_row >= 0
                err = (inter[padded.pair_row[local].long()].float() - ref_inter[grouped.pair_row[local].long()].float())
                res[f"{name} (max abs diff {err.abs().max().item():.3g})"] = timer(run)
            except Exception as exc:  # noqa: BLE001 (a tile past shared memory: say so, go on)
                print(name, "failed:", str(exc).splitlines()[0][:160])
        down = torch._grouped_mm(ref_inter, w2t, offs=grouped.offs)
        pair_row = grouped.pair_row.view(ids.shape).contiguous()
        weights = layout.topk_weights.float().contiguous()
        ref = weighted_pair_sum(down, pair_row, weights, torch.bfloat16)
        res["pair sum as shipped"] = timer(lambda: weighted_pair_sum(down, pair_row, weights, torch.bfloat16))
        out = torch.empty_like(ref)
        for block, warps in PAIR_SUM_SHAPES:
            grid = (tokens, triton.cdiv(h, block))
            run = lambda: _weighted_pair_sum_kernel[grid](down, pair_row, weights, out, h, down.stride(0),
                                                          out.stride(0), TOP_K=top_k, BLOCK=block, num_warps=warps)
            run()
            assert torch.equal(out, ref)
            res[f"pair sum, {block} columns a program, {warps} warps"] = timer(run)
        for block, warps in ((256, 2), (512, 4), (1024, 4), (256, 1)):
            run = lambda: _pair_sum_row_kernel[(tokens,)](down, pair_row, weights, out, h, down.stride(0),
                                                          out.stride(0), TOP_K=top_k, BLOCK=block, num_warps=warps)
            run()
            torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
            res[f"pair sum, a program a token, {block}-column loop, {warps} warps"] = timer(run)
        print(f"\n## M={tokens}, {pairs} local pairs\n\n| stage | µs |\n|---|---:|")
        for name, ms in res.items():
            print(f"| {name} | {ms * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
