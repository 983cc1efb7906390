"""`triton`: fused MoE in Triton (align tokens per expert, grouped GEMM with SiLU, grouped GEMM with top-k weights).

align.py     pairs sorted and padded per expert into BLOCK_M tiles, on the device, no host sync
kernel.py    the grouped GEMM kernel both expert GEMMs run on (bf16/fp16/fp32 and fp8 128x128 block scales)
finish.py    the small kernels around it: per-token-group fp8 quantization and the sum over top-k
configs.py   tile tables per (device, dtype, E, N, K), nearest token count, defaults
fused.py     the three layouts expressed as align -> GEMM 1 -> GEMM 2 -> finish
plugin.py    the MoEKernel the registry loads
"""
