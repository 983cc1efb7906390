"""How the decode benchmarks time an engine: the clock waits for the device, and starts once every request of a
batch has its first token (decode only, the prompts' step left out)."""

from __future__ import annotations

import time


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def decode_rate(engine, prompts, params, device: str) -> tuple[float, list]:
    """(decode tokens/s, the finished requests) of one batch run to completion; a request that failed stops the
    benchmark (a rate of failed requests means nothing)."""
    requests = [engine.add_request(p, params) for p in prompts]
    while any(not r.output_ids for r in requests):
        engine.step()
    sync(device)
    start, first = time.perf_counter(), sum(len(r.output_ids) for r in requests)
    while engine.has_work:
        engine.step()
    sync(device)
    elapsed = time.perf_counter() - start
    assert all(r.error is None for r in requests), [r.error for r in requests if r.error]
    return (sum(len(r.output_ids) for r in requests) - first) / elapsed, requests
