"""Split-K decode attention over the paged KV cache (flash-decoding), one query token per request.

Each program takes one request, one KV head with a block of the query heads that read it (GQA
without copying K/V; MLA's absorbed decode is the case of one latent "KV head" shared by every
head), and one split of the sequence. It walks its split in BLOCK_N-token tiles, finding each
token's slot through the request's page table, and keeps an online softmax. The reduce kernel
merges the splits' partial outputs by their log-sum-exps. With one split the first kernel writes
the output directly; given counters, the last split program of each request and head block to finish
merges them in the same launch (a decode step pays for launches more than for this work).

Keys are [slots, kv_heads, Dk] and values [slots, kv_heads, Dv] with Dk >= Dv: the first Dv key
columns meet the queries' first Dv columns, the remaining Dk - Dv (MLA's rope key) a second
product. When the values are the keys' first Dv columns (MLA: the latent is both), one load
serves both. Everything the kernels read comes from tensors (page table, sequence lengths), and
the grid depends only on shapes, so a CUDA graph can capture them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_DOT = 16  # tl.dot wants every dimension at least this large on the GPU


@triton.jit
def _merge_splits(part_ptr, lse_ptr, out_ptr, request, heads, head_ok, d, d_ok,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                  NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[heads] = the splits' partial outputs weighted by exp(their log-sum-exp), over the sum of the weights."""
    s = tl.arange(0, BLOCK_S)
    lse_rows = lse_ptr + request * stride_lb + heads[:, None] * stride_lh
    lse = tl.load(lse_rows + s[None, :], mask=head_ok[:, None] & (s < NUM_SPLITS)[None, :], other=float("-inf"),
                  cache_modifier=".cg")
    top = tl.max(lse, axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty sequence: every weight is zero
    total = tl.sum(tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top[:, None])), axis=1)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    part_rows = part_ptr + request * stride_pb + heads[:, None] * stride_ph + d[None, :]
    for split in range(NUM_SPLITS):
        split_lse = tl.load(lse_rows + split, mask=head_ok[:, None], other=float("-inf"), cache_modifier=".cg")
        weight = tl.where(split_lse == float("-inf"), 0.0, tl.exp(split_lse - top[:, None]))
        part = tl.load(part_rows + split * stride_ps, mask=head_ok[:, None] & d_ok[None, :], other=0.0,
                       cache_modifier=".cg")
        acc += part * weight
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + request * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None] & d_ok[None, :])


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, out_ptr, lse_ptr, final_ptr, counter_ptr,
    scale, page_size, group, head_blocks, dv, tail,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, HAS_TAIL: tl.constexpr, SHARED_KV: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
):
    request = tl.program_id(0)
    kv_head = tl.program_id(1) // head_blocks
    in_group = (tl.program_id(1) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_ok = in_group < group
    heads = kv_head * group + in_group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dv

    q_rows = q_ptr + request * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=head_ok[:, None] & d_ok[None, :], other=0.0)
    if HAS_TAIL:
        t = tl.arange(0, BLOCK_T)
        t_ok = t < tail
        q_tail = tl.load(q_rows + dv + t[None, :], mask=head_ok[:, None] & t_ok[None, :], other=0.0)

    seq_len = tl.load(seq_lens_ptr + request)
    # whole tiles per split: a program walks ceil(split_len / BLOCK_N) tiles whether or not the last is full, so
    # rounding up costs none of them a tile and leaves the splits past the sequence's end empty (a short context
    # in a graph captured for long ones runs a few programs, not NUM_SPLITS half-empty ones)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for first in range(start, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        page = tl.load(page_table_ptr + request * stride_pb + pos // page_size, mask=pos_ok, other=0)
        slot = page.to(tl.int64) * page_size + pos % page_size
        k_rows = k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh
        k = tl.load(k_rows + d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_TAIL:
            k_tail = tl.load(k_rows + dv + t[None, :], mask=pos_ok[:, None] & t_ok[None, :], other=0.0)
            scores += tl.dot(q_tail, tl.trans(k_tail), input_precision=DOT_PRECISION)
        scores = tl.where(pos_ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        if SHARED_KV:
            v = k
        else:
            v_rows = v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh
            v = tl.load(v_rows + d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    seen = total > 0  # an empty split (past the end of a short sequence) contributes nothing
    out = acc / tl.where(seen, total, 1.0)[:, None]
    o_ptrs = out_ptr + request * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + request * stride_lb + heads * stride_lh + split, lse, mask=head_ok)
    if MERGE:
        # the last split of this request and head block to finish merges them all (the reduce kernel's work);
        # every thread's stores come before the ticket, whose release makes them visible to that program
        tl.debug_barrier()
        counter = counter_ptr + request * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
            _merge_splits(out_ptr, lse_ptr, final_ptr, request, heads, head_ok, d, d_ok,
                          stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
                          NUM_SPLITS, BLOCK_S, BLOCK_H, BLOCK_D)
            tl.atomic_xchg(counter, 0, sem="relaxed")


@triton.jit
def _reduce_kernel(
    part_ptr, lse_ptr, out_ptr, dv,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dv
    lse = tl.load(lse_ptr + request * stride_lb + head * stride_lh + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty sequence: every weight is zero
    weight = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
    parts = tl.load(
        part_ptr + request * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :], other=0.0,
    )
    total = tl.sum(weight, axis=0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + request * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _block(size: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(size))


def head_blocks(num_q_heads: int, num_kv_heads: int, block_h: int = MIN_DOT) -> int:
    """Programs per KV head and request: the query heads of one KV head, BLOCK_H at a time."""
    return triton.cdiv(num_q_heads // num_kv_heads, block_h)


def merge_counters_needed(batch: int, num_q_heads: int, num_kv_heads: int) -> int:
    """Counters `decode_attention` needs to merge the splits in the split kernel: one per program column."""
    return batch * num_kv_heads * head_blocks(num_q_heads, num_kv_heads)


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    num_splits: int = 1,
    block_n: int | None = None,
    merge_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, Dk] against the cached keys [slots, Hkv, Dk] and values [slots, Hkv, Dv] -> [B, Hq, Dv].

    Request b's token j sits in slot page_table[b, j // page_size] * page_size + j % page_size,
    for j < seq_lens[b]. The sequence is cut into at most `num_splits` parts of whole BLOCK_N-token tiles, attended
    in parallel (a sequence shorter than num_splits tiles leaves the last splits empty).
    `merge_counters`: int32 zeros, at least `merge_counters_needed` of them, that no other launch uses
    meanwhile (they are zero again afterwards); with them the last split of each request and head block
    merges the splits itself, in the one launch, instead of a second (reduce) kernel.
    """
    batch, num_q_heads, dk = q.shape
    num_kv_heads, dv = value_cache.shape[1], value_cache.shape[2]
    if key_cache.shape[1] != num_kv_heads or key_cache.shape[2] != dk or dk < dv:
        raise ValueError(
            f"keys {tuple(key_cache.shape)} and values {tuple(value_cache.shape)} do not fit queries {tuple(q.shape)}"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not divide over {num_kv_heads} KV heads")
    if q.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("queries, keys and values must be contiguous along their last dimension")
    out = q.new_empty(batch, num_q_heads, dv)
    if batch == 0:
        return out
    shared = value_cache.data_ptr() == key_cache.data_ptr() and value_cache.stride() == key_cache.stride()
    block_d = _block(dv)
    block_n = block_n or (64 if block_d <= 128 else 32)
    if num_splits > 1:
        parts = torch.empty(batch, num_q_heads, num_splits, dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        parts, lse = out.unsqueeze(2), out.new_empty(0)  # the split kernel writes the output itself
    blocks = head_blocks(num_q_heads, num_kv_heads)
    merge = num_splits > 1 and merge_counters is not None
    if merge and (merge_counters.dtype != torch.int32 or
                  merge_counters.numel() < merge_counters_needed(batch, num_q_heads, num_kv_heads)):
        raise ValueError(f"merging {num_splits} splits in the split kernel takes "
                         f"{merge_counters_needed(batch, num_q_heads, num_kv_heads)} int32 counters; got "
                         f"{merge_counters.numel()} of {merge_counters.dtype}")
    _split_kernel[(batch, num_kv_heads * blocks, num_splits)](
        q, key_cache, value_cache, page_table, seq_lens, parts, lse, out, merge_counters if merge else lse,
        scale, page_size, num_q_heads // num_kv_heads, blocks, dv, dk - dv,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1),
        value_cache.stride(0), value_cache.stride(1), page_table.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0) if num_splits > 1 else 0, lse.stride(1) if num_splits > 1 else 0, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_H=MIN_DOT, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_T=_block(max(dk - dv, 1)),
        HAS_TAIL=dk > dv, SHARED_KV=shared, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MERGE=merge, BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4 if block_d <= 128 else 8, num_stages=2,
    )
    if num_splits > 1 and not merge:
        _reduce_kernel[(batch, num_q_heads)](
            parts, lse, out, dv,
            parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(dv),
        )
    return out
