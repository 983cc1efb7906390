"""How the decode benchmarks time an engine: the clock waits for the device, and starts once every request of a
batch has its first token (decode only, the prompts' step left out)."""

from __future__ import annotations

import time


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK_HELP = ("what the rates divide by: wall (default) or cpu, this process's CPU time: on a shared virtual "
              "machine a one-thread CPU engine's CPU time leaves out the time other guests and processes took "
              "from it, which moves wall-clock rates by +-20%% from one run to the next; equal to wall time on a "
              "quiet machine (GPU runs: wall only)")


def decode_rate(engine, prompts, params, device: str, clock=time.perf_counter) -> tuple[float, list]:
    """(decode tokens/s, the finished requests) of one batch run to completion; a request that failed stops the
    benchmark (a rate of failed requests means nothing). `clock`: one of CLOCKS."""
    requests = [engine.add_request(p, params) for p in prompts]
    while any(not r.output_ids for r in requests):
        engine.step()
    sync(device)
    start, first = clock(), sum(len(r.output_ids) for r in requests)
    while engine.has_work:
        engine.step()
    sync(device)
    elapsed = clock() - start
    assert all(r.error is None for r in requests), [r.error for r in requests if r.error]
    return (sum(len(r.output_ids) for r in requests) - first) / elapsed, requests
