"""Public helpers for plugins: fp8 quantization, row permutation, layout planning and CPU kernel choice.

The core uses the same functions from their home modules (moeplex.quant, moeplex.kernels,
moeplex.moe.adapters); this module is the one door a plugin imports them through, so those
homes may move without breaking a plugin. Importing it imports Triton (its kernels are
Triton kernels), which is why `moeplex.interfaces` itself does not import it.
"""

from moeplex.kernels.cpu import measured_choice, measuring_clock, onednn_runs, packed_copy_fits
from moeplex.kernels.expert_gemm import pack_for_streaming, streamed_experts, streams, streams_on_tiles
from moeplex.kernels.fp8 import quantize_rows, silu_mul_quantize
from moeplex.kernels.permute import gather_rows, weighted_pair_sum
from moeplex.moe.adapters import ContiguousPlan, LayoutAdapter, plan_contiguous
from moeplex.quant import (
    BLOCK,
    dequantize_activations,
    dequantize_blocks,
    quantize_activations,
    quantize_blocks,
)

__all__ = [
    "BLOCK",  # the fp8 group / block width: 128 columns of activations, 128x128 weights
    "ContiguousPlan",
    "LayoutAdapter",
    "dequantize_activations",
    "dequantize_blocks",
    "gather_rows",
    "measured_choice",  # a start-up measurement's result, kept per machine so every process chooses alike
    "measuring_clock",  # CPU kernels choose by timing candidates at start-up: the clock to time them with
    "onednn_runs",  # whether oneDNN runs a dtype on this processor
    "packed_copy_fits",  # whether a packed copy of some weights leaves room in host memory
    "pack_for_streaming",  # expert weights laid out for moeplex's C++ small-M expert GEMM
    "plan_contiguous",
    "quantize_activations",
    "quantize_blocks",
    "quantize_rows",
    "silu_mul_quantize",
    "streamed_experts",  # moeplex's C++ expert GEMM at memory speed for a few rows per expert (CPU)
    "streams",  # whether that GEMM runs these expert weights and builds on this machine
    "streams_on_tiles",  # whether its AMX tile form runs these packed weights (streamed_experts(..., tiles=True))
    "weighted_pair_sum",
]
