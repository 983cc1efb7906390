"""RMSNorm in one kernel, optionally fused with the residual add before it.

The torch RMSNorm launches about seven small kernels (upcast, square, mean, rsqrt, multiply,
downcast, weight); in a CUDA-graph decode step the count of such kernels, not their bytes,
sets the time. One program normalizes one row, rounding where the torch module rounds, so the
results are the module's within float error: the sum of residual and input is rounded to the
dtype first, the normalized row is rounded to the dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, cols, eps,
    stride_x, stride_r, stride_o, stride_s,
    HAS_RESIDUAL: tl.constexpr, PAIRS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < cols
    x = tl.load(x_ptr + row * PAIRS * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    if PAIRS > 1:  # x holds PAIRS rows per row of the residual: summed in fp32 and rounded, as the MoE's sum does
        for k in tl.static_range(1, PAIRS):
            x += tl.load(x_ptr + (row * PAIRS + k) * stride_x + c, mask=ok, other=0.0).to(tl.float32)
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + c, mask=ok, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + c, x, mask=ok)
        x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / cols + eps)
    normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (weight * normed).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, cols] with unit column stride (a copy only where no view has that shape)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, pairs: int = 1
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * norm(s), s) where s = x + residual rounded to x's dtype (s = x and None without a residual).

    x [..., cols] (rows may be strided: MLA normalizes a column slice of a projection), weight [cols].
    `pairs` > 1: x is [N * pairs, cols] (an MoE's unsummed top-k pair rows, executor.PairRows) and each group of
    `pairs` rows is summed (fp32, rounded to x's dtype) before the residual [N, cols] is added.
    """
    cols = x.shape[-1]
    if weight.shape != (cols,):
        raise ValueError(f"the norm weight has shape {tuple(weight.shape)}, the rows have {cols} columns")
    rows = _rows(x)
    if pairs > 1 and (residual is None or rows.shape[0] != residual.numel() // cols * pairs):
        raise ValueError(f"{pairs} pair rows a row need a residual of a {pairs}th of their rows; got {tuple(x.shape)} "
                         f"against {None if residual is None else tuple(residual.shape)}")
    shape = x.shape if pairs == 1 else residual.shape
    out = torch.empty(rows.shape[0] // pairs, cols, dtype=x.dtype, device=x.device)
    total = None
    if residual is not None:
        if residual.shape != shape:
            raise ValueError(f"the residual {tuple(residual.shape)} and the input {tuple(x.shape)} differ in shape")
        residual = _rows(residual)
        total = torch.empty_like(out)
    if out.shape[0]:
        _rms_norm_kernel[(out.shape[0],)](
            rows, residual if residual is not None else rows, weight, out, total if total is not None else out,
            cols, eps, rows.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            total.stride(0) if total is not None else 0,
            HAS_RESIDUAL=residual is not None, PAIRS=pairs, BLOCK=triton.next_power_of_2(cols),
            num_warps=min(16, max(1, triton.next_power_of_2(cols) // 512)),
        )
    return out.view(shape), None if total is None else total.view(shape)
