"""Rebalancing: the weight mover's plan, and greedy tokens unchanged by rebalances on one and on two ranks."""

from __future__ import annotations

import socket

import pytest
import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.ranks.launcher import launch
from moeplex.moe.weight_mover import plan_transfers
from moeplex.parallel import ParallelConfig
from moeplex.sampling import SamplingParams

import expert_load_ranks
from expert_load_ranks import PlacementChanges, expert_slot_mismatches

PROMPTS = [[256, 1, 2, 3, 4], [256] + list(range(40, 75)), [256, 9, 8]]
PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def skewed_load(num_layers: int = 2, num_experts: int = 16) -> torch.Tensor:
    """Experts 0 and 1 hot in every layer: a balancer gives them the redundant slots."""
    load = torch.ones(num_layers, num_experts)
    load[:, 0], load[:, 1] = 1000, 500
    return load


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("deepseek_v3")


def engine_config(folder: str, **changes) -> EngineConfig:
    return EngineConfig(model=folder, show_progress=False, max_total_tokens=1024, page_size=4, **changes)


@pytest.fixture(scope="module")
def reference(folder):
    """Greedy tokens with one replica per expert and the identity placement."""
    return [r.output_ids for r in Engine(engine_config(folder)).generate(PROMPTS, PARAMS)]


# --- the plan: pure functions of the two placements ---------------------------------------------


def apply(transfers, old: list[int], per_rank: int) -> list[int]:
    """What every slot holds after the transfers, each reading the old content of its source slot."""
    held = list(old)
    for t in transfers:
        assert old[t.src * per_rank + t.src_slot] == t.expert, "a source slot does not hold the expert it sends"
        for slot in t.dst_slots:
            held[t.dst * per_rank + slot] = t.expert
    return held


def random_phy2log(experts: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    """[1, slots]: every expert once plus random replicas, in a random slot order."""
    layout = torch.cat([torch.randperm(experts, generator=gen), torch.randint(0, experts, (slots - experts,), generator=gen)])
    return layout[torch.randperm(slots, generator=gen)].unsqueeze(0)


@pytest.mark.parametrize("seed", range(12))
def test_transfers_turn_the_old_placement_into_the_new(seed):
    gen = torch.Generator().manual_seed(seed)
    experts, ranks, ranks_per_node = 8, 4, 2
    slots = experts + 4
    old, new = (random_phy2log(experts, slots, gen) for _ in "ab")
    per_rank = slots // ranks
    transfers = plan_transfers(old, new, ranks, ranks_per_node)
    assert apply(transfers, old[0].tolist(), per_rank) == new[0].tolist()
    for t in transfers:
        holders = {p // per_rank for p, e in enumerate(old[0].tolist()) if e == t.expert}
        dst_slots = [t.dst * per_rank + s for s in t.dst_slots]
        assert all(old[0, p] != new[0, p] for p in dst_slots), "a slot that keeps its expert was rewritten"
        if t.dst in holders:
            assert t.src == t.dst, "an expert the rank holds was fetched from elsewhere"
        elif any(h // ranks_per_node == t.dst // ranks_per_node for h in holders):
            assert t.src // ranks_per_node == t.dst // ranks_per_node, "a holder on the same node was passed over"


def test_an_unchanged_placement_moves_nothing():
    phy2log = torch.tensor([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 3]])
    assert plan_transfers(phy2log, phy2log.clone(), 3, 3) == []


# --- one process --------------------------------------------------------------------------------


def test_rebalance_between_steps_keeps_greedy_tokens(folder, reference):
    engine = Engine(engine_config(folder, balancer="eplb", ep_num_redundant_experts=4))
    changes = PlacementChanges()
    engine.hooks.register(changes)
    requests = [engine.add_request(p, PARAMS) for p in PROMPTS]
    for _ in range(3):  # prefill and a couple of decode steps under the start-up placement
        engine.step()
    report = engine.rebalance(load=skewed_load())
    assert report.layers_changed == (0, 1)
    assert changes.placements == [report.placement]
    assert (report.placement.logcnt[:, :2] > 1).all(), "the hot experts did not get the redundant slots"
    assert expert_slot_mismatches(engine.model, folder) == []
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in requests] == reference


def test_rebalance_every_n_steps_keeps_greedy_tokens(folder, reference):
    config = engine_config(
        folder, balancer="eplb-vec", ep_num_redundant_experts=4, ep_dispatch_algorithm="static",
        enable_eplb=True, eplb_rebalance_num_iterations=2, eplb_rebalance_layers_per_chunk=1,
    )
    engine = Engine(config)
    changes = PlacementChanges()
    engine.hooks.register(changes)
    assert [r.output_ids for r in engine.generate(PROMPTS, PARAMS)] == reference
    assert engine.balancing.steps == 8  # one prefill step and seven decode steps
    assert len(changes.placements) >= 1
    assert expert_slot_mismatches(engine.model, folder) == []


def test_rebalance_needs_a_recorded_load(folder):
    engine = Engine(engine_config(folder, ep_num_redundant_experts=4))
    with pytest.raises(ValueError, match="no expert load is recorded"):
        engine.rebalance()
    engine.start_recording()
    with pytest.raises(ValueError, match="all zero"):
        engine.rebalance()


# --- two gloo ranks: EP 2 over TP 2 attention, through the naive dispatcher ------------------------


@pytest.mark.slow
def test_two_ranks_rebalance_while_generating(folder, reference):
    parallel = ParallelConfig(tp_size=2, ep_size=2, dist_init_addr=free_address(), timeout_s=60)
    params = [PARAMS] * len(PROMPTS)
    every = 3  # steps between rebalances
    ranks_fn = expert_load_ranks.rebalance_while_generating
    result = launch(ranks_fn, parallel, parallel, folder, PROMPTS, params, skewed_load(), every)
    assert result["during"] == reference, "tokens changed across rebalances every 3 steps"
    assert result["after"] == reference, "tokens changed after a rebalance that moved experts across ranks"
    ranks = result["ranks"]
    assert [r["mismatches"] for r in ranks] == [[], []]
    assert sum(r["received"] for r in ranks) > 0, "the forced rebalance moved no expert between the ranks"
    assert ranks[0]["phy2log"] == ranks[1]["phy2log"]
    assert all(r["placements"] >= 3 for r in ranks)  # two or more every 3 steps, and the forced one
    tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (PARAMS.max_new_tokens - 1)
    top_k, moe_layers = 4, 2
    assert torch.tensor(result["dump"]["logical_count"]).sum() == tokens * top_k * moe_layers
