"""MoE kernel contract: how experts compute on the tokens a rank received."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import attrs
import torch

from .context import MoEContext
from .layouts import ALL_LAYOUTS, ExpertOutput, Layout

BF16 = "bf16"  # plain floating-point weights (bf16, fp16 or fp32: the model's dtype)
FP8_BLOCK = "fp8-block"  # float8_e4m3fn weights with one fp32 scale per 128x128 block
WEIGHT_FORMATS = (BF16, FP8_BLOCK)


@attrs.frozen
class KernelCaps:
    layouts: frozenset[str]
    dtypes: frozenset[torch.dtype]
    weight_formats: frozenset[str] = frozenset({BF16})
    alignment: int = 1  # rows per expert group in the contiguous layout
    needs_gpu: bool = False
    graph_safe: bool = False
    fp8_compute: bool = False  # computes in fp8 whatever the weights: matches the reference within fp8 error
    fp8_payload: bool = False  # takes layouts whose rows arrive as fp8 values + 128-wide scales (layout.fp8)
    requires: tuple[str, ...] = ()  # Python modules it imports when an instance is made
    min_compute_capability: tuple[int, int] | None = None  # e.g. (9, 0): Hopper or newer

    def __attrs_post_init__(self):
        unknown = set(self.layouts) - set(ALL_LAYOUTS)
        if unknown:
            raise ValueError(f"unknown layouts {sorted(unknown)}; layouts are {', '.join(ALL_LAYOUTS)}")


@attrs.frozen
class ExpertWeights:
    """The experts of one MoE layer held by this rank, in physical-slot order.

    w13: [E_local, 2 * I, H] (gate rows, then up rows); w2: [E_local, H, I].
    In the fp8-block format the *_scale tensors hold one scale per 128x128 block
    (DeepSeek-V3's weight_scale_inv: dequantized = fp8 * scale).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    format: str = BF16
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]


class MoEKernel(abc.ABC):
    """Computes SiLU-gated experts on a dispatched layout.

    Contract: equals the `torch` kernel within the dtype's tolerance for every
    layout and weight format it declares, including zero tokens.
    """

    caps: ClassVar[KernelCaps]

    def __init__(self, ctx: MoEContext):
        self.ctx = ctx

    def prepare_weights(self, weights: ExpertWeights) -> Any:
        """Transform one layer's expert weights once, at load time."""
        return weights

    @abc.abstractmethod
    def apply(self, layout: Layout, weights: Any) -> ExpertOutput:
        """Run the experts on `layout` with weights returned by `prepare_weights`."""
