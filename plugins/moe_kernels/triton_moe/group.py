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

`align_local_pairs` pads each expert's group to whole tiles and hands the same grouping over as an Alignment, so
the Triton kernel's gated GEMM 1 can read the rows by index (no gather) and write its SiLU-and-multiply output at
the grouped rows, where torch._grouped_mm's GEMM 2 reads them (fused.py).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from .align import Alignment, max_slots

CHUNK = 128  # pairs per program; place compares every pair of a chunk with every other (CHUNK^2 lanes)
EXPERTS_PER_STEP = 64  # experts place sums over per step, bounding its [CHUNK, experts] registers
TILES_PER_STEP = 64  # tiles whose expert program 0 finds at once (align_local_pairs)


@attrs.frozen
class LocalPairs:
    """Where each local pair goes in expert-grouped order, and where each expert's group ends."""

    token: torch.Tensor  # [rows] int32: the token of each grouped row; -1 on rows no pair fills
    pair_row: torch.Tensor  # [N * K] int32: the grouped row of each pair; -1 for pairs not local
    offs: torch.Tensor  # [experts] int32: the end row of each expert's group (torch._grouped_mm's offs)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, num_chunks, CHUNK: tl.constexpr, EXPERTS: tl.constexpr):
    """counts[e, chunk] = local pairs of expert e in this chunk."""
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    local = (experts >= 0) & (experts < num_experts)
    counts = tl.histogram(tl.where(local, experts, EXPERTS), 2 * EXPERTS)  # bin EXPERTS: past every expert
    expert = tl.arange(0, 2 * EXPERTS)
    tl.store(counts_ptr + expert * num_chunks + chunk, counts, mask=expert < num_experts)


@triton.jit
def _padded_totals(cum_ptr, first, num_experts, num_chunks, TILE: tl.constexpr, EXPERTS_PER_STEP: tl.constexpr):
    """Experts first.. (a step of them): their ids, and their pairs rounded up to whole tiles (the last column of
    cum is every expert's total)."""
    expert = first + tl.arange(0, EXPERTS_PER_STEP)
    total = tl.load(cum_ptr + expert * num_chunks + num_chunks - 1, mask=expert < num_experts, other=0)
    return expert, (total + TILE - 1) // TILE * TILE


@triton.jit
def _place_kernel(ids_ptr, cum_ptr, row_ptr, pair_row_ptr, offs_ptr, block_expert_ptr, num_pairs, num_experts,
                  num_chunks, num_rows, num_tiles, row_div, TILE: tl.constexpr, CHUNK: tl.constexpr,
                  EXPERTS_PER_STEP: tl.constexpr, TILES_PER_STEP: tl.constexpr):
    """pair_row[pair] and row[its row] = pair // row_div for this chunk's pairs; program 0 also writes each
    expert's end row and, when TILE > 1, the expert of each tile."""
    chunk = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    pairs = chunk * CHUNK + lane
    in_range = pairs < num_pairs
    experts = tl.load(ids_ptr + pairs, mask=in_range, other=-1).to(tl.int32)
    local = (experts >= 0) & (experts < num_experts)
    # rows of the experts before each pair's own, each expert's rows padded to whole tiles
    expert_start = tl.zeros((CHUNK,), dtype=tl.int32)
    end = tl.zeros((EXPERTS_PER_STEP,), dtype=tl.int32)  # the experts' rows so far, in every lane
    for first in range(0, num_experts, EXPERTS_PER_STEP):
        expert, padded = _padded_totals(cum_ptr, first, num_experts, num_chunks, TILE, EXPERTS_PER_STEP)
        expert_start += tl.sum(tl.where(expert[None, :] < experts[:, None], padded[None, :], 0), axis=1)
        # a host count below the true one must not let a group end past the rows there are
        ends = tl.minimum(end + tl.cumsum(padded, axis=0), num_rows)
        tl.store(offs_ptr + expert, ends, mask=expert + chunk * num_experts < num_experts)  # program 0 only
        end += tl.sum(padded, axis=0)
    if TILE > 1:
        if chunk == 0:  # a tile's expert: the experts whose rows end at or before its first row
            for first_tile in range(0, num_tiles, TILES_PER_STEP):
                tile = first_tile + tl.arange(0, TILES_PER_STEP)
                owner = tl.zeros((TILES_PER_STEP,), dtype=tl.int32)
                rows_before = tl.zeros((EXPERTS_PER_STEP,), dtype=tl.int32)
                for step in range(0, num_experts, EXPERTS_PER_STEP):
                    step_expert, step_padded = _padded_totals(cum_ptr, step, num_experts, num_chunks, TILE,
                                                              EXPERTS_PER_STEP)
                    step_ends = rows_before + tl.cumsum(step_padded, axis=0)
                    done = (step_ends[None, :] <= tile[:, None] * TILE) & (step_expert[None, :] < num_experts)
                    owner += tl.sum(done.to(tl.int32), axis=1)
                    rows_before += tl.sum(step_padded, axis=0)
                tl.store(block_expert_ptr + tile, tl.where(owner < num_experts, owner, -1), mask=tile < num_tiles)
    # pairs of the same expert in earlier chunks (pairs >= CHUNK: chunk > 0)
    earlier_chunks = tl.load(cum_ptr + experts * num_chunks + chunk - 1, mask=local & (pairs >= CHUNK), other=0)
    earlier_same = (experts[None, :] == experts[:, None]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    row = expert_start + earlier_chunks + rank
    placed = local & (row < num_rows)
    tl.store(row_ptr + row, pairs // row_div, mask=placed)
    tl.store(pair_row_ptr + pairs, tl.where(placed, row, -1), mask=in_range)


def _place_pairs(topk_ids: torch.Tensor, num_experts: int, num_rows: int, tile: int, row_div: int, fill: int):
    """rows [num_rows] (pair // row_div, `fill` on rows no pair fills), pair_row, offs and, when tile > 1,
    block_expert [num_rows // tile]."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1).contiguous()
    num_pairs = ids.numel()
    num_chunks = triton.cdiv(num_pairs, CHUNK)
    rows = torch.full((num_rows,), fill, dtype=torch.int32, device=device)
    pair_row = torch.empty(num_pairs, dtype=torch.int32, device=device)
    offs = torch.zeros(num_experts, dtype=torch.int32, device=device)
    block_expert = torch.full((num_rows // tile if tile > 1 else 0,), -1, dtype=torch.int32, device=device)
    if num_chunks == 0:
        return rows, pair_row, offs, block_expert
    counts = torch.empty(num_experts, num_chunks, dtype=torch.int32, device=device)
    _count_kernel[(num_chunks,)](ids, counts, num_pairs, num_experts, num_chunks, CHUNK=CHUNK,
                                 EXPERTS=triton.next_power_of_2(num_experts))
    cum = torch.cumsum(counts, 1, dtype=torch.int32)
    per_step = min(triton.next_power_of_2(num_experts), EXPERTS_PER_STEP)
    _place_kernel[(num_chunks,)](ids, cum, rows, pair_row, offs, block_expert, num_pairs, num_experts, num_chunks,
                                 num_rows, block_expert.numel(), row_div, TILE=tile, CHUNK=CHUNK,
                                 EXPERTS_PER_STEP=per_step, TILES_PER_STEP=TILES_PER_STEP)
    return rows, pair_row, offs, block_expert


def group_local_pairs(topk_ids: torch.Tensor, num_experts: int, num_rows: int) -> LocalPairs:
    """Group the pairs of topk_ids [N, K] whose id is a local expert (0 <= id < num_experts) by expert.

    `num_rows` is the host's count of local pairs, or an upper bound on it (rows past the true count get
    token -1); a count below the true one drops the pairs past it rather than write out of bounds.
    """
    top_k = topk_ids.shape[-1] if topk_ids.dim() else 1
    token, pair_row, offs, _ = _place_pairs(topk_ids, num_experts, min(num_rows, topk_ids.numel()), 1, top_k, -1)
    return LocalPairs(token, pair_row, offs)


def align_local_pairs(topk_ids: torch.Tensor, num_experts: int, num_rows: int, block_m: int) -> tuple[Alignment, LocalPairs]:
    """group_local_pairs with every expert's group padded to whole tiles of block_m rows, as the grouped GEMM
    kernel reads them: the Alignment's slots hold pairs (row r of A: pair r // top_k), its sentinel on padding;
    the LocalPairs' `offs` are the padded groups' ends (the padding rows are the GEMM's zeros) and its `token`
    is the Alignment's slots. The slots are the worst case for `num_rows` local pairs; the groups end before.
    """
    num_pairs = topk_ids.numel()
    num_slots = max_slots(min(num_rows, num_pairs), num_experts, block_m)
    slots, pair_row, offs, block_expert = _place_pairs(topk_ids, num_experts, num_slots, block_m, 1, num_pairs)
    align = Alignment(slots, block_expert, offs[-1:] if num_experts else offs, num_pairs, block_m)
    return align, LocalPairs(slots, pair_row, offs)
