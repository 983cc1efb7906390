"""Prometheus metrics of the router, in a registry of its own (no process-wide default registry)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .workers import Worker


class WorkerGauges:
    """Per-worker state read at scrape time, so workers added or removed at run time show as they are."""

    def __init__(self, workers: Callable[[], list[Worker]], tree_size: Callable[[str], int]):
        self.workers = workers
        self.tree_size = tree_size

    def collect(self):
        load = GaugeMetricFamily("moeplex_router_worker_load", "Requests in flight from the router to the worker",
                                 labels=["worker"])
        healthy = GaugeMetricFamily("moeplex_router_worker_healthy", "1 while the worker is in routing, 0 while out",
                                    labels=["worker"])
        tree = GaugeMetricFamily("moeplex_router_tree_size_chars", "Characters of the cache-aware tree the worker owns",
                                 labels=["worker"])
        for worker in self.workers():
            load.add_metric([worker.url], worker.load)
            healthy.add_metric([worker.url], int(worker.healthy))
            tree.add_metric([worker.url], self.tree_size(worker.url))
        yield from (load, healthy, tree)


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moeplex_router_requests", "Forwards a worker answered, by worker", ["worker"], registry=r)
        self.decisions = Counter(
            "moeplex_router_decisions",
            "Routing decisions by reason: cache_hit, cache_miss, imbalanced (cache_aware), else the policy's name",
            ["reason"],
            registry=r,
        )
        self.retries = Counter("moeplex_router_retries", "Forwards repeated on another worker after a failure", registry=r)
        self.forward_failures = Counter(
            "moeplex_router_forward_failures", "Forwards that failed before the first byte, by worker", ["worker"], registry=r
        )
        self.failed_requests = Counter(
            "moeplex_router_failed_requests", "Client requests answered with the router's own 502 or 503", registry=r
        )
        self.workers_out = Counter("moeplex_router_workers_taken_out", "Times a worker was taken out of routing", registry=r)

    def watch(self, workers: Callable[[], list[Worker]], tree_size: Callable[[str], int]) -> None:
        self.registry.register(WorkerGauges(workers, tree_size))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
