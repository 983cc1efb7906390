"""The standard layout of a few tokens (decode at batch 1-4) as two GEMV launches, no alignment and no sum kernel.

Why: at one token each routed expert's weights are read once for a single row, so the MoE's time is those bytes over
the bandwidth plus what the kernels waste around them. The grouped GEMM (kernel.py) runs a 16-row MMA tile for that
row and leaves each pair's output for a third launch to weight and sum: on an H100, Qwen3-30B-A3B's two GEMMs took
33.3 µs a layer against ~25 µs for their bytes, and the sum 3.3 µs more (results/e2e_h100_s22_profile_qwen_bs1.md).

Here, as in moeplex.kernels.gemv, a program streams BLOCK_N weight rows along K and multiplies each tile with the
row it meets in registers:
- gate and up: a program per (pair, BLOCK_N intermediate columns) reads its pair's expert id, streams the gate rows
  and the matching up rows together, and writes SiLU(gate) * up for that pair, rounded once;
- down: a program per (token, BLOCK_N hidden columns) walks the token's pairs one after another (one loop over pairs
  and K tiles, which the compiler pipelines as one), each pair's down rows against its intermediate row, times its
  routed weight, summed in fp32 and rounded once: the sum over top-k happens in the GEMV.
Pairs routed elsewhere (id -1) load nothing and add nothing. Every grid comes from shapes: a CUDA graph holds it.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

MAX_TOKENS = 4  # more tokens share experts, and the grouped GEMM reads each shared expert once


@attrs.frozen
class MoEGemvTiles:
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, out_ptr, top_k, inter, hidden, stride_xm, stride_we, stride_wn, stride_om,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    expert = tl.load(ids_ptr + pair)
    gate_rows = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + inter * stride_wn
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xm
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for first in range(0, hidden, BLOCK_K):
        ks = first + tl.arange(0, BLOCK_K)
        k_ok = (ks < hidden) & (ks * 0 + expert >= 0)  # nothing is read for a pair routed elsewhere
        mask = col_ok[:, None] & k_ok[None, :]
        x = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        gate += tl.sum(tl.load(gate_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x, axis=1)
        up += tl.sum(tl.load(up_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x, axis=1)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty),
             mask=col_ok)


@triton.jit
def _down_sum_kernel(inter_ptr, ids_ptr, weights_ptr, w_ptr, out_ptr, top_k, hidden, inter,
                     stride_im, stride_we, stride_wn, stride_om, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    k_tiles = tl.cdiv(inter, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for step in range(0, top_k * k_tiles):  # (pair, K tile) in one loop, pipelined across pairs
        pair = token * top_k + step // k_tiles
        ks = (step % k_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
        expert = tl.load(ids_ptr + pair)
        k_ok = (ks < inter) & (ks * 0 + expert >= 0)  # nothing is read for a pair routed elsewhere
        w = tl.load(w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
                    + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        a = tl.load(inter_ptr + pair * stride_im + ks, mask=k_ok, other=0.0).to(tl.float32)
        # a pair routed elsewhere adds nothing, whatever its weight holds
        acc += tl.where(expert >= 0, tl.sum(w * a[None, :], axis=1) * tl.load(weights_ptr + pair).to(tl.float32), 0.0)
    tl.store(out_ptr + token * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def fits(hidden: torch.Tensor, topk_ids: torch.Tensor, max_tokens: int) -> bool:
    """Whether `moe_gemv` takes this batch: 1 to max_tokens rows, unit stride along the hidden size."""
    return 0 < topk_ids.shape[0] <= max_tokens and hidden.dim() == 2 and hidden.stride(-1) == 1


def _block_k(width: int, widest: int) -> int:
    """The widest power of two up to `widest` that divides `width` (no masked tail tile), at least 16."""
    block = widest
    while block > 16 and width % block:
        block //= 2
    return block


def moe_gemv(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor, tiles: MoEGemvTiles = MoEGemvTiles()) -> torch.Tensor:
    """[N, H]: sum over k of topk_weights[t, k] * down(SiLU(gate) * up) of expert topk_ids[t, k] (skipping -1),
    for hidden [N, H] with N <= MAX_TOKENS, w13 [E, 2I, H] and w2 [E, H, I] contiguous, in two launches."""
    num_tokens, top_k = topk_ids.shape
    width = w2.shape[1]
    inter = w2.shape[2]
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    pair_inter = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, tiles.block_n))](
        hidden, ids, w13, pair_inter, top_k, inter, width, hidden.stride(0), w13.stride(0), w13.stride(1),
        pair_inter.stride(0), BLOCK_N=tiles.block_n, BLOCK_K=_block_k(width, tiles.block_k),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    out = torch.empty(num_tokens, width, dtype=hidden.dtype, device=hidden.device)
    _down_sum_kernel[(num_tokens, triton.cdiv(width, tiles.block_n))](
        pair_inter, ids, weights, w2, out, top_k, width, inter, pair_inter.stride(0), w2.stride(0), w2.stride(1),
        out.stride(0), BLOCK_N=tiles.block_n, BLOCK_K=_block_k(inter, tiles.block_k),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
