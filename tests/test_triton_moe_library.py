"""The `triton` kernel's library path (torch._grouped_mm for both GEMMs) and the counting sort that feeds it.

The grouping must equal a stable argsort of the local ids (so the path computes exactly what the argsort-based
path did) for any routing: experts with no local pair, all pairs local, none local, ids of other ranks (-1, or
past the local experts), and a host count that is only an upper bound. torch._grouped_mm runs on CPU in fp32, and
the Triton kernels around it under the interpreter, so the whole path is checked here against the `torch` kernel.
"""

import pytest
import torch

from moeplex.interfaces import ExpertWeights, MoEContext, StandardLayout
from moeplex.plugins.moe_kernels.torch_ref import TorchMoEKernel
from moeplex.plugins.moe_kernels.triton_moe.fused import Activations, PreparedWeights, moe_standard_grouped_mm
from moeplex.plugins.moe_kernels.triton_moe.configs import TileConfig
from moeplex.plugins.moe_kernels.triton_moe.group import CHUNK, _place_kernel, align_local_pairs, group_local_pairs
from moeplex.plugins.moe_kernels.triton_moe.plugin import GROUPED_MM_MIN_ROWS, TritonMoEKernel

from triton_guard import DEVICE, skip_unless_runnable

skip_unless_runnable(_place_kernel)
needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")


def routing(tokens, top_k, experts, local_share, seed, empty_experts=(), far_ids=False):
    """Top-k ids of which about `local_share` are local experts; the rest -1 (or, with far_ids, ids past them)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    ids[torch.isin(ids, torch.tensor(empty_experts, dtype=ids.dtype))] = -1
    elsewhere = torch.rand(tokens, top_k, generator=gen) >= local_share
    ids[elsewhere] = experts + ids[elsewhere] if far_ids else -1
    return ids.to(DEVICE, torch.int32)


def argsort_grouping(ids, experts):
    """The reference: local pairs in a stable argsort's order, each pair's row in it, each expert's end row."""
    flat = ids.reshape(-1).long().cpu()
    local = (flat >= 0) & (flat < experts)
    order = torch.argsort(torch.where(local, flat, experts), stable=True)[: int(local.sum())]
    pair_row = torch.full_like(flat, -1)
    pair_row[order] = torch.arange(order.numel())
    ends = torch.bincount(flat[local], minlength=experts).cumsum(0)
    return order // ids.shape[1], pair_row, ends


GROUPING_CASES = {  # tokens, top_k, experts, local share, experts with no local pair, other ranks' ids past ours
    "ep8_global": (300, 8, 32, 1 / 8, (), False),
    "all_local": (37, 8, 8, 1.0, (), False),
    "none_local": (50, 4, 8, 0.0, (), False),
    "empty_experts": (200, 8, 16, 0.5, (0, 3, 15), False),
    "far_ids": (90, 6, 11, 0.3, (2,), True),
    "one_expert": (3, 1, 1, 1.0, (), False),
    "many_chunks": (4 * CHUNK + 5, 8, 70, 0.25, (69,), False),  # more experts than place sums in one step
}


@pytest.mark.parametrize("case", list(GROUPING_CASES))
def test_counting_sort_equals_a_stable_argsort_of_the_local_ids(case):
    tokens, top_k, experts, share, empty, far = GROUPING_CASES[case]
    ids = routing(tokens, top_k, experts, share, seed=tokens, empty_experts=empty, far_ids=far)
    token, pair_row, ends = argsort_grouping(ids, experts)
    grouped = group_local_pairs(ids, experts, token.numel())
    assert torch.equal(grouped.token.cpu().long(), token)
    assert torch.equal(grouped.pair_row.cpu().long(), pair_row)
    assert torch.equal(grouped.offs.cpu().long(), ends)


def test_rows_past_an_upper_bound_count_are_unfilled_and_a_low_count_drops_pairs_in_bounds():
    ids = routing(64, 8, 16, 0.25, seed=1)
    token, pair_row, ends = argsort_grouping(ids, 16)
    bound = group_local_pairs(ids, 16, ids.numel())  # e.g. the local dispatcher's top-k per row
    assert torch.equal(bound.token[: token.numel()].cpu().long(), token)
    assert (bound.token[token.numel():] == -1).all()
    assert torch.equal(bound.pair_row.cpu().long(), pair_row) and torch.equal(bound.offs.cpu().long(), ends)
    short = group_local_pairs(ids, 16, token.numel() - 10)
    assert torch.equal(short.offs.cpu().long(), ends.clamp(max=token.numel() - 10))
    assert torch.equal(short.pair_row.cpu().long(), torch.where(pair_row < token.numel() - 10, pair_row, -1))


def test_no_pairs_give_empty_groups():
    grouped = group_local_pairs(torch.empty(0, 8, dtype=torch.int32, device=DEVICE), 4, 0)
    assert grouped.token.numel() == 0 and grouped.pair_row.numel() == 0 and (grouped.offs == 0).all()


@pytest.mark.parametrize("case", list(GROUPING_CASES))
@pytest.mark.parametrize("block_m", [1, 16])
def test_padded_grouping_puts_each_experts_pairs_at_the_start_of_its_own_tiles(case, block_m):
    """align_local_pairs: the counting sort's order, each expert's group starting on a tile, the sentinel on
    padding, every tile's expert, and the padded ends (GEMM 2's offsets)."""
    tokens, top_k, experts, share, empty, far = GROUPING_CASES[case]
    ids = routing(tokens, top_k, experts, share, seed=tokens, empty_experts=empty, far_ids=far)
    token, _, ends = argsort_grouping(ids, experts)
    align, grouped = align_local_pairs(ids, experts, token.numel(), block_m)
    counts = torch.diff(ends, prepend=torch.zeros(1, dtype=ends.dtype))
    padded_ends = ((counts + block_m - 1) // block_m * block_m).cumsum(0)
    assert torch.equal(grouped.offs.cpu().long(), padded_ends)
    assert int(align.num_padded) == (int(padded_ends[-1]) if experts else 0) <= align.num_slots
    slots = align.sorted_ids.cpu().long()
    expected = torch.full((align.num_slots,), ids.numel(), dtype=torch.long)
    flat = ids.reshape(-1).cpu().long()
    local = torch.nonzero((flat >= 0) & (flat < experts)).flatten()
    order = local[torch.argsort(flat[local], stable=True)]
    starts = padded_ends - (counts + block_m - 1) // block_m * block_m
    rank = torch.arange(order.numel()) - torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])[flat[order]]
    expected[starts[flat[order]] + rank] = order
    assert torch.equal(slots, expected)
    pair_row = torch.full_like(flat, -1)
    pair_row[order] = starts[flat[order]] + rank
    assert torch.equal(grouped.pair_row.cpu().long(), pair_row)
    if block_m > 1:
        tiles = torch.arange(int(align.num_padded) // block_m)
        assert torch.equal(align.block_expert[: tiles.numel()].cpu().long(),
                           torch.searchsorted(padded_ends, tiles * block_m, right=True))
        assert (align.block_expert[tiles.numel():] == -1).all()


@pytest.mark.gpu
def test_gpu_counting_sort_at_ep8_global_16384_tokens():
    """DeepSeek-V3 on rank 0 of EP8: 16384 tokens' top-8 over 256 experts, ~16k of the 131k pairs local."""
    ids = routing(16384, 8, 32, 1 / 8, seed=0)
    token, pair_row, ends = argsort_grouping(ids, 32)
    grouped = group_local_pairs(ids, 32, token.numel())
    assert torch.equal(grouped.token.cpu().long(), token)
    assert torch.equal(grouped.pair_row.cpu().long(), pair_row)
    assert torch.equal(grouped.offs.cpu().long(), ends)


@pytest.mark.gpu
def test_gpu_gated_gemm1_at_ep8_global_16384_tokens_matches_the_cutlass_gemm1():
    """The plugin's tile for the gated GEMM 1 (TMA, bf16) at the size it is chosen for: the same MoE output as
    gather + CUTLASS + SiLU-and-multiply, up to bf16 rounding of the intermediate."""
    from moeplex.plugins.moe_kernels.triton_moe.plugin import GATED_GEMM1_TILE

    tokens, top_k, experts, hidden, inter = 16384, 8, 32, 7168, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).bfloat16()
    weights = PreparedWeights(w13, w2)
    ids = routing(tokens, top_k, experts, 1 / 8, seed=0)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    topk_weights = torch.rand(tokens, top_k, device="cuda", generator=gen)
    pairs = int((ids >= 0).sum())
    cutlass = moe_standard_grouped_mm(x, ids, topk_weights, pairs, weights)
    gated = moe_standard_grouped_mm(x, ids, topk_weights, pairs, weights, GATED_GEMM1_TILE)
    torch.testing.assert_close(gated.float(), cutlass.float(), rtol=2e-2, atol=2e-2)


@needs_grouped_mm
@pytest.mark.parametrize("share,upper_bound", [(1 / 8, False), (1.0, False), (1 / 8, True)],
                         ids=["global", "local", "global_upper_bound"])
@pytest.mark.parametrize("gate_up", [None, TileConfig(16, 32, 16, num_warps=2, num_stages=1)], ids=["cutlass_gemm1", "gated_gemm1"])
def test_library_path_matches_the_torch_kernel(share, upper_bound, gate_up):
    tokens, top_k, experts, hidden, inter = 24, 8, 8, 48, 40
    gen = torch.Generator().manual_seed(3)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    weights = ExpertWeights(w13.to(DEVICE), w2.to(DEVICE))
    ids = routing(tokens, top_k, experts, share, seed=5, empty_experts=(6,))
    layout = StandardLayout(torch.randn(tokens, hidden, generator=gen).to(DEVICE), ids,
                            torch.rand(tokens, top_k, generator=gen).to(DEVICE), experts,
                            routed_pairs=ids.numel() if upper_bound else int((ids >= 0).sum()))
    ours = moe_standard_grouped_mm(layout.hidden, ids, layout.topk_weights, layout.routed_pairs,
                                   PreparedWeights.from_expert_weights(weights), gate_up)
    reference = TorchMoEKernel(MoEContext(hidden, inter, experts, top_k, torch.float32, DEVICE))
    ref = reference.apply(layout, reference.prepare_weights(weights)).hidden
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_rows_per_expert_alone_sends_bf16_to_the_library_gemms_whatever_share_is_local():
    """EP8-global routing (an eighth of the ids local) takes the library GEMMs from GROUPED_MM_MIN_ROWS rows per
    expert, as local routing does; below it, or in fp8, the fused kernel."""
    experts, top_k = 2, 8
    kernel = TritonMoEKernel(MoEContext(16, 16, experts, top_k, torch.bfloat16, DEVICE))
    kernel.grouped_mm_min_rows = GROUPED_MM_MIN_ROWS  # as on an sm90 GPU
    weights = PreparedWeights(torch.empty(experts, 32, 16), torch.empty(experts, 16, 16))

    def library(rows_per_expert, share):
        pairs = rows_per_expert * experts
        tokens = int(pairs / share) // top_k
        layout = StandardLayout(torch.empty(tokens, 16, dtype=torch.bfloat16), torch.empty(tokens, top_k),
                                torch.empty(tokens, top_k), experts, routed_pairs=pairs)
        acts = Activations(layout.hidden, None, torch.bfloat16)
        return kernel._library_gemms(layout, kernel.rows_per_expert(layout), weights, acts)

    assert library(GROUPED_MM_MIN_ROWS, 1 / 8) and library(GROUPED_MM_MIN_ROWS, 1.0)
    assert not library(GROUPED_MM_MIN_ROWS - 1, 1 / 8) and not library(GROUPED_MM_MIN_ROWS - 1, 1.0)


def test_the_gated_gemm1_runs_only_inside_its_window_of_rows_per_expert(monkeypatch):
    """The library path takes the Triton gated GEMM 1 from GATED_GEMM1_MIN_ROWS rows per expert up to (not at)
    GATED_GEMM1_MAX_ROWS, where CUTLASS's GEMM 1 wins again; outside it the gather + CUTLASS + SiLU path."""
    from moeplex.plugins.moe_kernels.triton_moe import plugin

    chosen = []
    monkeypatch.setattr(plugin, "moe_standard_grouped_mm",
                        lambda hidden, ids, weights, pairs, prepared, gate_up=None: chosen.append(gate_up) or hidden)
    experts, top_k = 2, 8
    kernel = TritonMoEKernel(MoEContext(16, 16, experts, top_k, torch.bfloat16, DEVICE))
    kernel.grouped_mm_min_rows = GROUPED_MM_MIN_ROWS  # as on an sm90 GPU
    weights = PreparedWeights(torch.empty(experts, 32, 16, dtype=torch.bfloat16),
                              torch.empty(experts, 16, 16, dtype=torch.bfloat16))
    for rows_per_expert in (plugin.GATED_GEMM1_MIN_ROWS - 1, plugin.GATED_GEMM1_MIN_ROWS,
                            plugin.GATED_GEMM1_MAX_ROWS - 1, plugin.GATED_GEMM1_MAX_ROWS):
        tokens = rows_per_expert * experts // top_k + 1
        layout = StandardLayout(torch.empty(tokens, 16, dtype=torch.bfloat16), torch.zeros(tokens, top_k),
                                torch.empty(tokens, top_k), experts, routed_pairs=rows_per_expert * experts)
        kernel.apply(layout, weights)
    assert chosen == [None, plugin.GATED_GEMM1_TILE, plugin.GATED_GEMM1_TILE, None]
