"""The fused RMSNorm kernel equals the torch RMSNorm module (with and without the residual add before it)."""

import pytest
import torch

from moeplex.executor import PairRows
from moeplex.kernels.norm import _rms_norm_kernel, rms_norm
from moeplex.models.base import RMSNorm
from triton_guard import DEVICE, skip_unless_runnable

skip_unless_runnable(_rms_norm_kernel)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def reference(size: int, eps: float, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(size, eps).to(DEVICE, dtype)
    norm.weight.copy_(torch.rand(size) + 0.5)
    return norm


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=TOLERANCE[want.dtype], atol=TOLERANCE[want.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 20), (0, 48)])
def test_norm_and_add_norm_equal_the_module(dtype, shape):
    torch.manual_seed(0)
    norm = reference(shape[-1], 1e-6, dtype)
    x = torch.randn(shape, device=DEVICE).to(dtype) * 3
    residual = torch.randn(shape, device=DEVICE).to(dtype)
    want = norm(x)
    check(rms_norm(x, norm.weight, norm.eps)[0], want)
    want_normed, want_sum = norm.add_norm(x, residual)
    got_normed, got_sum = rms_norm(x, norm.weight, norm.eps, residual)
    assert torch.equal(got_sum, want_sum)  # the sum rounds once, as torch's add does
    check(got_normed, want_normed)
    norm.fused = True
    check(norm(x), want)
    check(norm.add_norm(x, residual)[0], want_normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,top_k", [(5, 8), (1, 2), (0, 4)])
def test_pair_rows_are_summed_then_added_as_the_moe_sum_and_the_module_do(dtype, tokens, top_k):
    """An MoE layer's unsummed pair rows (PairRows): each token's top_k rows summed in fp32 and rounded to the dtype,
    as the MoE kernel's own sum does, then the residual added and rounded, then normalized."""
    torch.manual_seed(3)
    norm = reference(48, 1e-6, dtype)
    pairs = PairRows(torch.randn(tokens * top_k, 48, device=DEVICE).to(dtype), top_k)
    residual = torch.randn(tokens, 48, device=DEVICE).to(dtype)
    summed = pairs.rows.view(tokens, top_k, 48).float().sum(1).to(dtype)
    want_normed, want_sum = norm.add_norm(summed, residual)
    got_normed, got_sum = rms_norm(pairs.rows, norm.weight, norm.eps, residual, pairs=top_k)
    torch.testing.assert_close(got_sum, want_sum, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    check(got_normed, want_normed)
    for fused in (False, True):  # the module takes PairRows both ways
        norm.fused = fused
        normed, total = norm.add_norm(pairs, residual)
        check(normed, want_normed)
        check(total, want_sum)


def test_pair_rows_need_a_residual_of_their_tokens():
    with pytest.raises(ValueError, match="pair rows"):
        rms_norm(torch.randn(6, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6, torch.randn(2, 8, device=DEVICE),
                 pairs=4)


def test_strided_rows_are_read_in_place():
    """MLA normalizes the latent columns of a wider projection: a view whose rows are strided."""
    torch.manual_seed(1)
    wide = torch.randn(6, 40, device=DEVICE)
    latent = wide[:, :32]
    norm = reference(32, 1e-6, torch.float32)
    before = wide.clone()
    check(rms_norm(latent, norm.weight, norm.eps)[0], norm(latent))
    assert torch.equal(wide, before)


def test_wrong_shapes_are_refused():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="8 columns"):
        rms_norm(x, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="differ in shape"):
        rms_norm(x, torch.ones(8, device=DEVICE), 1e-6, torch.randn(3, 8, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [2048, 7168, 1536, 512, 128])
def test_serving_shapes_bf16(cols):
    torch.manual_seed(2)
    norm = reference(cols, 1e-6, torch.bfloat16)
    x = torch.randn(4096, cols, device=DEVICE, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    want_normed, want_sum = norm.add_norm(x, residual)
    got_normed, got_sum = rms_norm(x, norm.weight, norm.eps, residual)
    assert torch.equal(got_sum, want_sum)
    check(got_normed, want_normed)
