"""The `triton` attention backend: split-K decode kernels over the paged cache, torch SDPA for extend."""

from __future__ import annotations

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from .backend import AttentionBackend
from .triton_decode import _split_kernel, decode_attention, head_blocks, merge_counters_needed

# Triton decides when it decorates a kernel whether it compiles it or interprets it on the CPU
INTERPRETED = isinstance(_split_kernel, InterpretedFunction)


class TritonAttention(AttentionBackend):
    """Decode in Triton; the split count fills the GPU even at batch 1 (flash-decoding).

    `target_programs`: programs one decode launch should have (default: two per streaming
    multiprocessor); a split is at least `min_split_tokens` long, and there are at most `max_splits`.
    `merge_in_split_kernel`: the last split to finish merges the splits (one launch), rather than a
    reduce kernel after the split kernel (two); the counters that takes are this backend's, and
    every layer's decode launches one after another on one stream, so they never share one at once.
    Off by default: on the H200 the merged launch made graph-replayed batch-1 decode 7.9% slower on
    Qwen3-30B-A3B shapes and 3.9% on DeepSeek-V3's (1.4% at batch 8; the last split waits for every
    other split of its request: benchmarks/results/e2e_h200.md, "launch cuts, one at a time").
    """

    name = "triton"
    graph_safe = True

    def __init__(
        self,
        device: torch.device | str,
        dtype: torch.dtype,
        max_splits: int = 32,
        min_split_tokens: int = 64,
        target_programs: int | None = None,
        block_n: int | None = None,
    ):
        device = torch.device(device)
        if device.type != "cuda" and not INTERPRETED:
            raise ValueError("the triton attention backend needs a CUDA GPU; here use --attention-backend torch")
        if INTERPRETED and dtype == torch.bfloat16:
            raise ValueError("Triton's CPU interpreter computes bf16 wrongly; use fp32, fp16 or --attention-backend torch")
        if target_programs is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
            target_programs = 2 * sms
        self.max_splits, self.min_split_tokens, self.target_programs = max_splits, min_split_tokens, target_programs
        self.block_n = block_n
        self.merge_in_split_kernel = False
        # every counter buffer made stays alive: a captured CUDA graph keeps the address it was given
        self._counters: list[torch.Tensor] = []

    def merge_counters(self, needed: int, device: torch.device) -> torch.Tensor:
        """At least `needed` int32 zeros on `device`, made once (larger when a larger batch needs more)."""
        for counters in reversed(self._counters):
            if counters.numel() >= needed and counters.device == device:
                return counters
        self._counters.append(torch.zeros(max(needed, 1024), dtype=torch.int32, device=device))
        return self._counters[-1]

    def num_splits(self, batch_size: int, programs_per_request: int, longest: int) -> int:
        """Enough splits to reach the target program count, none shorter than min_split_tokens."""
        by_occupancy = triton.cdiv(self.target_programs, max(1, batch_size * programs_per_request))
        by_length = triton.cdiv(max(longest, 1), self.min_split_tokens)
        return max(1, min(self.max_splits, by_occupancy, by_length))

    def decode(self, q, key_cache, value_cache, batch, scale):
        if batch.page_table is None:
            raise ValueError("the triton attention backend reads the batch's page table, and this batch has none")
        num_kv_heads = key_cache.shape[1]
        programs = num_kv_heads * head_blocks(q.shape[1], num_kv_heads)
        # the CPU-side lengths: a captured graph's batch claims the longest sequence it may replay
        splits = self.num_splits(batch.batch_size, programs, max(batch.seq_lens_cpu, default=0))
        counters = None
        if self.merge_in_split_kernel and splits > 1:
            counters = self.merge_counters(merge_counters_needed(q.shape[0], q.shape[1], num_kv_heads), q.device)
        return decode_attention(
            q, key_cache, value_cache, batch.page_table, batch.seq_lens, batch.page_size, scale, splits, self.block_n,
            counters,
        )
