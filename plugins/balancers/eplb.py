"""`eplb`: DeepSeek's hierarchical expert-parallelism load balancer, one layer at a time.

This is the readable reference: the two greedy primitives run per layer (and per node) in plain
Python with heaps. `eplb-vec` computes the same placement with tensor ops over all layers.
The policy and the index bookkeeping shared by both live in `_packing.py`.
"""

from __future__ import annotations

import heapq

import torch

from moeplex.interfaces import Balancer, BalancerCaps, Placement

from ._packing import eplb_placement, items_per_pack, pack_in_place


class EplbBalancer(Balancer):
    caps = BalancerCaps(hierarchical=True, supports_redundancy=True)

    def rebalance(self, load, num_physical, num_groups, num_nodes, num_gpus) -> Placement:
        return eplb_placement(
            load, num_physical, num_groups, num_nodes, num_gpus, pack=balanced_packing, replicate=replicate_experts
        )


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each row's items into `num_packs` equal-count packs; returns (pack, rank in pack) per item."""
    num_rows, num_items = weight.shape
    if num_items == num_packs:
        return pack_in_place(num_rows, num_items)
    rows = [_pack_row(items, num_packs) for items in weight.tolist()]
    pack_of_item = torch.tensor([pack for pack, _ in rows], dtype=torch.int64).reshape(num_rows, num_items)
    rank_in_pack = torch.tensor([rank for _, rank in rows], dtype=torch.int64).reshape(num_rows, num_items)
    return pack_of_item, rank_in_pack


def _pack_row(items: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    capacity = items_per_pack(len(items), num_packs)
    pack_of_item = [0] * len(items)
    rank_in_pack = [0] * len(items)
    # (load, pack, items held): the heap top is the lightest open pack, the lower pack on ties
    open_packs = [(0.0, pack, 0) for pack in range(num_packs)]
    for item in sorted(range(len(items)), key=lambda i: -items[i]):  # stable: earlier item first on ties
        pack_load, pack, held = heapq.heappop(open_packs)
        pack_of_item[item], rank_in_pack[item] = pack, held
        if held + 1 < capacity:  # a full pack never takes another item, so it leaves the heap
            heapq.heappush(open_packs, (pack_load + items[item], pack, held + 1))
    return pack_of_item, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill `num_slots` slots per row: one per expert, then replicas of the most loaded per replica."""
    num_rows, num_experts = weight.shape
    rows = [_replicate_row(loads, num_slots) for loads in weight.tolist()]
    expert_of_slot = torch.tensor([slots for slots, _ in rows], dtype=torch.int64).reshape(num_rows, num_slots)
    replica_count = torch.tensor([counts for _, counts in rows], dtype=torch.int64).reshape(num_rows, num_experts)
    return expert_of_slot, replica_count


def _replicate_row(loads: list[float], num_slots: int) -> tuple[list[int], list[int]]:
    expert_of_slot = list(range(len(loads)))
    replica_count = [1] * len(loads)
    # (-load per replica, expert): the heap top is the expert that most needs a replica
    neediest = [(-load, expert) for expert, load in enumerate(loads)]
    heapq.heapify(neediest)
    for _ in range(num_slots - len(loads)):
        _, expert = heapq.heappop(neediest)
        expert_of_slot.append(expert)
        replica_count[expert] += 1
        heapq.heappush(neediest, (-(loads[expert] / replica_count[expert]), expert))
    return expert_of_slot, replica_count
