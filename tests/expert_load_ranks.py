"""Rank entry points and checks for the rebalancing tests (spawned processes import this module by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.hooks import hookimpl
from moeplex.models.loader import CheckpointReader
from moeplex.moe.layer import MoELayer
from moeplex.parallel import init_parallel


class PlacementChanges:
    """A hook implementation counting the placements applied."""

    def __init__(self):
        self.placements = []

    @hookimpl
    def moeplex_placement_changed(self, placement):
        self.placements.append(placement)


def expert_slot_mismatches(model, folder: str) -> list[tuple[int, int]]:
    """(MoE layer, local slot) of every slot whose weights are not its logical expert's in the checkpoint.

    Each slot must hold whole experts (no tensor-parallel slicing of the experts).
    """
    reader = CheckpointReader(folder)
    gate, up, down = model.expert_names
    wrong = []
    for prefix, moe in model.named_modules():
        if not isinstance(moe, MoELayer):
            continue
        runtime = moe.runtime
        phy2log = runtime.placement.phy2log[moe.moe_index]
        for slot in range(moe.w13.shape[0]):
            expert = f"{prefix}.experts.{int(phy2log[runtime.ctx.first_local_expert + slot])}"
            w13 = torch.cat([reader.read(f"{expert}.{gate}.weight"), reader.read(f"{expert}.{up}.weight")])
            w2 = reader.read(f"{expert}.{down}.weight")
            if not (torch.equal(moe.w13.data[slot], w13) and torch.equal(moe.w2.data[slot], w2)):
                wrong.append((moe.moe_index, slot))
    return wrong


def rebalance_while_generating(rank, parallel_config, folder, prompts, params, skewed_load, every):
    """Generate with a rebalance every `every` steps, then force one that moves experts across ranks, then generate again.

    Rank 0 returns the tokens of both runs, the dump, and every rank's slot check and transfer counts.
    """
    parallel = init_parallel(parallel_config, rank, torch.device("cpu"))
    config = EngineConfig(
        model=folder,
        show_progress=False,
        max_total_tokens=1024,
        page_size=4,
        dispatcher="naive",
        balancer="eplb",
        ep_num_redundant_experts=2,
        enable_eplb=True,
        eplb_rebalance_num_iterations=every,
        eplb_rebalance_layers_per_chunk=1,
        parallel=parallel_config,
    )
    engine = Engine(config, parallel=parallel)
    changes = PlacementChanges()
    engine.hooks.register(changes)
    engine.start_recording()
    during = [r.output_ids for r in engine.generate(prompts, params, progress=False)]
    dump = engine.dump_recording()
    forced = engine.rebalance(load=skewed_load)
    after = [r.output_ids for r in engine.generate(prompts, params, progress=False)]
    mine = {
        "mismatches": expert_slot_mismatches(engine.model, folder),
        "received": forced.experts_received,
        "placements": len(changes.placements),
        "phy2log": engine.model.moe_runtime.placement.phy2log.tolist(),
    }
    everyone = [None] * parallel_config.world_size
    dist.all_gather_object(everyone, mine)
    return {"during": during, "after": after, "dump": dump, "ranks": everyone}
