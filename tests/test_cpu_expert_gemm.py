"""moeplex's C++ expert GEMM (kernels/csrc/expert_gemm.cpp, the `streamed` way of CpuExperts) equals the fp64
pair-by-pair reference: every row count of an expert's tile (1 to beyond one tile), experts with no rows, other
ranks' pairs (-1), fp32 and bf16 weights; the packing is a pure relayout. The bf16 tile form (Intel AMX) equals the
same reference where the processor has AMX."""

import pytest
import torch

from moeplex.interfaces.kernels import pack_for_streaming, streamed_experts, streams, streams_on_tiles
from moeplex.kernels import cpu_ext
from test_torch_moe_kernel import per_pair_reference

pytestmark = pytest.mark.skipif(
    cpu_ext.why_not("expert_gemm") is not None, reason=f"the C++ kernel does not build here: {cpu_ext.why_not('expert_gemm')}"
)


def weights(experts, hidden, inter, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    return w13, w2, gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_rows_per_expert_count_matches_the_reference(dtype):
    """Expert e gets e + 1 rows (1 .. 20: every tile size and more than one tile), the last expert none."""
    experts, hidden, inter = 21, 48, 32
    w13, w2, gen = weights(experts, hidden, inter, dtype)
    assert streams(w13, w2)
    ids = torch.cat([torch.full((e + 1,), e) for e in range(experts - 1)])[torch.randperm(210, generator=gen)]
    topk_ids = torch.stack([ids, torch.where(ids % 3 == 0, -1, (ids + 1) % (experts - 1))], dim=1)  # -1: another rank's
    tokens = topk_ids.shape[0]
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    topk_weights = torch.rand(tokens, 2, generator=gen)
    out = streamed_experts(x, topk_ids, topk_weights, pack_for_streaming(w13, w2))
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    reference = per_pair_reference(x, topk_ids, topk_weights, w13, w2)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding (sums and activations fp32)
    assert (out.double() - reference).abs().max() <= tol * reference.abs().max()


def test_tiles_match_the_reference_for_every_rows_per_expert_count():
    """Expert e gets e + 1 rows (1 .. 34: within one 16-row tile and across three), the last expert none."""
    experts, hidden, inter = 35, 64, 96
    w13, w2, gen = weights(experts, hidden, inter, torch.bfloat16)
    packed = pack_for_streaming(w13, w2)
    if not streams_on_tiles(packed):
        pytest.skip("no AMX tile unit granted on this processor (or no AVX-512 BF16 pair packing)")
    ids = torch.cat([torch.full((e + 1,), e) for e in range(experts - 1)])
    ids = ids[torch.randperm(len(ids), generator=gen)]
    topk_ids = torch.stack([ids, torch.where(ids % 3 == 0, -1, (ids + 1) % (experts - 1))], dim=1)  # -1: another rank's
    x = torch.randn(len(ids), hidden, generator=gen).bfloat16()
    topk_weights = torch.rand(len(ids), 2, generator=gen)
    out = streamed_experts(x, topk_ids, topk_weights, packed, tiles=True)
    reference = per_pair_reference(x, topk_ids, topk_weights, w13, w2)
    assert (out.double() - reference).abs().max() <= 1e-2 * reference.abs().max()
    torch.testing.assert_close(out, streamed_experts(x, topk_ids, topk_weights, packed), rtol=2e-2, atol=2e-2)
    assert not streams_on_tiles(pack_for_streaming(*weights(2, 48, 32, torch.bfloat16)[:2]))  # 48: not whole 32s


def test_packing_is_a_relayout_and_unfit_shapes_are_not_taken():
    w13, w2, _ = weights(3, 32, 16, torch.float32)
    gate_up, down = pack_for_streaming(w13, w2)
    # block b of 16 intermediate columns, input column k: gate then up weights of those 16 columns
    torch.testing.assert_close(gate_up[1, 0, 5], torch.cat((w13[1, 0:16, 5], w13[1, 16:32, 5])), rtol=0, atol=0)
    torch.testing.assert_close(down[2, 1, 7], w2[2, 16:32, 7], rtol=0, atol=0)
    w13b, w2b = w13.bfloat16(), w2.bfloat16()
    gate_up, down = pack_for_streaming(w13b, w2b)
    if gate_up.shape[-1] == 64:  # AVX-512 BF16: each column's weights for two consecutive inputs side by side
        torch.testing.assert_close(gate_up[1, 0, 5, :32].view(16, 2), w13b[1, 0:16, 10:12], rtol=0, atol=0)
        torch.testing.assert_close(gate_up[1, 0, 5, 32:].view(16, 2), w13b[1, 16:32, 10:12], rtol=0, atol=0)
        torch.testing.assert_close(down[2, 1, 3].view(16, 2), w2b[2, 16:32, 6:8], rtol=0, atol=0)
    else:
        torch.testing.assert_close(gate_up[1, 0, 5], torch.cat((w13b[1, 0:16, 5], w13b[1, 16:32, 5])), rtol=0, atol=0)
    assert not streams(*weights(3, 40, 16, torch.float32)[:2])  # hidden 40: not whole 16-column blocks
    assert not streams(w13.half(), w2.half())  # fp16: not one of the kernel's dtypes


def test_no_tokens_and_no_pairs_here():
    w13, w2, gen = weights(4, 32, 16, torch.float32)
    packed = pack_for_streaming(w13, w2)
    assert streamed_experts(torch.empty(0, 32), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2), packed).shape == (0, 32)
    x = torch.randn(3, 32, generator=gen)
    elsewhere = torch.full((3, 2), -1)  # every pair on another rank
    assert streamed_experts(x, elsewhere, torch.rand(3, 2), packed).eq(0).all()


def test_two_threads_compute_what_one_does():
    """Gate/up split over (expert, column block), the down projection over output column blocks: the same sums."""
    w13, w2, gen = weights(8, 64, 32, torch.float32)
    packed = pack_for_streaming(w13, w2)
    x = torch.randn(40, 64, generator=gen)
    topk_ids = torch.rand(40, 8, generator=gen).argsort(dim=1)[:, :3]
    topk_weights = torch.rand(40, 3, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = streamed_experts(x, topk_ids, topk_weights, packed)
        torch.set_num_threads(2)
        two = streamed_experts(x, topk_ids, topk_weights, packed)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(two, one, rtol=0, atol=0)
