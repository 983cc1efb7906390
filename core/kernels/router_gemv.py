"""The router of a small batch in one launch: hidden -> gate logits (fp32 GEMV) -> top-k ids and weights.

Why: at decode batch sizes the router is three or four launches (the upcast of the hidden rows to
fp32, the GEMM and its split-K reduce, the top-k kernel), each a few microseconds of a step that
replays about twenty launches per layer. Here every program computes the logits of a slice of the
experts for every token, writes them to a scratch row, and takes a ticket from a counter; the
program that takes the last ticket reads all the logits back and runs the top-k of
`moeplex.kernels.topk` on them, then puts the counter back to zero for the next launch. Nothing
travels to the host and the grid depends only on shapes, so a CUDA graph can capture it.

The counter belongs to the caller (a Router holds one): launches that share it must not overlap,
which launches on one stream never do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .topk import RouterSpec, _store_topk, _topk_rows, group_layout

MAX_TOKENS = 16  # larger batches take the GEMM and the top-k kernel: the GEMV tiles here stop paying
TARGET_PROGRAMS = 256  # programs a launch spreads the gate weight over (its bytes are what the GEMV waits for)
WEIGHT_TILE = 4096  # gate weights a program loads at once (experts x hidden columns): 16 KiB of fp32
# warps per program, by the launch's token block. The last program's top-k is a chain of reductions over every
# expert (two per pick), each a round through shared memory when the rows span several warps: one warp keeps a single
# token's row in registers (H100, Qwen3-30B-A3B batch-1 step: 4.140-4.154 ms with 1 warp, 4.184 with 4; session
# 12's results/e2e_h100_s12.md). But with 8 tokens one warp holds 8 rows of logits and runs the GEMV's 8 rows alone:
# 40.9 us a launch against 8.6 with 4 warps, the Qwen3 batch-8 step 12.44-12.48 ms against 10.92 (14%). Each entry is
# the fastest count at that block on an H100 (results/router_warps_h100.md, both models' shapes; at 2 and 8 tokens
# the two models differ by 0.5 us, and the entry is Qwen3's at 2, DeepSeek-V3's at 8).
WARPS_BY_TOKENS = {1: 1, 2: 2, 4: 4, 8: 4, 16: 8}
NUM_WARPS: int | None = None  # set: every launch takes this many (benchmarks/e2e_gpu.py --router-warps)


def warps_for(block_t: int) -> int:
    """Warps per program for a launch of `block_t` (a power of two) token rows."""
    return NUM_WARPS or WARPS_BY_TOKENS[block_t]


@triton.jit
def _router_kernel(x_ptr, w_ptr, bias_ptr, logits_ptr, counter_ptr, ids_ptr, weights_ptr,
                   num_tokens, num_experts, hidden, scaling_factor, stride_xt, stride_we,
                   TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                   NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                   K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    E_PAD: tl.constexpr = NUM_GROUPS * GROUP_SIZE
    tokens = tl.arange(0, BLOCK_T).to(tl.int64)
    token_ok = tokens < num_tokens
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    expert_ok = experts < num_experts
    rows = tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for first in range(0, hidden, BLOCK_H):
        cols = first + tl.arange(0, BLOCK_H)
        col_ok = cols < hidden
        # the weight tile is read once and meets every token's row (a few KiB, read from the cache after the first)
        w = tl.load(w_ptr + experts.to(tl.int64)[:, None] * stride_we + cols[None, :],
                    mask=expert_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        # unrolled, so that every token's row is loaded at once rather than one cache round trip after another
        for t in tl.static_range(BLOCK_T):
            x = tl.load(x_ptr + t * stride_xt + cols, mask=col_ok & (cols * 0 + t < num_tokens), other=0.0).to(tl.float32)
            acc = tl.where(rows[:, None] == t, acc + tl.sum(w * x[None, :], axis=1)[None, :], acc)
    tl.store(logits_ptr + tokens[:, None] * E_PAD + experts[None, :], acc,
             mask=token_ok[:, None] & expert_ok[None, :])
    # every thread's stores come before the ticket, whose release makes them visible to the last program
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        # (new names only in this branch: a runtime `if` may not change the type of a name bound before it)
        every_expert = tl.arange(0, E_PAD)
        # rows past the end read zeros, not -inf, so that their softmax stays finite; they are not stored
        logits = tl.load(logits_ptr + tokens[:, None] * E_PAD + every_expert[None, :],
                         mask=token_ok[:, None] & (every_expert < num_experts)[None, :], other=0.0,
                         cache_modifier=".cg")
        ids, weights = _topk_rows(logits, every_expert, bias_ptr, num_experts, scaling_factor, TOP_K, SIGMOID, HAS_BIAS,
                                  NORMALIZE, NUM_GROUPS, GROUP_SIZE, TOPK_GROUPS, K_PAD, BLOCK_T)
        _store_topk(ids_ptr, weights_ptr, tokens, token_ok, ids, weights, TOP_K, K_PAD)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed")


def fits(num_tokens: int) -> bool:
    """Whether `route_small_batch` takes a batch of this many tokens."""
    return 0 < num_tokens <= MAX_TOKENS


def new_counter(device: torch.device | str) -> torch.Tensor:
    """The ticket counter a caller keeps for its launches (zero between launches)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def route_small_batch(hidden: torch.Tensor, weight: torch.Tensor, spec: RouterSpec, counter: torch.Tensor,
                      correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H] (any float dtype, T <= MAX_TOKENS), weight [E, H] -> (ids [T, K] int64, weights [T, K] fp32):
    what `route_topk(linear(hidden.float(), weight.float()), spec, correction_bias)` returns, in one launch.

    `counter`: an int32 [1] device tensor at zero (`new_counter`), which no other launch uses meanwhile.
    """
    num_groups, group_size, topk_groups = group_layout(spec)
    num_tokens, width = hidden.shape
    if not fits(num_tokens):
        raise ValueError(f"route_small_batch takes 1 to {MAX_TOKENS} tokens; got {num_tokens}")
    if weight.shape != (spec.num_experts, width):
        raise ValueError(f"the gate weight must be [{spec.num_experts}, {width}]; got {list(weight.shape)}")
    if spec.correction_bias != (correction_bias is not None):
        raise ValueError("pass the correction bias exactly when spec.correction_bias is set (as Router holds one)")
    if counter.shape != (1,) or counter.dtype != torch.int32:
        raise ValueError(f"the counter must be an int32 tensor of one element; got {counter.dtype} {list(counter.shape)}")
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    e_pad = num_groups * group_size
    block_t = triton.next_power_of_2(num_tokens)
    block_e = max(1, triton.next_power_of_2(triton.cdiv(spec.num_experts, TARGET_PROGRAMS)))
    block_h = max(16, min(triton.next_power_of_2(width), WEIGHT_TILE // block_e))
    logits = torch.empty(block_t, e_pad, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(num_tokens, spec.top_k, dtype=torch.int64, device=hidden.device)
    weights = torch.empty(num_tokens, spec.top_k, dtype=torch.float32, device=hidden.device)
    sigmoid = spec.scoring == "sigmoid"
    bias = correction_bias if sigmoid else None
    _router_kernel[(triton.cdiv(spec.num_experts, block_e),)](
        hidden, weight, bias if bias is not None else weight, logits, counter, ids, weights,
        num_tokens, spec.num_experts, width, float(spec.scaling_factor), hidden.stride(0), weight.stride(0),
        TOP_K=spec.top_k, SIGMOID=sigmoid, HAS_BIAS=bias is not None, NORMALIZE=spec.norm_topk_prob,
        NUM_GROUPS=num_groups, GROUP_SIZE=group_size, TOPK_GROUPS=topk_groups,
        K_PAD=triton.next_power_of_2(spec.top_k), BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=block_h,
        num_warps=warps_for(block_t),
    )
    return ids, weights
