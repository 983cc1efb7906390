"""DeepSeek's expert-parallelism load balancer (EPLB), shared by `eplb` and `eplb-vec`.

The policy is three steps (https://github.com/deepseek-ai/EPLB):
  1. pack expert groups onto nodes so that node loads are balanced;
  2. inside each node, add replicas of the experts with the highest load per replica
     until the node's physical slots are full;
  3. pack each node's physical slots onto its GPUs so that GPU loads are balanced.
When the groups do not divide over the nodes, the whole cluster is treated as one node
with one group (the global policy).

The two balancers differ only in how they compute two greedy primitives, which each passes in;
this module owns the index bookkeeping that composes them, so both place the same load the same way:

  pack(weight[X, n], num_packs) -> (pack_of_item[X, n], rank_in_pack[X, n])
      heaviest item first into the lightest pack that is not yet full (n / num_packs items each);
      ties go to the earlier item and to the lower pack.
  replicate(weight[X, n], num_slots) -> (expert_of_slot[X, num_slots], replica_count[X, n])
      slots 0..n-1 hold experts 0..n-1; each further slot replicates the expert with the highest
      load per replica, ties to the lower expert.
"""

from __future__ import annotations

from typing import Callable

import torch

from moeplex.interfaces import Placement

PackFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
ReplicateFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def eplb_placement(
    load: torch.Tensor,
    num_physical: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    pack: PackFn,
    replicate: ReplicateFn,
) -> Placement:
    """The EPLB placement of `load` ([L, E] or [steps, L, E]), computed with the given primitives."""
    total = total_load(load)
    check_shape(total.shape[1], num_physical, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1  # global policy: groups cannot stay whole on a node
    phy2log = hierarchical_phy2log(total, num_physical, num_groups, num_nodes, num_gpus, pack, replicate)
    return Placement.from_phy2log(phy2log, total.shape[1])


def total_load(load: torch.Tensor) -> torch.Tensor:
    """[L, E] float64 load summed over steps; a new tensor, so the caller's load is never touched."""
    if load.dim() not in (2, 3):
        raise ValueError(f"load must be [layers, experts] or [steps, layers, experts], got shape {tuple(load.shape)}")
    if load.numel() == 0:
        raise ValueError(f"load of shape {tuple(load.shape)} has no layer, expert or step to balance")
    # float64 keeps integer token counts exact and makes every comparison reproducible
    load = load.to(torch.float64)
    if not torch.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must hold finite, non-negative token counts")
    return load.sum(0) if load.dim() == 3 else load.clone()


def check_shape(num_logical: int, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    """Raise ValueError with one sentence unless the cluster shape can hold a placement."""
    if min(num_groups, num_nodes, num_gpus) < 1:
        raise ValueError(f"groups, nodes and GPUs must be positive, got {num_groups}, {num_nodes}, {num_gpus}")
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical slots cannot hold {num_logical} logical experts")
    if num_physical % num_gpus:
        raise ValueError(f"{num_physical} physical slots do not divide evenly over {num_gpus} GPUs")
    if num_gpus % num_nodes:
        raise ValueError(f"{num_gpus} GPUs do not divide evenly over {num_nodes} nodes")
    if num_logical % num_groups:
        raise ValueError(f"{num_logical} logical experts do not divide into {num_groups} groups")


def hierarchical_phy2log(
    load: torch.Tensor,
    num_physical: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    pack: PackFn,
    replicate: ReplicateFn,
) -> torch.Tensor:
    """[L, P] logical expert of every physical slot; slot = gpu * slots_per_gpu + rank on that GPU."""
    num_layers, num_logical = load.shape
    experts_per_node = num_logical // num_nodes
    slots_per_node = num_physical // num_nodes

    # Step 1: groups -> nodes. `node_major[l, i]` is the logical expert at position i when
    # each node's groups are laid out one after another.
    node_major = _node_major_order(load, num_groups, num_nodes, pack)
    node_load = load.gather(1, node_major).reshape(num_layers * num_nodes, experts_per_node)

    # Step 2: replicas inside each node (expert ids are local to the node from here on).
    expert_of_slot, replica_count = replicate(node_load, slots_per_node)

    # Step 3: each node's slots -> its GPUs, balancing the load a single replica carries.
    slot_load = (node_load / replica_count).gather(1, expert_of_slot)
    gpu_of_slot, rank_on_gpu = pack(slot_load, num_gpus // num_nodes)
    final_position = gpu_of_slot * (num_physical // num_gpus) + rank_on_gpu
    local_expert = torch.empty_like(expert_of_slot).scatter_(1, final_position, expert_of_slot)

    # Back to global logical ids: node n's local expert j sits at node-major position n * E/N + j.
    node_offset = torch.arange(num_nodes).unsqueeze(1) * experts_per_node
    position = (local_expert.reshape(num_layers, num_nodes, slots_per_node) + node_offset).reshape(num_layers, -1)
    return node_major.gather(1, position)


def _node_major_order(load: torch.Tensor, num_groups: int, num_nodes: int, pack: PackFn) -> torch.Tensor:
    """[L, E] logical experts ordered by (node, rank of their group on the node, rank in the group)."""
    num_layers, num_logical = load.shape
    group_size = num_logical // num_groups
    group_load = load.reshape(num_layers, num_groups, group_size).sum(-1)
    node_of_group, rank_on_node = pack(group_load, num_nodes)
    group_position = node_of_group * (num_groups // num_nodes) + rank_on_node
    expert_position = (group_position.unsqueeze(-1) * group_size + torch.arange(group_size)).reshape(num_layers, -1)
    return _inverse_permutation(expert_position)


def _inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of a [X, n] permutation."""
    positions = torch.arange(perm.shape[1]).expand_as(perm)
    return torch.empty_like(perm).scatter_(1, perm, positions)


def pack_in_place(num_rows: int, num_items: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One item per pack: every assignment is equally balanced, and keeping items in place moves none."""
    return torch.arange(num_items).expand(num_rows, -1).clone(), torch.zeros(num_rows, num_items, dtype=torch.int64)


def items_per_pack(num_items: int, num_packs: int) -> int:
    if num_items % num_packs:
        raise ValueError(f"{num_items} items do not divide evenly into {num_packs} packs")
    return num_items // num_packs

