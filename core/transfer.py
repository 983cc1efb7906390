"""Host-to-device copies that never make the host wait for the GPU."""

from __future__ import annotations

import numpy as np
import torch

NO_NUMPY = frozenset({torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2})  # dtypes numpy has no view of


def to_device(device: torch.device | str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors (of one dtype) on `device`; to a GPU as one asynchronous copy from pinned memory.

    A copy from pageable memory would make the host wait for the GPU to finish all the work queued
    before it, which defeats the overlap schedule; many small copies also cost ~10 us each.
    The tensors are packed into the pinned buffer by numpy, in one single-threaded copy: torch's cat and
    pin_memory copy twice, and above 32768 elements (a step's KV indices and page table at a few dozen
    requests) fork torch's intra-op threads, which stall for milliseconds while other processes (the HTTP
    front end, its clients) hold cores.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    sizes = [t.numel() for t in tensors]
    if tensors[0].dtype in NO_NUMPY:
        staged = torch.cat([t.reshape(-1) for t in tensors]).pin_memory()
    else:
        staged = torch.empty(sum(sizes), dtype=tensors[0].dtype, pin_memory=True)  # the caching host allocator's
        np.concatenate([t.reshape(-1).numpy() for t in tensors], out=staged.numpy())
    packed = staged.to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(packed.split(sizes), tensors)]
