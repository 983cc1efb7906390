"""The row moves of DeepEP's normal mode (`moeplex.kernels.permute`) against their torch forms.

Under Triton's interpreter on the CPU; at serving shapes in bf16 on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from moeplex.kernels.permute import _gather_rows_kernel, gather_rows, weighted_pair_sum
from triton_guard import DEVICE, skip_unless_runnable

skip_unless_runnable(_gather_rows_kernel)


def reference_gather(rows: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    out = rows.new_zeros(source.shape[0], rows.shape[1])
    out[source >= 0] = rows[source[source >= 0]]
    return out


def reference_pair_sum(rows, pair_row, weights, dtype) -> torch.Tensor:
    picked = rows[pair_row.clamp_min(0)].float() * torch.where(pair_row >= 0, weights.float(), 0.0)[..., None]
    return picked.sum(1).to(dtype)


def routing(tokens: int, top_k: int, num_rows: int, seed: int):
    """Every token's pairs: distinct rows of `num_rows`, about a third of them elsewhere (-1)."""
    gen = torch.Generator().manual_seed(seed)
    pair_row = torch.randperm(num_rows, generator=gen)[: tokens * top_k].view(tokens, top_k)
    pair_row[torch.rand(tokens, top_k, generator=gen) < 0.3] = -1
    return pair_row.to(DEVICE), torch.rand(tokens, top_k, generator=gen).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [1, 56, 1030])  # one column (fp8 scales of a tiny model), one block, two blocks
def test_gather_rows_copies_sources_and_zeroes_padding(dtype, width):
    gen = torch.Generator().manual_seed(width)
    rows = torch.randn(7, width, generator=gen).to(DEVICE, dtype)
    source = torch.tensor([3, -1, 0, 6, -1, -1, 3, 2], device=DEVICE)
    got = gather_rows(rows, source)
    assert torch.equal(got, reference_gather(rows, source))
    assert gather_rows(rows, source[:0]).shape == (0, width)


def test_gather_rows_moves_fp8_payloads_bit_for_bit():
    rows = torch.randn(5, 256).to(DEVICE, torch.float8_e4m3fn)
    source = torch.tensor([4, -1, 1], device=DEVICE)
    got = gather_rows(rows, source)
    assert torch.equal(got.view(torch.uint8), reference_gather(rows.view(torch.uint8), source))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weighted_pair_sum_equals_the_torch_sum(dtype):
    pair_row, weights = routing(tokens=6, top_k=3, num_rows=40, seed=1)
    pair_row[0] = -1  # a token with no pair here
    rows = torch.randn(40, 1030, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    got = weighted_pair_sum(rows, pair_row, weights, dtype)
    torch.testing.assert_close(got, reference_pair_sum(rows, pair_row, weights, dtype))
    assert not got[0].any()


def test_bad_shapes_are_refused():
    rows = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="unit column stride"):
        gather_rows(rows.t(), torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="differ in shape"):
        weighted_pair_sum(rows, torch.zeros(2, 3, dtype=torch.int64, device=DEVICE), torch.zeros(2, 2, device=DEVICE),
                          torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_prefill_shapes_in_bf16():
    """4096 received rows of width 7168, top-8, ~30k expert rows: the sizes of a DeepSeek-V3 prefill layer."""
    rows = torch.randn(36_000, 7168, device="cuda", dtype=torch.bfloat16)
    pair_row, weights = routing(tokens=4096, top_k=8, num_rows=36_000, seed=3)
    torch.testing.assert_close(
        weighted_pair_sum(rows, pair_row, weights, torch.bfloat16),
        reference_pair_sum(rows, pair_row, weights, torch.bfloat16), atol=2e-2, rtol=2e-2,
    )
    source = torch.randint(-1, 36_000, (40_000,), device="cuda")
    assert torch.equal(gather_rows(rows, source), reference_gather(rows, source))
