"""Offline generation on every rank of one engine: requests shared out to DP groups (the server's longest-prefix
rule, dp_dispatch.py), results back on rank 0."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Sequence

import attrs
import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..context_limit import context_length, context_problem
from ..engine import Engine
from ..memory import describe, memory_report
from ..parallel import ParallelState, init_parallel, rank_device
from ..sampling import SamplingParams
from .dp_dispatch import DPDispatch
from .launcher import launch


log = logging.getLogger(__name__)
STOP_DELAY_S = 1.0


def assign_to_dp_groups(
    prompts: Sequence[Sequence[int]], dp_size: int, capacity_tokens: int = 0, cache_aware: bool = False
) -> list[int]:
    """Each prompt's DP group, by the server's rule (dp_dispatch.py): with `cache_aware`, the group that was given
    the longest share of its prefix (so its prefix cache holds it), unless the groups' loads are imbalanced; else
    the group with the fewest prompt tokens so far. Every prompt is handed over at once, before any finishes, so
    a group's load is what it was given. Deterministic: every rank computes the same owners."""
    dispatch = DPDispatch(dp_size, capacity_tokens, cache_aware)
    requests, tokens = [0] * dp_size, [0] * dp_size
    owners = []
    for prompt in prompts:
        group = dispatch.choose(prompt, requests, tokens)
        dispatch.will_cache(group, prompt)
        owners.append(group)
        requests[group] += 1
        tokens[group] += len(prompt)
    return owners


def result_of(request, with_text: bool) -> dict:
    result = {
        "output_ids": request.output_ids,
        "finish_reason": request.finish_reason.value,
        "logprobs": request.logprobs,
        "cached_tokens": request.cached_tokens,
    }
    if request.prompt_logprobs is not None:
        result["prompt_logprobs"] = request.prompt_logprobs
    if with_text:
        result["text"] = request.text
    return result


def _generate_on_rank(rank: int, config: EngineConfig, prompts, params) -> list[dict] | None:
    if config.parallel.distributed:  # a spawned rank: Ctrl-C is the launching process's to report, in one line
        signal.signal(signal.SIGINT, _stop_quietly)
    config = attrs.evolve(config, device=rank_device(config.device, rank, config.parallel))
    parallel = init_parallel(config.parallel, rank, torch.device(config.device))
    return generate_on_rank(parallel, config, prompts, params)


def check_context(engine: Engine, prompts, params) -> None:
    """Refuse, before any step, a prompt that cannot fit with its tokens to generate (as serve answers 400)."""
    context = context_length(engine.model.hf_config, engine.kv.capacity_tokens)
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        problem = context_problem(len(prompt), sp.max_new_tokens, context, "--max-new-tokens")
        if problem:
            raise ValueError(f"prompt {i}: {problem}" if len(prompts) > 1 else problem)


def _stop_quietly(signum, frame) -> None:
    """A rank's Ctrl-C: no traceback of its own; it leaves a moment after the launching process, which got the
    same signal, so that the launcher reports the interruption rather than a rank's death."""
    time.sleep(STOP_DELAY_S)
    os._exit(128 + signum)


def generate_on_rank(parallel: ParallelState, config: EngineConfig, prompts, params) -> list[dict] | None:
    """This rank's part of an offline run: its DP group's prompts; rank 0 returns every result."""
    engine = Engine(config, parallel=parallel)
    log.info(describe(memory_report(engine)))
    check_context(engine, prompts, params)
    rank = parallel.rank
    # the longest sequence every group can hold bounds the mirror of the groups' caches, as in the server (group.py)
    dp_size = config.parallel.dp_size
    capacity = min(row[0] for row in parallel.world.all_gather_ints([engine.kv.capacity_tokens])) if dp_size > 1 else 0
    owners = assign_to_dp_groups(prompts, dp_size, capacity, not config.disable_prefix_cache)
    mine = [i for i, owner in enumerate(owners) if owner == parallel.dp_rank]
    # one bar, on the first rank (its group's share of the tokens)
    requests = engine.generate([prompts[i] for i in mine], [params[i] for i in mine], progress=config.show_progress and rank == 0)
    local = {i: result_of(r, engine.tokenizer is not None) for i, r in zip(mine, requests)} if parallel.is_output_rank else {}
    if not config.parallel.distributed:
        return [local[i] for i in range(len(prompts))]
    gathered = [None] * config.parallel.world_size if rank == 0 else None
    dist.gather_object(local, gathered, dst=0, group=parallel.world.host_group)
    if rank != 0:
        return None
    merged = {i: r for part in gathered for i, r in part.items()}
    return [merged[i] for i in range(len(prompts))]


def generate(config: EngineConfig, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[dict]:
    """Run prompts on all ranks of `config.parallel` (one process when it is a single rank)."""
    params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    return launch(_generate_on_rank, config.parallel, config, [list(p) for p in prompts], params, device=config.device)
