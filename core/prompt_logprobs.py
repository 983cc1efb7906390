"""Prompt logprobs: the log-probability the model gave each prompt token (and its top-K), from the logits of the
position before it, computed in the prompt's own extend steps.

Positions served from the prefix cache have no logits, so a request that asks for prompt logprobs from position
`start` takes cached tokens only up to start - 1 (Request.cache_match_limit): the positions it asked about are
recomputed, the prefix before them is still reused. Its cost is those positions' lm_head rows (and, for a prefix
that was cached, their forward).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .request import Request
from .transfer import to_device


def due_rows(work: Sequence) -> list[tuple[Request, int, int]]:
    """(request, token row of the batch, position) of each position of this step's prompt chunks whose logits give
    the logprob of the prompt token after it (ModelRunner.prepare lays each work item's tokens out in order)."""
    out, at = [], 0
    for item in work:
        request = item.request
        p = request.params
        if p.prompt_logprobs is not None and not request.prompt_logprobs_done:
            first, start = max(p.prompt_logprobs_start, 1), request.num_cached
            for position in range(start, start + item.num_tokens):
                if first <= position + 1 < len(request.prompt_ids):
                    out.append((request, at + position - start, position))
        at += item.num_tokens
    return out


def record(due: Sequence[tuple[Request, int, int]], logits: torch.Tensor) -> None:
    """Each due row's prompt logprob into its request: logits [len(due), vocab] (fp32)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = to_device(logits.device, torch.tensor([r.prompt_ids[q + 1] for r, _, q in due], dtype=torch.int64))[0]
    chosen_t = logprobs.gather(-1, targets[:, None])
    ranks = ((logprobs > chosen_t).sum(-1) + 1).tolist()  # 1 + tokens the model found likelier (vLLM's rank)
    chosen = chosen_t[:, 0].tolist()
    top_k = max(r.params.prompt_logprobs for r, _, _ in due)
    top = torch.topk(logprobs, min(top_k, logprobs.shape[-1])) if top_k else None
    top_ids, top_values = (top.indices.tolist(), top.values.tolist()) if top is not None else (None, None)
    for j, (request, _, position) in enumerate(due):
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * len(request.prompt_ids)
        k = request.params.prompt_logprobs
        request.prompt_logprobs[position + 1] = {
            "token_id": request.prompt_ids[position + 1],
            "logprob": chosen[j],
            "rank": ranks[j],
            "top_logprobs": [[t, v] for t, v in zip(top_ids[j][:k], top_values[j][:k])] if k else [],
        }


def finish_prompt(request: Request) -> None:
    """The prompt is computed: its prompt logprobs are complete (and later recomputes, after a preemption, may
    use the prefix cache again)."""
    if request.params.prompt_logprobs is not None and not request.prompt_logprobs_done:
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * len(request.prompt_ids)
        request.prompt_logprobs_done = True
