"""Rows between the order they arrived in and expert-grouped order, each in one pass over the bytes.

DeepEP's normal mode delivers each token's row once per rank, with the rank's top-k expert ids;
grouped GEMMs want one row per (token, local expert) pair, grouped per expert and padded. The
torch forms of these two moves (an indexed write into a zeroed buffer; an fp32 `index_add_` of
weighted rows) cost several times the transfer itself at prefill sizes: ~1 ms and ~1.5 ms per
layer for 4096 tokens of width 7168 on an H200 against ~0.9 ms for DeepEP's dispatch and combine.

- `gather_rows`: out[i] = rows[source[i]], zeros where source[i] < 0 (padding rows); any dtype
  (bf16 rows, fp8 payloads and their fp32 scales alike).
- `weighted_pair_sum`: out[n] = sum over k of weight[n, k] * rows[pair_row[n, k]] for the pairs
  this rank computed (pair_row >= 0), accumulated in fp32 in k order (deterministic, unlike
  atomics) and rounded once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program
# The pair sum's programs each wait on their K row indices before they read; one warp a program lets more of them
# wait at once: 194 against 231 µs at EP8-global M=16384 on the H100 (benchmarks/results/fused_moe_large_m_h100_s23.md)
PAIR_SUM_WARPS = 1


@triton.jit
def _gather_rows_kernel(rows_ptr, source_ptr, out_ptr, cols, stride_r, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < cols
    source = tl.load(source_ptr + row).to(tl.int64) + tl.zeros((BLOCK,), dtype=tl.int64)  # a block: masks combine
    values = tl.load(rows_ptr + source * stride_r + c, mask=ok & (source >= 0), other=0.0)
    tl.store(out_ptr + row * stride_o + c, values.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _weighted_pair_sum_kernel(
    rows_ptr, pair_row_ptr, weight_ptr, out_ptr, cols, stride_r, stride_o, TOP_K: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(pair_row_ptr + token * TOP_K + k).to(tl.int64) + tl.zeros((BLOCK,), dtype=tl.int64)
        weight = tl.load(weight_ptr + token * TOP_K + k).to(tl.float32)
        values = tl.load(rows_ptr + row * stride_r + c, mask=ok & (row >= 0), other=0.0)
        acc += tl.where(row >= 0, weight * values.to(tl.float32), 0.0)  # a weight elsewhere may be anything
    tl.store(out_ptr + token * stride_o + c, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _check_rows(rows: torch.Tensor) -> None:
    if rows.dim() != 2 or rows.stride(-1) != 1:
        raise ValueError(f"rows must be [N, width] with unit column stride, got shape {tuple(rows.shape)}")


def gather_rows(rows: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """[M, width]: rows[source[i]] for each i, zeros where source[i] < 0."""
    _check_rows(rows)
    out = torch.empty(source.shape[0], rows.shape[1], dtype=rows.dtype, device=rows.device)
    if out.numel():
        grid = (source.shape[0], triton.cdiv(rows.shape[1], BLOCK))
        _gather_rows_kernel[grid](rows, source.contiguous(), out, rows.shape[1], rows.stride(0), out.stride(0), BLOCK=BLOCK)
    return out


def weighted_pair_sum(rows: torch.Tensor, pair_row: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, width] in `dtype`: each token's weighted sum of its pairs' rows; pair_row, weights: [N, K]."""
    _check_rows(rows)
    if pair_row.shape != weights.shape:
        raise ValueError(f"pair rows {tuple(pair_row.shape)} and weights {tuple(weights.shape)} differ in shape")
    num_tokens, top_k = pair_row.shape
    out = torch.empty(num_tokens, rows.shape[1], dtype=dtype, device=rows.device)
    if out.numel():
        grid = (num_tokens, triton.cdiv(rows.shape[1], BLOCK))
        _weighted_pair_sum_kernel[grid](
            rows, pair_row.contiguous(), weights.contiguous(), out, rows.shape[1], rows.stride(0), out.stride(0),
            TOP_K=top_k, BLOCK=BLOCK, num_warps=PAIR_SUM_WARPS,
        )
    return out
