"""Rotary position embeddings: the default kind and YaRN scaling, in the half-split or interleaved layout."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels.rope import KVWrite, rope_

SUPPORTED_ROPE_TYPES = ("default", "yarn")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def wavelengths(dim: int, base: float) -> torch.Tensor:
    """base^(2i/dim): the positions one radian of rotary pair i takes."""
    return base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor`."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _yarn_correction_range(
    dim: int, base: float, original_max: int, beta_fast: float, beta_slow: float, truncate: bool
) -> tuple[float, float]:
    """The rotary dims between full extrapolation (fast rotations) and full interpolation (slow ones)."""

    def dim_of(num_rotations: float) -> float:
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def with_yarn_defaults(params: dict, max_position_embeddings: int) -> dict:
    """Fill what yarn configs may leave out, as transformers does: the pretraining length defaults to
    max_position_embeddings, and a null factor is the ratio of the two lengths."""
    if params.get("rope_type") != "yarn":
        return params
    params = dict(params)
    params.setdefault("original_max_position_embeddings", max_position_embeddings)
    if params.get("factor") is None:
        params["factor"] = max_position_embeddings / params["original_max_position_embeddings"]
    return params


def yarn_inv_freq_and_scale(dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as Hugging Face transformers computes it.

    High-frequency dims keep their frequency, low-frequency dims are divided by `factor`, with a
    linear ramp between; cos/sin are multiplied by an attention factor derived from mscale.
    """
    for key in ("factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            raise ValueError(f"yarn rope scaling needs {key!r} (see with_yarn_defaults)")
    base, factor = float(params["rope_theta"]), float(params["factor"])
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    low, high = _yarn_correction_range(
        dim,
        base,
        params["original_max_position_embeddings"],
        params.get("beta_fast") or 32,
        params.get("beta_slow") or 1,
        params.get("truncate", True),
    )
    if low == high:
        high += 0.001  # keeps the ramp finite
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / wavelengths(dim, base)
    interpolated = 1.0 / (factor * wavelengths(dim, base))
    keep = 1 - ramp  # 1 where a dim keeps its original frequency
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def inv_freq_and_scale(dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of a rotary dim and the factor applied to cos/sin."""
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return 1.0 / wavelengths(dim, float(params["rope_theta"])), 1.0
    if rope_type == "yarn":
        return yarn_inv_freq_and_scale(dim, params)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (x0, x1), (x2, x3), ...; the result is laid out half-split (evens' rotation first).

    Queries and keys both come out in that layout, so their dot products are those of the pairs.
    """
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to [T, heads, dim] queries and keys at given positions.

    `interleaved`: the rotated pairs are adjacent dims (DeepSeek's checkpoints) rather than dims i and i + dim/2.
    `fused`: one Triton kernel rotates q and k in place, with the optional per-head norms before
    (set on CUDA by MoECausalLM.use_fused_kernels); otherwise torch ops make new tensors.
    """

    fused = False

    def __init__(self, dim: int, params: dict, interleaved: bool = False):
        super().__init__()
        inv_freq, self.scale = inv_freq_and_scale(dim, params)
        self.interleaved = interleaved
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k) rotated, each first normalized per head by its RMSNorm where one is given (Qwen3)."""
        if self.fused:
            rope_(q, k, positions, self.inv_freq, self.scale, self.interleaved, **_norm_args(q_norm, k_norm))
            return q, k
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos, sin = self.cos_sin(positions, q.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.interleaved:
            return _rotate_interleaved(q, cos, sin), _rotate_interleaved(k, cos, sin)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, write: KVWrite,
                         q_norm: nn.Module | None = None, k_norm: nn.Module | None = None) -> torch.Tensor:
        """q rotated in place and the rotated k with `write.v` stored in the caches, in one launch (fused only)."""
        if not self.fused:
            raise RuntimeError("rotate_and_store is the fused kernel's; this RotaryEmbedding runs the torch ops")
        rope_(q, k, positions, self.inv_freq, self.scale, self.interleaved, **_norm_args(q_norm, k_norm), kv_write=write)
        return q


def _norm_args(q_norm: nn.Module | None, k_norm: nn.Module | None) -> dict:
    return {} if q_norm is None else dict(q_norm=q_norm.weight, k_norm=k_norm.weight, eps=q_norm.eps)
