"""The workers behind the router: who they are, how loaded, and whether they are in or out of routing.

A worker's load counts the requests the router has sent it and not yet seen finish, from the moment
one is chosen (before a byte travels), so a burst of decisions sees the requests it just made.

A worker is in one of three states. `starting`: not yet seen healthy (still loading its model); not
routed to, probed with backoff, and never taken out for failing until its start-up grace period is
over; its first passed check puts it in routing at once. `healthy`: in routing. `out`: taken out
after `failure_threshold` failures in a row (forwards and health checks alike), or a start-up that
outlasted its grace period; put back after `success_threshold` passed health checks in a row.
"""

from __future__ import annotations

import time

import attrs

STARTING, HEALTHY, OUT = "starting", "healthy", "out"


@attrs.define(eq=False)
class Worker:
    url: str
    state: str = HEALTHY
    load: int = 0  # requests in flight from this router
    failures_in_a_row: int = 0
    passes_in_a_row: int = 0
    requests: int = 0  # forwards answered, over the router's life
    added_at: float = attrs.field(factory=time.monotonic)  # the start-up grace period counts from here
    last_check: int | str | None = None  # the last health check's status, or the name of its failure

    @property
    def healthy(self) -> bool:
        """In routing."""
        return self.state == HEALTHY

    def describe(self) -> dict:
        return {"url": self.url, "state": self.state, "healthy": self.healthy, "load": self.load,
                "requests": self.requests, "failures_in_a_row": self.failures_in_a_row, "last_check": self.last_check}


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or url.count("/") != 2:
        raise ValueError(f"a worker URL is http(s)://HOST:PORT with no path, got {url!r}")
    return url


class WorkerRegistry:
    def __init__(self, urls: tuple[str, ...] = (), failure_threshold: int = 3, success_threshold: int = 2,
                 startup_grace: float = 600.0, state: str = HEALTHY):
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.startup_grace = startup_grace
        self._workers: dict[str, Worker] = {}
        for url in urls:
            self.add(url, state)

    def add(self, url: str, state: str = HEALTHY) -> Worker:
        url = normalize_url(url)
        if url in self._workers:
            raise KeyError(f"{url} is already a worker of this router")
        worker = self._workers[url] = Worker(url, state=state)
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
        """A failed forward or health check; True when this one took the worker out of routing (or gave
        up on a worker that did not start within the grace period)."""
        worker.passes_in_a_row = 0
        worker.failures_in_a_row += 1
        if worker.state == STARTING:
            if time.monotonic() - worker.added_at > self.startup_grace:
                worker.state = OUT
                return True
            return False
        if worker.healthy and worker.failures_in_a_row >= self.failure_threshold:
            worker.state = OUT
            return True
        return False

    def passed_check(self, worker: Worker) -> bool:
        """A passed health check; True when this one put the worker in routing (a starting worker at once)."""
        worker.failures_in_a_row = 0
        worker.passes_in_a_row += 1
        if worker.state == STARTING or (worker.state == OUT and worker.passes_in_a_row >= self.success_threshold):
            worker.state = HEALTHY
            return True
        return False
