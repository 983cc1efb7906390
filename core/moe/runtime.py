"""MoERuntime: the plugin instances every MoE layer of one engine shares, and the parallel layout they serve."""

from __future__ import annotations

import torch

from ..interfaces import BF16, ExpertWeights, MoEContext, Placement
from ..parallel import Group, ParallelConfig, ParallelState
from .adapters import LayoutAdapter
from .replicas import ReplicaSelector


class MoERuntime:
    def __init__(
        self,
        ctx: MoEContext,
        dispatcher_cls: type,
        kernel_cls: type,
        placement: Placement,
        hooks=None,
        parallel: ParallelState | None = None,
    ):
        self.ctx = ctx
        self.parallel = parallel if parallel is not None else ParallelState(ParallelConfig())
        self.dispatcher = dispatcher_cls(ctx)
        self.kernel = kernel_cls(ctx)
        caps = self.kernel.caps
        self.adapter = LayoutAdapter(dispatcher_cls.caps.layout, caps.layouts, caps.alignment)
        self.replicas = ReplicaSelector(placement, ctx.device)
        self.hooks = hooks
        self._local_slots = self._index_local_slots(placement)

    @property
    def attn_tp(self) -> Group:
        """The ranks splitting attention and dense layers (and holding the same tokens)."""
        return self.parallel.attn

    @property
    def moe_tp(self) -> Group:
        """The ranks slicing every expert's intermediate dimension (tensor-parallel experts)."""
        return self.parallel.moe_tp

    def _index_local_slots(self, placement: Placement) -> list[dict[int, list[int]]]:
        first, count = self.ctx.first_local_expert, self.ctx.num_local_experts
        table = []
        for layer in range(placement.num_layers):
            slots: dict[int, list[int]] = {}
            for local, logical in enumerate(placement.phy2log[layer, first : first + count].tolist()):
                slots.setdefault(logical, []).append(local)
            table.append(slots)
        return table

    @property
    def placement(self) -> Placement:
        return self.replicas.placement

    def local_slots(self, layer: int, logical_expert: int) -> list[int]:
        return self._local_slots[layer].get(logical_expert, [])

    def prepare_weights(self, w13: torch.Tensor, w2: torch.Tensor):
        return self.kernel.prepare_weights(ExpertWeights(w13=w13.data, w2=w2.data, format=BF16))

    def record_load(self, layer: int, logical_ids: torch.Tensor) -> None:
        if self.hooks is not None and self.hooks.hook.moeplex_expert_load_recorded.get_hookimpls():
            counts = torch.bincount(logical_ids.flatten(), minlength=self.placement.num_logical)
            self.hooks.hook.moeplex_expert_load_recorded(layer_id=layer, counts=counts)
