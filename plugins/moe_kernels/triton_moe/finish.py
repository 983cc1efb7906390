"""The small kernels around the grouped GEMMs: SiLU-and-multiply, the sum over top-k (fp8 quantization lives in
moeplex.kernels.fp8)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 16


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


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, I]: SiLU(gate) * up of rows [M, 2I] holding gate then up, in one pass."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(triton.next_power_of_2(inter), 1024)
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                            BLOCK=block)
    return out
