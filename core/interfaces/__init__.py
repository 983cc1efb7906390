"""The public plugin API: every contract a dispatcher, MoE kernel, balancer or overlap strategy implements."""

from .balancer import Balancer, BalancerCaps, Placement
from .context import MoEContext
from .dispatcher import Dispatcher, DispatcherCaps
from .layouts import (
    ALL_LAYOUTS,
    CONTIGUOUS,
    MASKED,
    STANDARD,
    ContiguousLayout,
    Dispatched,
    ExpertOutput,
    Fp8Payload,
    Layout,
    MaskedLayout,
    StandardLayout,
    placeholder,
    reduce_standard,
)
from .moe_kernel import BF16, FP8_BLOCK, WEIGHT_FORMATS, ExpertWeights, KernelCaps, MoEKernel
from .overlap import BatchMeta, OverlapCaps, OverlapStrategy

__all__ = [name for name in dir() if not name.startswith("_")]
