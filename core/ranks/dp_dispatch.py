"""Which DP-attention group gets a new request: the one whose prefix cache likely holds most of its prompt.

Each DP group schedules its own requests and keeps its own prefix cache (its TP ranks make the same
decisions, so they keep identical trees). Rank 0 cannot read those trees between rounds, so it keeps an
approximate mirror: the router's radix tree over token ids, one share per group, fed with what the group
will cache (a prompt when it is handed over, prompt + output when it finishes) and bounded by the group's
KV capacity. The mirror forgets on its own schedule, not the group's, so it can be wrong; a wrong guess
costs a hit, never a token: outputs do not depend on the group.

The rule is the router's (policies.py): when the groups' loads are imbalanced (unfinished requests differ
by more than BALANCE_ABS_THRESHOLD and the largest exceeds BALANCE_REL_THRESHOLD times the smallest), the
least loaded group; otherwise, when some group has seen more than CACHE_THRESHOLD of the prompt, the group
with the longest match (the least loaded among equals); otherwise the least loaded group (fewest tokens of
unfinished requests, ties to the lowest).
"""

from __future__ import annotations

from typing import Sequence

from ..router.radix_tree import RadixTree, token_text

CACHE_THRESHOLD = 0.5
BALANCE_ABS_THRESHOLD = 32
BALANCE_REL_THRESHOLD = 1.1


class DPDispatch:
    def __init__(self, dp_size: int, capacity_tokens: int, cache_aware: bool):
        """`cache_aware` False (no prefix cache, or one group): the least loaded group, no mirror kept."""
        self.dp_size = dp_size
        self.tree = RadixTree(capacity_tokens) if cache_aware and dp_size > 1 else None
        self.reasons = {"cache_hit": 0, "cache_miss": 0, "imbalanced": 0}  # why each request went where it did

    def choose(self, prompt_ids: Sequence[int], requests: Sequence[int], tokens: Sequence[int]) -> int:
        """The group for a prompt, given each group's unfinished requests and their tokens so far."""
        least_loaded = min(range(self.dp_size), key=lambda dp: (tokens[dp], dp))
        if self.tree is None:
            return least_loaded
        high, low = max(requests), min(requests)
        if high - low > BALANCE_ABS_THRESHOLD and high > BALANCE_REL_THRESHOLD * low:
            return self._because("imbalanced", least_loaded)
        text = token_text(prompt_ids[:-1])  # the last prompt token is always computed
        match = self.tree.match(text)
        if text and match.length / len(text) > CACHE_THRESHOLD:
            groups = [int(dp) for dp in match.workers]
            return self._because("cache_hit", min(groups, key=lambda dp: (requests[dp], tokens[dp], dp)))
        return self._because("cache_miss", least_loaded)

    def will_cache(self, dp_rank: int, token_ids: Sequence[int]) -> None:
        """Group dp_rank computes (and so caches) these tokens."""
        if self.tree is not None and token_ids:
            self.tree.insert(token_text(token_ids), str(dp_rank))

    def forget(self) -> None:
        """The groups emptied their caches."""
        if self.tree is not None:
            self.tree = RadixTree(self.tree.max_size)

    def _because(self, reason: str, dp_rank: int) -> int:
        self.reasons[reason] += 1
        return dp_rank
