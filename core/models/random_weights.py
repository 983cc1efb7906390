"""Random weights drawn per tensor name: what `moeplex make-model` writes and `--load-format dummy` makes."""

from __future__ import annotations

import math
import zlib

import torch


def named_random_tensor(name: str, shape: tuple[int, ...], seed: int, device="cpu") -> torch.Tensor:
    """`random_tensor` drawn from a generator of the tensor's own (seeded by `seed` and its name), so the
    checkpoint make-model writes and the weights `--load-format dummy` makes are the same on any device
    and any parallel layout: each rank draws whole tensors and keeps its slices and experts."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return random_tensor(name, shape, gen)


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A random weight for the tensor called `name` (on the generator's device, fp32)."""
    noise = torch.randn(shape, generator=gen, device=gen.device)
    if "norm" in name:  # RMSNorm weights near one
        return 1.0 + 0.1 * noise
    if name.endswith("bias"):  # router correction bias, attention biases
        return 0.1 * noise
    if "embed_tokens" in name:
        return noise
    # unit-variance activations through the stack, so logits are peaked and ties unlikely
    return noise / math.sqrt(shape[-1])
