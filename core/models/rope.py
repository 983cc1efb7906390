"""Rotary position embeddings (the default kind; scaled kinds extend `inv_freq_and_scale`)."""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def inv_freq_and_scale(dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of a rotary dim and the factor applied to cos/sin."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: default")
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to [T, heads, dim] queries and keys at given positions."""

    def __init__(self, dim: int, params: dict):
        super().__init__()
        inv_freq, self.scale = inv_freq_and_scale(dim, params)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
