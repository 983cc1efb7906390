"""Attention over the paged KV cache in plain torch (the `torch` backend, and every backend's extend path).

Extend: every request's keys and values are gathered from its KV slots (ForwardBatch.kv_indices)
and attended with causal masking offset by the request's cached prefix. Decode: all requests at
once, their KV gathered into a [B, longest, ...] block with the padding masked out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..forward_batch import ForwardBatch, ForwardMode


def write_kv(buffer: torch.Tensor, batch: ForwardBatch, values: torch.Tensor) -> None:
    buffer[batch.out_cache_loc] = values.to(buffer.dtype)


def gather_kv(buffer: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """[sum(seq_lens), ...] cached rows of every request, request after request."""
    return buffer.index_select(0, batch.kv_indices)


def padded_rows(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """([B * longest] positions in kv_indices order, [B, longest] mask of the real ones)."""
    longest = max(batch.seq_lens_cpu)
    cols = torch.arange(longest, device=batch.seq_lens.device)
    valid = cols[None, :] < batch.seq_lens[:, None]
    rows = (batch.kv_indptr[:-1, None] + cols[None, :]).clamp_max(max(batch.kv_indices.numel() - 1, 0))
    return rows.flatten(), valid


def _attend_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] against k [B, L, Hkv, D], v [B, L, Hkv, Dv] -> [B, Hq, Dv]."""
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[2],
    )
    return out.squeeze(2)


def paged_decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """Decode straight from the cache buffers: one gather per buffer into the padded block."""
    rows, valid = padded_rows(batch)
    slots = batch.kv_indices.index_select(0, rows)
    k = key_cache.index_select(0, slots).view(*valid.shape, *key_cache.shape[1:])
    v = value_cache.index_select(0, slots).view(*valid.shape, *value_cache.shape[1:])
    return _attend_padded(q, k, v, valid, scale)


def ragged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """q [T, Hq, D]; k [S, Hkv, D], v [S, Hkv, Dv] in kv_indices order -> [T, Hq, Dv]."""
    if batch.mode == ForwardMode.DECODE:
        rows, valid = padded_rows(batch)
        k = k.index_select(0, rows).view(*valid.shape, *k.shape[1:])
        v = v.index_select(0, rows).view(*valid.shape, *v.shape[1:])
        return _attend_padded(q, k, v, valid, scale)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    gqa = q.shape[1] != k.shape[1]
    t0 = 0
    indptr = batch.kv_indptr.tolist()
    for i, (prefix, n) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
        ks, vs = k[indptr[i] : indptr[i + 1]], v[indptr[i] : indptr[i + 1]]
        qs = q[t0 : t0 + n]
        if prefix:
            # query j sits at position prefix + j and may see keys 0 .. prefix + j
            positions = torch.arange(prefix + n, device=q.device)
            causal = dict(attn_mask=positions[None, :] <= (prefix + torch.arange(n, device=q.device))[:, None])
        else:
            causal = dict(is_causal=True)  # no mask to build, and SDPA may pick its flash kernel
        # 4-D [1, heads, tokens, dim]: SDPA's flash and memory-efficient kernels take nothing else and
        # would fall back to the math path, which materializes every score in fp32
        out[t0 : t0 + n] = F.scaled_dot_product_attention(
            *(x.transpose(0, 1).unsqueeze(0) for x in (qs, ks, vs)), scale=scale, enable_gqa=gqa, **causal
        )[0].transpose(0, 1)
        t0 += n
    return out
