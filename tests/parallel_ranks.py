"""Rank entry points for the multi-process tests (spawned processes import this module by name)."""

from __future__ import annotations

import os
import time

import attrs
import torch
import torch.distributed as dist

from moeplex.config import EngineConfig
from moeplex.ranks.offline import generate_on_rank
from moeplex.parallel import init_parallel


def generate_every_model(rank, parallel_config, folders, prompts, params, **settings):
    """One launch, several models: {folder: results on rank 0}; `settings` go to EngineConfig."""
    parallel = init_parallel(parallel_config, rank, torch.device("cpu"))
    results = {}
    for folder in folders:
        config = EngineConfig(
            model=folder,
            show_progress=False,
            max_total_tokens=1024,
            page_size=4,
            dispatcher="naive" if parallel_config.ep_size > 1 else "local",
            parallel=parallel_config,
            **settings,
        )
        results[folder] = generate_on_rank(parallel, config, prompts, params)
    return results


def generate_with_settings(rank, parallel_config, folders, prompts, params, settings: dict):
    """generate_every_model with EngineConfig settings passed positionally (launch passes no keywords)."""
    return generate_every_model(rank, parallel_config, folders, prompts, params, **settings)


def generate_admitting_beside(rank, parallel_config, folders, prompts, params, settings: dict):
    """generate_with_settings where verify steps under the overlap schedule admit waiting requests within the token
    budget (test_spec_overlap.admit_beside: a CPU engine has no graphs to bound them by)."""
    from moeplex.speculation import build

    build.admit_rows = lambda scheduler, graphs, prompt_graphs: scheduler.token_budget
    return generate_every_model(rank, parallel_config, folders, prompts, params, **settings)


def die_after_joining(rank, parallel_config):
    init_parallel(parallel_config, rank, torch.device("cpu"))
    if rank == 1:
        os._exit(3)
    dist.barrier()


def hang_after_joining(rank, parallel_config):
    init_parallel(parallel_config, rank, torch.device("cpu"))
    if rank == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


def evolve(config, **changes):
    return attrs.evolve(config, **changes)


def memory_of_every_rank(rank, parallel_config, folder):
    from moeplex.engine import Engine
    from moeplex.memory import memory_report

    parallel = init_parallel(parallel_config, rank, torch.device("cpu"))
    dispatcher = "naive" if parallel_config.ep_size > 1 else "local"
    config = EngineConfig(model=folder, show_progress=False, max_total_tokens=1024, dispatcher=dispatcher, parallel=parallel_config)
    report = memory_report(Engine(config, parallel=parallel))
    if not parallel_config.distributed:
        return [report]
    reports = [None] * parallel_config.world_size if rank == 0 else None
    dist.gather_object(report, reports, dst=0)
    return reports


def calibrated_generate(rank, parallel_config, folder, prompts, params, settings: dict):
    """Rank 0: (outputs, every rank's published verify-cost scales, every rank's count of steps it observed) from an
    engine whose calibration publishes every 4 observed steps (speculation/calibration.py)."""
    from moeplex.engine import Engine
    from moeplex.speculation import calibration

    calibration.PUBLISH_EVERY, calibration.EARLY = 4, ()
    parallel = init_parallel(parallel_config, rank, torch.device("cpu"))
    config = EngineConfig(model=folder, show_progress=False, max_total_tokens=1024, page_size=4,
                          dispatcher="naive" if parallel_config.ep_size > 1 else "local", parallel=parallel_config,
                          **settings)
    engine = Engine(config, parallel=parallel)
    outputs = [r.output_ids for r in engine.generate(prompts, params)]
    mine = [repr(sorted(engine.step_costs.scales.items())), engine.calibration._observed]
    every = [None] * parallel_config.world_size
    dist.all_gather_object(every, mine)
    return outputs, [row[0] for row in every], [row[1] for row in every]
