"""What CPU paths choose by: whether oneDNN runs a dtype on this processor, the clock to time candidates with,
and whether a packed copy of some weights fits beside them.

Kernels on a CPU are chosen by measuring them at start-up (processors differ: a Xeon with AMX, an EPYC
without it), never by the processor's name; these two helpers are what every such measurement shares.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable

import torch


def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN has kernels for this dtype on this processor (fp32 wherever torch was built with it;
    bf16 and fp16 where the processor has the instructions: AVX-512-BF16 / AMX, AVX-512-FP16)."""
    return _onednn_runs(dtype)


@functools.cache
def _onednn_runs(dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return torch.backends.mkldnn.is_available()
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()


def measuring_clock() -> Callable[[], float]:
    """The calling thread's CPU time where torch runs its ops on that thread alone (time other jobs on the
    machine take from it is not counted), else the wall clock."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def packed_copy_fits(nbytes: int) -> bool:
    """Whether a packed copy of `nbytes` of weights leaves room: at most a quarter of the host memory free now (a
    copy doubles those weights' footprint, and the KV pool is sized from what is left after loading)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # no such figure on this system: assume the copy fits
        return True
    return 4 * nbytes <= free
