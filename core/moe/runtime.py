"""MoERuntime: the plugin instances every MoE layer of one engine shares, and the parallel layout they serve."""

from __future__ import annotations

import torch

from ..config import SPREAD
from ..interfaces import BF16, ExpertWeights, MoEContext, Placement
from ..parallel import Group, ParallelConfig, ParallelState
from .adapters import LayoutAdapter
from .rebalance import PlacementShape
from .recorder import LoadRecorder
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
        dispatch_algorithm: str = SPREAD,
        placement_shape: PlacementShape | None = None,  # what rebalancing may change (default: placement's own)
        expert_format: str = BF16,  # how the MoE layers hold their experts: BF16 (the model dtype) or FP8_BLOCK
    ):
        self.ctx = ctx
        self.parallel = parallel if parallel is not None else ParallelState(ParallelConfig())
        self.dispatcher = dispatcher_cls(ctx)
        self.kernel = kernel_cls(ctx)
        caps = self.kernel.caps
        if expert_format not in caps.weight_formats:
            formats = ", ".join(sorted(caps.weight_formats))
            raise ValueError(f"the MoE kernel takes {formats} expert weights, not {expert_format}")
        self.expert_format = expert_format
        self.adapter = LayoutAdapter(dispatcher_cls.caps.layouts, caps.layouts, caps.alignment)
        self.placement_shape = placement_shape or PlacementShape(
            placement.num_layers, placement.num_logical, placement.num_physical, 1, 1, ctx.ep_size
        )
        # room for the most replicas an expert can get: its own slot plus every redundant one
        max_replicas = 1 + self.placement_shape.num_physical - self.placement_shape.num_logical
        self.replicas = ReplicaSelector(placement, ctx.device, dispatch_algorithm, max_replicas)
        self.hooks = hooks
        self.recorders: list[LoadRecorder] = []  # attached by the engine's expert balancing
        self._local_slots = self._index_local_slots(placement)

    @property
    def attn_tp(self) -> Group:
        """The ranks splitting attention and dense layers (and holding the same tokens)."""
        return self.parallel.attn

    @property
    def moe_tp(self) -> Group:
        """The ranks slicing every expert's intermediate dimension (tensor-parallel experts)."""
        return self.parallel.moe_tp

    @property
    def sums_topk_later(self) -> bool:
        """Whether an MoE layer may leave its tokens' top-k sum to the next layer's norm (executor.PairRows): the
        dispatcher's combine does nothing else (`combine_only_reduces`: every pair on this rank), the kernel can
        hand its pair rows back unsummed (`apply_unsummed`), and every expert is whole on this rank."""
        return (getattr(self.dispatcher, "combine_only_reduces", False) and hasattr(self.kernel, "apply_unsummed")
                and self.moe_tp.size == 1)

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

    def apply_placement(self, placement: Placement) -> None:
        """Route tokens by `placement` from the next step on (its expert weights are already in place)."""
        self.replicas.update(placement)
        self._local_slots = self._index_local_slots(placement)

    def local_slots(self, layer: int, logical_expert: int) -> list[int]:
        return self._local_slots[layer].get(logical_expert, [])

    def prepare_weights(self, w13: torch.Tensor, w2: torch.Tensor, w13_scale=None, w2_scale=None):
        """The kernel's form of one layer's experts (the block scales only for fp8 experts)."""
        scales = [None if scale is None else scale.data for scale in (w13_scale, w2_scale)]
        return self.kernel.prepare_weights(ExpertWeights(w13.data, w2.data, self.expert_format, *scales))

    @property
    def records_load(self) -> bool:
        """Whether steps count routing choices now (a recording is on, or a hook observes the load)."""
        if any(recorder.recording for recorder in self.recorders):
            return True
        return self.hooks is not None and bool(self.hooks.hook.moeplex_expert_load_recorded.get_hookimpls())

    def record_load(self, layer: int, logical_ids: torch.Tensor) -> None:
        """Count one MoE layer's routing choices on the device; a hook implementation gets them as well."""
        for recorder in self.recorders:
            recorder.record(layer, logical_ids)
        if self.hooks is not None and self.hooks.hook.moeplex_expert_load_recorded.get_hookimpls():
            counts = torch.bincount(logical_ids.flatten(), minlength=self.placement.num_logical)
            self.hooks.hook.moeplex_expert_load_recorded(layer_id=layer, counts=counts)
