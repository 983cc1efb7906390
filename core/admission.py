"""The order in which waiting requests are admitted (`--schedule-policy`).

fcfs: arrival order (a preempted request goes back to the front).

lpm, longest prefix match first, as in SGLang: the waiting requests sorted by how many of their tokens
the prefix cache holds (a pure lookup: ranking the queue touches no node), ties in arrival order. Beyond
LPM_MAX_QUEUE waiting requests it is fcfs again: the lookups would cost more than the order gains.
lpm also caches within the batch: a request whose cached prefix is short but which shares a longer
prefix with a request being prefilled (running, or ahead of it in this step's order) is held back, so
that it finds that prefix in the tree a step or a chunk later instead of computing it a second time.
A held request waits only while the one it shares with is prefilling, so it is never starved.
"""

from __future__ import annotations

from typing import Sequence

from .prefix_cache import PrefixCache
from .request import Request
from .router.radix_tree import RadixTree, token_text

LPM_MAX_QUEUE = 128
IN_BATCH_MIN_SHARED = 32  # tokens beyond the cached prefix that make sharing worth a wait (SGLang's threshold)


def admission_order(
    policy: str, waiting: Sequence[Request], running: Sequence[Request], cache: PrefixCache | None
) -> list[Request]:
    """The waiting requests the scheduler may admit this step, in the order it should try them."""
    if policy == "fcfs" or cache is None or len(waiting) > LPM_MAX_QUEUE:
        return list(waiting)
    cached = [cache.peek(r.all_ids, r.cache_match_limit) for r in waiting]
    order = sorted(range(len(waiting)), key=lambda i: -cached[i])  # stable: ties keep arrival order
    prefilling = RadixTree()  # the prompts being computed (running, or admitted first this step)
    for request in running:
        if request.num_uncached > 1:
            prefilling.insert(token_text(request.all_ids), "")
    admissible = []
    for i in order:
        text = token_text(waiting[i].all_ids[: waiting[i].num_tokens - 1])
        if prefilling.match(text).length >= cached[i] + IN_BATCH_MIN_SHARED:
            continue  # held back: the tree will soon hold what it shares with a request ahead
        admissible.append(waiting[i])
        prefilling.insert(text, "")
    return admissible
