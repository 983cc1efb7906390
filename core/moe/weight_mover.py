"""Weight mover: after a placement change, give every local slot the weights of its new logical expert.

Every rank derives the same list of transfers from the old and new placements. A slot whose
expert did not change keeps its weights; one that needs an expert this rank already holds copies
it locally; otherwise it receives the expert from a rank that holds it (the same node first, then
the rank with the fewest sends so far), by point-to-point isend / irecv. Layers move a chunk at a
time, so the extra memory is the sent and received experts of a few layers.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch
import torch.distributed as dist

from ..interfaces import Placement
from ..parallel import Group


@attrs.frozen
class Transfer:
    """One logical expert of one layer, from local slot `src_slot` of EP rank `src` into slots of rank `dst`.

    src == dst is a copy inside one rank.
    """

    layer: int
    expert: int
    src: int
    src_slot: int
    dst: int
    dst_slots: tuple[int, ...]


@attrs.frozen
class MoveStats:
    layers_changed: tuple[int, ...]  # layers whose placement changed
    copied: int  # experts this rank copied from its own slots
    received: int  # experts this rank received from another rank
    sent: int  # experts this rank sent


def plan_transfers(old: torch.Tensor, new: torch.Tensor, num_ranks: int, ranks_per_node: int) -> list[Transfer]:
    """The transfers that turn phy2log `old` [L, P] into `new`, in one order every rank agrees on."""
    per_rank = old.shape[1] // num_ranks
    transfers: list[Transfer] = []
    for layer in range(old.shape[0]):
        if not torch.equal(old[layer], new[layer]):
            transfers += _layer_transfers(layer, old[layer].tolist(), new[layer].tolist(), per_rank, ranks_per_node)
    return transfers


def _layer_transfers(layer: int, old: list[int], new: list[int], per_rank: int, ranks_per_node: int) -> list[Transfer]:
    num_ranks = len(old) // per_rank
    holders: dict[int, dict[int, int]] = {}  # expert -> {rank: its first local slot holding the expert}
    for physical, expert in enumerate(old):
        holders.setdefault(expert, {}).setdefault(physical // per_rank, physical % per_rank)
    sends = [0] * num_ranks
    transfers = []
    for dst in range(num_ranks):
        wanted: dict[int, list[int]] = {}  # expert -> the local slots of dst that need it
        for slot in range(per_rank):
            physical = dst * per_rank + slot
            if new[physical] != old[physical]:
                wanted.setdefault(new[physical], []).append(slot)
        for expert, slots in wanted.items():
            src = _source(holders[expert], dst, sends, ranks_per_node)
            sends[src] += src != dst
            transfers.append(Transfer(layer, expert, src, holders[expert][src], dst, tuple(slots)))
    return transfers


def _source(holders: dict[int, int], dst: int, sends: list[int], ranks_per_node: int) -> int:
    """The rank dst reads an expert from: itself, else the same node, else the least busy sender."""
    if dst in holders:
        return dst
    return min(holders, key=lambda rank: (rank // ranks_per_node != dst // ranks_per_node, sends[rank], rank))


class WeightMover:
    """Moves the expert weights of `layers` (MoE layers sharing one runtime) between placements."""

    def __init__(self, layers: Sequence, ep: Group, ranks_per_node: int, layers_per_chunk: int = 4):
        if layers_per_chunk < 1:
            raise ValueError(f"layers per chunk must be at least 1, got {layers_per_chunk}")
        self.layers = list(layers)
        self.ep = ep
        self.ranks_per_node = min(ranks_per_node, ep.size)
        self.layers_per_chunk = layers_per_chunk

    def move(self, old: Placement, new: Placement) -> MoveStats:
        """Collective over the EP ranks: every rank calls it with the same placements."""
        transfers = plan_transfers(old.phy2log, new.phy2log, self.ep.size, self.ranks_per_node)
        changed = sorted({t.layer for t in transfers})
        for start in range(0, len(changed), self.layers_per_chunk):
            chunk = set(changed[start : start + self.layers_per_chunk])
            self._move_chunk([t for t in transfers if t.layer in chunk])
        me = self.ep.rank
        for layer in sorted({t.layer for t in transfers if t.dst == me}):
            self.layers[layer].finish_loading()  # the kernel prepares the changed layers again
        return MoveStats(
            layers_changed=tuple(changed),
            copied=sum(t.src == me and t.dst == me for t in transfers),
            received=sum(t.src != me and t.dst == me for t in transfers),
            sent=sum(t.src == me and t.dst != me for t in transfers),
        )

    def _move_chunk(self, transfers: list[Transfer]) -> None:
        me = self.ep.rank
        # read every source before any slot is written: a slot may be a source and a destination
        sources = {(t.layer, t.src_slot): self._payload(t.layer, t.src_slot) for t in transfers if t.src == me}
        ops, received = [], []
        for tag, t in enumerate(transfers):  # the same order on every rank, so sends meet their receives
            if t.src == me and t.dst != me:
                ops.append(dist.P2POp(dist.isend, sources[(t.layer, t.src_slot)], self._peer(t.dst), self.ep.group, tag))
            elif t.dst == me and t.src != me:
                buffer = self._receive_buffer(t.layer)
                ops.append(dist.P2POp(dist.irecv, buffer, self._peer(t.src), self.ep.group, tag))
                received.append((t, buffer))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for t in transfers:
            if t.src == me and t.dst == me:
                self._write(t, sources[(t.layer, t.src_slot)])
        for t, buffer in received:
            self._write(t, buffer)

    def _peer(self, ep_rank: int) -> int:
        return dist.get_global_rank(self.ep.group, ep_rank)

    def _payload(self, layer: int, slot: int) -> torch.Tensor:
        """A copy of one slot's expert as one flat byte tensor: w13, w2 and, for fp8 experts, their block scales."""
        return torch.cat([t.data[slot].view(-1).view(torch.uint8) for t in self.layers[layer].expert_tensors()])

    def _receive_buffer(self, layer: int) -> torch.Tensor:
        tensors = self.layers[layer].expert_tensors()
        size = sum(t.data[0].numel() * t.element_size() for t in tensors)
        return torch.empty(size, dtype=torch.uint8, device=tensors[0].device)

    def _write(self, transfer: Transfer, payload: torch.Tensor) -> None:
        for slot in transfer.dst_slots:
            offset = 0
            for t in self.layers[transfer.layer].expert_tensors():
                dst = t.data[slot].view(-1).view(torch.uint8)
                dst.copy_(payload[offset : offset + dst.numel()])
                offset += dst.numel()
