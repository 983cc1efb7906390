"""A dense projection of a few rows (decode at batch 1-4) as a Triton GEMV: out [M, N] = x [M, K] @ weight [N, K]^T.

Why: at one row a projection reads its weight once and does almost no arithmetic, so its time is the weight's bytes
over the bandwidth plus what the kernel wastes around them. cuBLAS runs Qwen3-30B-A3B's o_proj at one row as a split-K
GEMM and a reduce (two launches, ~1.8x the weight's copy time on an H100: results/e2e_h100_s12_profile_qwen_bs1.md).
Here one launch streams the weight: every program takes BLOCK_N output columns, walks K in BLOCK_K tiles, and
multiplies each weight tile with every row of x (the rows are few, so the tile is read from memory once). Sums are
fp32 and the output is rounded once, as cuBLAS rounds a bf16 GEMM's fp32 accumulator.

Whether it beats cuBLAS depends on the shape and the card, so callers time both (`moeplex.models.gpu_linear`).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

MAX_ROWS = 4  # more rows and the weight tile's reuse across rows is what a GEMM is for


@attrs.frozen
class GemvTiles:
    """One launch's tiling: output columns and K per program step, warps, pipeline stages."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        return f"n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, rows, n, k, stride_xm, stride_wn, stride_om,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    m = tl.arange(0, BLOCK_M)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for first in range(0, k, BLOCK_K):
        ks = first + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        for row in tl.static_range(BLOCK_M):  # unrolled: each row's slice of x is loaded at once
            x = tl.load(x_ptr + row * stride_xm + ks, mask=k_ok & (ks * 0 + row < rows), other=0.0).to(tl.float32)
            acc = tl.where(m[:, None] == row, acc + tl.sum(w * x[None, :], axis=1)[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m < rows)[:, None] & col_ok[None, :])


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes these operands: 1 to MAX_ROWS rows, one dtype, unit stride along K."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype and weight.dim() == 2
            and x.shape[1] == weight.shape[1] and x.stride(1) == 1 and weight.stride(1) == 1)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tiles: GemvTiles = GemvTiles()) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of 1 to MAX_ROWS rows, in one launch."""
    if not fits(x, weight):
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows [M, K] of the weight's dtype with unit stride along K; "
                         f"got x {x.dtype} {list(x.shape)} against a weight {weight.dtype} {list(weight.shape)}")
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, bias if bias is not None else weight, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=tiles.block_n,
        BLOCK_K=min(tiles.block_k, triton.next_power_of_2(k)), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out
