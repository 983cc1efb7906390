"""Each layout as align -> GEMM 1 (gate and up, SiLU fused) -> GEMM 2 (down) -> finish."""

from __future__ import annotations

import attrs
import torch

from moeplex.interfaces import FP8_BLOCK, ExpertWeights, Fp8Payload
from moeplex.interfaces.kernels import BLOCK as GROUP, dequantize_activations, gather_rows, quantize_rows, weighted_pair_sum

from .align import (
    ONE_LAUNCH_MAX_PAIRS,
    Alignment,
    align_direct,
    align_in_place,
    align_pairs,
    align_pairs_one_launch,
    can_align_direct,
    can_align_in_one_launch,
    can_align_in_place,
)
from .configs import MoETiles, TileConfig
from .finish import silu_mul, sum_topk
from .group import align_local_pairs, group_local_pairs
from .kernel import grouped_gemm


@attrs.frozen
class PreparedWeights:
    """w13 [E, 2I, H] and w2 [E, H, I], contiguous; with their 128x128 block scales in the fp8 format."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @classmethod
    def from_expert_weights(cls, weights: ExpertWeights) -> PreparedWeights:
        if weights.format != FP8_BLOCK:
            return cls(weights.w13.contiguous(), weights.w2.contiguous())
        return cls(
            weights.w13.contiguous(),
            weights.w2.contiguous(),
            weights.w13_scale.float().contiguous(),
            weights.w2_scale.float().contiguous(),
        )

    @property
    def fp8(self) -> bool:
        return self.w13_scale is not None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]


@attrs.frozen
class Activations:
    """GEMM 1's A operand, rows flattened: fp8 values with per-row 128-group scales, or plain values."""

    values: torch.Tensor
    scales: torch.Tensor | None
    out_dtype: torch.dtype


def activations(hidden: torch.Tensor, payload: Fp8Payload | None, weights: PreparedWeights) -> Activations:
    """Match the activations to the weights: quantize for fp8 weights, dequantize a payload for plain ones."""
    width = hidden.shape[-1]
    if not weights.fp8:
        values = hidden if payload is None else dequantize_activations(payload).to(hidden.dtype)
        return Activations(values.reshape(-1, width), None, hidden.dtype)
    if payload is None:
        values, scales = quantize_rows(hidden.reshape(-1, width))
        return Activations(values, scales, hidden.dtype)
    if payload.group_size != GROUP:
        raise ValueError(f"fp8 activations must carry one scale per {GROUP} columns, not per {payload.group_size}")
    scales = payload.scales.reshape(-1, payload.scales.shape[-1]).float()
    return Activations(payload.values.reshape(-1, width), scales, hidden.dtype)


def run_experts(
    acts: Activations,
    weights: PreparedWeights,
    align: Alignment,
    out: torch.Tensor,
    tiles: MoETiles,
    *,
    a_row_div: int = 1,
    routed_weights: torch.Tensor | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """out[row] = SiLU-gated expert of each aligned row (times its routed weight when given)."""
    inter = torch.empty(align.num_valid, weights.intermediate_size, dtype=acts.out_dtype, device=out.device)
    grouped_gemm(acts.values, weights.w13, inter, align, tiles.gate_up, a_scale=acts.scales, b_scale=weights.w13_scale,
                 a_row_div=a_row_div, gated=True, in_place=in_place)
    inter_scales = None
    if weights.fp8:
        inter, inter_scales = quantize_rows(inter)
    grouped_gemm(inter, weights.w2, out, align, tiles.down, a_scale=inter_scales, b_scale=weights.w2_scale,
                 routed_weights=routed_weights, in_place=in_place)
    return out


def moe_standard(acts: Activations, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 weights: PreparedWeights, tiles: MoETiles, one_launch_pairs: int = ONE_LAUNCH_MAX_PAIRS,
                 sum_pairs: bool = True) -> torch.Tensor:
    """[N, H]: every token's routed experts, weighted by their top-k weights and summed; with `sum_pairs` False
    the weighted pair rows unsummed, [N, K, H] (rows of pairs routed elsewhere, id -1, left unwritten, as an
    ExpertOutput may leave them)."""
    num_tokens, top_k = topk_ids.shape
    device = topk_ids.device
    if num_tokens == 0:
        shape = (0, weights.hidden_size) if sum_pairs else (0, top_k, weights.hidden_size)
        return torch.empty(shape, dtype=acts.out_dtype, device=device)
    align = align_standard(topk_ids, weights.num_experts, tiles.block_m, tiles.tail_m, one_launch_pairs)
    pair_rows = torch.empty(num_tokens * top_k, weights.hidden_size, dtype=acts.out_dtype, device=device)
    run_experts(acts, weights, align, pair_rows, tiles, a_row_div=top_k,
                routed_weights=topk_weights.reshape(-1).contiguous())
    if not sum_pairs:
        return pair_rows.view(num_tokens, top_k, -1)
    out = torch.empty(num_tokens, weights.hidden_size, dtype=acts.out_dtype, device=device)
    return sum_topk(pair_rows, topk_ids.contiguous(), out)


def moe_standard_grouped_mm(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            routed_pairs: int, weights: PreparedWeights, gate_up: TileConfig | None = None) -> torch.Tensor:
    """moe_standard through torch._grouped_mm (CUTLASS) for GEMM 2, and for GEMM 1 unless `gate_up` is given: bf16
    on sm90, where rows per expert are many.

    The `routed_pairs` local pairs (the host's count, or an upper bound on it) are grouped by expert with a
    counting sort (group.py: O(pairs), however few of them are local). Then either their rows are gathered once,
    GEMM 1 runs through torch._grouped_mm and SiLU-and-multiply in one pass after it; or, with a `gate_up` tile,
    the Triton kernel's gated GEMM 1 reads the rows by index and writes SiLU(gate) * up at the grouped rows,
    each expert's group padded to whole tiles (two passes over the rows fewer; GEMM 2 also runs the padding
    rows, at most a tile's height per expert). One kernel weights and sums each token's pairs. Group offsets stay
    on the device: no host sync, so a CUDA graph can hold it.
    """
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0 or routed_pairs == 0:
        return torch.zeros(num_tokens, weights.hidden_size, dtype=hidden.dtype, device=hidden.device)
    hidden = hidden.reshape(num_tokens, -1)
    if gate_up is None:
        grouped = group_local_pairs(topk_ids, weights.num_experts, routed_pairs)
        rows = gather_rows(hidden, grouped.token)  # zeros on rows past the true count
        inter = silu_mul(torch._grouped_mm(rows, weights.w13.transpose(1, 2), offs=grouped.offs))
    else:
        align, grouped = align_local_pairs(topk_ids, weights.num_experts, routed_pairs, gate_up.block_m)
        inter = torch.empty(align.num_slots, weights.intermediate_size, dtype=hidden.dtype, device=hidden.device)
        grouped_gemm(hidden, weights.w13, inter, align, gate_up, a_row_div=top_k, gated=True, in_place=True)
    down = torch._grouped_mm(inter, weights.w2.transpose(1, 2), offs=grouped.offs)
    return weighted_pair_sum(down, grouped.pair_row.view(num_tokens, top_k), topk_weights.float(), hidden.dtype)


def align_standard(topk_ids: torch.Tensor, num_experts: int, block_m: int, tail_m: int = 0,
                   one_launch_pairs: int = ONE_LAUNCH_MAX_PAIRS) -> Alignment:
    """The (token, k) pairs of topk_ids [N, K] grouped per expert: read directly for a few tokens, else sorted
    into tiles of block_m + tail_m slots (in one launch up to `one_launch_pairs` pairs, else three)."""
    num_tokens, top_k = topk_ids.shape
    if can_align_direct(num_tokens, top_k, block_m):
        return align_direct(topk_ids, block_m)
    if can_align_in_one_launch(topk_ids.numel(), num_experts, one_launch_pairs):
        return align_pairs_one_launch(topk_ids, num_experts, block_m + tail_m)
    return align_pairs(topk_ids, num_experts, block_m + tail_m)


def moe_grouped_rows(acts: Activations, expert_index: torch.Tensor, group_rows: int,
                     weights: PreparedWeights, tiles: MoETiles) -> torch.Tensor:
    """[M, H] for rows already grouped per expert in groups of `group_rows` (-1 rows come out as zeros)."""
    num_rows = expert_index.numel()
    expert_index = expert_index.contiguous()
    if not tiles.tail_m and can_align_in_place(num_rows, group_rows, tiles.block_m):
        out = torch.empty(num_rows, weights.hidden_size, dtype=acts.out_dtype, device=expert_index.device)
        return run_experts(acts, weights, align_in_place(expert_index, tiles.block_m), out, tiles, in_place=True)
    # Tiles would straddle groups, or have a tail (which needs their rows first): sort the rows like top-1 pairs;
    # rows nobody writes stay zero.
    out = torch.zeros(num_rows, weights.hidden_size, dtype=acts.out_dtype, device=expert_index.device)
    if num_rows == 0:
        return out
    align = align_pairs(expert_index[:, None], weights.num_experts, tiles.block_m + tiles.tail_m)
    return run_experts(acts, weights, align, out, tiles)


def masked_expert_index(counts: torch.Tensor, max_rows: int) -> torch.Tensor:
    """The masked layout's rows as one grouped list: row r of expert e is e when r < counts[e], else -1."""
    num_experts = counts.shape[0]
    slot = torch.arange(max_rows, device=counts.device)
    expert = torch.arange(num_experts, dtype=torch.int32, device=counts.device)
    return torch.where(slot[None, :] < counts[:, None], expert[:, None], -1).reshape(-1)
