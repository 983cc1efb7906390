"""`deepep-ll`: DeepEP's low-latency mode, for decode.

Fixed buffers sized for `MoEContext.max_tokens_per_rank` tokens per rank, received
straight into the masked layout [local experts, ranks x max tokens, H] with a count per
expert on the device: no host sync, so a whole decode step can be captured in a CUDA
graph. Eagerly, each half only issues its transfers and the receive hook, called in
*_finish, waits for them, so compute placed between the halves overlaps the communication;
inside a CUDA graph capture each transfer is one send-and-receive kernel.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch

from moeplex.interfaces import (
    MASKED,
    Dispatched,
    DispatcherCaps,
    ExpertOutput,
    Fp8Payload,
    MaskedLayout,
    MoEContext,
    placeholder,
)

from .buffers import (
    FP8_GROUP,
    LL_HIDDEN_SIZES,
    LL_MAX_TOP_K,
    BufferPool,
    OneModeDispatcher,
    as_bf16,
    check_low_latency,
)


@attrs.frozen
class LowLatencyHandle:
    deepep: Any
    topk_ids: torch.Tensor  # [T, K] int64, as dispatched
    weights: torch.Tensor  # [T, K] fp32: low-latency combine applies them
    dtype: torch.dtype


@attrs.frozen
class PendingLowLatency:
    received: Any
    counts: torch.Tensor
    handle: LowLatencyHandle
    hook: Callable[[], None] | None
    expected_rows: int
    sent: torch.Tensor


@attrs.frozen
class PendingLowLatencyCombine:
    combined: torch.Tensor
    hook: Callable[[], None] | None
    dtype: torch.dtype
    sent: torch.Tensor


def split_halves() -> bool:
    """Issue and receive in separate kernels (the receive in *_finish), except while a CUDA graph is captured:
    there each transfer is one kernel that sends and receives, the form that replays correctly."""
    return not torch.cuda.is_current_stream_capturing()


def expected_rows(num_tokens: int, ctx: MoEContext) -> int:
    """Rows a local expert typically receives, if every rank sends as many tokens as this one."""
    return max(1, -(-num_tokens * ctx.ep_size * ctx.top_k // ctx.num_physical_experts))


class LowLatencyMode:
    """The low-latency halves over one buffer; `deepep-ll` and `deepep-auto` both use it."""

    def __init__(self, ctx: MoEContext, buffer, max_tokens: int, name: str):
        self.ctx, self.buffer, self.max_tokens, self.name = ctx, buffer, max_tokens, name

    def dispatch_start(self, hidden, topk_ids, topk_weights) -> PendingLowLatency:
        num_tokens = hidden.shape[0]
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"dispatcher '{self.name}' was sized for {self.max_tokens} tokens per rank and got {num_tokens}; "
                f"raise --max-dispatch-tokens-per-rank or use deepep-auto"
            )
        x, topk_ids = as_bf16(hidden), topk_ids.to(torch.int64).contiguous()
        received, counts, deepep, _, hook = self.buffer.low_latency_dispatch(
            x, topk_ids, self.max_tokens, self.ctx.num_physical_experts,
            use_fp8=self.ctx.dispatch_fp8, async_finish=False, return_recv_hook=split_halves(),
        )
        handle = LowLatencyHandle(deepep, topk_ids, topk_weights.float().contiguous(), hidden.dtype)
        return PendingLowLatency(received, counts, handle, hook, expected_rows(num_tokens, self.ctx), x)

    def dispatch_finish(self, pending: PendingLowLatency) -> Dispatched:
        if pending.hook is not None:
            pending.hook()
        if isinstance(pending.received, tuple):
            values, scales = pending.received
            hidden = placeholder(tuple(values.shape), torch.bfloat16, values.device)
            fp8 = Fp8Payload(values, scales, FP8_GROUP)
        else:
            hidden, fp8 = pending.received, None
        rows = min(pending.expected_rows, hidden.shape[1])
        return Dispatched(MaskedLayout(hidden, pending.counts, fp8, expected_rows=rows), pending.handle)

    def combine_start(self, output: ExpertOutput, handle: LowLatencyHandle) -> PendingLowLatencyCombine:
        rows = as_bf16(output.hidden)
        combined, _, hook = self.buffer.low_latency_combine(
            rows, handle.topk_ids, handle.weights, handle.deepep, async_finish=False, return_recv_hook=split_halves()
        )
        return PendingLowLatencyCombine(combined, hook, handle.dtype, rows)

    def combine_finish(self, pending: PendingLowLatencyCombine) -> torch.Tensor:
        if pending.hook is not None:
            pending.hook()
        return pending.combined.to(pending.dtype)


class DeepEPLowLatencyDispatcher(OneModeDispatcher):
    name = "deepep-ll"
    caps = DispatcherCaps(
        layout=MASKED,
        multi_rank=True,
        single_rank=True,
        needs_gpu=True,
        graph_safe=True,
        fixed_max_tokens=True,
        fp8_payload=True,
        async_halves=True,
        max_in_flight=1,  # each low-latency transfer clears the other buffer's receive flags
        requires=("deep_ep",),
        min_compute_capability=(9, 0),
        hidden_sizes=LL_HIDDEN_SIZES,
        max_top_k=LL_MAX_TOP_K,
    )

    def __init__(self, ctx: MoEContext, buffers: BufferPool | None = None):
        super().__init__(ctx)
        check_low_latency(ctx, self.name)
        self.buffers = buffers if buffers is not None else BufferPool()
        _, buffer, plan = self.buffers.make(ctx, self.name, normal=False, low_latency=True)
        self.mode = LowLatencyMode(ctx, buffer, plan.ll_tokens_per_rank, self.name)
