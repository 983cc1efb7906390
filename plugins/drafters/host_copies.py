"""Host tensors for the drafters' device state, copied without making the host wait for the GPU's queue."""

from __future__ import annotations

import torch


def to_device(device: torch.device, host: torch.Tensor) -> torch.Tensor:
    """A host tensor on `device`; to a GPU from pinned memory, so the host does not wait for the GPU's queue."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def pinned(device: torch.device, host: torch.Tensor) -> torch.Tensor:
    """A host tensor to `copy_` into a tensor on `device` without waiting: pinned where that is a GPU."""
    return host.pin_memory() if device.type == "cuda" else host
