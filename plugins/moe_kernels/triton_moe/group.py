"""The local (token, k) pairs grouped per expert by a counting sort: O(pairs), no sort of all ids, no host sync.

torch._grouped_mm wants each expert's rows contiguous and each group's end offset. Under EP with global routing a
rank holds about 1/ep_size of each row's top-k; an argsort of all N x K ids to find them (with an atomic count of
the pairs elsewhere into one bin) cost more than the library GEMMs gained over the fused kernel (EP8, M=16384 on
the H200: benchmarks/results/fused_moe_h200_routing.md). Here each id is read twice, by two launches around a
cumsum:

- count: each chunk of CHUNK pairs counts its local pairs per expert (a histogram in registers, no atomics);
  a cumsum over the chunks (torch, along the inner dimension, where its scan is parallel) gives every chunk the
  pairs of each expert in the chunks up to it;
- place: a pair's row = the pairs of the experts before its own + its expert's pairs in earlier chunks + its
  expert's earlier pairs in its chunk.

Pairs thus keep their order within an expert (a stable argsort's order): the result is deterministic.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

CHUNK = 128  # pairs per program; place compares every pair of a chunk with every other (CHUNK^2 lanes)
EXPERTS_PER_STEP = 64  # experts place sums over per step, bounding its [CHUNK, experts] registers


@attrs.frozen
class LocalPairs:
    """Where each local pair goes in expert-grouped order, and where each expert's group ends."""

    token: torch.Tensor  # [rows] int32: the token of each grouped row; -1 on rows no pair fills
    pair_row: torch.Tensor  # [N * K] int32: the grouped row of each pair; -1 for pairs not local
    offs: torch.Tensor  # [experts] int32: the end row of each expert's group (torch._grouped_mm's offs)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, token_ptr, num_pairs, num_experts, num_chunks, num_rows, rows_per_program,
                  CHUNK: tl.constexpr, EXPERTS: tl.constexpr):
    """counts[e, chunk] = local pairs of expert e in this chunk; also marks this program's share of rows unfilled."""
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    local = (experts >= 0) & (experts < num_experts)
    counts = tl.histogram(tl.where(local, experts, EXPERTS), 2 * EXPERTS)  # bin EXPERTS: past every expert
    expert = tl.arange(0, 2 * EXPERTS)
    tl.store(counts_ptr + expert * num_chunks + chunk, counts, mask=expert < num_experts)
    # rows_per_program <= CHUNK, since rows <= pairs; place overwrites the rows pairs land in
    step = tl.arange(0, CHUNK)
    row = chunk * rows_per_program + step
    tl.store(token_ptr + row, tl.full((CHUNK,), -1, tl.int32), mask=(step < rows_per_program) & (row < num_rows))


@triton.jit
def _place_kernel(ids_ptr, cum_ptr, token_ptr, pair_row_ptr, offs_ptr, num_pairs, num_experts, num_chunks, num_rows,
                  top_k, CHUNK: tl.constexpr, EXPERTS_PER_STEP: tl.constexpr):
    """pair_row[pair] and token[row] for this chunk's pairs; program 0 also writes each expert's end row."""
    chunk = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    pairs = chunk * CHUNK + lane
    in_range = pairs < num_pairs
    experts = tl.load(ids_ptr + pairs, mask=in_range, other=-1).to(tl.int32)
    local = (experts >= 0) & (experts < num_experts)
    # rows of the experts before each pair's own, from every expert's total (the last column of cum)
    expert_start = tl.zeros((CHUNK,), dtype=tl.int32)
    end = tl.zeros((EXPERTS_PER_STEP,), dtype=tl.int32)  # the experts' rows so far, in every lane
    for first in range(0, num_experts, EXPERTS_PER_STEP):
        expert = first + tl.arange(0, EXPERTS_PER_STEP)
        total = tl.load(cum_ptr + expert * num_chunks + num_chunks - 1, mask=expert < num_experts, other=0)
        expert_start += tl.sum(tl.where(expert[None, :] < experts[:, None], total[None, :], 0), axis=1)
        # a host count below the true one must not let a group end past the rows there are
        ends = tl.minimum(end + tl.cumsum(total, axis=0), num_rows)
        tl.store(offs_ptr + expert, ends, mask=expert + chunk * num_experts < num_experts)  # program 0 only
        end += tl.sum(total, axis=0)
    # pairs of the same expert in earlier chunks (pairs >= CHUNK: chunk > 0)
    earlier_chunks = tl.load(cum_ptr + experts * num_chunks + chunk - 1, mask=local & (pairs >= CHUNK), other=0)
    earlier_same = (experts[None, :] == experts[:, None]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    row = expert_start + earlier_chunks + rank
    placed = local & (row < num_rows)
    tl.store(token_ptr + row, pairs // top_k, mask=placed)
    tl.store(pair_row_ptr + pairs, tl.where(placed, row, -1), mask=in_range)


def group_local_pairs(topk_ids: torch.Tensor, num_experts: int, num_rows: int) -> LocalPairs:
    """Group the pairs of topk_ids [N, K] whose id is a local expert (0 <= id < num_experts) by expert.

    `num_rows` is the host's count of local pairs, or an upper bound on it (rows past the true count get
    token -1); a count below the true one drops the pairs past it rather than write out of bounds.
    """
    device = topk_ids.device
    top_k = topk_ids.shape[-1] if topk_ids.dim() else 1
    ids = topk_ids.reshape(-1).contiguous()
    num_pairs = ids.numel()
    num_rows = min(num_rows, num_pairs)
    num_chunks = triton.cdiv(num_pairs, CHUNK)
    token = torch.empty(num_rows, dtype=torch.int32, device=device)
    pair_row = torch.empty(num_pairs, dtype=torch.int32, device=device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=device)
    if num_chunks == 0:
        return LocalPairs(token, pair_row, offs.zero_())
    counts = torch.empty(num_experts, num_chunks, dtype=torch.int32, device=device)
    _count_kernel[(num_chunks,)](ids, counts, token, num_pairs, num_experts, num_chunks, num_rows,
                                 triton.cdiv(num_rows, num_chunks), CHUNK=CHUNK,
                                 EXPERTS=triton.next_power_of_2(num_experts))
    cum = torch.cumsum(counts, 1, dtype=torch.int32)
    per_step = min(triton.next_power_of_2(num_experts), EXPERTS_PER_STEP)
    _place_kernel[(num_chunks,)](ids, cum, token, pair_row, offs, num_pairs, num_experts, num_chunks, num_rows, top_k,
                                 CHUNK=CHUNK, EXPERTS_PER_STEP=per_step)
    return LocalPairs(token, pair_row, offs)
