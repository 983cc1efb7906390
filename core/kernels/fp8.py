"""fp8 activation kernels: per-row 128-wide group quantization, and SiLU-and-mul fused with it.

Both give the same bits as `moeplex.quant.quantize_activations` on the same fp32 input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import BLOCK as GROUP, FP8, FP8_MAX

ROWS_PER_PROGRAM = 16
GROUPS_PER_MASKED_PROGRAM = 4  # column groups a masked-layout program loops over, beside its rows


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
def _quantize_tile(x_ptr, values_ptr, scales_ptr, rows, row_mask, group, num_cols, stride_xm, stride_vm, stride_sm,
                   FP8_MAX: tl.constexpr, GROUP: tl.constexpr):
    cols = group * GROUP + tl.arange(0, GROUP)
    col_mask = cols < num_cols
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    _store_quantized(x, rows, group, row_mask, cols, col_mask, values_ptr, scales_ptr, stride_vm, stride_sm, FP8_MAX)


@triton.jit
def _silu_quantize_tile(x_ptr, values_ptr, scales_ptr, rows, row_mask, group, inter, stride_xm, stride_vm, stride_sm,
                        FP8_MAX: tl.constexpr, GROUP: tl.constexpr):
    cols = group * GROUP + tl.arange(0, GROUP)
    col_mask = cols < inter
    mask = row_mask[:, None] & col_mask[None, :]
    base = x_ptr + rows[:, None] * stride_xm + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + inter, mask=mask, other=0.0).to(tl.float32)
    # SiLU rounded to the input dtype before the product, as torch computes F.silu(gate) * up
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    y = (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_quantized(y, rows, group, row_mask, cols, col_mask, values_ptr, scales_ptr, stride_vm, stride_sm, FP8_MAX)


@triton.jit
def _tile(x_ptr, values_ptr, scales_ptr, rows, row_mask, group, num_cols, stride_xm, stride_vm, stride_sm,
          SILU: tl.constexpr, FP8_MAX: tl.constexpr, GROUP: tl.constexpr):
    if SILU:
        _silu_quantize_tile(x_ptr, values_ptr, scales_ptr, rows, row_mask, group, num_cols, stride_xm, stride_vm,
                            stride_sm, FP8_MAX, GROUP)
    else:
        _quantize_tile(x_ptr, values_ptr, scales_ptr, rows, row_mask, group, num_cols, stride_xm, stride_vm,
                       stride_sm, FP8_MAX, GROUP)


@triton.jit
def _rows_kernel(x_ptr, values_ptr, scales_ptr, counts_ptr, num_rows, rows_per_group, num_cols, num_groups,
                 stride_xm, stride_vm, stride_sm,
                 SILU: tl.constexpr, MASKED: tl.constexpr, FP8_MAX: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_R: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr):
    """One tile of rows x 128 columns quantized (SILU: of silu(gate) * up), or in the masked layout, for expert
    program_id(0), its counted rows only: a loop over them, so rows past the count cost no program."""
    if MASKED:
        expert = tl.program_id(0)
        count = tl.minimum(tl.load(counts_ptr + expert), rows_per_group)
        for start in range(0, count, BLOCK_R):
            offsets = start + tl.arange(0, BLOCK_R)
            rows = expert.to(tl.int64) * rows_per_group + offsets
            for j in tl.static_range(GROUPS_PER_PROGRAM):
                group = tl.program_id(1) * GROUPS_PER_PROGRAM + j
                if group < num_groups:
                    _tile(x_ptr, values_ptr, scales_ptr, rows, offsets < count, group, num_cols,
                          stride_xm, stride_vm, stride_sm, SILU, FP8_MAX, GROUP)
    else:
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        _tile(x_ptr, values_ptr, scales_ptr, rows, rows < num_rows, tl.program_id(1), num_cols,
              stride_xm, stride_vm, stride_sm, SILU, FP8_MAX, GROUP)


def _launch_rows(flat, values, scales, counts, rows_per_group, num_cols, silu: bool) -> None:
    """flat [rows, C or 2C] -> values [rows, C], scales [rows, C/128]: a program per 16 rows and 128 columns, or
    with counts [G] (the masked layout: G groups of rows_per_group rows) a program per group and 4 column groups."""
    num_rows, num_groups = flat.shape[0], scales.shape[-1]
    if not num_rows:
        return
    masked = counts is not None
    per_program = GROUPS_PER_MASKED_PROGRAM if masked else 1
    programs = counts.shape[0] if masked else triton.cdiv(num_rows, ROWS_PER_PROGRAM)
    grid = (programs, triton.cdiv(num_groups, per_program))
    _rows_kernel[grid](flat, values, scales, counts if masked else flat, num_rows, rows_per_group, num_cols, num_groups,
                       flat.stride(0), num_cols, num_groups, SILU=silu, MASKED=masked, FP8_MAX=FP8_MAX, GROUP=GROUP,
                       BLOCK_R=ROWS_PER_PROGRAM, GROUPS_PER_PROGRAM=per_program)


def quantize_rows(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R, C] -> fp8 values [..., R, C] and fp32 scales [..., R, ceil(C/128)], as
    moeplex.quant.quantize_activations does.

    With `counts` [G] and x [G, R, C] only the first counts[g] rows of group g are quantized
    (the masked layout); the other rows of the result are left unwritten.
    """
    num_cols, rows_per_group = x.shape[-1], x.shape[-2] if x.dim() > 1 else 1
    values = torch.empty(*x.shape, dtype=FP8, device=x.device)
    scales = torch.empty(*x.shape[:-1], triton.cdiv(num_cols, GROUP), dtype=torch.float32, device=x.device)
    _launch_rows(x.reshape(-1, num_cols), values, scales, counts, rows_per_group, num_cols, silu=False)
    return values, scales


def silu_mul_quantize(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R, 2I] (gate, then up) -> fp8 of silu(gate) * up [..., R, I] and its scales [..., R, I/128].

    With `counts` [G] and x [G, R, 2I] only the first counts[g] rows of group g are computed
    (the masked layout); the other rows of the result are left unwritten.
    """
    inter = x.shape[-1] // 2
    if inter % GROUP:
        raise ValueError(f"the intermediate size {inter} is not a multiple of the {GROUP}-wide fp8 groups")
    rows_per_group = x.shape[-2]
    values = torch.empty(*x.shape[:-1], inter, dtype=FP8, device=x.device)
    scales = torch.empty(*x.shape[:-1], inter // GROUP, dtype=torch.float32, device=x.device)
    _launch_rows(x.reshape(-1, x.shape[-1]), values, scales, counts, rows_per_group, inter, silu=True)
    return values, scales
