"""`eplb-vec`: DeepSeek's hierarchical load balancer with tensor ops over all layers at once.

Same policy, same tie-breaking and same float64 arithmetic as `eplb`, so the placements are
identical; only the two greedy primitives change. Each loops over sequential decisions, and
every iteration acts on all layers x nodes rows and all packs / experts at once:
  - replication loops once per redundant slot of a node, for all layers and nodes together;
  - packing loops once per run: a run is as many next items as the greedy provably sends to the
    open packs in lightest-first order, so it usually takes far fewer iterations than there are
    items (weightless items, which sort last, are all placed in one step).
"""

from __future__ import annotations

import torch

from moeplex.interfaces import Balancer, BalancerCaps, Placement

from ._packing import eplb_placement, items_per_pack, pack_in_place


class VectorizedEplbBalancer(Balancer):
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
    capacity = items_per_pack(num_items, num_packs)
    order = weight.sort(dim=1, descending=True, stable=True).indices  # stable: earlier item first on ties
    sorted_weight = weight.gather(1, order)
    # weightless items sort last and change no load, so they are placed in one step at the end
    num_weighted = (sorted_weight > 0).sum(dim=1)
    open_load = torch.zeros(num_rows, num_packs, dtype=weight.dtype)  # +inf once a pack is full
    held = torch.zeros(num_rows, num_packs, dtype=torch.int64)
    pack_sorted = torch.empty(num_rows, num_items, dtype=torch.int64)
    rank_sorted = torch.empty_like(pack_sorted)
    next_item = torch.zeros(num_rows, dtype=torch.int64)
    while bool((next_item < num_weighted).any()):
        packs, run_load, run_length = _greedy_run(open_load, held, sorted_weight, next_item, num_weighted, capacity)
        row, step = (torch.arange(num_packs) < run_length.unsqueeze(1)).nonzero(as_tuple=True)
        item, pack = next_item[row] + step, packs[row, step]
        rank = held[row, pack]
        pack_sorted[row, item], rank_sorted[row, item] = pack, rank
        held[row, pack] = rank + 1
        open_load[row, pack] = torch.where(rank + 1 < capacity, run_load[row, step], torch.inf)
        next_item += run_length
    _place_weightless(open_load, held, next_item, capacity, pack_sorted, rank_sorted)
    pack_of_item = torch.empty_like(pack_sorted).scatter_(1, order, pack_sorted)
    rank_in_pack = torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)
    return pack_of_item, rank_in_pack


def _greedy_run(open_load, held, sorted_weight, next_item, num_weighted, capacity):
    """How many of each row's next items the greedy sends to the open packs in lightest-first order.

    The greedy gives the next item to the lightest open pack (lower pack on equal load). With the
    open packs sorted by (load, pack), the j-th next item goes to the j-th of them when that pack is
    strictly lighter than every pack topped up earlier in the run. On an exact tie the run stops
    early and the next run re-sorts: slower, never wrong.
    Returns (packs in that order [X, m], their loads after the run [X, m], run length per row [X]).
    """
    num_rows, num_packs = open_load.shape
    load, packs = open_load.sort(dim=1, stable=True)  # full packs (+inf) last
    item = next_item.unsqueeze(1) + torch.arange(num_packs)
    in_range = (item < num_weighted.unsqueeze(1)) & torch.isfinite(load)
    topped_up = load + sorted_weight.gather(1, item.clamp(max=sorted_weight.shape[1] - 1))
    stays_open = held.gather(1, packs) + 1 < capacity
    lightest_topped_up = torch.cummin(torch.where(stays_open, topped_up, torch.inf), dim=1).values
    barrier = torch.cat([torch.full((num_rows, 1), torch.inf, dtype=load.dtype), lightest_topped_up[:, :-1]], dim=1)
    run_length = (in_range & (load < barrier)).cumprod(dim=1).sum(dim=1)
    return packs, topped_up, run_length


def _place_weightless(open_load, held, next_item, capacity, pack_sorted, rank_sorted):
    """Place each row's items from `next_item` on, which all weigh nothing.

    The greedy keeps giving them to the lightest open pack, whose load they leave unchanged, so they
    fill the open packs to capacity one after another in (load, pack) order.
    """
    num_items = pack_sorted.shape[1]
    _, packs = open_load.sort(dim=1, stable=True)  # full packs (+inf, no room) last
    room = capacity - held.gather(1, packs)
    room_end = room.cumsum(dim=1)
    tail = torch.arange(num_items) - next_item.unsqueeze(1)  # index among the weightless items
    is_tail = tail >= 0
    which = torch.searchsorted(room_end, tail.clamp(min=0), right=True).clamp(max=packs.shape[1] - 1)
    pack = packs.gather(1, which)
    rank = held.gather(1, pack) + tail - (room_end - room).gather(1, which)
    pack_sorted[is_tail] = pack[is_tail]
    rank_sorted[is_tail] = rank[is_tail]


def replicate_experts(weight: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill `num_slots` slots per row: one per expert, then replicas of the most loaded per replica."""
    num_rows, num_experts = weight.shape
    expert_of_slot = torch.arange(num_slots).repeat(num_rows, 1)
    replica_count = torch.ones(num_rows, num_experts, dtype=torch.int64)
    one_more = torch.ones(num_rows, 1, dtype=torch.int64)
    # One iteration per replica: batching replicas into runs (as packing does) needs a sort per
    # run, which costs more than these few ops whenever a hot expert takes many replicas.
    for slot in range(num_experts, num_slots):
        neediest = (weight / replica_count).argmax(dim=1, keepdim=True)  # first maximum: lower expert on ties
        expert_of_slot[:, slot : slot + 1] = neediest
        replica_count.scatter_add_(1, neediest, one_more)
    return expert_of_slot, replica_count
