"""Balancer contract: a pure, deterministic CPU function from expert load to a valid Placement.

Every logical expert keeps >= 1 replica, each GPU gets exactly P / num_gpus slots, the
two maps invert each other (Placement.check); the same load gives the same placement;
the load tensor is left as it was; balancedness (mean GPU load / max GPU load) is in (0, 1].
Loads are random, Zipf-skewed, all zero (what the engine passes at start-up), with idle
experts (a third of them recorded no token), all on one expert per layer, and [steps, L, E]:
an expert that recorded no load still keeps a replica, or the engine refuses the placement.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from moeplex.conformance.plugin import load_plugin


@attrs.frozen
class World:
    layers: int
    logical: int
    physical: int
    groups: int
    nodes: int
    gpus: int

    @property
    def redundant(self) -> bool:
        return self.physical > self.logical


WORLDS = {
    "one_gpu": World(layers=1, logical=8, physical=8, groups=1, nodes=1, gpus=1),
    "4_gpus": World(layers=2, logical=16, physical=16, groups=4, nodes=1, gpus=4),
    "2_nodes_redundant": World(layers=3, logical=16, physical=24, groups=4, nodes=2, gpus=8),
    "4_nodes_redundant": World(layers=2, logical=32, physical=48, groups=8, nodes=4, gpus=8),
    "16_gpus_redundant": World(layers=2, logical=64, physical=80, groups=8, nodes=2, gpus=16),
}
LOADS = ("random", "zipf", "zero", "idle_experts", "one_hot", "steps")


@pytest.fixture(scope="module")
def balancer_cls(moeplex_plugin):
    return load_plugin(moeplex_plugin)


def make_load(kind: str, world: World, seed: int) -> torch.Tensor:
    """Token counts per logical expert: [L, E], or [steps, L, E] for 'steps'."""
    gen = torch.Generator().manual_seed(seed)
    shape = (world.layers, world.logical)
    if kind == "random":
        return torch.randint(0, 1000, shape, generator=gen)
    if kind == "zipf":
        ranks = torch.rand(shape, generator=gen).argsort(dim=1) + 1  # a different hot expert per layer
        return (100_000 / ranks.double() ** 1.2).long()
    if kind == "zero":
        return torch.zeros(shape, dtype=torch.int64)
    if kind == "idle_experts":  # a third of each layer's experts recorded nothing, the rest a skewed load
        load = torch.randint(1, 1000, shape, generator=gen) ** 2
        idle = torch.rand(shape, generator=gen).argsort(dim=1) < max(1, world.logical // 3)
        return load.masked_fill(idle, 0)
    if kind == "one_hot":  # every token of a layer went to one expert
        load = torch.zeros(shape, dtype=torch.int64)
        load[torch.arange(world.layers), torch.randint(0, world.logical, (world.layers,), generator=gen)] = 10_000
        return load
    if kind == "steps":
        return torch.randint(0, 300, (4, *shape), generator=gen)
    raise ValueError(kind)


def rebalance(balancer_cls, load: torch.Tensor, world: World):
    return balancer_cls().rebalance(load, world.physical, world.groups, world.nodes, world.gpus)


def world_for(balancer_cls, name: str, world_name: str) -> World:
    world = WORLDS[world_name]
    if world.redundant and not balancer_cls.caps.supports_redundancy:
        pytest.skip(f"balancer '{name}' does not declare supports_redundancy")
    return world


@pytest.mark.parametrize("load_kind", LOADS)
@pytest.mark.parametrize("world_name", list(WORLDS))
def test_placement_keeps_the_contract(balancer_cls, moeplex_plugin, world_name, load_kind):
    world = world_for(balancer_cls, moeplex_plugin.name, world_name)
    placement = rebalance(balancer_cls, make_load(load_kind, world, seed=1), world)
    assert tuple(placement.phy2log.shape) == (world.layers, world.physical)
    assert tuple(placement.logcnt.shape) == (world.layers, world.logical)
    assert placement.log2phy.shape[:2] == (world.layers, world.logical)
    assert placement.phy2log.device.type == "cpu", "a Placement lives on the CPU"
    placement.check(world.gpus)


@pytest.mark.parametrize("load_kind", LOADS)
@pytest.mark.parametrize("world_name", list(WORLDS))
def test_every_logical_expert_keeps_a_replica(balancer_cls, moeplex_plugin, world_name, load_kind):
    """Counted from phy2log itself, whatever logcnt says: the experts no token reached too."""
    world = world_for(balancer_cls, moeplex_plugin.name, world_name)
    load = make_load(load_kind, world, seed=5)
    placement = rebalance(balancer_cls, load, world)
    for layer in range(world.layers):
        present = set(placement.phy2log[layer].tolist())
        missing = [e for e in range(world.logical) if e not in present]
        layer_load = load.reshape(-1, world.layers, world.logical).sum(0)[layer]
        assert not missing, (
            f"layer {layer}: logical experts {missing} (recorded load {layer_load[missing].tolist()}) have no "
            f"physical slot; every logical expert keeps >= 1 replica, idle ones too"
        )


@pytest.mark.parametrize("load_kind", LOADS)
@pytest.mark.parametrize("world_name", list(WORLDS))
def test_same_load_gives_same_placement(balancer_cls, moeplex_plugin, world_name, load_kind):
    world = world_for(balancer_cls, moeplex_plugin.name, world_name)
    first = rebalance(balancer_cls, make_load(load_kind, world, seed=2), world)
    second = rebalance(balancer_cls, make_load(load_kind, world, seed=2), world)
    for field in ("phy2log", "log2phy", "logcnt"):
        assert torch.equal(getattr(first, field), getattr(second, field)), f"{field} differs between two equal calls"


@pytest.mark.parametrize("load_kind", LOADS)
@pytest.mark.parametrize("world_name", list(WORLDS))
def test_load_is_not_modified(balancer_cls, moeplex_plugin, world_name, load_kind):
    world = world_for(balancer_cls, moeplex_plugin.name, world_name)
    load = make_load(load_kind, world, seed=3)
    before = load.clone()
    rebalance(balancer_cls, load, world)
    assert torch.equal(load, before), "rebalance changed the load tensor it was given"


@pytest.mark.parametrize("load_kind", ["random", "zipf", "idle_experts", "one_hot", "steps"])
@pytest.mark.parametrize("world_name", list(WORLDS))
def test_balancedness_is_in_unit_interval(balancer_cls, moeplex_plugin, world_name, load_kind):
    world = world_for(balancer_cls, moeplex_plugin.name, world_name)
    load = make_load(load_kind, world, seed=4)
    balancedness = rebalance(balancer_cls, load, world).balancedness(load, world.gpus)
    assert tuple(balancedness.shape) == (world.layers,)
    assert ((balancedness > 0) & (balancedness <= 1 + 1e-9)).all(), f"balancedness {balancedness.tolist()}"
