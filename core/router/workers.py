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

import ipaddress
import re
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


DEFAULT_PORTS = {"http": 80, "https": 443}
HOST_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    split_worker_url(url)
    return url


def split_worker_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of http(s)://HOST[:PORT], or ValueError saying what is wrong. HOST is a DNS name, an
    IPv4 address or a bracketed IPv6 one; PORT is a decimal number in 1..65535. Checked before any
    --worker-url-allow pattern sees the URL, so no pattern can admit a port like `31001.evil.example`."""
    wrong = f"a worker URL is http(s)://HOST[:PORT] with no path, got {url!r}"
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in DEFAULT_PORTS or not rest or any(c in rest for c in "/?#@\\ \t"):
        raise ValueError(wrong)
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{wrong}: [{host}] is no IPv6 address") from None
        host, colon, port = f"[{host.lower()}]", tail[:1], tail[1:]
        if tail and colon != ":":
            raise ValueError(wrong)
    else:
        host, colon, port = rest.lower().partition(":")
        if not _valid_host(host):
            raise ValueError(f"{wrong}: {host!r} is no host name or IPv4 address")
    if not colon:
        return scheme, host, DEFAULT_PORTS[scheme]
    if not (port.isascii() and port.isdigit() and port[0] != "0" and int(port) <= 65535):
        raise ValueError(f"{wrong}: the port must be a number in 1..65535, got {port!r}")
    return scheme, host, int(port)


def _valid_host(host: str) -> bool:
    labels = host.split(".")
    if all(label.isascii() and label.isdigit() for label in labels):  # digits only: an IPv4 address or nothing
        try:
            ipaddress.IPv4Address(host)
            return True
        except ValueError:
            return False
    return len(host) <= 253 and all(HOST_LABEL.fullmatch(label) for label in labels)


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
