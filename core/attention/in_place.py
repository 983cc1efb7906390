"""CPU decode attention that reads the paged KV cache in place: moeplex's C++ kernel (kernels/csrc/paged_decode.cpp),
one pass over each request's cached rows through its slot indices, online softmax, parallel over (request, KV head).

It is one of the ways PagedGather times on CPU (beside gathering each request's rows for SDPA), offered only where
the kernel builds on this machine and takes the cache's shapes. On a processor with Intel AMX the same kernel runs
bf16 decodes on the tile unit as a way of its own (`in_place_tiles`), timed beside the vector one."""

from __future__ import annotations

import torch

from ..forward_batch import ForwardBatch
from ..kernels import cpu_ext

KERNEL = "paged_decode"


def in_place_takes(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the kernel runs these caches (fp32/bf16, rows contiguous) and builds on this machine."""
    return (
        q.device.type == "cpu"
        and key_cache.dtype == value_cache.dtype
        and key_cache.dtype in (torch.float32, torch.bfloat16)
        and key_cache.stride(-1) == 1
        and value_cache.stride(-1) == 1
        and cpu_ext.load_kernel(KERNEL)
    )


def tiles_take(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the kernel's tile-unit form runs these (AMX granted to the process, bf16 queries and KV, widths of
    whole 32-column chunks, at most 16 query heads per KV head)."""
    return in_place_takes(q, key_cache, value_cache) and cpu_ext.ops(KERNEL).paged_decode_tiles_take(
        q, key_cache, value_cache)


def decode_in_place(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: ForwardBatch, scale: float,
    tiles: bool = False,
) -> torch.Tensor:
    """q [B, Hq, D] against each request's cached rows -> [B, Hq, Dv] in q's dtype (accumulated in fp32); with
    `tiles` on the AMX tile unit (tiles_take)."""
    q = q if q.dtype in (torch.float32, torch.bfloat16) else q.float()  # bf16 q: its own values feed bf16 dot products
    out = cpu_ext.ops(KERNEL).paged_decode(
        q.contiguous(), key_cache, value_cache, batch.kv_indices.long().contiguous(),
        batch.kv_indptr.long().contiguous(), float(scale), tiles,
    )
    return out.to(q.dtype)
