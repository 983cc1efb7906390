"""The host side of an eager step: kernels launched one by one from Python, and the syncs that drain the GPU.

A replayed CUDA graph launches a whole decode step at once, so only its kernels' GPU time counts. An eager
step (every prefill, decode without graphs) launches each kernel from the host, which costs a measured time
per launch; the GPU runs a kernel only once it is launched, and a host sync (a `.tolist()`, a `nonzero`,
DeepEP normal mode's wait for the received counts) makes the host wait until the GPU has finished everything
queued. Between syncs the host runs ahead of a busy GPU, so launches hide under long kernels; after a sync the
GPU waits for the host until a long kernel is queued again. `eager_us` walks that timeline.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """`launches` kernels issued in a row, `gpu_us` of GPU time between them (spread evenly), after a sync or not."""

    name: str
    launches: int
    gpu_us: float
    sync_before: bool = False


def eager_us(ops: list[Op], host_us_per_launch: float, gpu: float = 0.0, host: float = 0.0) -> tuple[float, float]:
    """(GPU done, host done) µs after `ops` are launched in order from the state (gpu, host) (both free at 0).

    Each launch costs the host `host_us_per_launch`; its kernel starts when it is launched and the kernel
    before it is done. A sync makes the host wait for the GPU to finish what was queued.
    """
    for op in ops:
        if op.sync_before:
            host = max(host, gpu)
        if op.launches <= 0:  # GPU work queued by a launch counted elsewhere
            gpu += op.gpu_us
            continue
        each = op.gpu_us / op.launches
        for _ in range(op.launches):
            host += host_us_per_launch
            gpu = max(gpu, host) + each
    return gpu, host


def timeline_us(ops: list[Op], host_us_per_launch: float, repeats: int = 1) -> float:
    """Wall µs of `repeats` runs of `ops` back to back from an idle GPU, until the GPU and the host are both done.

    Between repeats the host runs ahead into the next one (up to its first sync), as it does from layer to layer.
    """
    gpu = host = 0.0
    for _ in range(repeats):
        gpu, host = eager_us(ops, host_us_per_launch, gpu, host)
    return max(gpu, host)
