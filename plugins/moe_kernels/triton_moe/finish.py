"""The small kernels around the grouped GEMM: fp8 activation quantization and the sum over top-k."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeplex.quant import BLOCK as GROUP, FP8, FP8_MAX

ROWS_PER_PROGRAM = 16


@triton.jit
def _round_to_e4m3(x):
    """fp32 -> the nearest float8_e4m3fn value (ties to even), still in fp32.

    Rounding here makes the final cast exact, so the result equals torch's on every backend
    (Triton's CPU interpreter drops the carry when rounding up to the next power of two).
    """
    magnitude = tl.abs(x)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # below 2**-6 e4m3 is subnormal, with the step of 2**-6
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: 2**(exponent - 3)
    units = magnitude / step
    rounded = tl.floor(units + 0.5)
    tie_to_odd = (rounded - units == 0.5) & ((rounded.to(tl.int32) & 1) == 1)
    rounded = tl.where(tie_to_odd, rounded - 1.0, rounded) * step
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def _quantize_kernel(x_ptr, values_ptr, scales_ptr, num_rows, num_cols,
                     stride_xm, stride_vm, stride_sm,
                     FP8_MAX: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < num_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / FP8_MAX
    values = _round_to_e4m3(tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX))
    tl.store(values_ptr + rows[:, None] * stride_vm + cols[None, :], values.to(values_ptr.dtype.element_ty), mask=mask)
    tl.store(scales_ptr + rows * stride_sm + group, scale, mask=rows < num_rows)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> fp8 values [R, C] and fp32 scales [R, ceil(C/128)], as moeplex.quant.quantize_activations does."""
    num_rows, num_cols = x.shape
    values = torch.empty(num_rows, num_cols, dtype=FP8, device=x.device)
    scales = torch.empty(num_rows, triton.cdiv(num_cols, GROUP), dtype=torch.float32, device=x.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, ROWS_PER_PROGRAM), scales.shape[1])
        _quantize_kernel[grid](x, values, scales, num_rows, num_cols, x.stride(0), values.stride(0), scales.stride(0),
                               FP8_MAX=FP8_MAX, GROUP=GROUP, BLOCK_R=ROWS_PER_PROGRAM)
    return values, scales


@triton.jit
def _sum_topk_kernel(rows_ptr, topk_ids_ptr, out_ptr, num_tokens, hidden,
                     stride_rm, stride_om, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_mask = tokens < num_tokens
    col_mask = cols[None, :] < hidden
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        # Rows of pairs routed elsewhere (-1) were never written: skip them rather than read garbage.
        routed = tl.load(topk_ids_ptr + tokens * TOP_K + k, mask=token_mask, other=-1) >= 0
        pair_rows = tokens * TOP_K + k
        acc += tl.load(rows_ptr + pair_rows[:, None] * stride_rm + cols[None, :],
                       mask=routed[:, None] & col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tokens[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=token_mask[:, None] & col_mask)


def sum_topk(pair_rows: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over k of pair_rows[t * K + k], for the pairs whose id is not -1 (zeros if none is)."""
    num_tokens, top_k = topk_ids.shape
    hidden = out.shape[1]
    if num_tokens:
        block_h = min(triton.next_power_of_2(hidden), 512)
        grid = (triton.cdiv(num_tokens, ROWS_PER_PROGRAM), triton.cdiv(hidden, block_h))
        _sum_topk_kernel[grid](pair_rows, topk_ids, out, num_tokens, hidden, pair_rows.stride(0), out.stride(0),
                               TOP_K=top_k, BLOCK_T=ROWS_PER_PROGRAM, BLOCK_H=block_h)
    return out
