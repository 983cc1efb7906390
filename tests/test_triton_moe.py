"""The `triton` fused MoE kernel: equal to the `torch` reference on every layout, dtype and weight format it declares.

Without CUDA the kernels run under Triton's CPU interpreter (slow, so shapes are tiny and odd: with
its 64-wide default tiles, H=72 and I=88 give two K and N tiles, the last partial). With CUDA the same
tests run compiled on the GPU; the `gpu` tests add serving shapes, bf16, poisoned buffers and CUDA graphs.
"""

import json

import attrs
import pytest
import torch
import torch.nn.functional as F

from moeplex.interfaces import (
    BF16,
    FP8_BLOCK,
    ContiguousLayout,
    ExpertWeights,
    MaskedLayout,
    MoEContext,
    StandardLayout,
)
from moeplex.moe.adapters import standard_to_contiguous, standard_to_masked
from moeplex.plugins.moe_kernels.torch_ref import TorchMoEKernel
from moeplex.plugins.moe_kernels.triton_moe.align import (
    align_direct,
    align_in_place,
    align_pairs,
    align_pairs_one_launch,
)
from moeplex.plugins.moe_kernels.triton_moe.configs import (
    INTERPRETER_DEVICE,
    MoETiles,
    TileConfig,
    TileTables,
    dtype_name,
    read_table,
    table_file,
    write_table,
)
from moeplex.kernels.fp8 import quantize_rows
from moeplex.plugins.moe_kernels.triton_moe.fused import align_standard
from moeplex.plugins.moe_kernels.triton_moe.kernel import grouped_gemm, grouped_gemm_kernel
from moeplex.plugins.moe_kernels.triton_moe.plugin import INTERPRETED, TritonMoEKernel
from moeplex.quant import dequantize_activations, dequantize_blocks, quantize_activations, quantize_blocks

from triton_guard import DEVICE, skip_unless_runnable

skip_unless_runnable(grouped_gemm_kernel)
H, I = 72, 88
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2}


def make_weights(experts, hidden, inter, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return ExpertWeights(w13.to(DEVICE, dtype), w2.to(DEVICE, dtype))


def random_routing(tokens, top_k, experts, seed, empty_experts=()):
    """Distinct experts per token; ~15% of pairs on other ranks (-1), none on `empty_experts`, token 1 nowhere here."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=gen).argsort(1)[:, :top_k]
    ids[torch.isin(ids, torch.tensor(empty_experts, dtype=ids.dtype))] = -1
    ids[torch.rand(tokens, top_k, generator=gen) < 0.15] = -1
    ids[1:2] = -1
    return ids.to(DEVICE, torch.int32), torch.rand(tokens, top_k, generator=gen).to(DEVICE)


def relative_error(ours, ref):
    return ((ours.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def w8a8_reference(layout, weights, inter_dtype=torch.float32):
    """What a w8a8 kernel computes: fp8 activations into GEMM 1, the SiLU product re-quantized per 128 columns."""
    w13 = dequantize_blocks(weights.w13, weights.w13_scale).to(layout.hidden.device)
    w2 = dequantize_blocks(weights.w2, weights.w2_scale).to(layout.hidden.device)
    x = dequantize_activations(layout.fp8)

    def expert(rows, e):
        gate, up = (rows @ w13[e].T).chunk(2, -1)
        inter = (F.silu(gate) * up).to(inter_dtype).float()
        padded = F.pad(inter, (0, -inter.shape[-1] % 128))  # zero columns leave every group's amax alone
        return dequantize_activations(quantize_activations(padded))[:, : inter.shape[-1]] @ w2[e].T

    if isinstance(layout, StandardLayout):
        out = torch.zeros(x.shape[0], w2.shape[1], device=x.device)
        for e in range(w13.shape[0]):
            token, k = (layout.topk_ids == e).nonzero(as_tuple=True)
            out.index_add_(0, token, expert(x[token], e) * layout.topk_weights[token, k, None])
        return out
    if isinstance(layout, ContiguousLayout):
        out = torch.zeros(x.shape[0], w2.shape[1], device=x.device)
        for e in range(w13.shape[0]):
            rows = (layout.expert_index == e).nonzero().squeeze(1)
            out[rows] = expert(x[rows], e)
        return out
    out = torch.zeros(*x.shape[:2], w2.shape[1], device=x.device)
    for e, count in enumerate(layout.counts.tolist()):
        out[e, :count] = expert(x[e, :count], e)
    return out


def kernels(dtype, hidden=H, inter=I, experts=8, top_k=8, tables=None):
    ctx = MoEContext(hidden, inter, experts, top_k, dtype, DEVICE)
    return TritonMoEKernel(ctx, tables), TorchMoEKernel(ctx)


def run_both(layout, weights, triton_kernel, torch_kernel):
    ours = triton_kernel.apply(layout, triton_kernel.prepare_weights(weights))
    ref = torch_kernel.apply(layout, torch_kernel.prepare_weights(weights))
    assert (ours.weights_applied, ours.summed) == (ref.weights_applied, ref.summed)
    assert ours.hidden.shape == ref.hidden.shape and ours.hidden.dtype == ref.hidden.dtype
    return ours.hidden, ref.hidden


# --- align -----------------------------------------------------------------------------------------


ALIGN_CASES = [(37, 8, 8, 16), (1, 8, 256, 16), (300, 2, 9, 32), (0, 4, 8, 16)]


@pytest.mark.parametrize("align_fn", [align_pairs, align_pairs_one_launch], ids=["three_launches", "one_launch"])
@pytest.mark.parametrize("tokens,top_k,experts,block_m", ALIGN_CASES)
def test_align_gives_every_routed_pair_one_slot_in_a_tile_of_its_expert(tokens, top_k, experts, block_m, align_fn):
    ids = torch.randint(-1, experts, (tokens, top_k), generator=torch.Generator().manual_seed(tokens), dtype=torch.int32)
    if align_fn is align_pairs_one_launch and tokens == 0:
        with pytest.raises(ValueError, match="one launch"):
            align_fn(ids.to(DEVICE), experts, block_m)
        return
    align = align_fn(ids.to(DEVICE), experts, block_m)
    flat = ids.flatten().long()
    counts = torch.bincount(flat[flat >= 0], minlength=experts)
    align = attrs.evolve(align, **{f: getattr(align, f).cpu() for f in ("sorted_ids", "block_expert", "num_padded")})
    used = int(align.num_padded)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    slots = align.sorted_ids[:used].long()
    real = slots < flat.numel()
    assert sorted(slots[real].tolist()) == (flat >= 0).nonzero().flatten().tolist()
    tile_expert = align.block_expert.long().repeat_interleave(block_m)[:used]
    assert torch.equal(tile_expert[real], flat[slots[real]])
    assert (align.block_expert[: used // block_m] >= 0).all() and (align.block_expert[used // block_m :] == -1).all()


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [case for case in ALIGN_CASES if case[0]] + [(64, 8, 128, 16)])
def test_one_launch_align_is_the_three_launch_align(tokens, top_k, experts, block_m):
    """Pairs keep their order within an expert on both paths, so the slots are the same, not only equivalent."""
    ids = torch.randint(-1, experts, (tokens, top_k), generator=torch.Generator().manual_seed(7), dtype=torch.int64)
    one, three = align_pairs_one_launch(ids.to(DEVICE), experts, block_m), align_pairs(ids.to(DEVICE), experts, block_m)
    used = int(three.num_padded)
    assert int(one.num_padded) == used
    assert torch.equal(one.sorted_ids[:used], three.sorted_ids[:used])
    assert torch.equal(one.block_expert, three.block_expert)
    assert (one.sorted_ids[used:] == ids.numel()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(32, 8, 128, 16), (128, 8, 128, 16), (128, 8, 256, 64)])
def test_gpu_one_launch_align_at_decode_batches(tokens, top_k, experts, block_m):
    test_one_launch_align_is_the_three_launch_align(tokens, top_k, experts, block_m)


def test_align_in_place_keeps_rows_and_skips_padding_tiles():
    expert_index = torch.tensor([2] * 5 + [-1] * 11 + [-1] * 16 + [0] * 16, dtype=torch.int32)
    align = align_in_place(expert_index, 16)
    assert align.block_expert.tolist() == [2, -1, 0]
    assert align.sorted_ids.tolist() == list(range(5)) + [48] * 27 + list(range(32, 48))


def test_quantize_rows_is_bit_exact_with_moeplex_quant():
    x = torch.randn(19, 384) * torch.logspace(-5, 3, 19)[:, None]
    x[0, :128] = torch.arange(128) * 0.5  # many values on rounding ties
    values, scales = quantize_rows(x.to(DEVICE))
    expected = quantize_activations(x.to(DEVICE))
    assert torch.equal(scales, expected.scales)
    assert torch.equal(values.view(torch.uint8), expected.values.view(torch.uint8))


# --- standard layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,top_k,experts", [(37, 8, 8), (29, 1, 8), (13, 3, 11)])
def test_standard_matches_torch(dtype, tokens, top_k, experts):
    triton_kernel, torch_kernel = kernels(dtype, experts=experts, top_k=top_k)
    weights = make_weights(experts, H, I, dtype)
    ids, topk_weights = random_routing(tokens, top_k, experts, seed=tokens, empty_experts=(1, experts - 2))
    hidden = torch.randn(tokens, H).to(DEVICE, dtype)
    hidden[ids.lt(0).all(1)] = float("nan")  # tokens routed nowhere here must not be read
    ours, ref = run_both(StandardLayout(hidden, ids, topk_weights, experts), weights, triton_kernel, torch_kernel)
    assert relative_error(ours, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 8, 64), (4, 8, 8), (3, 1, 8), (16, 2, 4)])
def test_few_tokens_skip_the_sort_and_match_torch(tokens, top_k, experts):
    """Decode sizes read topk_ids directly: every expert once (duplicates across tokens, -1 pairs, empty experts)."""
    triton_kernel, torch_kernel = kernels(torch.float32, experts=experts, top_k=top_k)
    ids, topk_weights = random_routing(tokens, top_k, experts, seed=tokens + top_k, empty_experts=(0,))
    assert align_standard(ids, experts, 16).direct
    hidden = torch.randn(tokens, H, device=DEVICE)
    hidden[ids.lt(0).all(1)] = float("nan")  # tokens routed nowhere here must not be read
    ours, ref = run_both(StandardLayout(hidden, ids, topk_weights, experts), make_weights(experts, H, I, torch.float32),
                         triton_kernel, torch_kernel)
    assert relative_error(ours, ref) <= TOLERANCE[torch.float32]


def test_direct_alignment_refuses_more_tokens_than_a_tile():
    ids = torch.zeros(17, 1, dtype=torch.int32, device=DEVICE)
    assert not align_standard(ids, 8, 16).direct
    with pytest.raises(ValueError, match="direct"):
        align_direct(ids, 16)


def one_entry_tables(tmp_path, tiles, dtype, experts, hidden=H, inter=I, fp8=False):
    """Tables for the interpreter whose one entry serves every token count."""
    write_table(tmp_path / table_file(INTERPRETER_DEVICE, dtype_name(dtype, fp8), experts, inter, hidden), {1: tiles})
    return TileTables(INTERPRETER_DEVICE, tmp_path)


def tma_tables(tmp_path, dtype, experts, block_m=16):
    """Both GEMMs' weight tiles through tensor descriptors (K and N tails included at H=72, I=88)."""
    return one_entry_tables(tmp_path, MoETiles.both(TileConfig(block_m, block_n=32, block_k=64, tma=True)), dtype, experts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout_name", ["standard", "contiguous", "masked"])
def test_tiles_with_a_tail_run_at_the_height_their_rows_need_and_match_torch(tmp_path, dtype, layout_name):
    """16 + 16-slot tiles: experts of at most 16 rows, of 17-32 (both parts at once) and of more (two tiles)."""
    tiles = MoETiles.both(TileConfig(16, 64, 64, tail_m=16))
    triton_kernel, torch_kernel = kernels(dtype, experts=8, top_k=4, tables=one_entry_tables(tmp_path, tiles, dtype, 8))
    ids, topk_weights = random_routing(45, 4, 8, seed=11, empty_experts=(5,))
    ids[2:22, 0] = 7  # expert 7 gets more than one tile
    standard = StandardLayout(torch.randn(45, H).to(DEVICE, dtype), ids, topk_weights, 8)
    layout = {
        "standard": lambda: standard,
        "contiguous": lambda: standard_to_contiguous(standard, 32)[0],
        "masked": lambda: standard_to_masked(standard, 32)[0],
    }[layout_name]()
    rows = torch.bincount(ids[ids >= 0].long(), minlength=8)
    last_tile = (rows - 1) % 32 + 1
    assert ((last_tile > 0) & (last_tile <= 16)).any() and (last_tile > 16).any() and (rows > 32).any()
    ours, ref = run_both(layout, make_weights(8, H, I, dtype), triton_kernel, torch_kernel)
    assert relative_error(ours, ref) <= TOLERANCE[dtype]
    if layout_name == "contiguous":  # sorted, not in place: padding rows are nobody's and stay zero
        padding = ours[layout.expert_index < 0]
        assert torch.equal(padding, torch.zeros_like(padding))


def test_a_tile_with_a_tail_takes_an_alignment_of_its_slots():
    ids, _ = random_routing(45, 4, 8, seed=1)
    with pytest.raises(ValueError, match="slots"):
        grouped_gemm(torch.zeros(45, H, device=DEVICE), torch.zeros(8, 2 * I, H, device=DEVICE),
                     torch.empty(180, I, device=DEVICE), align_pairs(ids, 8, 16), TileConfig(16, 64, 64, tail_m=16),
                     a_row_div=4, gated=True)


def test_zero_tokens_and_unrouted_tokens_give_zeros():
    triton_kernel, torch_kernel = kernels(torch.float32)
    weights = make_weights(8, H, I, torch.float32)
    empty = StandardLayout(torch.empty(0, H, device=DEVICE), torch.empty(0, 8, dtype=torch.int32, device=DEVICE),
                           torch.empty(0, 8, device=DEVICE), 8)
    assert run_both(empty, weights, triton_kernel, torch_kernel)[0].shape == (0, H)
    nowhere = StandardLayout(torch.randn(3, H, device=DEVICE), torch.full((3, 8), -1, dtype=torch.int32, device=DEVICE),
                             torch.rand(3, 8, device=DEVICE), 8)
    assert torch.equal(run_both(nowhere, weights, triton_kernel, torch_kernel)[0], torch.zeros(3, H, device=DEVICE))


# --- contiguous and masked layouts -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("alignment", [1, 16, 128])  # 1 sorts the rows; 16 and 128 use them in place
def test_contiguous_matches_torch(dtype, alignment):
    triton_kernel, torch_kernel = kernels(dtype)
    ids, topk_weights = random_routing(23, 4, 8, seed=alignment, empty_experts=(3,))
    standard = StandardLayout(torch.randn(23, H).to(DEVICE, dtype), ids, topk_weights, 8)
    layout, _ = standard_to_contiguous(standard, alignment)
    hidden = layout.hidden.clone()
    hidden[layout.expert_index < 0] = float("nan")  # padding rows must never be read
    layout = ContiguousLayout(hidden, layout.expert_index, 8, alignment)
    ours, ref = run_both(layout, make_weights(8, H, I, dtype), triton_kernel, torch_kernel)
    assert relative_error(ours, ref) <= TOLERANCE[dtype]
    assert torch.equal(ours[layout.expert_index < 0], torch.zeros_like(ours[layout.expert_index < 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("max_rows", [32, 24])  # 32 rows are whole tiles; 24 straddle them and get sorted
def test_masked_matches_torch(dtype, max_rows):
    triton_kernel, torch_kernel = kernels(dtype)
    counts = torch.tensor([5, 0, max_rows, 17, 1, 0, 3, 16], dtype=torch.int32, device=DEVICE)
    hidden = torch.full((8, max_rows, H), float("nan"), dtype=dtype, device=DEVICE)  # rows past a count must never be read
    for expert, count in enumerate(counts.tolist()):
        hidden[expert, :count] = torch.randn(count, H).to(DEVICE, dtype)
    ours, ref = run_both(MaskedLayout(hidden, counts), make_weights(8, H, I, dtype), triton_kernel, torch_kernel)
    assert relative_error(ours, ref) <= TOLERANCE[dtype]
    valid = torch.arange(max_rows, device=DEVICE)[None, :] < counts[:, None]
    assert torch.equal(ours[~valid], torch.zeros_like(ours[~valid]))


# --- fp8 with 128x128 weight blocks ----------------------------------------------------------------

FP8_H, FP8_I = 256, 192  # gate and up rows share a 128-row scale block; I ends in a partial group


def fp8_tables(tmp_path):
    """A tuned table for the interpreter: one K tile per scale group keeps the CPU run short; 20 tokens fill tails."""
    tiles = MoETiles.both(TileConfig(block_m=16, block_n=64, block_k=128, tail_m=16))
    return one_entry_tables(tmp_path, tiles, torch.float32, 8, FP8_H, FP8_I, fp8=True)


@pytest.mark.parametrize("layout_name", ["standard", "direct", "contiguous", "masked"])
def test_fp8_block_matches_a_w8a8_emulation_and_torch(tmp_path, layout_name):
    triton_kernel, torch_kernel = kernels(torch.float32, FP8_H, FP8_I, top_k=4, tables=fp8_tables(tmp_path))
    w13, w2 = make_weights(8, FP8_H, FP8_I, torch.float32).w13, make_weights(8, FP8_H, FP8_I, torch.float32, seed=1).w2
    (q13, s13), (q2, s2) = quantize_blocks(w13), quantize_blocks(w2)
    weights = ExpertWeights(q13, q2, FP8_BLOCK, s13, s2)
    tokens = 3 if layout_name == "direct" else 36  # 3 tokens align directly; 36 fill some tiles past BLOCK_M
    ids, topk_weights = random_routing(tokens, 4, 8, seed=2, empty_experts=(6,))
    standard = StandardLayout(torch.randn(tokens, FP8_H, device=DEVICE), ids, topk_weights, 8)
    layout = {
        "standard": lambda: standard,
        "direct": lambda: standard,
        "contiguous": lambda: standard_to_contiguous(standard, 16)[0],
        "masked": lambda: standard_to_masked(standard, 16)[0],
    }[layout_name]()
    layout = attrs.evolve(layout, fp8=quantize_activations(layout.hidden))  # GEMM 1 takes the payload as it is
    ours, ref = run_both(layout, weights, triton_kernel, torch_kernel)
    emulated = w8a8_reference(layout, weights)
    assert relative_error(ours, emulated) <= 5e-3
    assert relative_error(ours, ref) <= 6e-2  # the reference does not quantize the intermediate activations


def test_fp8_payload_with_plain_weights_is_dequantized():
    triton_kernel, torch_kernel = kernels(torch.float32, FP8_H, FP8_I, top_k=2)
    ids, topk_weights = random_routing(9, 2, 8, seed=3)
    hidden = torch.randn(9, FP8_H, device=DEVICE)
    layout = StandardLayout(hidden, ids, topk_weights, 8, fp8=quantize_activations(hidden))
    ours, ref = run_both(layout, make_weights(8, FP8_H, FP8_I, torch.float32), triton_kernel, torch_kernel)
    assert relative_error(ours, ref) <= TOLERANCE[torch.float32]


# --- capabilities and tile tables ------------------------------------------------------------------


def test_caps_follow_how_triton_runs_the_kernels():
    caps = TritonMoEKernel.caps
    assert caps.graph_safe and caps.weight_formats == {BF16, FP8_BLOCK}
    assert caps.alignment % 128 == 0
    if INTERPRETED:
        assert not caps.needs_gpu and torch.bfloat16 not in caps.dtypes
    else:
        assert caps.needs_gpu and torch.bfloat16 in caps.dtypes


def test_tile_table_picks_the_nearest_rows_per_expert_and_defaults_without_one(tmp_path):
    small = MoETiles(TileConfig(16, 32, 64), TileConfig(16, 128, 128, num_stages=5))
    large = MoETiles.both(TileConfig(64, 128, 64, group_m=8, num_warps=8, num_stages=4))
    write_table(tmp_path / table_file("dev", "bf16", 8, I, H), {0.5: small, 128: large})
    tables = TileTables("dev", tmp_path)
    pick = lambda rows, e=8: tables.pick(rows, dtype="bf16", num_experts=e, intermediate=I, hidden=H)  # noqa: E731
    # nearest on a log scale: 7 rows is nearer 0.5 (2^-1) than 128 (2^7); 9 rows is nearer 128
    assert (pick(0.03), pick(7), pick(9), pick(4096)) == (small, small, large, large)
    assert pick(1).gate_up != pick(1).down  # each GEMM keeps its own tile
    assert pick(1, e=9).block_m in (16, 32, 64)  # no table for 9 experts: a default


def test_tiles_are_looked_up_by_the_rows_each_expert_receives():
    """512 rows of top-8: 16 rows per expert when routing spreads over 8 EP ranks' 256 experts, 128 when all
    eight land on the 32 local experts (the dispatcher says so through routed_pairs), whatever M is."""
    kernel = TritonMoEKernel(MoEContext(H, I, 256, 8, torch.float32, torch.device("cpu"), ep_rank=0, ep_size=8))
    ids, weights, hidden = torch.zeros(512, 8, dtype=torch.int32), torch.ones(512, 8), torch.zeros(512, H)
    assert kernel.rows_per_expert(StandardLayout(hidden, ids, weights, 32)) == 16  # unknown: uniform over EP
    assert kernel.rows_per_expert(StandardLayout(hidden, ids, weights, 32, routed_pairs=4096)) == 128
    contiguous = ContiguousLayout(torch.zeros(32 * 128, H), torch.zeros(32 * 128, dtype=torch.int32), 32, 128)
    assert kernel.rows_per_expert(contiguous) == 128  # the padded rows: an upper bound
    assert kernel.rows_per_expert(attrs.evolve(contiguous, routed_pairs=320)) == 10
    masked = MaskedLayout(torch.zeros(32, 256, H), torch.zeros(32, dtype=torch.int32), None, expected_rows=3)
    assert kernel.rows_per_expert(masked) == 3


def test_tile_table_entries_of_one_tile_serve_both_gemms(tmp_path):
    one = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 3}
    (tmp_path / "table.json").write_text(json.dumps({"16": one}))
    assert read_table(tmp_path / "table.json") == {16: MoETiles.both(TileConfig(32, 64, 64, 8, 4, 3))}
    tuned = MoETiles(TileConfig(64, 128, 64, tma=True, tail_m=16), TileConfig(64, 256, 64, tail_m=16))
    write_table(tmp_path / "tuned.json", {0.03125: tuned, 128: tuned})
    assert read_table(tmp_path / "tuned.json") == {0.03125: tuned, 128.0: tuned}


@pytest.mark.parametrize("tail_m", [8, 24, 128])
def test_a_tail_must_be_a_power_of_two_up_to_block_m(tail_m):
    with pytest.raises(ValueError, match="TAIL_SIZE_M"):
        TileConfig(64, 64, 64, tail_m=tail_m)


def test_the_two_gemms_must_share_block_m_and_tail_m():
    with pytest.raises(ValueError, match="BLOCK_M"):
        MoETiles(TileConfig(16, 64, 64), TileConfig(32, 64, 64))
    with pytest.raises(ValueError, match="TAIL_M"):
        MoETiles(TileConfig(32, 64, 64, tail_m=16), TileConfig(32, 64, 64))


# --- GPU: bf16 and fp8 at serving shapes, every buffer poisoned, CUDA-graph replay ------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the kernels compile for it")
GPU_E, GPU_H, GPU_I, GPU_TOP_K = 32, 2048, 768, 8  # Qwen3-30B-A3B's experts, 32 of them on this rank


def poison_cuda_allocator():
    """Leave NaN in the allocator's cached blocks, so any output or buffer element the kernel never writes shows."""
    torch.cuda.empty_cache()
    blocks = [torch.full((n,), float("nan"), device="cuda") for n in [2**28] + [2**17] * 64]
    del blocks


def gpu_case(tokens, fp8=False, shape=(GPU_E, GPU_H, GPU_I)):
    experts, hidden, inter = shape
    ctx = MoEContext(hidden, inter, experts, GPU_TOP_K, torch.bfloat16, torch.device("cuda"))
    master = make_weights(experts, hidden, inter, torch.float32)
    if fp8:
        (q13, s13), (q2, s2) = quantize_blocks(master.w13), quantize_blocks(master.w2)
        weights = ExpertWeights(q13, q2, FP8_BLOCK, s13, s2)
    else:
        weights = ExpertWeights(master.w13.bfloat16(), master.w2.bfloat16())
    ids, topk_weights = random_routing(tokens, GPU_TOP_K, experts, seed=tokens)
    layout = StandardLayout(torch.randn(tokens, hidden, device="cuda").bfloat16(), ids, topk_weights, experts)
    return TritonMoEKernel(ctx), layout, weights


def fp32_reference(layout, weights):
    experts, inter, hidden = weights.w13.shape[0], weights.w2.shape[2], weights.w2.shape[1]
    ctx = MoEContext(hidden, inter, experts, GPU_TOP_K, torch.float32, torch.device("cuda"))
    fp32 = ExpertWeights(weights.w13.float(), weights.w2.float())
    reference = TorchMoEKernel(ctx)
    return reference.apply(attrs.evolve(layout, hidden=layout.hidden.float()), reference.prepare_weights(fp32)).hidden


def apply_poisoned(kernel, layout, weights):
    prepared = kernel.prepare_weights(weights)
    poison_cuda_allocator()
    return kernel.apply(layout, prepared).hidden


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 2048])
def test_gpu_bf16_matches_fp32(tokens):
    kernel, layout, weights = gpu_case(tokens)
    assert relative_error(apply_poisoned(kernel, layout, weights), fp32_reference(layout, weights)) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 3, 512, 4096])
def test_gpu_tuned_deepseek_v3_ep8_tiles_match_fp32(tokens):
    """DeepSeek-V3's experts as one EP8 rank holds them, with the tuned table's tiles (direct decode, TMA) on the H200."""
    kernel, layout, weights = gpu_case(tokens, shape=(32, 7168, 2048))
    assert relative_error(apply_poisoned(kernel, layout, weights), fp32_reference(layout, weights)) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("library", [False, True])
def test_gpu_many_rows_per_expert_match_fp32_on_both_gemm_paths(library):
    """From GROUPED_MM_MIN_ROWS rows per expert bf16 runs torch._grouped_mm; both paths agree with fp32, in a graph too."""
    kernel, layout, weights = gpu_case(1024)
    # an upper bound on the host's count (as the local dispatcher gives: top-k per row), so pairs routed elsewhere
    # sort into the counted range too and must be masked out
    layout = attrs.evolve(layout, routed_pairs=layout.topk_ids.numel())
    if not kernel.grouped_mm_min_rows < float("inf"):
        pytest.skip("torch._grouped_mm's kernels need sm90")
    kernel.grouped_mm_min_rows = 0 if library else float("inf")
    assert relative_error(apply_poisoned(kernel, layout, weights), fp32_reference(layout, weights)) <= 1e-2
    prepared = kernel.prepare_weights(weights)
    kernel.apply(layout, prepared)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel.apply(layout, prepared).hidden
    _, fresh, _ = gpu_case(1025)
    layout.hidden.copy_(fresh.hidden[:1024])
    layout.topk_ids.copy_(fresh.topk_ids[:1024])
    graph.replay()
    assert relative_error(captured, fp32_reference(layout, weights)) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout_name", ["contiguous", "masked"])
def test_gpu_grouped_layouts_match_fp32(layout_name):
    kernel, standard, weights = gpu_case(300)
    convert = standard_to_contiguous if layout_name == "contiguous" else standard_to_masked
    layout, _ = convert(standard, 128)
    ours = apply_poisoned(kernel, layout, weights)
    assert relative_error(ours, fp32_reference(layout, weights)) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 2048])
def test_gpu_fp8_block_matches_a_w8a8_emulation(tokens):
    kernel, layout, weights = gpu_case(tokens, fp8=True)
    ours = apply_poisoned(kernel, layout, weights)  # quantizes the bf16 activations itself
    emulated = w8a8_reference(attrs.evolve(layout, fp8=quantize_activations(layout.hidden)), weights, torch.bfloat16)
    assert relative_error(ours, emulated) <= 1e-2
    assert relative_error(ours, fp32_reference(layout, ExpertWeights(
        dequantize_blocks(weights.w13, weights.w13_scale), dequantize_blocks(weights.w2, weights.w2_scale)))) <= 6e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout_name", ["standard", "masked"])
def test_gpu_replays_in_a_cuda_graph(layout_name):
    kernel, layout, weights = gpu_case(64)
    if layout_name == "masked":
        layout, _ = standard_to_masked(layout, 128)
    prepared = kernel.prepare_weights(weights)
    kernel.apply(layout, prepared)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel.apply(layout, prepared).hidden
    _, fresh, _ = gpu_case(65)  # new routing and activations, written into the captured buffers
    layout.hidden.copy_(fresh.hidden[:64] if layout_name == "standard" else layout.hidden.flip(1))
    if layout_name == "standard":
        layout.topk_ids.copy_(fresh.topk_ids[:64])
        layout.topk_weights.copy_(fresh.topk_weights[:64])
    else:
        layout.counts.copy_(layout.counts.flip(0))
    graph.replay()
    assert torch.equal(captured, kernel.apply(layout, prepared).hidden)
