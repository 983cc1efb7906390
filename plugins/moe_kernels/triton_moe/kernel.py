"""The grouped GEMM both expert projections run on.

C[row] = A[row] @ B[e].T for every row routed to expert e. Rows reach the kernel through an
Alignment (align.py): `sorted_ids` lists them grouped per expert, each group padded to whole tiles
with a sentinel, so every tile has one expert and streams that expert's weights once.
A tile is BLOCK_M + TAIL_M slots with the rows first. A program runs it at the height its rows
need: TAIL_M rows, BLOCK_M rows, or both parts at once, each weight tile loaded once into both
dots. An expert whose rows just pass BLOCK_M (DeepSeek-V3 prefill puts ~130 rows on each) thus
costs one program and one pass over its weights instead of a second, nearly empty tile that
streams them all again.
A direct Alignment (few tokens) skips the sort: program m takes pair m's expert unless an earlier
pair has it, and its rows are every token routed to that expert, one lane per token.
B is [E, N, K] row-major like nn.Linear; in the fp8 block format it comes with one fp32 scale per
128x128 block, and A with one scale per row per 128 columns (DeepSeek-V3's w8a8). B tiles load
through a tensor descriptor (the Hopper copy engine) when the tile asks for it, else through pointers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeplex.interfaces.kernels import BLOCK as SCALE_BLOCK

from .align import Alignment
from .configs import TileConfig


@triton.jit
def _tile_coords(num_pid_m, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row tiles sweep the columns together, so their A rows stay in L2."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_rows
    pid_n = (pid % pids_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _scaled_dot(a, b, a_scale, b_scale, FP8_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if FP8_BLOCK:
        # One K tile lies inside one 128-wide scale group, so the scales factor out of the dot.
        return tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    else:
        return tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION)


@triton.jit
def _a_tile(a_ptrs, row_mask, k_mask, EVEN_K: tl.constexpr):
    if EVEN_K:  # no K mask: the loads stay full-width vectors
        return tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
    else:
        return tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def _b_tile(b_ptrs, b_desc, b_row, kb, k_mask, B_TMA: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_K, BLOCK_N] of B: rows b_row.. of the [E * rows, K] weights through the descriptor, or at b_ptrs."""
    if B_TMA:  # rows past the tensor and columns past K come back as zeros
        return b_desc.load([b_row, kb * BLOCK_K]).T
    elif EVEN_K:
        return tl.load(b_ptrs)
    else:
        return tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)


@triton.jit
def _accumulate(a_ptr, b_ptr, b_desc, a_scale_ptr, b_scale_ptr, a_rows, row_mask, x_rows, x_mask, expert, pid_n, N, K,
                stride_am, stride_ak, stride_be, stride_bn, stride_bk,
                stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                GATED: tl.constexpr, FP8_BLOCK: tl.constexpr, SCALE_BLOCK: tl.constexpr, EVEN_K: tl.constexpr,
                B_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, X_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K loop in fp32: A rows x B tile (x the up-projection B tile too when GATED, then SiLU(gate) * up).

    With X_M > 0, X_M more rows (x_rows) share every B tile loaded; both results come back.
    """
    ks = tl.arange(0, BLOCK_K)
    # Columns past N wrap onto real weight rows so pointer loads of B need no mask; they are never stored.
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)) % N
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk
    up_offset = N * stride_bn  # the up rows follow the N gate rows
    b_row = (expert * (2 * N if GATED else N) + pid_n * BLOCK_N).to(tl.int32)
    a_scale_ptrs = a_scale_ptr + a_rows * stride_asm
    b_scale_ptrs = b_scale_ptr + expert * stride_bse + (cols // SCALE_BLOCK) * stride_bsn
    up_scale_ptrs = b_scale_ptr + expert * stride_bse + ((cols + N) // SCALE_BLOCK) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if X_M > 0:
        x_ptrs = a_ptr + x_rows[:, None] * stride_am + ks[None, :] * stride_ak
        x_scale_ptrs = a_scale_ptr + x_rows * stride_asm
        acc_x = tl.zeros((X_M, BLOCK_N), dtype=tl.float32)
        acc_x_up = tl.zeros((X_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = ks < K - kb * BLOCK_K
        a = _a_tile(a_ptrs, row_mask, k_mask, EVEN_K)
        b = _b_tile(b_ptrs, b_desc, b_row, kb, k_mask, B_TMA, EVEN_K, BLOCK_K)
        a_scale = 1.0
        b_scale = 1.0
        up_scale = 1.0
        x_scale = 1.0
        if FP8_BLOCK:
            group = kb * BLOCK_K // SCALE_BLOCK
            a_scale = tl.load(a_scale_ptrs + group * stride_ask, mask=row_mask, other=0.0)
            b_scale = tl.load(b_scale_ptrs + group * stride_bsk)
            up_scale = tl.load(up_scale_ptrs + group * stride_bsk)
        acc += _scaled_dot(a, b, a_scale, b_scale, FP8_BLOCK, DOT_PRECISION)
        if GATED:
            b_up = _b_tile(b_ptrs + up_offset, b_desc, b_row + N, kb, k_mask, B_TMA, EVEN_K, BLOCK_K)
            acc_up += _scaled_dot(a, b_up, a_scale, up_scale, FP8_BLOCK, DOT_PRECISION)
        if X_M > 0:
            x = _a_tile(x_ptrs, x_mask, k_mask, EVEN_K)
            if FP8_BLOCK:
                x_scale = tl.load(x_scale_ptrs + group * stride_ask, mask=x_mask, other=0.0)
            acc_x += _scaled_dot(x, b, x_scale, b_scale, FP8_BLOCK, DOT_PRECISION)
            if GATED:
                acc_x_up += _scaled_dot(x, b_up, x_scale, up_scale, FP8_BLOCK, DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_ak
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # SiLU(gate) * up
        if X_M > 0:
            acc_x = acc_x * tl.sigmoid(acc_x) * acc_x_up
    if X_M == 0:
        acc_x = acc  # nothing more was asked for
    return acc, acc_x


@triton.jit
def _store_rows(c_ptr, routed_weight_ptr, acc, rows, row_mask, slots, num_slots, cols, N, stride_cm, stride_cn,
                MUL_ROUTED_WEIGHT: tl.constexpr, IN_PLACE: tl.constexpr):
    """Rows of C at their rows, or at their slots when IN_PLACE (padding slots get their zero rows too)."""
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(routed_weight_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    if IN_PLACE:
        c_ptrs = c_ptr + slots[:, None] * stride_cm + cols[None, :] * stride_cn
        c_mask = (slots[:, None] < num_slots) & (cols[None, :] < N)
    else:
        c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
        c_mask = row_mask[:, None] & (cols[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _rows_tile(a_ptr, b_ptr, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, routed_weight_ptr,
               rows, row_mask, slots, x_rows, x_mask, x_slots, num_slots, expert, pid_n, N, K,
               stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
               stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
               A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, IN_PLACE: tl.constexpr,
               FP8_BLOCK: tl.constexpr, SCALE_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, B_TMA: tl.constexpr,
               DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, X_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """One tile of one expert (-1: none): BLOCK_M rows, and X_M more rows sharing its weight tiles when X_M > 0."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    if expert < 0:
        if IN_PLACE:  # never with X_M: in-place alignments have no tails
            tl.store(c_ptr + slots[:, None] * stride_cm + cols[None, :] * stride_cn,
                     tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty),
                     mask=(slots[:, None] < num_slots) & (cols[None, :] < N))
    else:
        acc, acc_x = _accumulate(a_ptr, b_ptr, b_desc, a_scale_ptr, b_scale_ptr, rows // A_ROW_DIV, row_mask,
                                 x_rows // A_ROW_DIV, x_mask, expert, pid_n, N, K,
                                 stride_am, stride_ak, stride_be, stride_bn, stride_bk,
                                 stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                                 GATED, FP8_BLOCK, SCALE_BLOCK, EVEN_K, B_TMA, DOT_PRECISION,
                                 BLOCK_M, X_M, BLOCK_N, BLOCK_K)
        _store_rows(c_ptr, routed_weight_ptr, acc, rows, row_mask, slots, num_slots, cols, N, stride_cm, stride_cn,
                    MUL_ROUTED_WEIGHT, IN_PLACE)
        if X_M > 0:
            _store_rows(c_ptr, routed_weight_ptr, acc_x, x_rows, x_mask, x_slots, num_slots, cols, N,
                        stride_cm, stride_cn, MUL_ROUTED_WEIGHT, IN_PLACE)


@triton.jit
def _sorted_tile(a_ptr, b_ptr, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, routed_weight_ptr, sorted_ids_ptr,
                 first, num_valid, num_slots, expert, pid_n, N, K,
                 stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                 stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                 A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                 IN_PLACE: tl.constexpr, FP8_BLOCK: tl.constexpr, SCALE_BLOCK: tl.constexpr, EVEN_K: tl.constexpr,
                 B_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 HEIGHT: tl.constexpr, X_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The HEIGHT slots from `first` of a sorted alignment as one tile, and the X_M after them with it."""
    slots = first + tl.arange(0, HEIGHT).to(tl.int64)
    rows = tl.load(sorted_ids_ptr + slots).to(tl.int64)
    if X_M > 0:
        x_slots = first + HEIGHT + tl.arange(0, X_M).to(tl.int64)
        x_rows = tl.load(sorted_ids_ptr + x_slots).to(tl.int64)
    else:
        x_slots = slots
        x_rows = rows
    _rows_tile(a_ptr, b_ptr, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, routed_weight_ptr,
               rows, rows < num_valid, slots, x_rows, x_rows < num_valid, x_slots, num_slots, expert, pid_n, N, K,
               stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
               stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
               A_ROW_DIV, GATED, MUL_ROUTED_WEIGHT, IN_PLACE, FP8_BLOCK, SCALE_BLOCK, EVEN_K, B_TMA,
               DOT_PRECISION, HEIGHT, X_M, BLOCK_N, BLOCK_K)


@triton.jit
def _direct_rows(topk_ids_ptr, pair, num_valid, TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """Pair `pair`'s expert and the pair of every token routed to it (one lane per token); expert -1
    when another program owns the expert (an earlier pair has it) or the pair is not routed here."""
    tokens = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, TOP_K_POW2)
    flat = tokens[:, None] * TOP_K + ks[None, :]
    ids = tl.load(topk_ids_ptr + flat, mask=(ks[None, :] < TOP_K) & (flat < num_valid), other=-1)
    expert = tl.load(topk_ids_ptr + pair)
    match = ids == expert
    owned_earlier = tl.sum((match & (flat < pair)).to(tl.int32)) > 0
    rows = (tokens * TOP_K + tl.sum(tl.where(match, ks[None, :], 0), axis=1)).to(tl.int64)
    row_mask = tl.sum(match.to(tl.int32), axis=1) > 0
    expert = tl.where(owned_earlier, -1, expert)
    return expert, rows, row_mask


# Row and slot counts change with every batch; specializing on them would compile a variant per size class.
@triton.jit(do_not_specialize=["num_valid", "num_slots", "num_pid_m"])
def grouped_gemm_kernel(
    a_ptr, b_ptr, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, routed_weight_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_valid, num_slots, num_pid_m, N, K,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    A_ROW_DIV: tl.constexpr,  # rows index (token, k) pairs while A holds one row per token: top_k
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    IN_PLACE: tl.constexpr,  # write each tile at its slots, padding as zeros, instead of at its rows
    DIRECT: tl.constexpr,  # sorted_ids holds topk_ids [tokens, TOP_K]; a program per pair, a lane per token
    TOP_K: tl.constexpr,
    TOP_K_POW2: tl.constexpr,
    FP8_BLOCK: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    EVEN_K: tl.constexpr,
    B_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TAIL_M: tl.constexpr,  # sorted tiles are BLOCK_M + TAIL_M slots (see the module's docstring)
):
    pid_m, pid_n = _tile_coords(num_pid_m, N, BLOCK_N, GROUP_M)
    if DIRECT:
        expert, rows, row_mask = _direct_rows(sorted_ids_ptr, pid_m, num_valid, TOP_K, TOP_K_POW2, BLOCK_M)
        _rows_tile(a_ptr, b_ptr, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, routed_weight_ptr,
                   rows, row_mask, rows, rows, row_mask, rows, num_slots, expert.to(tl.int64), pid_n, N, K,
                   stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                   stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                   A_ROW_DIV, GATED, MUL_ROUTED_WEIGHT, False, FP8_BLOCK, SCALE_BLOCK, EVEN_K, B_TMA,
                   DOT_PRECISION, BLOCK_M, 0, BLOCK_N, BLOCK_K)
    elif pid_m * (BLOCK_M + TAIL_M) < tl.load(num_padded_ptr):  # the grid covers the worst-case padding
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        first = pid_m * (BLOCK_M + TAIL_M)
        if TAIL_M > 0:
            # A sorted tile's rows come first (align_pairs pads after them): two slots say how tall it must run.
            # A tile height is a compile-time shape, so each height is a call of its own. (One call per height
            # chosen through flags that are Python bools without a tail failed to compile for tiles with none.)
            if tl.load(sorted_ids_ptr + first + BLOCK_M) < num_valid:
                _sorted_tile(a_ptr, b_ptr, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, routed_weight_ptr, sorted_ids_ptr,
                             first, num_valid, num_slots, expert, pid_n, N, K,
                             stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                             stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                             A_ROW_DIV, GATED, MUL_ROUTED_WEIGHT, IN_PLACE, FP8_BLOCK, SCALE_BLOCK, EVEN_K, B_TMA,
                             DOT_PRECISION, BLOCK_M, TAIL_M, BLOCK_N, BLOCK_K)
            elif tl.load(sorted_ids_ptr + first + TAIL_M) < num_valid:
                _sorted_tile(a_ptr, b_ptr, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, routed_weight_ptr, sorted_ids_ptr,
                             first, num_valid, num_slots, expert, pid_n, N, K,
                             stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                             stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                             A_ROW_DIV, GATED, MUL_ROUTED_WEIGHT, IN_PLACE, FP8_BLOCK, SCALE_BLOCK, EVEN_K, B_TMA,
                             DOT_PRECISION, BLOCK_M, 0, BLOCK_N, BLOCK_K)
            else:
                _sorted_tile(a_ptr, b_ptr, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, routed_weight_ptr, sorted_ids_ptr,
                             first, num_valid, num_slots, expert, pid_n, N, K,
                             stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                             stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                             A_ROW_DIV, GATED, MUL_ROUTED_WEIGHT, IN_PLACE, FP8_BLOCK, SCALE_BLOCK, EVEN_K, B_TMA,
                             DOT_PRECISION, TAIL_M, 0, BLOCK_N, BLOCK_K)
        else:
            _sorted_tile(a_ptr, b_ptr, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, routed_weight_ptr, sorted_ids_ptr,
                         first, num_valid, num_slots, expert, pid_n, N, K,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                         A_ROW_DIV, GATED, MUL_ROUTED_WEIGHT, IN_PLACE, FP8_BLOCK, SCALE_BLOCK, EVEN_K, B_TMA,
                         DOT_PRECISION, BLOCK_M, 0, BLOCK_N, BLOCK_K)


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    align: Alignment,
    config: TileConfig,
    *,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    routed_weights: torch.Tensor | None = None,
    a_row_div: int = 1,
    gated: bool = False,
    in_place: bool = False,
) -> None:
    """out[rows] = A[rows // a_row_div] @ B[expert].T (SiLU-gated when `gated`, times the routed weight if given).

    a [rows, K]; b [E, N or 2N, K], contiguous; out [rows or slots, N]. fp8 when `b_scale` is given.
    """
    fp8 = b_scale is not None
    n = b.shape[1] // 2 if gated else b.shape[1]
    if fp8 and (a_scale is None or SCALE_BLOCK % config.block_k):
        raise ValueError(f"fp8 block GEMMs need activation scales and BLOCK_K dividing {SCALE_BLOCK}")
    if in_place and align.direct:
        raise ValueError("a direct alignment has no slots to write in place")
    tail_m = 0 if align.direct else config.tail_m
    if align.block_m != config.block_m + tail_m:
        raise ValueError(f"the alignment has tiles of {align.block_m} slots; this tile takes {config.block_m + tail_m}")
    if in_place and tail_m:
        raise ValueError("tiles with a tail need sorted rows (rows first in each tile), not rows in place")
    num_pid_m = align.num_tiles
    grid = (num_pid_m * triton.cdiv(n, config.block_n),)
    if grid[0] == 0:
        return
    a_scale = a_scale if fp8 else a  # never read: FP8_BLOCK is off
    b_scale = b_scale if fp8 else b
    routed = routed_weights if routed_weights is not None else a
    b_desc = weight_descriptor(b, config) if config.tma else b
    grouped_gemm_kernel[grid](
        a, b, b_desc, out, a_scale, b_scale, routed,
        align.sorted_ids, align.block_expert, align.num_padded,
        align.num_valid, align.num_slots, num_pid_m, n, a.shape[1],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        a_scale.stride(0) if fp8 else 0, a_scale.stride(1) if fp8 else 0,
        b_scale.stride(0) if fp8 else 0, b_scale.stride(1) if fp8 else 0, b_scale.stride(2) if fp8 else 0,
        A_ROW_DIV=a_row_div,
        GATED=gated,
        MUL_ROUTED_WEIGHT=routed_weights is not None,
        IN_PLACE=in_place,
        DIRECT=align.direct,
        TOP_K=align.top_k,
        TOP_K_POW2=triton.next_power_of_2(align.top_k),
        FP8_BLOCK=fp8,
        SCALE_BLOCK=SCALE_BLOCK,
        EVEN_K=a.shape[1] % config.block_k == 0,
        B_TMA=config.tma,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        TAIL_M=tail_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def weight_descriptor(b: torch.Tensor, config: TileConfig):
    """B as [E * rows, K] for the copy engine, in tiles of [BLOCK_N, BLOCK_K] (Triton 3.3 and later)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(b.view(-1, b.shape[2]), [config.block_n, config.block_k])
