"""Rotary position embeddings applied in place to queries and keys, after an optional per-head RMSNorm.

One launch does what the torch path does in a dozen small ops: Qwen3's q_norm and k_norm, cos/sin
at each token's position, the rotation of every query and key head and, given a `KVWrite`, the
stores of the keys and values into the paged cache. A CUDA-graph decode step
is dominated by the number of tiny kernels it replays, not by their work, so this one kernel
replaces them all.

The kernel rounds where `moeplex.models.base.RMSNorm` and `moeplex.models.rope.RotaryEmbedding`
round, so it matches them to the bit as far as cos/sin agree: the norm is computed in fp32, rounded
to the tensor dtype, multiplied by its weight and rounded again; cos/sin are rounded to the dtype;
x*cos and the rotated half times sin are each rounded before they are added.
"""

from __future__ import annotations

import attrs
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
def _rope_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, inv_freq_ptr, q_norm_ptr, k_norm_ptr,
                 slots_ptr, k_cache_ptr, v_cache_ptr,
                 q_heads, k_heads, head_dim, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_kcs, stride_kch, stride_vcs, stride_vch, scale, eps,
                 INTERLEAVED: tl.constexpr, NORM: tl.constexpr, WRITE_KV: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Program (token, block of heads); heads [0, q_heads) are the query's, the next k_heads the key's
    and, with WRITE_KV, the next k_heads the value's.

    Each head is read as two halves (`first`, `second`) of the rotated pairs and written back
    half-split: out[:D/2] = first*cos - second*sin, out[D/2:] = second*cos + first*sin. With
    WRITE_KV the keys go to the key cache's row slots[token] instead of back in place, and the values,
    neither normalized nor rotated, to the value cache's row.
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
    k_head = (heads - q_heads).to(tl.int64)[:, None]
    q_rows = q_ptr + token * stride_qt + heads.to(tl.int64)[:, None] * stride_qh
    k_rows = k_ptr + token * stride_kt + k_head * stride_kh
    rows = tl.where(is_q, q_rows, k_rows)
    num_heads = q_heads + k_heads
    is_v = heads[:, None] < 0  # no value heads
    if WRITE_KV:
        num_heads += k_heads
        is_v = (heads >= q_heads + k_heads)[:, None]
        v_head = k_head - k_heads
        rows = tl.where(is_v, v_ptr + token * stride_vt + v_head * stride_vh, rows)
    mask = (heads < num_heads)[:, None] & (pairs < half)[None, :]
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
        n1 = _rounded(w1 * _rounded(x1 * rms, dtype), dtype)
        n2 = _rounded(w2 * _rounded(x2 * rms, dtype), dtype)
    else:
        n1, n2 = x1, x2

    position = tl.load(positions_ptr + token).to(tl.float32)
    freqs = position * tl.load(inv_freq_ptr + pairs, mask=pairs < half, other=0.0)
    cos = _rounded(tl.cos(freqs) * scale, dtype)[None, :]
    sin = _rounded(tl.sin(freqs) * scale, dtype)[None, :]
    out1 = _rounded(n1 * cos, dtype) - _rounded(n2 * sin, dtype)
    out2 = _rounded(n2 * cos, dtype) + _rounded(n1 * sin, dtype)
    if WRITE_KV:
        tl.store(rows + pairs[None, :], out1.to(dtype), mask=mask & is_q)
        tl.store(rows + half + pairs[None, :], out2.to(dtype), mask=mask & is_q)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        is_k = ~is_q & ~is_v
        k_dst = k_cache_ptr + slot * stride_kcs + k_head * stride_kch
        k_cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_dst + pairs[None, :], out1.to(dtype).to(k_cache_dtype), mask=mask & is_k)
        tl.store(k_dst + half + pairs[None, :], out2.to(dtype).to(k_cache_dtype), mask=mask & is_k)
        v_dst = v_cache_ptr + slot * stride_vcs + (k_head - k_heads) * stride_vch
        v_cache_dtype = v_cache_ptr.dtype.element_ty
        tl.store(v_dst + first[None, :], x1.to(dtype).to(v_cache_dtype), mask=mask & is_v)
        tl.store(v_dst + second[None, :], x2.to(dtype).to(v_cache_dtype), mask=mask & is_v)
    else:
        tl.store(rows + pairs[None, :], out1.to(dtype), mask=mask)
        tl.store(rows + half + pairs[None, :], out2.to(dtype), mask=mask)


@attrs.frozen
class KVWrite:
    """Where rope_ stores the keys it rotates, and the values beside them, instead of rotating k in place:
    row slots[t] of key_cache [slots, Hk, D] and value_cache [slots, Hk, D] (any dtype; the cast is the
    kernel's) takes token t's keys and values v [T, Hk, D]. One launch then replaces rope's and the two
    cache writes'."""

    v: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slots: torch.Tensor  # [T] int


def _check_kv_write(write: KVWrite, k: torch.Tensor) -> None:
    num_tokens, heads, head_dim = k.shape
    shapes = (write.v.shape, write.key_cache.shape[1:], write.value_cache.shape[1:], write.slots.shape)
    if shapes != ((num_tokens, heads, head_dim), (heads, head_dim), (heads, head_dim), (num_tokens,)):
        raise ValueError(f"a KV write needs v [T, Hk, D], caches [slots, Hk, D] and slots [T] for keys "
                         f"{tuple(k.shape)}; got {', '.join(str(tuple(s)) for s in shapes)}")
    if write.v.dtype != k.dtype or any(t.stride(-1) != 1 for t in (write.v, write.key_cache, write.value_cache)):
        raise ValueError("a KV write needs v of the keys' dtype and v and the caches contiguous along the head dim")


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
          interleaved: bool = False, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
          eps: float = 1e-6, kv_write: KVWrite | None = None) -> None:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place at positions [T] (int), in one launch.

    inv_freq [D/2] (fp32) and scale are `RotaryEmbedding`'s; `interleaved` rotates adjacent pairs
    (DeepSeek) and writes them half-split, as `RotaryEmbedding` does. With q_norm and k_norm ([D]
    weights, both or neither) each head is first RMS-normalized with eps, as Qwen3's q_norm/k_norm.
    q and k may be views with any strides except along D, which must be contiguous. With `kv_write`
    the rotated keys go to the key cache (k itself is left as it was) and the values to the value cache.
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
    if kv_write is not None:
        _check_kv_write(kv_write, k)
    if num_tokens == 0:
        return
    norm = q_norm is not None
    heads = q_heads + k_heads * (2 if kv_write is not None else 1)
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(heads), max(1, ELEMENTS_PER_PROGRAM // (2 * block_half)))
    grid = (num_tokens, triton.cdiv(heads, block_h))
    w = kv_write
    v, key_cache, value_cache, slots = (w.v, w.key_cache, w.value_cache, w.slots) if w is not None else (k, k, k, positions)
    _rope_kernel[grid](
        q, k, v, positions, inv_freq.contiguous(), q_norm if norm else q, k_norm if norm else k,
        slots, key_cache, value_cache,
        q_heads, k_heads, head_dim, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1), float(scale), eps,
        INTERLEAVED=interleaved, NORM=norm, WRITE_KV=w is not None, BLOCK_H=block_h, BLOCK_HALF=block_half,
    )
