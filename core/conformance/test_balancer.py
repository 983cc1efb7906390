"""Balancer contract: a pure, deterministic CPU function from expert load to a valid Placement.

Every logical expert keeps >= 1 replica, each GPU gets exactly P / num_gpus slots, the
two maps invert each other (Placement.check); the same load gives the same placement;
the load tensor is left as it was; balancedness (mean GPU load / max GPU load) is in (0, 1].
Loads are random, Zipf-skewed, zero (what the engine passes at start-up) and [steps, L, E].
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
LOADS = ("random", "zipf", "zero", "steps")


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


@pytest.mark.parametrize("load_kind", ["random", "zipf", "steps"])
@pytest.mark.parametrize("world_name", list(WORLDS))
def test_balancedness_is_in_unit_interval(balancer_cls, moeplex_plugin, world_name, load_kind):
    world = world_for(balancer_cls, moeplex_plugin.name, world_name)
    load = make_load(load_kind, world, seed=4)
    balancedness = rebalance(balancer_cls, load, world).balancedness(load, world.gpus)
    assert tuple(balancedness.shape) == (world.layers,)
    assert ((balancedness > 0) & (balancedness <= 1 + 1e-9)).all(), f"balancedness {balancedness.tolist()}"
