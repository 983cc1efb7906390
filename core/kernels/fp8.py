"""fp8 activation kernels: per-row 128-wide group quantization, and SiLU-and-mul fused with it.

Both give the same bits as `moeplex.quant.quantize_activations` on the same fp32 input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import BLOCK as GROUP, FP8, FP8_MAX

ROWS_PER_PROGRAM = 16


@triton.jit
def round_to_e4m3(x):
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
def _store_quantized(x, rows, group, row_mask, cols, col_mask, values_ptr, scales_ptr, stride_vm, stride_sm,
                     FP8_MAX: tl.constexpr):
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / FP8_MAX
    values = round_to_e4m3(tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX))
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(values_ptr + rows[:, None] * stride_vm + cols[None, :], values.to(values_ptr.dtype.element_ty), mask=mask)
    tl.store(scales_ptr + rows * stride_sm + group, scale, mask=row_mask)


@triton.jit
def _counted_rows(rows, num_rows, counts_ptr, rows_per_group, MASKED: tl.constexpr):
    """Which of `rows` hold data: all below num_rows, or (masked layout) those below their group's count."""
    row_mask = rows < num_rows
    if MASKED:
        count = tl.load(counts_ptr + rows // rows_per_group, mask=row_mask, other=0)
        row_mask = row_mask & (rows % rows_per_group < count)
    return row_mask


@triton.jit
def _quantize_kernel(x_ptr, values_ptr, scales_ptr, counts_ptr, num_rows, rows_per_group, num_cols,
                     stride_xm, stride_vm, stride_sm,
                     MASKED: tl.constexpr, FP8_MAX: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    row_mask = _counted_rows(rows, num_rows, counts_ptr, rows_per_group, MASKED)
    col_mask = cols < num_cols
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    _store_quantized(x, rows, group, row_mask, cols, col_mask, values_ptr, scales_ptr, stride_vm, stride_sm, FP8_MAX)


def quantize_rows(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R, C] -> fp8 values [..., R, C] and fp32 scales [..., R, ceil(C/128)], as
    moeplex.quant.quantize_activations does.

    With `counts` [G] and x [G, R, C] only the first counts[g] rows of group g are quantized
    (the masked layout); the other rows of the result are left unwritten.
    """
    num_cols, rows_per_group = x.shape[-1], x.shape[-2] if x.dim() > 1 else 1
    flat = x.reshape(-1, num_cols)
    num_rows = flat.shape[0]
    values = torch.empty(*x.shape, dtype=FP8, device=x.device)
    scales = torch.empty(*x.shape[:-1], triton.cdiv(num_cols, GROUP), dtype=torch.float32, device=x.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, ROWS_PER_PROGRAM), scales.shape[-1])
        _quantize_kernel[grid](flat, values, scales, counts if counts is not None else flat, num_rows, rows_per_group,
                               num_cols, flat.stride(0), num_cols, scales.shape[-1],
                               MASKED=counts is not None, FP8_MAX=FP8_MAX, GROUP=GROUP, BLOCK_R=ROWS_PER_PROGRAM)
    return values, scales


@triton.jit
def _silu_mul_quantize_kernel(x_ptr, values_ptr, scales_ptr, counts_ptr, num_rows, rows_per_group, inter,
                              stride_xm, stride_vm, stride_sm,
                              MASKED: tl.constexpr, FP8_MAX: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    # rows past their expert's count (masked layout) hold nothing: neither read nor written
    row_mask = _counted_rows(rows, num_rows, counts_ptr, rows_per_group, MASKED)
    col_mask = cols < inter
    mask = row_mask[:, None] & col_mask[None, :]
    base = x_ptr + rows[:, None] * stride_xm + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + inter, mask=mask, other=0.0).to(tl.float32)
    # SiLU rounded to the input dtype before the product, as torch computes F.silu(gate) * up
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    y = (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_quantized(y, rows, group, row_mask, cols, col_mask, values_ptr, scales_ptr, stride_vm, stride_sm, FP8_MAX)


def silu_mul_quantize(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R, 2I] (gate, then up) -> fp8 of silu(gate) * up [..., R, I] and its scales [..., R, I/128].

    With `counts` [G] and x [G, R, 2I] only the first counts[g] rows of group g are computed
    (the masked layout); the other rows of the result are left unwritten.
    """
    inter = x.shape[-1] // 2
    if inter % GROUP:
        raise ValueError(f"the intermediate size {inter} is not a multiple of the {GROUP}-wide fp8 groups")
    rows_per_group = x.shape[-2]
    flat = x.reshape(-1, x.shape[-1])
    values = torch.empty(*x.shape[:-1], inter, dtype=FP8, device=x.device)
    scales = torch.empty(*x.shape[:-1], inter // GROUP, dtype=torch.float32, device=x.device)
    num_rows = flat.shape[0]
    if num_rows:
        grid = (triton.cdiv(num_rows, ROWS_PER_PROGRAM), inter // GROUP)
        _silu_mul_quantize_kernel[grid](
            flat, values, scales, counts if counts is not None else flat, num_rows, rows_per_group, inter,
            flat.stride(0), inter, inter // GROUP,
            MASKED=counts is not None, FP8_MAX=FP8_MAX, GROUP=GROUP, BLOCK_R=ROWS_PER_PROGRAM,
        )
    return values, scales
