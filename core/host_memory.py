"""Freed host memory kept in the process, so large CPU tensors do not page-fault on every step.

glibc's malloc serves large blocks (from 128 KiB, its threshold rising to at most 32 MiB) with `mmap`
and gives them back with `munmap` on free, and trims the heap's free top: every prefill chunk's
activations on CPU (tens of MiB each: the MoE layer's padded rows, its expert outputs, the gathered
hidden rows) were then fresh pages, zeroed by the kernel at first touch. On a 2-core Xeon that was
~25% of a 4096-token prefill step of the small DeepSeek-V3 (benchmarks/results/cpu_throughput.md).
Raising both thresholds keeps freed blocks in the heap for reuse; the process keeps its peak
footprint instead of returning it (what a caching allocator such as tcmalloc, or PyTorch's CUDA
allocator, does).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
KEEP_BELOW = 1 << 30  # blocks up to 1 GiB come from the heap; larger ones (weights) still use mmap


@functools.cache
def keep_freed_host_memory() -> bool:
    """Set glibc's thresholds once per process; False where the C library is not glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BELOW)) and bool(mallopt(M_TRIM_THRESHOLD, 2 * KEEP_BELOW - 1))
