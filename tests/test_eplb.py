"""Balancers `eplb` (reference) and `eplb-vec` (vectorized): DeepSeek's expert-parallelism load balancer."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplex.interfaces import BalancerCaps
from moeplex.plugins.balancers import eplb as reference
from moeplex.plugins.balancers import eplb_vec as vectorized
from moeplex.registry import discover

EPLB_NAMES = ["eplb", "eplb-vec"]


def balancer(name: str):
    """Load through the entry points, as the engine does."""
    return discover("balancer")[name].load()()


def zipf_load(num_layers: int, num_experts: int, skew: float, seed: int, tokens: int = 32768) -> torch.Tensor:
    """[L, E] token counts drawn from a Zipf law, with the hot experts at random positions per layer."""
    gen = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** skew
    layers = []
    for _ in range(num_layers):
        tokens_to = torch.multinomial(probs, tokens, replacement=True, generator=gen)
        counts = torch.bincount(tokens_to, minlength=num_experts)
        layers.append(counts[torch.randperm(num_experts, generator=gen)])
    return torch.stack(layers)


def random_load(num_layers: int, num_experts: int, seed: int) -> torch.Tensor:
    """Continuous loads: no two sums or ratios tie, so every greedy choice is unique."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(num_layers, num_experts, generator=gen, dtype=torch.float64) * 1000


def tied_load(num_layers: int, num_experts: int, seed: int) -> torch.Tensor:
    """Small integers plus an all-zero layer: almost every greedy choice is a tie."""
    gen = torch.Generator().manual_seed(seed)
    load = torch.randint(0, 3, (num_layers, num_experts), generator=gen)
    load[0] = 0
    return load


# (logical experts, physical slots, groups, nodes, GPUs)
SHAPES = [
    (12, 16, 4, 2, 8),  # the README example's shape
    (64, 80, 8, 2, 8),  # hierarchical with redundancy
    (64, 64, 8, 2, 8),  # no redundant slots
    (64, 96, 8, 4, 16),  # two groups per node
    (60, 72, 6, 4, 8),  # 6 groups over 4 nodes: global policy
    (32, 64, 4, 2, 32),  # hierarchical, two slots per GPU
    (16, 32, 4, 4, 32),  # one group per node, one slot per GPU: both packings keep items in place
    (256, 288, 8, 4, 32),  # DeepSeek-V3 experts on 4 nodes x 8 GPUs
    (256, 512, 8, 32, 256),  # 8 groups over 32 nodes: global policy, 256 GPUs
]
LOADS = {"random": random_load, "zipf": lambda L, E, seed: zipf_load(L, E, 1.2, seed), "tied": tied_load}


# DeepSeek EPLB README, "Interface and Example": 2 layers, 12 experts, 16 slots, 4 groups, 2 nodes, 8 GPUs.
README_LOAD = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = torch.tensor(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)


@pytest.mark.parametrize("name", EPLB_NAMES)
def test_reproduces_the_deepseek_readme_example(name):
    placement = balancer(name).rebalance(README_LOAD, 16, 4, 2, 8)
    assert torch.equal(placement.phy2log, README_PHY2LOG)
    placement.check(num_gpus=8)


@pytest.mark.parametrize("name", EPLB_NAMES)
def test_declares_hierarchical_with_redundancy(name):
    assert type(balancer(name)).caps == BalancerCaps(hierarchical=True, supports_redundancy=True)


@pytest.mark.parametrize("load_kind", sorted(LOADS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", EPLB_NAMES)
def test_placement_keeps_the_contract(name, shape, load_kind):
    num_logical, num_physical, num_groups, num_nodes, num_gpus = shape
    load = LOADS[load_kind](3, num_logical, seed=1)
    placement = balancer(name).rebalance(load, num_physical, num_groups, num_nodes, num_gpus)
    assert placement.phy2log.shape == (3, num_physical)
    placement.check(num_gpus)
    assert (placement.balancedness(load, num_gpus) <= 1 + 1e-12).all()
    if num_groups % num_nodes == 0:
        _assert_groups_stay_on_one_node(placement.phy2log, num_groups, num_logical // num_groups, num_nodes)


def _assert_groups_stay_on_one_node(phy2log, num_groups, group_size, num_nodes):
    """Hierarchical policy: a group and all replicas of its experts live on a single node."""
    node_of_slot = torch.arange(phy2log.shape[1]) // (phy2log.shape[1] // num_nodes)
    for layer in phy2log:
        group_of_slot = layer // group_size
        nodes_per_group = [set(node_of_slot[group_of_slot == g].tolist()) for g in range(num_groups)]
        assert all(len(nodes) == 1 for nodes in nodes_per_group)
        groups_per_node = torch.bincount(torch.tensor([min(n) for n in nodes_per_group]), minlength=num_nodes)
        assert (groups_per_node == num_groups // num_nodes).all()


@pytest.mark.parametrize("load_kind", sorted(LOADS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_vectorized_places_exactly_like_the_reference(shape, load_kind):
    # Tolerance zero: both run the same greedy steps with the same tie-breaking (earlier item,
    # lower pack, lower expert) in the same float64 arithmetic, so even tied loads agree.
    num_logical, num_physical, num_groups, num_nodes, num_gpus = shape
    load = LOADS[load_kind](4, num_logical, seed=2)
    expected = balancer("eplb").rebalance(load, num_physical, num_groups, num_nodes, num_gpus)
    placement = balancer("eplb-vec").rebalance(load, num_physical, num_groups, num_nodes, num_gpus)
    assert torch.equal(placement.phy2log, expected.phy2log)
    assert torch.equal(placement.log2phy, expected.log2phy)


def _primitive_input(rows: int, items: int, seed: int, ties: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if ties:  # zeros and repeated values exercise every tie-breaking rule and the weightless tail
        return torch.randint(0, 3, (rows, items), generator=gen).double()
    return torch.rand(rows, items, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("module", [reference, vectorized], ids=["eplb", "eplb-vec"])
def test_packing_sends_an_item_to_the_lower_pack_when_loads_tie(module):
    # 5->p0, 4->p1, 4->p1 (8), 2->p0 (7), 1->p0 (8), then p0 and p1 both weigh 8: the 1 goes to p0,
    # which is now full, so both weightless items go to p1.
    pack, rank = module.balanced_packing(torch.tensor([[5.0, 4, 4, 2, 1, 1, 0, 0]]), 2)
    assert pack.tolist() == [[0, 1, 1, 0, 0, 0, 1, 1]]
    assert rank.tolist() == [[0, 0, 1, 1, 2, 3, 2, 3]]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 4),
    packs=st.integers(1, 6),
    per_pack=st.integers(1, 6),
    seed=st.integers(0, 9999),
    ties=st.booleans(),
)
def test_vectorized_packing_makes_the_reference_greedy_choices(rows, packs, per_pack, seed, ties):
    weight = _primitive_input(rows, packs * per_pack, seed, ties)
    pack, rank = vectorized.balanced_packing(weight, packs)
    expected_pack, expected_rank = reference.balanced_packing(weight, packs)
    assert torch.equal(pack, expected_pack) and torch.equal(rank, expected_rank)
    slot = pack * per_pack + rank  # each pack holds exactly per_pack items, ranked 0..per_pack-1
    assert torch.equal(slot.sort(dim=1).values, torch.arange(packs * per_pack).expand(rows, -1))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 4),
    experts=st.integers(1, 8),
    extra=st.integers(0, 12),
    seed=st.integers(0, 9999),
    ties=st.booleans(),
)
def test_vectorized_replication_makes_the_reference_greedy_choices(rows, experts, extra, seed, ties):
    weight = _primitive_input(rows, experts, seed, ties)
    expert_of_slot, replica_count = vectorized.replicate_experts(weight, experts + extra)
    expected_slots, expected_count = reference.replicate_experts(weight, experts + extra)
    assert torch.equal(expert_of_slot, expected_slots) and torch.equal(replica_count, expected_count)


@pytest.mark.parametrize("name", EPLB_NAMES)
def test_redundant_slots_beat_static_on_skewed_load(name):
    load = zipf_load(8, 64, skew=1.2, seed=3)
    static = balancer("static").rebalance(load, 80, 8, 2, 8).balancedness(load, 8)
    eplb = balancer(name).rebalance(load, 80, 8, 2, 8).balancedness(load, 8)
    assert (eplb > static).all()
    assert eplb.mean() > 0.85 > 0.5 > static.mean()


@pytest.mark.parametrize("name", EPLB_NAMES)
def test_packing_alone_beats_static_without_redundancy(name):
    load = zipf_load(8, 64, skew=0.8, seed=4)
    static = balancer("static").rebalance(load, 64, 8, 2, 8).balancedness(load, 8)
    eplb = balancer(name).rebalance(load, 64, 8, 2, 8).balancedness(load, 8)
    assert (eplb > static).all()
    assert eplb.mean() > static.mean() + 0.1


@pytest.mark.parametrize("name", EPLB_NAMES)
def test_even_load_without_redundancy_is_perfectly_balanced(name):
    load = torch.full((2, 64), 7)
    placement = balancer(name).rebalance(load, 64, 8, 2, 8)
    assert torch.equal(placement.balancedness(load, 8), torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("name", EPLB_NAMES)
def test_replica_counts_minimize_the_heaviest_replica(name):
    # Global policy (one node, one group): the replica counts must reach the smallest possible
    # max(load / replicas), found here by trying every way to split 9 slots over 5 experts.
    load = random_load(6, 5, seed=5)
    placement = balancer(name).rebalance(load, 9, 1, 1, 3)
    splits = [c for c in itertools.product(range(1, 6), repeat=5) if sum(c) == 9]
    for layer_load, counts in zip(load, placement.logcnt):
        best = min(max(w / c for w, c in zip(layer_load.tolist(), split)) for split in splits)
        assert (layer_load / counts).max().item() == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("name", EPLB_NAMES)
def test_groups_that_do_not_divide_over_nodes_fall_back_to_the_global_policy(name):
    load = random_load(3, 60, seed=6)
    fallback = balancer(name).rebalance(load, 72, 6, 4, 8)
    global_policy = balancer(name).rebalance(load, 72, 1, 1, 8)
    assert torch.equal(fallback.phy2log, global_policy.phy2log)


@pytest.mark.parametrize("name", EPLB_NAMES)
def test_load_over_steps_is_summed_and_left_untouched(name):
    steps = zipf_load(12, 32, skew=1.0, seed=7).reshape(4, 3, 32)
    before = steps.clone()
    over_steps = balancer(name).rebalance(steps, 48, 4, 2, 8)
    assert torch.equal(steps, before)
    assert torch.equal(over_steps.phy2log, balancer(name).rebalance(steps.sum(0), 48, 4, 2, 8).phy2log)


@pytest.mark.parametrize(
    "args, message",
    [
        ((60, 4, 2, 8), "60 physical slots cannot hold 64 logical experts"),
        ((68, 4, 2, 8), "68 physical slots do not divide evenly over 8 GPUs"),
        ((72, 4, 3, 8), "8 GPUs do not divide evenly over 3 nodes"),
        ((80, 6, 2, 8), "64 logical experts do not divide into 6 groups"),
        ((80, 4, 0, 8), "groups, nodes and GPUs must be positive"),
    ],
)
@pytest.mark.parametrize("name", EPLB_NAMES)
def test_refuses_impossible_shapes(name, args, message):
    with pytest.raises(ValueError, match=message):
        balancer(name).rebalance(torch.ones(2, 64), *args)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("name", EPLB_NAMES)
def test_refuses_loads_that_are_not_token_counts(name, bad):
    steps = torch.ones(3, 2, 16)
    steps[2, 1, 3] = bad  # also when the sum over steps would hide it
    steps[0, 1, 3] = 2.0
    with pytest.raises(ValueError, match="finite, non-negative"):
        balancer(name).rebalance(steps, 16, 4, 2, 8)


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16), (16,)])
@pytest.mark.parametrize("name", EPLB_NAMES)
def test_refuses_loads_without_layers_and_experts(name, shape):
    with pytest.raises(ValueError, match="load"):
        balancer(name).rebalance(torch.ones(shape), 16, 4, 2, 8)


def test_replicate_first_keeps_each_experts_replicas_on_one_node_and_beats_eplb_on_zipf():
    from moeplex.plugins.balancers.eplb import EplbBalancer
    from moeplex.plugins.balancers.replicate_first import ReplicateFirstBalancer

    gen = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, 65, dtype=torch.float64)
    load = torch.stack([(1.0 / ranks)[torch.randperm(64, generator=gen)] * 1000 for _ in range(4)])
    shape = dict(num_physical=80, num_groups=8, num_nodes=2, num_gpus=8)
    ours = ReplicateFirstBalancer().rebalance(load, **shape)
    ours.check(8)
    node_of_slot = torch.arange(80) // 40
    for layer in range(4):
        for expert in range(64):
            slots = ours.log2phy[layer, expert, : int(ours.logcnt[layer, expert])]
            assert len(set(node_of_slot[slots].tolist())) == 1  # all replicas of an expert on one node
    theirs = EplbBalancer().rebalance(load, **shape)
    assert ours.balancedness(load, 8).mean() > theirs.balancedness(load, 8).mean()
