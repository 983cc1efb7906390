"""Rank entry points for the multi-rank decode-graph tests (spawned processes import this module by name).

On the CPU a rank's engine gets DecodeGraphs whose `capture` returns the step itself: a replay runs the
captured batch over the static inputs, so the agreement, the padding, an idle rank's replay and the
collectives of the padded step all run for real; only the CUDA capture is missing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeplex.config import EngineConfig
from moeplex.cuda_graph import DecodeGraphs, DecodeInputs, capture_sizes, max_pages_per_request
from moeplex.engine import Engine
from moeplex.parallel import init_parallel
from moeplex.ranks.offline import assign_to_dp_groups, result_of
from moeplex.speculation.setup import drafter_context

MAX_BS = 4


def install_graphs(engine: Engine, world_size: int) -> list[tuple]:
    """Give the engine decode graphs of sizes 1, 2, 4; returns the log of its replays:
    (captured size, real rows, mode) per replayed step."""
    kv, model = engine.kv, engine.model
    max_pages = max_pages_per_request(kv, model.hf_config.get("max_position_embeddings"))
    inputs = DecodeInputs.allocate(MAX_BS, max_pages, kv, "cpu")
    hidden = engine.speculation is not None and engine.speculation.drafter.caps.needs_hidden
    graphs = DecodeGraphs(model, kv, engine.runner.strategy, inputs, capture_sizes(MAX_BS), lambda step: step,
                          world_size, with_hidden=hidden)
    replays, run = [], graphs.run

    def logged(batch, rows=None):
        replays.append((graphs.size_for(batch), batch.batch_size, batch.mode.name))
        return run(batch, rows)

    graphs.run = logged
    engine.runner.graphs = graphs
    return replays


def install_drafter_graphs(engine: Engine, world_size: int) -> list[int]:
    """Bind the engine's drafter again with graphs over its decode graphs' static inputs (nextn: its MTP layer's
    steps replay); returns the captured size of each of the drafter's replays."""
    drafter, kv = engine.speculation.drafter, engine.kv
    own_layers = range(len(engine.model.kv_shapes()), len(kv.buffers))
    drafter.bind(drafter_context(engine.model, kv, engine.config, engine.device, own_layers, engine.runner.graphs,
                                 world_size, capture=lambda step: step))
    replayed: list[int] = []
    graphed = getattr(drafter, "rows_step", None)
    for size, replay in getattr(graphed, "replays", {}).items():
        graphed.replays[size] = lambda size=size, replay=replay: replayed.append(size) or replay()
    return replayed


class CollectivesPerStep:
    """Counts the all-gathers (the agreement's kind of collective) each engine step issues on this rank."""

    def __init__(self, engine: Engine):
        self.counts: list[int] = []
        self.calls = 0
        gather, step = dist.all_gather, engine.step

        def counted_gather(*args, **kwargs):
            self.calls += 1
            return gather(*args, **kwargs)

        def counted_step():
            before = self.calls
            finished = step()
            self.counts.append(self.calls - before)
            return finished

        dist.all_gather = counted_gather  # looked up on the module at each call (moeplex.parallel's `dist`)
        engine.step = counted_step
        self.restore = lambda: setattr(dist, "all_gather", gather)


def run_engines(rank, parallel_config, folder, prompts, params, variants: dict):
    """Each variant {name: (EngineConfig settings, with graphs)} generates the prompts on this launch's ranks;
    rank 0 returns {name: {"results": per prompt, "ranks": per rank {replays, pages_conserved, cuts, overlap_schedule,
    gathers_per_step}}}."""
    parallel = init_parallel(parallel_config, rank, torch.device("cpu"))
    owners = assign_to_dp_groups(prompts, parallel_config.dp_size)
    mine = [i for i, owner in enumerate(owners) if owner == parallel.dp_rank]
    out = {}
    for name, (settings, graphs) in variants.items():
        config = EngineConfig(
            model=folder, show_progress=False, max_total_tokens=256, page_size=4, dispatcher="naive",
            attention_backend="triton", mixed_chunk=False, parallel=parallel_config, **settings,
        )
        engine = Engine(config, parallel=parallel)
        replays = install_graphs(engine, parallel_config.world_size) if graphs else []
        drafts = graphs and engine.speculation is not None
        draft_replays = install_drafter_graphs(engine, parallel_config.world_size) if drafts else []
        collectives = CollectivesPerStep(engine)
        try:
            requests = engine.generate([prompts[i] for i in mine], [params[i] for i in mine])
        finally:
            collectives.restore()
        local = {i: result_of(r, False) for i, r in zip(mine, requests)} if parallel.is_output_rank else {}
        conserved = engine.flush_cache() and engine.kv.num_free_pages == engine.kv.num_pages
        cuts = engine.runner.graphs.cuts if graphs else {}
        mine_out = {"results": local, "rank": {"replays": replays, "pages_conserved": conserved, "cuts": cuts,
                                              "overlap_schedule": engine.overlap_schedule,
                                              "gathers_per_step": collectives.counts, "draft_replays": draft_replays}}
        gathered = [None] * parallel_config.world_size if rank == 0 else None
        dist.gather_object(mine_out, gathered, dst=0, group=parallel.world.host_group)
        if rank == 0:
            merged = {i: r for part in gathered for i, r in part["results"].items()}
            out[name] = {"results": [merged[i] for i in range(len(prompts))], "ranks": [p["rank"] for p in gathered]}
    return out if rank == 0 else None
