"""Rows sorted per expert and padded into BLOCK_M tiles, on the device and without a host sync.

The GEMM kernel gives every BLOCK_M slots one expert. An Alignment says which row each slot holds
(`sorted_ids`, with `num_valid` as the padding sentinel), which expert each tile uses
(`block_expert`, -1 for a tile to skip) and how many slots are in use (`num_padded`, a one-element
device tensor, so no count ever travels to the host). The slot count itself is a worst-case bound
known from shapes alone, which keeps every launch grid static (CUDA-graph safe).

Sorting (token, k) pairs takes three small launches (decode pays for launches, not for work):
count pairs per expert in each chunk of pairs, scan the counts into slot offsets, place the pairs.
Up to ONE_LAUNCH_MAX_PAIRS pairs (a decode batch) one program does all three in registers. Within an
expert, pairs keep their order, so the result is deterministic.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

CHUNK = 128  # pairs per program when counting and placing
CHUNKS_PER_STEP = 16
TILES_PER_STEP = 32


@attrs.frozen
class Alignment:
    sorted_ids: torch.Tensor  # [num_slots] int32: the row each slot holds; num_valid on padding
    block_expert: torch.Tensor  # [num_slots // block_m] int32: the local expert of each tile, -1 to skip it
    num_padded: torch.Tensor  # [1] int32: slots in use; tiles from here on exit at once
    num_valid: int  # rows that exist; also the padding sentinel
    block_m: int
    direct: bool = False  # sorted_ids is topk_ids itself [tokens, top_k]: see align_direct
    top_k: int = 1

    @property
    def num_slots(self) -> int:
        return self.sorted_ids.numel()

    @property
    def num_tiles(self) -> int:
        """Row tiles of the GEMM grid: one per pair for a direct alignment."""
        return self.num_valid if self.direct else self.num_slots // self.block_m


DIRECT_MAX_PAIRS = 32  # beyond this, programs that find their expert owned by an earlier pair outnumber the work


def can_align_direct(num_tokens: int, top_k: int, block_m: int) -> bool:
    return num_tokens <= block_m and num_tokens * top_k <= DIRECT_MAX_PAIRS


def align_direct(topk_ids: torch.Tensor, block_m: int) -> Alignment:
    """No sort for a few tokens: the GEMM reads topk_ids [N, K] itself (N <= block_m), a program per pair.

    Each expert is computed by the program of its first pair, over a lane per token; decode thus
    skips the three alignment launches.
    """
    topk_ids = topk_ids.contiguous()
    num_tokens, top_k = topk_ids.shape
    if not can_align_direct(num_tokens, top_k, block_m):
        raise ValueError(f"a direct alignment takes at most {block_m} tokens and {DIRECT_MAX_PAIRS} pairs")
    ids = topk_ids.view(-1)  # also stands in for block_expert and num_padded, which a direct GEMM never reads
    return Alignment(ids, ids, ids, ids.numel(), block_m, direct=True, top_k=top_k)


def max_slots(num_rows: int, num_experts: int, block_m: int) -> int:
    """Padded slots needed at worst: each non-empty expert pads at most block_m - 1 rows."""
    return triton.cdiv(num_rows + min(num_experts, num_rows) * (block_m - 1), block_m) * block_m


@triton.jit
def _chunk_experts(topk_ids_ptr, num_pairs, CHUNK: tl.constexpr):
    pairs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    experts = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    return pairs, experts


@triton.jit
def _count_kernel(topk_ids_ptr, counts_ptr, sorted_ids_ptr, num_pairs, num_experts, num_slots, slots_per_program,
                  CHUNK: tl.constexpr, EXPERTS_PER_STEP: tl.constexpr, SLOTS_PER_STEP: tl.constexpr):
    """counts[chunk, e] = pairs of expert e in this chunk; also fills this program's share of slots with the sentinel."""
    chunk = tl.program_id(0)
    _, experts = _chunk_experts(topk_ids_ptr, num_pairs, CHUNK)
    for first in range(0, num_experts, EXPERTS_PER_STEP):
        expert = first + tl.arange(0, EXPERTS_PER_STEP)
        count = tl.sum((experts[:, None] == expert[None, :]).to(tl.int32), axis=0)
        tl.store(counts_ptr + chunk * num_experts + expert, count, mask=expert < num_experts)
    # Padding slots must hold the sentinel; the place kernel overwrites the slots pairs land in.
    for first in range(0, slots_per_program, SLOTS_PER_STEP):
        step = first + tl.arange(0, SLOTS_PER_STEP)
        slot = chunk * slots_per_program + step
        sentinel = tl.zeros((SLOTS_PER_STEP,), dtype=tl.int32) + num_pairs
        tl.store(sorted_ids_ptr + slot, sentinel, mask=(step < slots_per_program) & (slot < num_slots))


@triton.jit
def _store_tile_experts(end, is_expert, block_expert_ptr, num_experts, num_tiles, BLOCK_M: tl.constexpr,
                        TILES_PER_STEP: tl.constexpr):
    """block_expert[tile]: the number of experts whose slots (ending at `end`) end at or before the tile's first
    slot; -1 for a tile past every expert's slots."""
    end = tl.where(is_expert, end, 2147483647)
    for first in range(0, num_tiles, TILES_PER_STEP):
        tile = first + tl.arange(0, TILES_PER_STEP)
        owner = tl.sum((end[None, :] <= tile[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + tile, tl.where(owner < num_experts, owner, -1), mask=tile < num_tiles)


@triton.jit
def _scan_kernel(counts_ptr, expert_start_ptr, block_expert_ptr, num_padded_ptr,
                 num_chunks, num_experts, num_tiles,
                 BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr,
                 CHUNKS_PER_STEP: tl.constexpr, TILES_PER_STEP: tl.constexpr):
    """One program: counts become per-chunk offsets within each expert; experts get padded slot ranges."""
    expert = tl.arange(0, EXPERTS)
    expert_mask = expert < num_experts
    total = tl.zeros((EXPERTS,), dtype=tl.int32)
    for first in range(0, num_chunks, CHUNKS_PER_STEP):
        chunk = first + tl.arange(0, CHUNKS_PER_STEP)
        ptrs = counts_ptr + chunk[:, None] * num_experts + expert[None, :]
        mask = (chunk[:, None] < num_chunks) & expert_mask[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + total[None, :], mask=mask)
        total += tl.sum(counts, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    tl.store(expert_start_ptr + expert, end - padded, mask=expert_mask)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    _store_tile_experts(end, expert_mask, block_expert_ptr, num_experts, num_tiles, BLOCK_M, TILES_PER_STEP)


@triton.jit
def _place_kernel(topk_ids_ptr, counts_ptr, expert_start_ptr, sorted_ids_ptr, num_pairs, num_experts,
                  CHUNK: tl.constexpr):
    """sorted_ids[start of e + pairs of e in earlier chunks + earlier pairs of e in this chunk] = pair."""
    chunk = tl.program_id(0)
    pairs, experts = _chunk_experts(topk_ids_ptr, num_pairs, CHUNK)
    routed = experts >= 0
    lane = tl.arange(0, CHUNK)
    earlier_same = (experts[None, :] == experts[:, None]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    offset = tl.load(counts_ptr + chunk * num_experts + experts, mask=routed, other=0)
    start = tl.load(expert_start_ptr + experts, mask=routed, other=0)
    tl.store(sorted_ids_ptr + start + offset + rank, pairs, mask=routed)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Group the (token, k) pairs of topk_ids [N, K] per local expert; pairs with id -1 get no slot.

    Row r of the result is pair r = token * K + k.
    """
    device = topk_ids.device
    topk_ids = topk_ids.contiguous()
    num_pairs = topk_ids.numel()
    num_slots = max_slots(num_pairs, num_experts, block_m)
    num_chunks = triton.cdiv(num_pairs, CHUNK)
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    expert_start = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(num_slots, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_slots // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    experts_pow2 = triton.next_power_of_2(num_experts)
    if num_chunks:
        _count_kernel[(num_chunks,)](topk_ids, counts, sorted_ids, num_pairs, num_experts,
                                     num_slots, triton.cdiv(num_slots, num_chunks), CHUNK=CHUNK,
                                     EXPERTS_PER_STEP=min(experts_pow2, 64), SLOTS_PER_STEP=256)
    _scan_kernel[(1,)](counts, expert_start, block_expert, num_padded, num_chunks, num_experts,
                       block_expert.numel(), BLOCK_M=block_m, EXPERTS=experts_pow2,
                       CHUNKS_PER_STEP=CHUNKS_PER_STEP, TILES_PER_STEP=TILES_PER_STEP)
    if num_chunks:
        _place_kernel[(num_chunks,)](topk_ids, counts, expert_start, sorted_ids, num_pairs, num_experts, CHUNK=CHUNK)
    return Alignment(sorted_ids, block_expert, num_padded, num_pairs, block_m)


# pairs one program sorts in registers: a decode batch of 32 at top-8. The kernel takes up to 1024; whether its
# bitonic sort still beats three launches there is for a GPU run to say, so the default stays at what surely does
ONE_LAUNCH_MAX_PAIRS = 256
ONE_LAUNCH_LIMIT = 1024
ONE_LAUNCH_MAX_EXPERTS = 512


def can_align_in_one_launch(num_pairs: int, num_experts: int, max_pairs: int = ONE_LAUNCH_MAX_PAIRS) -> bool:
    return 0 < num_pairs <= min(max_pairs, ONE_LAUNCH_LIMIT) and num_experts <= ONE_LAUNCH_MAX_EXPERTS


@triton.jit
def _align_one_launch_kernel(topk_ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, shift_ptr,
                             num_pairs, num_experts, num_slots, num_tiles,
                             BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr,
                             SLOTS_PER_STEP: tl.constexpr, TILES_PER_STEP: tl.constexpr):
    """One program does align_pairs' three launches: count (a histogram), scan, and place (a sort of
    expert * PAIRS + pair keys, so a pair's slot is its sorted position shifted by its expert's padding)."""
    pair = tl.arange(0, PAIRS)
    expert_of = tl.load(topk_ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
    routed = expert_of >= 0
    # unrouted pairs and the padding lanes count in bin EXPERTS, past every expert
    counts = tl.histogram(tl.where(routed, expert_of, EXPERTS), 2 * EXPERTS)
    expert = tl.arange(0, 2 * EXPERTS)
    is_expert = expert < num_experts
    counts = tl.where(is_expert, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    # a pair's slot = its position among the sorted routed pairs + the padding of the experts before its own
    tl.store(shift_ptr + expert, end - padded - (tl.cumsum(counts, axis=0) - counts))
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    _store_tile_experts(end, is_expert, block_expert_ptr, num_experts, num_tiles, BLOCK_M, TILES_PER_STEP)
    for first in range(0, num_slots, SLOTS_PER_STEP):
        slot = first + tl.arange(0, SLOTS_PER_STEP)
        tl.store(sorted_ids_ptr + slot, tl.zeros((SLOTS_PER_STEP,), dtype=tl.int32) + num_pairs, mask=slot < num_slots)
    keys = tl.sort(tl.where(routed, expert_of * PAIRS + pair, 2147483647))
    placed = keys != 2147483647
    key_expert = tl.where(placed, keys // PAIRS, 0)
    tl.debug_barrier()  # the shifts and the sentinel fill are in memory before the placement reads and overwrites them
    shift = tl.load(shift_ptr + key_expert, mask=placed, other=0)
    tl.store(sorted_ids_ptr + pair + shift, keys % PAIRS, mask=placed)


def align_pairs_one_launch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """align_pairs for a few pairs (can_align_in_one_launch) in one launch instead of three; the same Alignment."""
    device = topk_ids.device
    topk_ids = topk_ids.contiguous()
    num_pairs = topk_ids.numel()
    if not can_align_in_one_launch(num_pairs, num_experts, ONE_LAUNCH_LIMIT):
        raise ValueError(f"one launch aligns 1 to {ONE_LAUNCH_LIMIT} pairs over at most {ONE_LAUNCH_MAX_EXPERTS} "
                         f"experts; got {num_pairs} pairs and {num_experts} experts")
    num_slots = max_slots(num_pairs, num_experts, block_m)
    experts_pow2 = triton.next_power_of_2(num_experts)
    sorted_ids = torch.empty(num_slots, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_slots // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    shift = torch.empty(2 * experts_pow2, dtype=torch.int32, device=device)
    _align_one_launch_kernel[(1,)](topk_ids, sorted_ids, block_expert, num_padded, shift, num_pairs, num_experts,
                                   num_slots, block_expert.numel(), BLOCK_M=block_m,
                                   PAIRS=triton.next_power_of_2(num_pairs), EXPERTS=experts_pow2,
                                   SLOTS_PER_STEP=1024, TILES_PER_STEP=TILES_PER_STEP, num_warps=8)
    return Alignment(sorted_ids, block_expert, num_padded, num_pairs, block_m)


def can_align_in_place(num_rows: int, group_rows: int, block_m: int) -> bool:
    """Rows already grouped per expert in groups of `group_rows` need no sorting when tiles never straddle groups."""
    return group_rows % block_m == 0 and num_rows % block_m == 0


def align_in_place(expert_index: torch.Tensor, block_m: int) -> Alignment:
    """Rows already grouped per expert (-1 on padding rows), each group a multiple of block_m rows long.

    Every slot holds its own row; a tile's expert is the one its valid rows share.
    """
    num_rows = expert_index.numel()
    rows = torch.arange(num_rows, dtype=torch.int32, device=expert_index.device)
    sorted_ids = torch.where(expert_index >= 0, rows, num_rows)
    block_expert = expert_index.view(-1, block_m).amax(1).to(torch.int32)
    num_padded = torch.full((1,), num_rows, dtype=torch.int32, device=expert_index.device)
    return Alignment(sorted_ids.to(torch.int32), block_expert, num_padded, num_rows, block_m)
