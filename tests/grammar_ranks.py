"""Rank entry point for the tensor-parallel structured-output tests (spawned processes import this module by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.parallel import init_parallel


def constrained_on_every_rank(rank, parallel_config, folder, prompts, params, overlaps, settings=None):
    """For each overlap setting, an engine's outputs (token ids, finish reason, text, error) and, per rank, what its
    grammar book compiled and filled: [(outputs, [(compiles, filled rows, mask waits) per rank])] on rank 0. Under
    DP attention every DP group runs all the prompts."""
    parallel = init_parallel(parallel_config, rank, torch.device("cpu"))
    runs = []
    for overlap in overlaps:
        config = EngineConfig(model=folder, show_progress=False, dtype="fp32", max_total_tokens=4096, page_size=4,
                              overlap_schedule=overlap, parallel=parallel_config, **(settings or {}))
        engine = Engine(config, parallel=parallel)
        requests = engine.generate(prompts, params)
        book = engine.grammar
        mine = (book.compiler.misses if book.compiler is not None else 0, book.filled_rows, book.mask_waits)
        every = [None] * parallel_config.world_size if rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        outputs = [(r.output_ids, r.finish_reason, r.text, r.error) for r in requests]
        runs.append((outputs, every))
        book.close()
    return runs
