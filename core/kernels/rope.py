"""Rotary position embeddings applied in place to queries and keys, after an optional per-head RMSNorm.

One launch does what the torch path does in a dozen small ops: Qwen3's q_norm and k_norm, cos/sin
at each token's position, and the rotation of every query and key head. A CUDA-graph decode step
is dominated by the number of tiny kernels it replays, not by their work, so this one kernel
replaces them all.

The kernel rounds where `moeplex.models.base.RMSNorm` and `moeplex.models.rope.RotaryEmbedding`
round, so it matches them to the bit as far as cos/sin agree: the norm is computed in fp32, rounded
to the tensor dtype, multiplied by its weight and rounded again; cos/sin are rounded to the dtype;
x*cos and the rotated half times sin are each rounded before they are added.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# a program rotates about this many elements: whole heads, several of them when heads are small
ELEMENTS_PER_PROGRAM = 1024


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """fp32 -> the nearest value of `dtype`, back in fp32 (what a torch op in that dtype returns)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, positions_ptr, inv_freq_ptr, q_norm_ptr, k_norm_ptr,
                 q_heads, k_heads, head_dim, stride_qt, stride_qh, stride_kt, stride_kh, scale, eps,
                 INTERLEAVED: tl.constexpr, NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Program (token, block of heads); heads [0, q_heads) are the query's, the next k_heads the key's.

    Each head is read as two halves (`first`, `second`) of the rotated pairs and written back
    half-split: out[:D/2] = first*cos - second*sin, out[D/2:] = second*cos + first*sin.
    """
    dtype = q_ptr.dtype.element_ty
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_HALF)
    half = head_dim // 2
    if INTERLEAVED:  # pairs (x0, x1), (x2, x3), ...
        first, second = 2 * pairs, 2 * pairs + 1
    else:  # pairs (x_i, x_{i + D/2})
        first, second = pairs, pairs + half

    is_q = (heads < q_heads)[:, None]
    q_rows = q_ptr + token * stride_qt + heads.to(tl.int64)[:, None] * stride_qh
    k_rows = k_ptr + token * stride_kt + (heads - q_heads).to(tl.int64)[:, None] * stride_kh
    rows = tl.where(is_q, q_rows, k_rows)
    mask = (heads < q_heads + k_heads)[:, None] & (pairs < half)[None, :]
    x1 = tl.load(rows + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows + second[None, :], mask=mask, other=0.0).to(tl.float32)
    # in place, and (interleaved) a thread writes elements that other warps read: all reads come first
    tl.debug_barrier()

    if NORM:
        rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / head_dim + eps)[:, None]
        w1 = tl.where(is_q, tl.load(q_norm_ptr + first, mask=pairs < half, other=0.0)[None, :],
                      tl.load(k_norm_ptr + first, mask=pairs < half, other=0.0)[None, :]).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_norm_ptr + second, mask=pairs < half, other=0.0)[None, :],
                      tl.load(k_norm_ptr + second, mask=pairs < half, other=0.0)[None, :]).to(tl.float32)
        x1 = _rounded(w1 * _rounded(x1 * rms, dtype), dtype)
        x2 = _rounded(w2 * _rounded(x2 * rms, dtype), dtype)

    position = tl.load(positions_ptr + token).to(tl.float32)
    freqs = position * tl.load(inv_freq_ptr + pairs, mask=pairs < half, other=0.0)
    cos = _rounded(tl.cos(freqs) * scale, dtype)[None, :]
    sin = _rounded(tl.sin(freqs) * scale, dtype)[None, :]
    out1 = _rounded(x1 * cos, dtype) - _rounded(x2 * sin, dtype)
    out2 = _rounded(x2 * cos, dtype) + _rounded(x1 * sin, dtype)
    tl.store(rows + pairs[None, :], out1.to(dtype), mask=mask)
    tl.store(rows + half + pairs[None, :], out2.to(dtype), mask=mask)


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
          interleaved: bool = False, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
          eps: float = 1e-6) -> None:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place at positions [T] (int), in one launch.

    inv_freq [D/2] (fp32) and scale are `RotaryEmbedding`'s; `interleaved` rotates adjacent pairs
    (DeepSeek) and writes them half-split, as `RotaryEmbedding` does. With q_norm and k_norm ([D]
    weights, both or neither) each head is first RMS-normalized with eps, as Qwen3's q_norm/k_norm.
    q and k may be views with any strides except along D, which must be contiguous.
    """
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if k.shape[::2] != q.shape[::2] or positions.shape != (num_tokens,):
        raise ValueError(f"rope_ needs q [T, Hq, D], k [T, Hk, D] and positions [T]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)} and {tuple(positions.shape)}")
    if head_dim % 2 or inv_freq.shape != (head_dim // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"rope_ needs an even head dim and fp32 inv_freq [D/2]; got D={head_dim}, "
                         f"inv_freq {inv_freq.dtype} {tuple(inv_freq.shape)}")
    if q.dtype != k.dtype or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope_ needs q and k of one dtype, contiguous along the head dim")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rope_ takes q_norm and k_norm together, or neither")
    if num_tokens == 0:
        return
    norm = q_norm is not None
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(q_heads + k_heads), max(1, ELEMENTS_PER_PROGRAM // (2 * block_half)))
    grid = (num_tokens, triton.cdiv(q_heads + k_heads, block_h))
    _rope_kernel[grid](
        q, k, positions, inv_freq.contiguous(), q_norm if norm else q, k_norm if norm else k,
        q_heads, k_heads, head_dim, q.stride(0), q.stride(1), k.stride(0), k.stride(1), float(scale), eps,
        INTERLEAVED=interleaved, NORM=norm, BLOCK_H=block_h, BLOCK_HALF=block_half,
    )
