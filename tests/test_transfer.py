"""to_device: one pinned, asynchronous copy of several host tensors, each coming back whole and in its shape."""

import pytest
import torch

from moeplex.transfer import to_device


def some_tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(6, 9, generator=gen) * 1000
    return [t.to(dtype) for t in (full[:, ::2], full[0], torch.empty(0), full[:3, :4].T)]  # strided, empty, transposed


def test_on_cpu_the_tensors_themselves():
    tensors = some_tensors(torch.int64)
    assert all(a is b for a, b in zip(to_device("cpu", *tensors), tensors))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bool, torch.bfloat16])
def test_on_gpu_every_tensor_arrives_whole(dtype):
    tensors = some_tensors(dtype)
    moved = to_device("cuda", *tensors)
    torch.cuda.synchronize()
    for got, want in zip(moved, tensors):
        assert got.device.type == "cuda" and got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_on_gpu_a_reused_pinned_buffer_does_not_change_a_copy_in_flight():
    """Many copies queued behind a long kernel, each from a staging buffer freed at once: each arrives as it was."""
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        busy = busy @ busy / 64  # the stream is busy while the copies below are queued
    moved = [to_device("cuda", torch.full((50000,), i, dtype=torch.int64))[0] for i in range(64)]
    torch.cuda.synchronize()
    assert all(bool((m == i).all()) for i, m in enumerate(moved))
