"""`local`: one EP rank holds every expert, so dispatch hands the tokens straight to the kernel."""

from __future__ import annotations

import torch

from moeplex.interfaces import (
    STANDARD,
    Dispatched,
    Dispatcher,
    DispatcherCaps,
    ExpertOutput,
    StandardLayout,
    reduce_standard,
)


class LocalDispatcher(Dispatcher):
    caps = DispatcherCaps(layout=STANDARD, multi_rank=False, graph_safe=True)
    # combine is reduce_standard and nothing else: an MoE layer may leave that sum to the next norm (MoERuntime)
    combine_only_reduces = True

    def dispatch_start(self, hidden, topk_ids, topk_weights, batch=None):
        return hidden, topk_ids, topk_weights

    def dispatch_finish(self, pending) -> Dispatched:
        hidden, topk_ids, topk_weights = pending
        layout = StandardLayout(hidden, topk_ids, topk_weights, self.ctx.num_local_experts, routed_pairs=topk_ids.numel())
        return Dispatched(layout, handle=(topk_ids, topk_weights))

    def combine_start(self, output: ExpertOutput, handle):
        topk_ids, topk_weights = handle
        return reduce_standard(output, topk_ids, topk_weights)

    def combine_finish(self, pending) -> torch.Tensor:
        return pending
