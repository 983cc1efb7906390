"""Turning scheduled work (new tokens, cached prefix, page table per request) into a ForwardBatch."""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from .forward_batch import ForwardBatch, ForwardMode
from .kv_cache import KVPool


@attrs.frozen
class ScheduledSeq:
    """One request's part of a step: `new_tokens` at positions prefix_len .. prefix_len+len-1."""

    new_tokens: Sequence[int]
    prefix_len: int
    pages: Sequence[int]  # must already cover prefix_len + len(new_tokens) tokens


def build_forward_batch(seqs: Sequence[ScheduledSeq], kv: KVPool, device: torch.device | str) -> ForwardBatch:
    if not seqs:
        return ForwardBatch.idle(device)
    extend_lens = tuple(len(s.new_tokens) for s in seqs)
    prefix_lens = tuple(s.prefix_len for s in seqs)
    decode = all(n == 1 for n in extend_lens) and all(p > 0 for p in prefix_lens)
    mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
    input_ids = torch.tensor([t for s in seqs for t in s.new_tokens], dtype=torch.int64)
    positions = torch.cat([torch.arange(s.prefix_len, s.prefix_len + len(s.new_tokens)) for s in seqs])
    out_cache_loc = torch.cat([kv.slots(s.pages, s.prefix_len, s.prefix_len + len(s.new_tokens)) for s in seqs])
    kv_indices = torch.cat([kv.slots(s.pages, 0, s.prefix_len + len(s.new_tokens)) for s in seqs])
    seq_lens = torch.tensor([p + n for p, n in zip(prefix_lens, extend_lens)], dtype=torch.int64)
    kv_indptr = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    kv_indptr[1:] = seq_lens.cumsum(0)
    return ForwardBatch(
        mode=mode,
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        out_cache_loc=out_cache_loc.to(device),
        seq_lens=seq_lens.to(device),
        extend_lens=extend_lens,
        prefix_lens=prefix_lens,
        kv_indices=kv_indices.to(device),
        kv_indptr=kv_indptr.to(device),
    )
