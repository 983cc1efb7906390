"""How the MoE layers hold their routed experts: in the model dtype (BF16), or in fp8 with 128x128 block scales.

fp8 when the kernel takes fp8-block weights and either the checkpoint stores its experts in fp8 in
blocks that fit each rank's slice (kept as stored), or --quantize-experts fp8 asks for it (quantized
at load). Otherwise an fp8 checkpoint's experts are dequantized at load.
"""

from __future__ import annotations

import logging

from ..interfaces import BF16, FP8_BLOCK
from ..quant import BLOCK
from .loader import is_fp8_checkpoint

log = logging.getLogger(__name__)


def expert_weight_format(hf_config: dict, config, kernel_cls: type, intermediate_per_rank: int) -> str:
    """BF16 or FP8_BLOCK for the experts of the model `hf_config` under `config` (an EngineConfig)."""
    formats = kernel_cls.caps.weight_formats
    if config.quantize_experts == "fp8":  # selection.resolve refused a kernel without fp8-block weights
        return FP8_BLOCK
    if not is_fp8_checkpoint(hf_config):
        return BF16
    if FP8_BLOCK not in formats:
        log.info(
            "moe_kernel '%s' takes no fp8 weights: the checkpoint's fp8 experts are dequantized at load", config.moe_kernel
        )
        return BF16
    if intermediate_per_rank % BLOCK:
        log.info(
            "each rank's expert slice (%d rows) is not a multiple of %d: the checkpoint's fp8 experts are dequantized "
            "at load (--quantize-experts fp8 quantizes them again, with blocks of their own)", intermediate_per_rank, BLOCK,
        )
        return BF16
    return FP8_BLOCK
