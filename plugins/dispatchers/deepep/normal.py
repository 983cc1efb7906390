"""`deepep-normal`: DeepEP's high-throughput mode, for prefill-sized batches.

The received rows are grouped per local expert and padded for DeepGEMM (the contiguous
layout). Dispatch learns on the host how many rows arrive (DeepEP's normal mode syncs
once for that), so this mode is not CUDA-graph safe; its kernels run on DeepEP's own
stream and SMs, and the halves wait on events, so compute overlaps them.

`dispatch_start` only marks where the rows are ready and counts them per rank and expert
(asynchronously); `dispatch_finish` sends them and waits on the host for the counts. Work
queued between the halves (the other micro-batch's attention under `tbo`, the shared experts
under `sbo`) therefore keeps the GPU busy while the host waits, and the transfer waits only
for this batch's rows, not for that work.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from moeplex.interfaces import (
    CONTIGUOUS,
    ContiguousLayout,
    Dispatched,
    DispatcherCaps,
    ExpertOutput,
    Fp8Payload,
    MoEContext,
    placeholder,
)
from moeplex.interfaces.kernels import ContiguousPlan, gather_rows, plan_contiguous, quantize_rows, weighted_pair_sum

from .buffers import FP8_GROUP, BufferPool, OneModeDispatcher, as_bf16, check_normal

ALIGNMENT = 128  # rows per expert group: DeepGEMM's contiguous-layout alignment on Hopper


@attrs.frozen
class NormalHandle:
    deepep: Any  # DeepEP's own handle for combine
    plan: ContiguousPlan
    weights: torch.Tensor  # [N_recv, K] fp32 top-k weights of the received rows
    num_rows: int  # N_recv
    dtype: torch.dtype  # the source hidden's dtype


@attrs.frozen
class LaunchedNormalDispatch:
    """Between the halves: the rows to send and DeepEP's layout of them (computed on its stream)."""

    x: Any  # bf16 rows, or (fp8 rows, scales)
    topk_ids: torch.Tensor  # [N, K] int64
    weights: torch.Tensor  # [N, K] fp32
    layout: tuple  # num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank
    event: Any  # when the layout is done
    dtype: torch.dtype


@attrs.frozen
class PendingNormalDispatch:
    """What DeepEP's dispatch handed this rank (its stream already waited on)."""

    received: Any  # rows, or (fp8 rows, scales)
    topk_ids: torch.Tensor  # [N_recv, K] local expert ids, -1 for experts elsewhere
    weights: torch.Tensor
    counts: list[int]  # rows received per local expert
    deepep: Any
    dtype: torch.dtype


@attrs.frozen
class PendingNormalCombine:
    combined: torch.Tensor
    event: Any
    dtype: torch.dtype
    sent: torch.Tensor


def grouped_rows(rows: torch.Tensor, plan: ContiguousPlan) -> torch.Tensor:
    """Received rows [N, W] -> contiguous rows [M, W] (padding rows zero), in one pass."""
    source = torch.full(plan.expert_index.shape, -1, dtype=torch.int64, device=rows.device)
    source[plan.rows] = plan.sources
    return gather_rows(rows, source)


def weighted_sum(output: torch.Tensor, plan: ContiguousPlan, weights: torch.Tensor, num_rows: int,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[N, H] in `dtype`: every received row's sum over its local experts of w_k * expert_k(row), in fp32."""
    pair_row = torch.full((num_rows * plan.top_k,), -1, dtype=torch.int64, device=output.device)
    pair_row[plan.pairs] = plan.rows
    return weighted_pair_sum(output, pair_row.view(num_rows, plan.top_k), weights.float(), dtype)


def contiguous_layout(pending: PendingNormalDispatch, ctx: MoEContext) -> tuple[ContiguousLayout, ContiguousPlan]:
    plan = plan_contiguous(pending.topk_ids, ctx.num_local_experts, ALIGNMENT, pending.counts)
    if isinstance(pending.received, tuple):
        values, scales = pending.received
        fp8 = Fp8Payload(grouped_rows(values, plan), grouped_rows(scales, plan), FP8_GROUP)
        hidden = placeholder((fp8.values.shape[0], ctx.hidden_size), torch.bfloat16, values.device)
    else:
        fp8, hidden = None, grouped_rows(pending.received, plan)
    return ContiguousLayout(hidden, plan.expert_index, ctx.num_local_experts, ALIGNMENT, fp8,
                            routed_pairs=sum(pending.counts)), plan


class NormalMode:
    """The normal-mode halves over one buffer; `deepep-normal` and `deepep-auto` both use it."""

    def __init__(self, ctx: MoEContext, deep_ep, buffer):
        self.ctx, self.deep_ep, self.buffer = ctx, deep_ep, buffer

    def dispatch_start(self, hidden, topk_ids, topk_weights) -> LaunchedNormalDispatch:
        topk_ids, weights = topk_ids.to(torch.int64).contiguous(), topk_weights.float().contiguous()
        x = as_bf16(hidden)
        if self.ctx.dispatch_fp8:
            x = quantize_rows(x)
        # recorded after every input is written: DeepEP's stream waits for this event only
        ready = self.deep_ep.Buffer.capture()
        *layout, event = self.buffer.get_dispatch_layout(
            topk_ids, self.ctx.num_physical_experts, previous_event=ready, async_finish=True,
            allocate_on_comm_stream=True,
        )
        return LaunchedNormalDispatch(x, topk_ids, weights, tuple(layout), event, hidden.dtype)

    def dispatch_finish(self, launched: LaunchedNormalDispatch) -> Dispatched:
        per_rank, per_rdma_rank, per_expert, in_rank = launched.layout
        x, topk_ids, weights = launched.x, launched.topk_ids, launched.weights
        received, recv_ids, recv_weights, counts, handle, event = self.buffer.dispatch(  # waits for the counts
            x, topk_idx=topk_ids, topk_weights=weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            previous_event=launched.event, async_finish=True, allocate_on_comm_stream=True,
        )
        event.current_stream_wait()  # `launched` keeps the sent rows alive until here
        pending = PendingNormalDispatch(received, recv_ids, recv_weights, list(counts), handle, launched.dtype)
        layout, plan = contiguous_layout(pending, self.ctx)
        handle = NormalHandle(pending.deepep, plan, pending.weights, pending.topk_ids.shape[0], pending.dtype)
        return Dispatched(layout, handle)

    def combine_start(self, output: ExpertOutput, handle: NormalHandle) -> PendingNormalCombine:
        rows = weighted_sum(output.hidden, handle.plan, handle.weights, handle.num_rows)
        combined, _, event = self.buffer.combine(
            rows, handle.deepep, previous_event=self.deep_ep.Buffer.capture(), async_finish=True,
            allocate_on_comm_stream=True,
        )
        return PendingNormalCombine(combined, event, handle.dtype, rows)

    def combine_finish(self, pending: PendingNormalCombine) -> torch.Tensor:
        pending.event.current_stream_wait()
        return pending.combined.to(pending.dtype)


class DeepEPNormalDispatcher(OneModeDispatcher):
    name = "deepep-normal"
    caps = DispatcherCaps(
        layout=CONTIGUOUS,
        multi_rank=True,
        single_rank=False,  # DeepEP's intranode kernels exist for 2, 4 and 8 ranks
        needs_gpu=True,
        graph_safe=False,
        needs_host_sync=True,
        fp8_payload=True,
        async_halves=True,
        requires=("deep_ep",),
        min_compute_capability=(9, 0),
    )

    def __init__(self, ctx: MoEContext, buffers: BufferPool | None = None):
        super().__init__(ctx)
        check_normal(ctx, self.name)
        self.buffers = buffers if buffers is not None else BufferPool()
        deep_ep, buffer, _ = self.buffers.make(ctx, self.name, normal=True, low_latency=False)
        self.mode = NormalMode(ctx, deep_ep, buffer)
