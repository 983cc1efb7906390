"""Attention over the paged KV cache: the torch reference and the Triton kernels, chosen by `--attention-backend`."""

from __future__ import annotations

import torch

from ..config import ATTENTION_BACKENDS, AUTO
from .backend import AttentionBackend, TorchAttention
from .torch_ref import gather_kv, write_kv

__all__ = [
    "ATTENTION_BACKENDS",
    "AUTO",
    "AttentionBackend",
    "TorchAttention",
    "gather_kv",
    "make_attention_backend",
    "write_kv",
]


def make_attention_backend(name: str, device: torch.device | str, dtype: torch.dtype) -> AttentionBackend:
    """The backend `--attention-backend` names; auto is triton on CUDA and torch elsewhere."""
    device = torch.device(device)
    if name == AUTO:
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from .triton_backend import TritonAttention  # imports triton only when chosen

        return TritonAttention(device, dtype)
    raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
