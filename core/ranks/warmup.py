"""Rank 0's warm-up before a server takes requests: prefill steps of every size class, all ranks together.

The first step of a new size compiles what it needs (Triton specializations and the fused-MoE tile of
that token count, read from the tuned table); a client would otherwise wait seconds on it, the first time
a burst of prompts fills a step. Decode steps need none of this: their CUDA graphs were captured at start-up.
"""

from __future__ import annotations

import logging
import time

from ..sampling import SamplingParams
from .group import EngineGroup

log = logging.getLogger("moeplex.server")

FIRST_SIZE = 16


def step_sizes(budget: int) -> list[int]:
    """16, 32, ... and the budget itself: one step of each token count class up to a full step."""
    sizes, size = [], FIRST_SIZE
    while size < budget:
        sizes.append(size)
        size *= 2
    return sizes + [budget]


def warm_up(group: EngineGroup) -> int:
    """Run one prefill step of each size (and the decode steps after it); the steps it took."""
    config = group.engine.config
    budget = min(config.max_batched_tokens, group.capacity_tokens)
    chunk = min(config.chunked_prefill_size, budget)
    vocab = group.engine.vocab_size
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    started, steps = time.monotonic(), 0
    for size in step_sizes(budget):
        lengths = [chunk] * (size // chunk) + ([size % chunk] if size % chunk else [])
        if len(lengths) > config.max_running_requests:
            break
        for index, length in enumerate(lengths):
            group.add_request([(7 * i + index) % vocab for i in range(length)], params, rid=f"warmup-{size}-{index}")
        while group.needs_round:
            group.step()
            steps += 1
        # each size computes its whole prompts (no hit on the size before), and clients start from an empty cache
        group.call("reset_prefix_cache", (), lambda outcome: None)
        group.step()
    group.admitted = [0] * group.dp_size  # clients' requests are what these count
    log.info("warm-up: %d steps, prefill up to %d tokens, in %.1f s", steps, budget, time.monotonic() - started)
    return steps
