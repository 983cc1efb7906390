"""FP8 block quantization as DeepSeek-V3 stores it: weights in 128x128 blocks, activations in 1x128 groups."""

from __future__ import annotations

import torch

from .interfaces import Fp8Payload

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BLOCK = 128


def num_blocks(size: int, block: int = BLOCK) -> int:
    """Blocks of `block` covering `size` (the last one may be partial)."""
    return -(-size // block)


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """weight [..., N, K] fp8 and scale [..., ceil(N/b), ceil(K/b)] -> fp32 weight * scale."""
    n, k = weight.shape[-2:]
    expanded = scale.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]
    return weight.float() * expanded.float()


def quantize_blocks(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (fp8 values, scale [..., ceil(N/b), ceil(K/b)]) with dequantized = fp8 * scale."""
    n, k = weight.shape[-2:]
    padded = torch.nn.functional.pad(weight.float(), (0, num_blocks(k, block) * block - k, 0, num_blocks(n, block) * block - n))
    blocks = padded.unflatten(-1, (-1, block)).unflatten(-3, (-1, block))  # [..., nb, b, kb, b]
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12)  # [..., nb, kb]
    scale = amax / FP8_MAX
    values = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    values = values.flatten(-4, -3).flatten(-2, -1)[..., :n, :k]
    return values, scale


def quantize_activations(x: torch.Tensor, group: int = BLOCK) -> Fp8Payload:
    """x [..., H] with H a multiple of `group` -> fp8 values and one scale per row per group."""
    groups = x.float().unflatten(-1, (-1, group))
    scale = groups.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    values = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2)
    return Fp8Payload(values=values, scales=scale, group_size=group)


def dequantize_activations(payload: Fp8Payload) -> torch.Tensor:
    values = payload.values.float().unflatten(-1, (-1, payload.group_size))
    return (values * payload.scales[..., None]).flatten(-2)
