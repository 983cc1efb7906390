"""The MoE layer: one fixed pipeline from router to combine, with the plugins doing the moving and computing."""

from __future__ import annotations

from typing import Generator

import torch
from torch import nn

from ..executor import StepState
from ..models.loader import Target
from .router import Router, RouterSpec
from .runtime import MoERuntime


def _slot_copier(param: torch.Tensor, slots: list[int], where: tuple[slice, ...]):
    def copy(tensor: torch.Tensor) -> None:
        for slot in slots:
            param.data[(slot, *where)].copy_(tensor)

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
        inter = intermediate_size // runtime.moe_tp.size  # this rank's slice of every expert
        self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, inter), requires_grad=False)
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
        tp = self.runtime.moe_tp
        full = inter * tp.size
        # (parameter, where it goes in the slot, checkpoint shape, which slice this rank reads)
        parts = (
            (self.w13, (slice(0, inter),), (full, hidden), (0, tp.rank * inter, inter)),
            (self.w13, (slice(inter, None),), (full, hidden), (0, tp.rank * inter, inter)),
            (self.w2, (slice(None), slice(None)), (hidden, full), (1, tp.rank * inter, inter)),
        )
        targets = {}
        for expert in range(self.gate.spec.num_experts):
            slots = self.local_slots(expert)
            for proj, (param, where, shape, select) in zip(names, parts):
                copy = _slot_copier(param, slots, where) if slots else None
                targets[f"{prefix}.{expert}.{proj}.weight"] = Target(shape, copy, select if tp.size > 1 else None)
        return targets

    def finish_loading(self) -> None:
        self.prepared = self.runtime.prepare_weights(self.w13, self.w2)

    def program(self, hidden: torch.Tensor, state: StepState) -> Generator[str, None, torch.Tensor]:
        """Yields while dispatch and combine are in flight; returns [T, H].

        The ranks of an attention group hold the same tokens; when experts are sharded over
        ranks (EP), each of them routes only its share and the shares are gathered afterwards.
        """
        runtime, batch = self.runtime, state.batch
        shared_first = self.shared_experts is not None and not state.shared_during_dispatch
        shared = self.shared_experts(hidden) if shared_first else None
        share, counts = self._token_share(hidden)
        logical_ids, weights = self.gate(share)
        runtime.record_load(self.moe_index, logical_ids)
        physical_ids = runtime.replicas(self.moe_index, logical_ids)
        pending = runtime.dispatcher.dispatch_start(share, physical_ids, weights, batch)
        yield "dispatch"
        if self.shared_experts is not None and not shared_first:
            shared = self.shared_experts(hidden)  # while the routed tokens travel
        dispatched = runtime.dispatcher.dispatch_finish(pending)
        layout, restore = runtime.adapter(dispatched.layout)
        output = restore(runtime.kernel.apply(layout, self.prepared))
        pending = runtime.dispatcher.combine_start(output, dispatched.handle)
        yield "combine"
        routed = runtime.dispatcher.combine_finish(pending).to(hidden.dtype)
        routed = runtime.moe_tp.all_reduce(routed)  # tensor-parallel experts: sum the slices
        if counts is not None:
            routed = runtime.attn_tp.all_gather_rows(routed, counts)
        return routed if shared is None else routed + shared

    def _token_share(self, hidden: torch.Tensor) -> tuple[torch.Tensor, list[int] | None]:
        """This rank's contiguous share of the attention group's tokens when experts are sharded."""
        tp, ep = self.runtime.attn_tp, self.runtime.parallel.ep
        if tp.size == 1 or ep.size == 1:
            return hidden, None
        total = hidden.shape[0]
        counts = [total // tp.size + (i < total % tp.size) for i in range(tp.size)]
        start = sum(counts[: tp.rank])
        return hidden[start : start + counts[tp.rank]], counts
