"""Routings the dispatcher and kernel suites feed to plugins: the shapes of top-k a router or a remote rank produces.

Every routing is built from a seed alone, so each rank of a multi-rank test can build
its own and compute what it must get back without talking to the others.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch


@attrs.frozen
class Routing:
    topk_ids: torch.Tensor  # [T, K] int64 expert ids; -1: the pair goes nowhere (dropped, or not on this rank)
    topk_weights: torch.Tensor  # [T, K] float32, as routers produce them

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    def weighted_sum(self, rows: torch.Tensor) -> torch.Tensor:
        """sum_k w_k * rows[t, k] over the pairs whose id is not -1: what identity or real experts must combine to.

        `rows` is [T, K, H] (one row per pair) or [T, H] (the same row for every pair of a token).
        """
        weights = torch.where(self.topk_ids >= 0, self.topk_weights, 0.0).float()
        if rows.dim() == 2:
            return rows.float() * weights.sum(-1, keepdim=True)
        return torch.einsum("tkh,tk->th", rows.float(), weights)


def _weights(num_tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    # distinct, unnormalized weights, so a plugin that forgets or mixes them up cannot match by luck
    return torch.rand(num_tokens, top_k, generator=gen) * 0.9 + 0.1


def _distinct_choice(num_tokens: int, experts: torch.Tensor, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Per token, top_k distinct experts drawn from `experts`."""
    order = torch.rand(num_tokens, experts.numel(), generator=gen).argsort(dim=1)[:, :top_k]
    return experts[order]


def random_routing(num_tokens, num_experts, top_k, gen) -> Routing:
    ids = _distinct_choice(num_tokens, torch.arange(num_experts), top_k, gen)
    return Routing(ids, _weights(num_tokens, top_k, gen))


def one_expert_routing(num_tokens, num_experts, top_k, gen) -> Routing:
    """Every token to expert 0 (the other top-k slots -1): one expert, and one rank, receive everything."""
    ids = torch.full((num_tokens, top_k), -1, dtype=torch.int64)
    ids[:, 0] = 0
    return Routing(ids, _weights(num_tokens, top_k, gen))


def dropped_ids_routing(num_tokens, num_experts, top_k, gen) -> Routing:
    """About a third of the pairs -1, and the first token's pairs all -1 (a token routed nowhere)."""
    routing = random_routing(num_tokens, num_experts, top_k, gen)
    dropped = torch.rand(num_tokens, top_k, generator=gen) < 1 / 3
    dropped[:1] = True
    if num_tokens > 1:
        dropped[-1] = False  # the last token keeps its pairs: dropping it must be visible
    return Routing(routing.topk_ids.masked_fill(dropped, -1), routing.topk_weights)


def idle_experts_routing(num_tokens, num_experts, top_k, gen) -> Routing:
    """Only even experts receive tokens; every odd expert is idle."""
    busy = torch.arange(0, num_experts, 2)
    if busy.numel() < top_k:
        raise ValueError(f"{num_experts} experts leave too few busy ones for top-{top_k}")
    ids = _distinct_choice(num_tokens, busy, top_k, gen)
    return Routing(ids, _weights(num_tokens, top_k, gen))


ROUTINGS: dict[str, Callable[..., Routing]] = {
    "random": random_routing,
    "one_expert": one_expert_routing,
    "dropped_ids": dropped_ids_routing,
    "idle_experts": idle_experts_routing,
}


def make_routing(name: str, num_tokens: int, num_experts: int, top_k: int, seed: int) -> Routing:
    gen = torch.Generator().manual_seed(seed)
    return ROUTINGS[name](num_tokens, num_experts, top_k, gen)


def make_hidden(num_tokens: int, hidden_size: int, seed: int) -> torch.Tensor:
    """[T, H] float32 activations of unit scale."""
    gen = torch.Generator().manual_seed(seed + 7919)
    return torch.randn(num_tokens, hidden_size, generator=gen)
