"""Attention over the paged KV cache (torch reference path, used on CPU).

Every request's keys and values are gathered from its KV slots (ForwardBatch.kv_indices),
then attended with causal masking offset by the request's cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..forward_batch import ForwardBatch, ForwardMode


def write_kv(buffer: torch.Tensor, batch: ForwardBatch, values: torch.Tensor) -> None:
    buffer[batch.out_cache_loc] = values.to(buffer.dtype)


def gather_kv(buffer: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """[sum(seq_lens), ...] cached rows of every request, request after request."""
    return buffer[batch.kv_indices]


def ragged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """q [T, Hq, D]; k [S, Hkv, D], v [S, Hkv, Dv] in kv_indices order -> [T, Hq, Dv]."""
    if batch.mode == ForwardMode.DECODE:
        return _decode_attention(q, k, v, batch, scale)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    gqa = q.shape[1] != k.shape[1]
    t0 = 0
    indptr = batch.kv_indptr.tolist()
    for i, (prefix, n) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
        ks, vs = k[indptr[i] : indptr[i + 1]], v[indptr[i] : indptr[i + 1]]
        qs = q[t0 : t0 + n]
        # query j sits at position prefix + j and may see keys 0 .. prefix + j
        mask = torch.arange(prefix + n, device=q.device)[None, :] <= (prefix + torch.arange(n, device=q.device))[:, None]
        out[t0 : t0 + n] = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=gqa
        ).transpose(0, 1)
        t0 += n
    return out


def _decode_attention(q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
    lens = batch.seq_lens
    max_len = max(batch.seq_lens_cpu)
    cols = torch.arange(max_len, device=q.device)
    valid = cols[None, :] < lens[:, None]
    rows = (batch.kv_indptr[:-1, None] + cols[None, :]).clamp_max(k.shape[0] - 1)
    kp, vp = k[rows], v[rows]  # [B, L, Hkv, D]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, Hq, 1, D]
        kp.transpose(1, 2),
        vp.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(2)
