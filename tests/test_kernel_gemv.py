"""`gemv` equals F.linear at 1-4 rows, and the dense layers take it exactly where their `GemvChoice` says.

The sums run in another order than torch's, so results agree within float error. Without CUDA the kernel runs under
Triton's interpreter (fp32, fp16); on a GPU the start-up timing (GpuLinears) runs too.
"""

import pytest
import torch
import torch.nn.functional as F

from moeplex.kernels import gemv as gemv_module
from moeplex.kernels.gemv import MAX_ROWS, GemvTiles, _gemv_kernel, fits, gemv
from moeplex.models import gpu_linear
from moeplex.models.gpu_linear import GemvChoice, GpuLinears, agrees
from moeplex.models.parallel_layers import Linear, MergedColumnLinear, RowLinear
from moeplex.parallel import Group
from triton_guard import DEVICE, skip_unless_runnable

skip_unless_runnable(_gemv_kernel)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def case(rows: int, n: int, k: int, dtype, bias: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, weight, b


def assert_close(got: torch.Tensor, x, weight, bias) -> None:
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.shape == want.shape and got.dtype == x.dtype
    error = ((got.float() - want).norm() / want.norm()).item()
    assert error < TOLERANCE[x.dtype], error


@pytest.mark.parametrize("rows", [1, 2, 3, MAX_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_equals_linear(rows, dtype):
    # K not a multiple of the tile and N not a multiple of the program's columns: the masked edges are exercised
    x, weight, bias = case(rows, 37, 300, dtype, bias=rows % 2 == 1)
    for tiles in (GemvTiles(8, 128, 4, 3), GemvTiles(16, 64, 2, 2), GemvTiles(4, 512, 4, 4)):
        assert_close(gemv(x, weight, bias, tiles), x, weight, bias)


def test_strided_rows_of_a_wider_tensor():
    x, weight, _ = case(2, 24, 64, torch.float32)
    wide = torch.zeros(2, 100, device=DEVICE)
    wide[:, 10:74] = x
    assert_close(gemv(wide[:, 10:74], weight), x, weight, None)


def test_operands_it_does_not_take_are_refused():
    x, weight, _ = case(MAX_ROWS + 1, 8, 16, torch.float32)
    assert not fits(x, weight)
    with pytest.raises(ValueError, match=f"1 to {MAX_ROWS} rows"):
        gemv(x, weight)
    assert not fits(x[:1].half(), weight)  # dtypes differ
    assert not fits(x[:1, :8], weight)  # K differs
    assert not fits(x[:1], weight.t().contiguous().t())  # the weight's K is not its unit-stride dimension


def test_a_tiling_is_timed_only_where_it_agrees_with_the_exact_product(monkeypatch, caplog):
    """The start-up check before any timing: the GEMV's output against F.linear's, at the output's rounding. A
    kernel that a card's compiler got wrong (here: a faulty result, one column off by 5% of the output's range) is
    refused with a warning, so the start-up choice can never pick it for its speed."""
    x, weight, _ = case(2, 48, 256, torch.float16)
    tiles = GemvTiles(8, 128, 4, 3)
    assert agrees(x, weight, tiles)

    def faulty(x, weight, bias=None, tiles=None):
        out = gemv(x, weight, bias, tiles)
        out[:, 3] += 0.05 * out.abs().max()
        return out

    monkeypatch.setattr(gpu_linear, "gemv", faulty)
    with caplog.at_level("WARNING"):
        assert not agrees(x, weight, tiles)
    assert "not used" in caplog.text and "(48, 256)" in caplog.text


def test_choice_takes_the_nearest_measured_row_count_at_or_above():
    choice = GemvChoice({1: GemvTiles(8), 4: GemvTiles(16)})
    assert choice.tiles(1) == GemvTiles(8)
    assert choice.tiles(2) is None  # cuBLAS won at 2 rows
    assert choice.tiles(3) == GemvTiles(16)
    assert choice.tiles(MAX_ROWS + 1) is None


def layers(dtype):
    torch.manual_seed(0)
    plain = Linear(48, 40, bias=True)
    row = RowLinear(48, 32, bias=True)
    merged = MergedColumnLinear(48, {"q": (24, Group()), "k": (8, Group())}, bias=False)
    for layer in (plain, row, merged):
        for param in layer.parameters():
            param.requires_grad_(False)
            param.normal_()
        layer.to(DEVICE, dtype)
    return plain, row, merged


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_dense_layers_take_the_gemv_where_chosen(rows, monkeypatch):
    launched = []
    real = gemv_module.gemv
    monkeypatch.setattr("moeplex.models.gpu_linear.gemv", lambda *a, **k: launched.append(a[0].shape[0]) or real(*a, **k))
    x = torch.randn(rows, 48).to(DEVICE)
    for layer in layers(torch.float32):
        want = layer(x)
        layer.gemv_choice = GemvChoice({1: GemvTiles(8, 32), 4: GemvTiles(16, 64)})
        got = layer(x)
        for a, b in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert launched == ([rows] * 3 if rows <= MAX_ROWS else [])


def test_no_choice_is_made_off_the_gpu():
    plain, row, merged = layers(torch.float32)
    model = torch.nn.Sequential(plain, row, merged)
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU the fp32 layers are skipped for another reason (dtype); see the GPU test")
    assert GpuLinears().choose(model) == 0
    assert all(layer.gemv_choice is None for layer in model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096)])
def test_start_up_timing_on_the_gpu(n, k, tmp_path, monkeypatch):
    """The timing runs on real shapes (Qwen3-30B-A3B's q/k/v and o_proj) and whatever it picks computes alike."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # measured here, not read from an earlier run's file
    import moeplex.kernels.cpu as cpu

    monkeypatch.setattr(cpu, "_CHOICES", cpu.MeasuredChoices(str(tmp_path / "choices.json")))
    layer = Linear(k, n, bias=False).to("cuda", torch.bfloat16).requires_grad_(False)
    GpuLinears().choose(torch.nn.Sequential(layer))
    for rows in (1, 2, 4):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        assert_close(layer(x), x, layer.weight, None)
