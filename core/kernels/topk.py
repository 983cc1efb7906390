"""Router top-k in one Triton launch: logits -> (expert ids, weights), as `moeplex.moe.router.Router` computes them.

Why: a CUDA-graph decode step costs about one launch per kernel however little each does, and the
torch router launches about seven per layer (softmax or sigmoid, bias add, group top-2, group top-k,
mask, top-k, gather, normalize, scale). Here one program holds a block of tokens' rows in registers,
the experts padded to a power of two, and takes the top k by k unrolled rounds of arg-max (k is 2
to 8 in the models here).

Ties: among exactly equal values the lowest expert id wins, and the lowest group id among equal
groups; torch.topk leaves that order unspecified. The softmax path selects on the logits, which
order as the probabilities do but stay distinct where probabilities round to the same value.
"""

from __future__ import annotations

import functools

import attrs
import torch
import triton
import triton.language as tl


@attrs.frozen
class RouterSpec:
    """How an architecture routes: what the router module computes and this kernel fuses."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True
    num_groups: int = 1  # DeepSeek-V3 n_group
    topk_groups: int = 1  # DeepSeek-V3 topk_group
    scaling_factor: float = 1.0  # DeepSeek-V3 routed_scaling_factor
    correction_bias: bool = False  # DeepSeek-V3 e_score_correction_bias (selection only)


ELEMENTS_PER_PROGRAM = 2048  # rows per program = this / padded experts: 8 rows of 256 experts, 16 at most


@triton.jit
def _argmax(values, cols, WIDTH: tl.constexpr):
    """Per row of `values` [R, WIDTH] the largest value and its column, the lowest column among equals."""
    best = tl.max(values, axis=1)
    col = tl.min(tl.where(values == best[:, None], cols[None, :], WIDTH), axis=1)
    return best, col


@triton.jit
def _keep_best_groups(choice, BLOCK_T: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                      TOPK_GROUPS: tl.constexpr):
    """-inf outside each row's TOPK_GROUPS groups with the largest sums of their two largest values."""
    grouped = tl.reshape(choice, [BLOCK_T, NUM_GROUPS, GROUP_SIZE])
    members = tl.arange(0, GROUP_SIZE)
    first = tl.max(grouped, axis=2)
    first_col = tl.min(tl.where(grouped == first[:, :, None], members[None, None, :], GROUP_SIZE), axis=2)
    second = tl.max(tl.where(members[None, None, :] == first_col[:, :, None], -float("inf"), grouped), axis=2)
    group_scores = first + second  # padding groups hold only -inf and are never kept
    groups = tl.arange(0, NUM_GROUPS)
    keep = groups[None, :] < 0
    for _ in tl.static_range(TOPK_GROUPS):
        _, best = _argmax(group_scores, groups, NUM_GROUPS)
        hit = groups[None, :] == best[:, None]
        keep = keep | hit
        group_scores = tl.where(hit, -float("inf"), group_scores)
    grouped = tl.where(keep[:, :, None], grouped, -float("inf"))
    return tl.reshape(grouped, [BLOCK_T, NUM_GROUPS * GROUP_SIZE])


@triton.jit
def _topk_rows(logits, cols, bias_ptr, num_experts, scaling_factor,
               TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
               NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
               K_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """(ids [BLOCK_T, K_PAD] int64, weights [BLOCK_T, K_PAD] fp32) of fp32 logits [BLOCK_T, experts padded]."""
    E_PAD: tl.constexpr = NUM_GROUPS * GROUP_SIZE
    col_mask = cols < num_experts
    if SIGMOID:
        scores = tl.sigmoid(logits)
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(col_mask[None, :], choice, -float("inf"))
        if NUM_GROUPS > 1:
            choice = _keep_best_groups(choice, BLOCK_T, NUM_GROUPS, GROUP_SIZE, TOPK_GROUPS)
    else:
        choice = tl.where(col_mask[None, :], logits, -float("inf"))
        numerators = tl.exp(choice - tl.max(choice, axis=1)[:, None])
        scores = numerators / tl.sum(numerators, axis=1)[:, None]

    slots = tl.arange(0, K_PAD)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int64)
    weights = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        _, expert = _argmax(choice, cols, E_PAD)
        hit = cols[None, :] == expert[:, None]
        weight = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        choice = tl.where(hit, -float("inf"), choice)
        ids = tl.where(slots[None, :] == k, expert[:, None].to(tl.int64), ids)
        weights = tl.where(slots[None, :] == k, weight[:, None], weights)
    if NORMALIZE:
        total = tl.sum(weights, axis=1)
        if SIGMOID:
            total = total + 1e-20
        weights = weights / total[:, None]
    return ids, weights * scaling_factor


@triton.jit
def _store_topk(ids_ptr, weights_ptr, rows, row_mask, ids, weights, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    slots = tl.arange(0, K_PAD)
    out = rows[:, None] * TOP_K + slots[None, :]
    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    tl.store(ids_ptr + out, ids, mask=out_mask)
    tl.store(weights_ptr + out, weights, mask=out_mask)


@triton.jit
def _route_topk_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, num_tokens, num_experts, scaling_factor,
                       stride_lt, stride_le,
                       TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                       NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                       K_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    E_PAD: tl.constexpr = NUM_GROUPS * GROUP_SIZE
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    row_mask = rows < num_tokens
    cols = tl.arange(0, E_PAD)
    # rows past the end read zeros, not -inf, so that their softmax stays finite; they are not stored
    logits = tl.load(logits_ptr + rows[:, None] * stride_lt + cols[None, :] * stride_le,
                     mask=row_mask[:, None] & (cols < num_experts)[None, :], other=0.0).to(tl.float32)
    ids, weights = _topk_rows(logits, cols, bias_ptr, num_experts, scaling_factor, TOP_K, SIGMOID, HAS_BIAS,
                              NORMALIZE, NUM_GROUPS, GROUP_SIZE, TOPK_GROUPS, K_PAD, BLOCK_T)
    _store_topk(ids_ptr, weights_ptr, rows, row_mask, ids, weights, TOP_K, K_PAD)


@functools.cache
def group_layout(spec: RouterSpec) -> tuple[int, int, int]:
    """(padded group count, experts per group, groups kept) of the kernel; one group when routing is not grouped.

    Checks the spec once per spec (a router calls this every step): a refusal raises again on every call.
    """
    if spec.scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown router scoring {spec.scoring!r}; expected 'softmax' or 'sigmoid'")
    if not 1 <= spec.top_k <= spec.num_experts:
        raise ValueError(f"top_k {spec.top_k} is not between 1 and num_experts {spec.num_experts}")
    if spec.scoring == "softmax" or spec.num_groups == 1:
        return 1, triton.next_power_of_2(spec.num_experts), 1
    size, rest = divmod(spec.num_experts, spec.num_groups)
    if rest or size < 2 or size & (size - 1):
        raise ValueError(f"grouped routing needs num_experts / num_groups to be a power of two of at least 2; "
                         f"got {spec.num_experts} experts in {spec.num_groups} groups")
    if not 1 <= spec.topk_groups <= spec.num_groups:
        raise ValueError(f"topk_groups {spec.topk_groups} is not between 1 and num_groups {spec.num_groups}")
    if spec.topk_groups * size < spec.top_k:
        raise ValueError(f"top_k {spec.top_k} exceeds the {spec.topk_groups * size} experts of the kept groups")
    return triton.next_power_of_2(spec.num_groups), size, spec.topk_groups


def check_logits(logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None) -> None:
    if logits.dim() != 2 or logits.shape[1] != spec.num_experts:
        raise ValueError(f"logits must be [T, {spec.num_experts}]; got {list(logits.shape)}")
    if spec.correction_bias != (correction_bias is not None):
        raise ValueError("pass the correction bias exactly when spec.correction_bias is set (as Router holds one)")
    if correction_bias is not None and correction_bias.shape != (spec.num_experts,):
        raise ValueError(f"correction_bias must be [{spec.num_experts}]; got {list(correction_bias.shape)}")


def route_topk(logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (ids [T, K] int64, weights [T, K] fp32), as Router computes them,
    times spec.scaling_factor.

    The order of the K ids in a row may differ from torch.topk's. `correction_bias` [E] is
    given exactly when spec.correction_bias is set; like Router, only sigmoid scoring uses it.
    """
    num_groups, group_size, topk_groups = group_layout(spec)
    check_logits(logits, spec, correction_bias)
    num_tokens = logits.shape[0]
    ids = torch.empty(num_tokens, spec.top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, spec.top_k, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return ids, weights
    sigmoid = spec.scoring == "sigmoid"
    bias = correction_bias if sigmoid and correction_bias is not None else None
    block_t = max(1, min(16, ELEMENTS_PER_PROGRAM // (num_groups * group_size)))
    _route_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, bias if bias is not None else logits, ids, weights, num_tokens, spec.num_experts,
        float(spec.scaling_factor), logits.stride(0), logits.stride(1),
        TOP_K=spec.top_k, SIGMOID=sigmoid, HAS_BIAS=bias is not None, NORMALIZE=spec.norm_topk_prob,
        NUM_GROUPS=num_groups, GROUP_SIZE=group_size, TOPK_GROUPS=topk_groups,
        K_PAD=triton.next_power_of_2(spec.top_k), BLOCK_T=block_t,
    )
    return ids, weights
