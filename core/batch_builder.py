"""Turning scheduled work (new tokens, cached prefix, page table per request) into a ForwardBatch."""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from .forward_batch import ForwardBatch, ForwardMode
from .kv_cache import KVPool
from .transfer import to_device


@attrs.frozen
class ScheduledSeq:
    """One request's part of a step: `new_tokens` at positions prefix_len .. prefix_len+len-1."""

    new_tokens: Sequence[int]
    prefix_len: int
    pages: Sequence[int]  # must already cover prefix_len + len(new_tokens) tokens


def build_forward_batch(seqs: Sequence[ScheduledSeq], kv: KVPool, device: torch.device | str) -> ForwardBatch:
    """All index tensors are computed at once over a padded page table (no per-request tensor ops)."""
    if not seqs:
        return ForwardBatch.idle(device)
    extend_lens = tuple(len(s.new_tokens) for s in seqs)
    prefix_lens = tuple(s.prefix_len for s in seqs)
    decode = all(n == 1 for n in extend_lens) and all(p > 0 for p in prefix_lens)
    batch_size = len(seqs)

    max_pages = max(len(s.pages) for s in seqs)
    table = torch.tensor([list(s.pages) + [0] * (max_pages - len(s.pages)) for s in seqs], dtype=torch.int64)
    slots = (table[:, :, None] * kv.page_size + torch.arange(kv.page_size)).view(batch_size, -1)
    seq_lens = torch.tensor(prefix_lens, dtype=torch.int64) + torch.tensor(extend_lens, dtype=torch.int64)
    kv_indices = slots[torch.arange(slots.shape[1])[None, :] < seq_lens[:, None]]

    extend = torch.tensor(extend_lens, dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(batch_size), extend)  # request of each new token
    first = torch.cumsum(extend, 0) - extend
    positions = torch.tensor(prefix_lens, dtype=torch.int64)[owner] + torch.arange(owner.numel()) - first[owner]
    kv_indptr = torch.zeros(batch_size + 1, dtype=torch.int64)
    kv_indptr[1:] = seq_lens.cumsum(0)
    input_ids = torch.tensor([t for s in seqs for t in s.new_tokens], dtype=torch.int64)
    on_device = to_device(device, input_ids, positions, slots[owner, positions], seq_lens, kv_indices, kv_indptr, table)
    input_ids, positions, out_cache_loc, seq_lens, kv_indices, kv_indptr, table = on_device
    return ForwardBatch(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        seq_lens=seq_lens,
        extend_lens=extend_lens,
        prefix_lens=prefix_lens,
        kv_indices=kv_indices,
        kv_indptr=kv_indptr,
        page_table=table,
        page_size=kv.page_size,
    )

