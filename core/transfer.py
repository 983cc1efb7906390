"""Host-to-device copies that never make the host wait for the GPU."""

from __future__ import annotations

import torch


def to_device(device: torch.device | str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors (of one dtype) on `device`; to a GPU as one asynchronous copy from pinned memory.

    A copy from pageable memory would make the host wait for the GPU to finish all the work queued
    before it, which defeats the overlap schedule; many small copies also cost ~10 us each.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    packed = torch.cat([t.reshape(-1) for t in tensors]).pin_memory().to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(packed.split([t.numel() for t in tensors]), tensors)]
