"""The MoE layer: one fixed pipeline from router to combine, with the plugins doing the moving and computing."""

from __future__ import annotations

from typing import Generator

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from ..models.loader import Target
from .router import Router, RouterSpec
from .runtime import MoERuntime


def _slot_copier(param: torch.Tensor, slots: list[int], rows: slice):
    def copy(tensor: torch.Tensor) -> None:
        for slot in slots:
            param.data[slot, rows].copy_(tensor)

    return copy


class MoELayer(nn.Module):
    """router -> replica selector -> dispatch -> (layout adapter) -> kernel -> combine, plus shared experts.

    Expert weights are held for this rank's physical slots only:
    w13 [E_local, 2I, H] (gate rows then up rows) and w2 [E_local, H, I].
    """

    def __init__(
        self,
        moe_index: int,  # ordinal among the model's MoE layers (the Placement's layer axis)
        hidden_size: int,
        intermediate_size: int,
        router_spec: RouterSpec,
        runtime: MoERuntime,
        shared_experts: nn.Module | None = None,
    ):
        super().__init__()
        self.moe_index = moe_index
        self.runtime = runtime
        self.gate = Router(hidden_size, router_spec)
        local = runtime.ctx.num_local_experts
        self.w13 = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, intermediate_size), requires_grad=False)
        self.shared_experts = shared_experts
        self.prepared = None

    def local_slots(self, logical_expert: int) -> list[int]:
        """This rank's local slots holding `logical_expert` (empty when none does)."""
        return self.runtime.local_slots(self.moe_index, logical_expert)

    def expert_targets(self, prefix: str, names: tuple[str, str, str]) -> dict[str, Target]:
        """Checkpoint tensors `{prefix}.{e}.{gate|up|down}.weight` of every logical expert e.

        Each is copied into every local slot holding a replica of e; experts held by
        other ranks get a Target without `copy`, so this rank never reads them.
        """
        inter, hidden = self.w2.shape[2], self.w2.shape[1]
        targets = {}
        for expert in range(self.gate.spec.num_experts):
            slots = self.local_slots(expert)
            for proj, (param, rows) in zip(names, ((self.w13, slice(0, inter)), (self.w13, slice(inter, None)), (self.w2, slice(None)))):
                shape = (hidden, inter) if param is self.w2 else (inter, hidden)
                copy = _slot_copier(param, slots, rows) if slots else None
                targets[f"{prefix}.{expert}.{proj}.weight"] = Target(shape, copy)
        return targets

    def finish_loading(self) -> None:
        self.prepared = self.runtime.prepare_weights(self.w13, self.w2)

    def program(self, hidden: torch.Tensor, batch: ForwardBatch) -> Generator[str, None, torch.Tensor]:
        """Yields while dispatch and combine are in flight; returns [T, H]."""
        runtime = self.runtime
        logical_ids, weights = self.gate(hidden)
        runtime.record_load(self.moe_index, logical_ids)
        physical_ids = runtime.replicas(self.moe_index, logical_ids)
        pending = runtime.dispatcher.dispatch_start(hidden, physical_ids, weights, batch)
        yield "dispatch"
        shared = self.shared_experts(hidden) if self.shared_experts is not None else None
        dispatched = runtime.dispatcher.dispatch_finish(pending)
        layout, restore = runtime.adapter(dispatched.layout)
        output = restore(runtime.kernel.apply(layout, self.prepared))
        pending = runtime.dispatcher.combine_start(output, dispatched.handle)
        yield "combine"
        routed = runtime.dispatcher.combine_finish(pending).to(hidden.dtype)
        return routed if shared is None else routed + shared

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        program = self.program(hidden, batch)
        while True:
            try:
                next(program)
            except StopIteration as done:
                return done.value
