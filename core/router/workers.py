"""The workers behind the router: who they are, how loaded, and whether they are in or out of routing.

A worker's load counts the requests the router has sent it and not yet seen finish, from the moment
one is chosen (before a byte travels), so a burst of decisions sees the requests it just made. A
worker is taken out after `failure_threshold` failures in a row (forwards and health checks alike)
and put back after `success_threshold` passed health checks in a row.
"""

from __future__ import annotations

import attrs


@attrs.define(eq=False)
class Worker:
    url: str
    load: int = 0  # requests in flight from this router
    healthy: bool = True  # in routing
    failures_in_a_row: int = 0
    passes_in_a_row: int = 0
    requests: int = 0  # forwards answered, over the router's life

    def describe(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "load": self.load, "requests": self.requests,
                "failures_in_a_row": self.failures_in_a_row}


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or url.count("/") != 2:
        raise ValueError(f"a worker URL is http(s)://HOST:PORT with no path, got {url!r}")
    return url


class WorkerRegistry:
    def __init__(self, urls: tuple[str, ...] = (), failure_threshold: int = 3, success_threshold: int = 2):
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self._workers: dict[str, Worker] = {}
        for url in urls:
            self.add(url)

    def add(self, url: str, healthy: bool = True) -> Worker:
        url = normalize_url(url)
        if url in self._workers:
            raise KeyError(f"{url} is already a worker of this router")
        worker = self._workers[url] = Worker(url, healthy=healthy)
        return worker

    def remove(self, url: str) -> Worker:
        """Stop routing to `url`; requests already sent to it finish."""
        try:
            return self._workers.pop(normalize_url(url))
        except KeyError:
            raise KeyError(f"{url} is not a worker of this router") from None

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def healthy(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.healthy]

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    # --- load ------------------------------------------------------------------------------------

    @staticmethod
    def sent(worker: Worker) -> None:
        worker.load += 1

    @staticmethod
    def finished(worker: Worker) -> None:
        worker.load -= 1

    # --- health ----------------------------------------------------------------------------------

    def succeeded(self, worker: Worker) -> None:
        """A forward that got an answer: the worker is in; its failure streak ends."""
        worker.failures_in_a_row = 0
        worker.requests += 1

    def failed(self, worker: Worker) -> bool:
        """A failed forward or health check; True when this one took the worker out."""
        worker.passes_in_a_row = 0
        worker.failures_in_a_row += 1
        if worker.healthy and worker.failures_in_a_row >= self.failure_threshold:
            worker.healthy = False
            return True
        return False

    def passed_check(self, worker: Worker) -> bool:
        """A passed health check; True when this one put the worker back."""
        worker.failures_in_a_row = 0
        worker.passes_in_a_row += 1
        if not worker.healthy and worker.passes_in_a_row >= self.success_threshold:
            worker.healthy = True
            return True
        return False
