"""DeepEP buffers: which limits a world must meet, how big the buffers are, and who owns them."""

from __future__ import annotations

import importlib
from typing import Any, Callable

import attrs
import torch
import torch.distributed as dist

from moeplex.interfaces import Dispatched, Dispatcher, ExpertOutput, MoEContext, PluginError

# What DeepEP v1.2.1's kernels are built for.
LL_HIDDEN_SIZES = frozenset({2048, 2560, 4096, 5120, 6144, 7168, 8192})  # low-latency kernels, per hidden size
LL_MAX_TOP_K = 11
INTRANODE_RANKS = (2, 4, 8)  # normal-mode kernels over NVLink within one machine
NORMAL_MAX_LOCAL_EXPERTS = 128  # the normal-mode layout kernel counts each rank's experts with one block of 128 threads
FP8_GROUP = 128


def check_normal(ctx: MoEContext, name: str) -> None:
    if ctx.ep_size not in INTRANODE_RANKS:
        raise PluginError(
            f"dispatcher '{name}' runs DeepEP's normal mode over {', '.join(map(str, INTRANODE_RANKS))} EP ranks "
            f"of one machine, not {ctx.ep_size}; with one rank use deepep-ll, local or naive."
        )
    if (ctx.hidden_size * 2) % 16:
        raise PluginError(f"dispatcher '{name}' moves rows of whole 16-byte words; hidden size {ctx.hidden_size} is not.")
    if ctx.num_local_experts > NORMAL_MAX_LOCAL_EXPERTS:
        raise PluginError(
            f"dispatcher '{name}' serves at most {NORMAL_MAX_LOCAL_EXPERTS} expert slots per rank in DeepEP's normal "
            f"mode, not {ctx.num_local_experts} ({ctx.num_physical_experts} over {ctx.ep_size} ranks); use more EP "
            "ranks, fewer redundant experts, or naive."
        )


def check_low_latency(ctx: MoEContext, name: str) -> None:
    if ctx.hidden_size not in LL_HIDDEN_SIZES:
        raise PluginError(
            f"dispatcher '{name}' has low-latency kernels for hidden sizes {', '.join(map(str, sorted(LL_HIDDEN_SIZES)))}, "
            f"not {ctx.hidden_size}; use deepep-normal or naive for this model."
        )
    if ctx.top_k > LL_MAX_TOP_K:
        raise PluginError(f"dispatcher '{name}' routes at most {LL_MAX_TOP_K} experts per token, not {ctx.top_k}.")
    if ctx.dispatch_fp8 and ctx.hidden_size % 512:
        raise PluginError(f"dispatcher '{name}' sends fp8 rows only for hidden sizes divisible by 512.")


MASKED_ROW_ALIGNMENT = 128  # rows per expert of the received buffer: grouped GEMMs store whole 128-row tiles


def low_latency_tokens(max_tokens_per_rank: int, ep_size: int) -> int:
    """Tokens per rank the low-latency buffer holds: the request, raised so that every expert's rows
    (ranks x tokens) are a whole number of 128-row tiles (DeepEP itself needs a multiple of 4)."""
    tokens = max(1, max_tokens_per_rank)
    while (tokens * ep_size) % MASKED_ROW_ALIGNMENT:
        tokens += 1
    return tokens


@attrs.frozen
class BufferPlan:
    """The sizes one DeepEP Buffer is made with."""

    num_nvl_bytes: int  # normal mode's NVLink buffer
    num_rdma_bytes: int  # low-latency mode's buffer (NVSHMEM symmetric memory)
    low_latency: bool
    num_qps_per_rank: int
    ll_tokens_per_rank: int  # the most tokens one rank dispatches in low-latency mode

    def covers(self, other: BufferPlan) -> bool:
        return (
            self.low_latency == other.low_latency
            and self.num_nvl_bytes >= other.num_nvl_bytes
            and self.num_rdma_bytes >= other.num_rdma_bytes
            and self.ll_tokens_per_rank == other.ll_tokens_per_rank
        )


def plan_buffer(
    ctx: MoEContext,
    normal: bool,
    low_latency: bool,
    nvl_hint: Callable[[int, int], int],
    ll_hint: Callable[[int, int, int, int], int],
) -> BufferPlan:
    """Sizes from DeepEP's own hints: nvl_hint(hidden bytes, ranks), ll_hint(tokens, hidden, ranks, experts)."""
    tokens = low_latency_tokens(ctx.max_tokens_per_rank, ctx.ep_size)
    hidden_bytes = ctx.hidden_size * 2  # bf16, the widest row either mode sends
    return BufferPlan(
        num_nvl_bytes=nvl_hint(hidden_bytes, ctx.ep_size) if normal else 0,
        num_rdma_bytes=ll_hint(tokens, ctx.hidden_size, ctx.ep_size, ctx.num_physical_experts) if low_latency else 0,
        low_latency=low_latency,
        num_qps_per_rank=max(1, ctx.num_local_experts) if low_latency else 1,
        ll_tokens_per_rank=tokens,
    )


class BufferPool:
    """DeepEP buffers, one per (EP group, mode), owned by the dispatcher that made the pool.

    Each DeepEP dispatcher makes its pool in `__init__` unless it is handed one; deepep-auto's
    two modes share the one buffer of the pool deepep-auto owns. NVSHMEM, which low-latency
    buffers live in, starts once per process, so whoever makes several dispatchers in one
    process (a test, a second engine) passes them one pool: a later dispatcher then takes the
    earlier one's buffer when it is big enough rather than starting NVSHMEM again.
    """

    def __init__(self):
        self._buffers: dict[tuple, tuple[BufferPlan, Any]] = {}

    def __len__(self) -> int:
        return len(self._buffers)

    def make(self, ctx: MoEContext, name: str, normal: bool, low_latency: bool):
        """(deep_ep module, Buffer, BufferPlan) for a dispatcher of `ctx`."""
        deep_ep = import_deep_ep(name)
        group = ep_group(ctx, name)

        def nvl_hint(hidden_bytes: int, ranks: int) -> int:
            configs = (deep_ep.Buffer.get_dispatch_config(ranks), deep_ep.Buffer.get_combine_config(ranks))
            return max(config.get_nvl_buffer_size_hint(hidden_bytes, ranks) for config in configs)

        plan = plan_buffer(ctx, normal, low_latency, nvl_hint, deep_ep.Buffer.get_low_latency_rdma_size_hint)
        return deep_ep, self.get(deep_ep, group, plan), plan

    def get(self, deep_ep, group, plan: BufferPlan):
        key = (id(group), plan.low_latency)
        held = self._buffers.get(key)
        if held is not None and held[0].covers(plan):
            return held[1]
        buffer = deep_ep.Buffer(
            group,
            num_nvl_bytes=plan.num_nvl_bytes,
            num_rdma_bytes=plan.num_rdma_bytes,
            low_latency_mode=plan.low_latency,
            num_qps_per_rank=plan.num_qps_per_rank,
        )
        self._buffers[key] = (plan, buffer)
        return buffer


def import_deep_ep(name: str):
    try:
        return importlib.import_module("deep_ep")
    except ImportError as exc:
        raise PluginError(f"dispatcher '{name}' needs DeepEP (the deep_ep package), which failed to import ({exc}).") from exc


def ep_group(ctx: MoEContext, name: str):
    """The EP ranks' process group; one rank alone gets a group of its own process."""
    if ctx.group is not None:
        return ctx.group
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise PluginError(f"dispatcher '{name}' with one EP rank runs only in an engine of one process.")
    return dist.group.WORLD


def as_bf16(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.to(torch.bfloat16).contiguous()


class OneModeDispatcher(Dispatcher):
    """A dispatcher whose halves are those of one mode object (`self.mode`), made in __init__."""

    mode: Any

    def dispatch_start(self, hidden, topk_ids, topk_weights, batch=None):
        return self.mode.dispatch_start(hidden, topk_ids, topk_weights)

    def dispatch_finish(self, pending) -> Dispatched:
        return self.mode.dispatch_finish(pending)

    def combine_start(self, output: ExpertOutput, handle):
        return self.mode.combine_start(output, handle)

    def combine_finish(self, pending) -> torch.Tensor:
        return self.mode.combine_finish(pending)
