"""The MoE layer: one fixed pipeline from router to combine, with the plugins doing the moving and computing."""

from __future__ import annotations

from typing import Generator

import torch
from torch import nn

from ..executor import PairRows, StepState
from ..interfaces import FP8_BLOCK
from ..targets import CheckpointError, Target
from ..quant import BLOCK, FP8, num_blocks, quantize_blocks
from .router import Router, RouterSpec
from .runtime import MoERuntime

GATE, UP, DOWN = "gate", "up", "down"  # an expert's projections, in the order of MoECausalLM.expert_names


def _holder(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _write_rows(param: torch.Tensor, slots: list[int], first_row: int, values: torch.Tensor) -> None:
    for slot in slots:
        param.data[slot, first_row : first_row + values.shape[0]].copy_(values)


class MoELayer(nn.Module):
    """router -> replica selector -> dispatch -> (layout adapter) -> kernel -> combine, plus shared experts.

    `fewer_launches` (MoECausalLM.use_fused_kernels): where the runtime allows it (`sums_topk_later`) and no shared
    experts or token shares are added after, the kernel's unsummed pair rows are the layer's output (PairRows),
    which the next layer's norm sums in its own kernel: the sum's launch saved.

    Expert weights are held for this rank's physical slots only:
    w13 [E_local, 2I, H] (gate rows then up rows) and w2 [E_local, H, I], in the model dtype, or for
    the fp8-block format in float8_e4m3fn with fp32 scales per 128x128 block of each slot:
    w13_scale [E_local, ceil(2I/128), ceil(H/128)] and w2_scale [E_local, ceil(H/128), ceil(I/128)].
    """

    fewer_launches = False

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
        fp8 = runtime.expert_format == FP8_BLOCK
        self.w13 = _holder(local, 2 * inter, hidden_size, dtype=FP8 if fp8 else None)
        self.w2 = _holder(local, hidden_size, inter, dtype=FP8 if fp8 else None)
        self.w13_scale = _holder(local, num_blocks(2 * inter), num_blocks(hidden_size), dtype=torch.float32) if fp8 else None
        self.w2_scale = _holder(local, num_blocks(hidden_size), num_blocks(inter), dtype=torch.float32) if fp8 else None
        self._unpaired: dict[int, dict[str, torch.Tensor]] = {}  # expert -> its gate or up, awaiting the other
        self.shared_experts = shared_experts
        self.prepared = None

    def expert_tensors(self) -> list[nn.Parameter]:
        """What one slot's expert consists of (each indexed by local slot): w13, w2 and, in fp8, their scales."""
        return [t for t in (self.w13, self.w2, self.w13_scale, self.w2_scale) if t is not None]

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
        rows, cols = (0, tp.rank * inter, inter), (1, tp.rank * inter, inter)
        # (projection, checkpoint shape, which slice this rank reads)
        parts = ((GATE, (full, hidden), rows), (UP, (full, hidden), rows), (DOWN, (hidden, full), cols))
        targets = {}
        for expert in range(self.gate.spec.num_experts):
            slots = self.local_slots(expert)
            for proj, (part, shape, select) in zip(names, parts):
                copy = self._copier(slots, part, expert) if slots else None
                copy_fp8 = self._fp8_copier(slots, part) if slots else None
                targets[f"{prefix}.{expert}.{proj}.weight"] = Target(shape, copy, select if tp.size > 1 else None, copy_fp8)
        return targets

    def _place(self, part: str) -> tuple[nn.Parameter, nn.Parameter | None, int]:
        """(weight, its scales, first row) where projection `part` lives in a slot."""
        if part == DOWN:
            return self.w2, self.w2_scale, 0
        return self.w13, self.w13_scale, 0 if part == GATE else self.w2.shape[2]

    def _copier(self, slots: list[int], part: str, expert: int):
        """Takes one projection in floating point: stored as it is, or quantized (gate and up together,
        since they share 128-row blocks when the intermediate size is not a multiple of 128)."""
        weight, scale, first_row = self._place(part)

        def copy(tensor: torch.Tensor) -> None:
            if scale is None:
                _write_rows(weight, slots, first_row, tensor)
            elif part == DOWN:
                self._write_quantized(slots, weight, scale, tensor)
            else:
                halves = self._unpaired.setdefault(expert, {})
                halves[part] = tensor
                if len(halves) == 2:
                    del self._unpaired[expert]
                    self._write_quantized(slots, weight, scale, torch.cat([halves[GATE], halves[UP]]))

        return copy

    def _fp8_copier(self, slots: list[int], part: str):
        """Takes one projection's fp8 values and block scales as an fp8 checkpoint stores them, when they fit the
        layer's blocks as they are; None otherwise (the loader then dequantizes them for `_copier`)."""
        weight, scale, first_row = self._place(part)
        if scale is None or self.w2.shape[2] % BLOCK:
            return None

        def copy(values: torch.Tensor, scales: torch.Tensor) -> None:
            _write_rows(weight, slots, first_row, values)
            _write_rows(scale, slots, first_row // BLOCK, scales)

        return copy

    def _write_quantized(self, slots: list[int], weight: nn.Parameter, scale: nn.Parameter, tensor: torch.Tensor) -> None:
        values, scales = quantize_blocks(tensor.to(weight.device))
        _write_rows(weight, slots, 0, values)
        _write_rows(scale, slots, 0, scales)

    def finish_loading(self) -> None:
        if self._unpaired:
            expert, halves = next(iter(self._unpaired.items()))
            raise CheckpointError(
                f"MoE layer {self.moe_index}: expert {expert} got its {', '.join(halves)} projection but not the other "
                "one to quantize it with (are gate and up stored in different formats?)"
            )
        self.prepared = self.runtime.prepare_weights(*self.expert_tensors())

    def program(self, hidden: torch.Tensor, state: StepState) -> Generator[str, None, torch.Tensor | PairRows]:
        """Yields after launching each transfer ("dispatch", "combine"), after finishing it ("dispatched",
        "combined") and after the experts ("experts"); returns [T, H], or PairRows (`fewer_launches`).

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
        yield "dispatched"
        layout, restore = runtime.adapter(dispatched.layout)
        defer = self.fewer_launches and self.shared_experts is None and counts is None and runtime.sums_topk_later
        output = restore((runtime.kernel.apply_unsummed if defer else runtime.kernel.apply)(layout, self.prepared))
        yield "experts"
        if defer and output.weights_applied and not output.summed:  # the next norm sums the pairs
            yield "combine"
            yield "combined"
            return PairRows(output.hidden.reshape(-1, output.hidden.shape[-1]), output.hidden.shape[1])
        pending = runtime.dispatcher.combine_start(output, dispatched.handle)
        yield "combine"
        routed = runtime.dispatcher.combine_finish(pending).to(hidden.dtype)
        yield "combined"
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
