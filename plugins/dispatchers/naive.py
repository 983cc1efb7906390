"""`naive`: expert parallelism over torch.distributed, one uneven all-to-all there and one back.

Each token travels once to every EP rank that holds at least one of its top-k experts,
with its top-k ids translated to that rank's local experts (-1 for the others) and its
top-k weights. The row counts per destination are exchanged first, so that every rank
knows the uneven split sizes; `all_to_all_single` with uneven splits is what both NCCL
and gloo support. Received rows form the `standard` layout; kernels that want
`contiguous` or `masked` get it from the core's layout adapter. With one EP rank no
collective runs and the rows stay where they are.

Decode steps whose every rank's token count is known (DP attention, and every captured decode
graph, whose batch says each rank holds the padded size) go a fixed-size way instead: each rank
sends every destination a block of max(counts) rows (its tokens, ids local to that destination or
-1, then padding rows), so the splits are equal, nothing is read on the host, and the step can be
captured in a CUDA graph. Extend steps keep the uneven splits (a block per destination would
multiply a prompt's traffic by the EP size).
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from moeplex.interfaces import (
    STANDARD,
    Dispatched,
    Dispatcher,
    DispatcherCaps,
    ExpertOutput,
    StandardLayout,
    reduce_standard,
)


@attrs.frozen
class SendPlan:
    """The rows one rank sends in a dispatch, ordered by destination rank, then by source token."""

    source_tokens: torch.Tensor | None  # [S] the source token of every row sent (None: fixed blocks, in order)
    local_ids: torch.Tensor  # [S, K] top-k ids local to the row's destination rank, -1 for pairs elsewhere
    counts: torch.Tensor  # [ep_size] rows sent to each rank


def plan_sends(topk_ids: torch.Tensor, num_local_experts: int, ep_size: int) -> SendPlan:
    """One row per (token, rank holding at least one of the token's experts); ids of -1 go nowhere."""
    num_tokens, device = topk_ids.shape[0], topk_ids.device
    # pairs whose id is -1 land in an extra destination, ep_size, which is dropped below
    dest = torch.where(topk_ids >= 0, topk_ids // num_local_experts, ep_size)
    sends = torch.zeros(ep_size + 1, num_tokens, dtype=torch.bool, device=device)
    sends[dest, torch.arange(num_tokens, device=device).unsqueeze(1)] = True
    sends = sends[:ep_size]
    rank, token = sends.nonzero(as_tuple=True)  # row-major: grouped by rank, tokens ascending
    ids = topk_ids[token]
    on_rank = dest[token] == rank.unsqueeze(1)
    local_ids = torch.where(on_rank, ids - rank.unsqueeze(1) * num_local_experts, -1).to(topk_ids.dtype)
    return SendPlan(token, local_ids, sends.sum(dim=1))


def fixed_block(batch) -> int | None:
    """Rows per destination of a decode step whose every rank's count is known (None: uneven splits)."""
    if batch is None or batch.global_num_tokens is None or not batch.global_all_decode:
        return None
    return max(batch.global_num_tokens)


def plan_blocks(topk_ids: torch.Tensor, num_local_experts: int, ep_size: int, block: int) -> SendPlan:
    """The fixed-size plan: row d * block + t carries token t to rank d, with the ids local to d (-1 elsewhere);
    rows past the tokens are padding (all ids -1). `source_tokens` is None: the rows' order says it."""
    num_tokens, top_k = topk_ids.shape
    ranks = torch.arange(ep_size, device=topk_ids.device).view(ep_size, 1, 1)
    dest = torch.where(topk_ids >= 0, topk_ids // num_local_experts, -1).unsqueeze(0)
    local = torch.where(dest == ranks, topk_ids.unsqueeze(0) - ranks * num_local_experts, -1)
    local_ids = torch.full((ep_size, block, top_k), -1, dtype=topk_ids.dtype, device=topk_ids.device)
    local_ids[:, :num_tokens] = local
    counts = torch.full((ep_size,), block, dtype=torch.int64, device=topk_ids.device)
    return SendPlan(None, local_ids, counts)


@attrs.frozen
class Route:
    """How the rows of one dispatch travelled; combine sends them back the same way reversed."""

    plan: SendPlan
    send_splits: list[int]  # rows this rank sent to each rank
    recv_splits: list[int]  # rows this rank received from each rank
    num_tokens: int  # T on this (source) rank
    dtype: torch.dtype  # the source hidden's dtype: the wire dtype both ways, and combine's result


@attrs.frozen
class CombineHandle:
    """Everything combine needs, so several micro-batches can be in flight on one instance."""

    route: Route
    local_ids: torch.Tensor  # [N_recv, K] the received rows' local ids
    topk_weights: torch.Tensor  # [N_recv, K]


@attrs.frozen
class PendingDispatch:
    route: Route
    weights_dtype: torch.dtype
    hidden: torch.Tensor  # [N_recv, H], being filled
    meta: torch.Tensor  # [N_recv, 2K] local ids then weights, being filled
    works: tuple
    sent: tuple  # the send buffers, kept alive until the collectives finish


@attrs.frozen
class PendingCombine:
    route: Route
    rows: torch.Tensor  # [S, H], being filled with the experts' output for every row sent
    works: tuple
    sent: torch.Tensor


class NaiveAllToAllDispatcher(Dispatcher):
    caps = DispatcherCaps(
        layout=STANDARD,
        multi_rank=True,
        single_rank=True,
        needs_gpu=False,
        graph_safe=True,  # captured steps are decode steps with known counts: fixed-size blocks, no host read
        needs_host_sync=True,  # uneven steps: the count exchange goes to the host to size the splits
        # The halves launch and wait, but a wait is not free: dispatch_start blocks on the count
        # exchange with every peer, NCCL's all-to-all kernels occupy SMs while in flight, and
        # gloo's transfers run on worker threads that share the CPU cores with compute.
        async_halves=False,
    )

    def dispatch_start(self, hidden, topk_ids, topk_weights, batch=None) -> PendingDispatch:
        block = fixed_block(batch)
        if block is not None:
            return self._dispatch_blocks(hidden, topk_ids, topk_weights, block)
        ctx = self.ctx
        plan = plan_sends(topk_ids, ctx.num_local_experts, ctx.ep_size)
        send_splits = plan.counts.tolist()
        route = Route(plan, send_splits, self._exchange_counts(plan.counts), hidden.shape[0], hidden.dtype)
        send_hidden = hidden[plan.source_tokens]
        # ids travel as float32 beside the weights (exact below 2**24 experts): one collective, not two
        send_meta = torch.cat([plan.local_ids.float(), topk_weights[plan.source_tokens].float()], dim=1)
        recv_hidden, hidden_work = self._all_to_all(send_hidden, route.recv_splits, send_splits)
        recv_meta, meta_work = self._all_to_all(send_meta, route.recv_splits, send_splits)
        works, sent = (hidden_work, meta_work), (send_hidden, send_meta)
        return PendingDispatch(route, topk_weights.dtype, recv_hidden, recv_meta, works, sent)

    def _dispatch_blocks(self, hidden, topk_ids, topk_weights, block: int) -> PendingDispatch:
        """Every destination gets `block` rows from this rank: equal splits, shapes from the batch alone."""
        ctx = self.ctx
        num_tokens, top_k = topk_ids.shape
        if num_tokens > block:
            raise ValueError(
                f"a decode step agreed on at most {block} tokens per rank and this rank routes {num_tokens}"
            )
        plan = plan_blocks(topk_ids, ctx.num_local_experts, ctx.ep_size, block)
        send_hidden = hidden.new_zeros(ctx.ep_size, block, hidden.shape[1])
        send_hidden[:, :num_tokens] = hidden
        weights = topk_weights.new_zeros(block, top_k, dtype=torch.float32)
        weights[:num_tokens] = topk_weights
        send_meta = torch.cat([plan.local_ids.float(), weights.expand(ctx.ep_size, block, top_k)], dim=2)
        send_hidden, send_meta = send_hidden.flatten(0, 1), send_meta.flatten(0, 1)
        splits = [block] * ctx.ep_size
        route = Route(plan, splits, splits, num_tokens, hidden.dtype)
        recv_hidden, hidden_work = self._all_to_all(send_hidden, splits, splits)
        recv_meta, meta_work = self._all_to_all(send_meta, splits, splits)
        works, sent = (hidden_work, meta_work), (send_hidden, send_meta)
        return PendingDispatch(route, topk_weights.dtype, recv_hidden, recv_meta, works, sent)

    def dispatch_finish(self, pending: PendingDispatch) -> Dispatched:
        _wait(pending.works)
        top_k = pending.meta.shape[1] // 2
        local_ids = pending.meta[:, :top_k].to(pending.route.plan.local_ids.dtype)
        weights = pending.meta[:, top_k:].to(pending.weights_dtype)
        layout = StandardLayout(pending.hidden, local_ids, weights, self.ctx.num_local_experts)
        return Dispatched(layout, CombineHandle(pending.route, local_ids, weights))

    def combine_start(self, output: ExpertOutput, handle: CombineHandle) -> PendingCombine:
        route = handle.route
        rows = _weighted_rows(output, handle).to(route.dtype)
        back, work = self._all_to_all(rows, route.send_splits, route.recv_splits)
        return PendingCombine(route, back, (work,), rows)

    def combine_finish(self, pending: PendingCombine) -> torch.Tensor:
        _wait(pending.works)
        route = pending.route
        if route.plan.source_tokens is None:  # fixed blocks: destination d's results are rows d * block ..
            blocks = pending.rows.view(self.ctx.ep_size, -1, pending.rows.shape[1])
            return blocks[:, : route.num_tokens].float().sum(dim=0).to(route.dtype)
        out = torch.zeros(route.num_tokens, pending.rows.shape[1], dtype=torch.float32, device=pending.rows.device)
        out.index_add_(0, route.plan.source_tokens, pending.rows.float())
        return out.to(route.dtype)

    def _exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        """Rows this rank will receive from each rank (blocking: the sizes are needed on the host)."""
        if self.ctx.ep_size == 1:
            return send_counts.tolist()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ctx.group)
        return recv_counts.tolist()

    def _all_to_all(self, send: torch.Tensor, recv_splits: list[int], send_splits: list[int]):
        """Launch an uneven all-to-all of the rows of `send`; (receive buffer, work handle or None)."""
        if self.ctx.ep_size == 1:
            return send, None  # every row stays here
        recv = send.new_empty(sum(recv_splits), *send.shape[1:])
        work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.ctx.group, async_op=True)
        return recv, work


def _wait(works: tuple) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _weighted_rows(output: ExpertOutput, handle: CombineHandle) -> torch.Tensor:
    """[N_recv, H]: each received row's sum over its local experts of w_k * expert_k(x), in fp32."""
    if not output.summed:  # the sum over top-k happens here: do it in fp32
        output = ExpertOutput(output.hidden.float(), output.weights_applied, summed=False)
    return reduce_standard(output, handle.local_ids, handle.topk_weights)
