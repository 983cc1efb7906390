"""Turning scheduled work (new tokens, cached prefix, page table per request) into a ForwardBatch."""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np
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


def build_forward_batch(seqs: Sequence[ScheduledSeq], kv: KVPool, device: torch.device | str,
                        rows: bool = False) -> ForwardBatch:
    """All index arrays are computed at once over a padded page table (no per-request tensor ops). `rows`: the
    seqs are decode rows of one token each, a DECODE batch even where a row is a sequence's first token.

    They are built in numpy: torch's CPU ops on arrays this small fork its intra-op thread pool,
    which costs milliseconds a step when other processes (an HTTP front end, clients) hold cores.
    """
    if not seqs:
        return ForwardBatch.idle(device)
    extend_lens = tuple(len(s.new_tokens) for s in seqs)
    prefix_lens = tuple(s.prefix_len for s in seqs)
    decode = all(n == 1 for n in extend_lens) and (rows or all(p > 0 for p in prefix_lens))
    batch_size = len(seqs)

    table = np.zeros((batch_size, max(len(s.pages) for s in seqs)), dtype=np.int64)
    for row, s in enumerate(seqs):
        table[row, : len(s.pages)] = s.pages
    slots = (table[:, :, None] * kv.page_size + np.arange(kv.page_size)).reshape(batch_size, -1)
    extend, prefix = np.array(extend_lens, dtype=np.int64), np.array(prefix_lens, dtype=np.int64)
    seq_lens = prefix + extend
    kv_indices = slots[np.arange(slots.shape[1])[None, :] < seq_lens[:, None]]

    owner = np.repeat(np.arange(batch_size), extend)  # request of each new token
    first = np.cumsum(extend) - extend
    positions = prefix[owner] + np.arange(owner.size) - first[owner]
    kv_indptr = np.zeros(batch_size + 1, dtype=np.int64)
    kv_indptr[1:] = np.cumsum(seq_lens)
    input_ids = np.fromiter((t for s in seqs for t in s.new_tokens), dtype=np.int64, count=owner.size)
    arrays = (input_ids, positions, slots[owner, positions], seq_lens, kv_indices, kv_indptr, table)
    on_device = to_device(device, *(torch.from_numpy(a) for a in arrays))
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

