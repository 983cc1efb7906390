"""Routing policies: which of the healthy workers gets a request, given the request's text.

Every policy answers a Choice: the worker and why it was chosen (the reason is counted in
/metrics). The cache-aware policy follows SGLang's router: if load is imbalanced (max - min above
the absolute threshold AND max above the relative threshold times min) the shortest queue wins;
otherwise the worker whose tree share matches the longest prefix, if the match covers more than the
cache threshold of the text; otherwise the least loaded worker (among those within one request of it,
the one owning the least text). The chosen worker then owns the text in the tree at once (so a burst of
requests sharing a prefix follows the first), and gives it back if it refuses the request or fails.
"""

from __future__ import annotations

import abc

import itertools
import random

import attrs

from .radix_tree import Inserted, RadixTree
from .settings import RouterSettings
from .workers import Worker


@attrs.frozen
class Choice:
    worker: Worker
    reason: str  # cache_hit, cache_miss, imbalanced (cache_aware); otherwise the policy's name
    inserted: Inserted | None = None  # what the choice added to the cache-aware tree


class Policy(abc.ABC):
    name = ""

    @abc.abstractmethod
    def select(self, text: str, workers: list[Worker]) -> Choice:
        """The worker for a request whose routing text is `text`, among the routable `workers`."""

    def refused(self, choice: Choice) -> None:
        """The chosen worker refused or failed the request: forget what the choice taught the policy."""

    def forget(self, url: str) -> None:
        """`url` left the router: drop what the policy knows of it."""

    def evict(self, max_size: int) -> dict[str, int]:
        """Keep what the policy knows per worker under `max_size`; the amount dropped per worker."""
        return {}

    def tree_size(self, url: str) -> int:
        """Characters of routing history the policy holds for `url`."""
        return 0


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._turn = itertools.count()

    def select(self, text: str, workers: list[Worker]) -> Choice:
        return Choice(workers[next(self._turn) % len(workers)], self.name)


class Random(Policy):
    name = "random"

    def __init__(self, seed: int | None = None):
        self._random = random.Random(seed)

    def select(self, text: str, workers: list[Worker]) -> Choice:
        return Choice(self._random.choice(workers), self.name)


def least_loaded(workers: list[Worker], turn: int) -> Worker:
    """The worker with the fewest requests in flight; ties go round in turn, not always to the first."""
    start = turn % len(workers)
    rotated = workers[start:] + workers[:start]
    return min(rotated, key=lambda w: w.load)


class ShortestQueue(Policy):
    name = "shortest_queue"

    def __init__(self):
        self._turn = itertools.count()

    def select(self, text: str, workers: list[Worker]) -> Choice:
        return Choice(least_loaded(workers, next(self._turn)), self.name)


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, cache_threshold: float, balance_abs_threshold: int, balance_rel_threshold: float,
                 max_tree_size: int | None = None):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = RadixTree(max_tree_size)
        self._turn = itertools.count()

    def select(self, text: str, workers: list[Worker]) -> Choice:
        choice = self._choose(text, workers)
        if not text:
            return choice
        return attrs.evolve(choice, inserted=self.tree.insert(text, choice.worker.url))

    def refused(self, choice: Choice) -> None:
        if choice.inserted is not None:
            self.tree.retract(choice.inserted)

    def forget(self, url: str) -> None:
        self.tree.remove_worker(url)

    def evict(self, max_size: int) -> dict[str, int]:
        return self.tree.evict(max_size)

    def tree_size(self, url: str) -> int:
        return self.tree.size(url)

    def imbalanced(self, workers: list[Worker]) -> bool:
        loads = [w.load for w in workers]
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def _choose(self, text: str, workers: list[Worker]) -> Choice:
        if self.imbalanced(workers):
            return Choice(least_loaded(workers, next(self._turn)), "imbalanced")
        by_url = {w.url: w for w in workers}
        match = self.tree.match(text, allowed=by_url)
        if text and match.length / len(text) > self.cache_threshold:
            # several workers share the longest match: the least loaded, then the one that saw it last
            url = min(match.workers, key=lambda u: (by_url[u].load, -match.workers[u]))
            return Choice(by_url[url], "cache_hit")
        return Choice(self._owner_for_new_text(workers), "cache_miss")

    def _owner_for_new_text(self, workers: list[Worker]) -> Worker:
        """The least loaded worker; among those within one request of it, the one owning the least text.

        A new prefix's later requests follow it to its owner, so the text a worker owns is its share of
        future load: loads that differ by one request say little (they change every few milliseconds),
        the tree says which worker has taken fewer prefixes so far.
        """
        lowest = min(w.load for w in workers)
        close = [w for w in workers if w.load <= lowest + 1]
        start = next(self._turn) % len(close)
        rotated = close[start:] + close[:start]
        return min(rotated, key=lambda w: (self.tree.size(w.url), w.load))


def make_policy(settings: RouterSettings) -> Policy:
    makers = {
        CacheAware.name: lambda: CacheAware(
            settings.cache_threshold, settings.balance_abs_threshold, settings.balance_rel_threshold,
            settings.max_tree_size,
        ),
        RoundRobin.name: RoundRobin,
        Random.name: lambda: Random(settings.seed),
        ShortestQueue.name: ShortestQueue,
    }
    return makers[settings.policy]()
