"""KV transfer throughput per kv_transfer backend: GB/s of pages moved from one pool to another, against a torch copy.

The sender is this process; the receiver is a spawned child for backends that cross processes (loopback
stays in this one). A transfer is timed from `start` until the sender's `poll` says DONE, which every
backend promises only once the bytes are in the receiver's pool. The reference is one plain torch copy of
the same number of bytes in this process (a memcpy on CPU, a device-to-device copy on CUDA). Pages are
picked at random from the pool (`scattered`: runs of one page) or as one block (`contiguous`).
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from moeplex import registry
from moeplex.conformance.kv_transfer_peer import LocalPeer, PoolSpec, RemotePeer

METADATA = bytes(64)


def page_bytes(spec: PoolSpec) -> int:
    elements = spec.page_size * torch.Size(spec.token_shape).numel()
    return spec.layers * spec.per_layer * elements * torch.empty(0, dtype=getattr(torch, spec.dtype)).element_size()


def copy_rate(nbytes: int, device: str, runs: int) -> list[float]:
    """GB/s of a plain torch copy of `nbytes` in this process (the reference)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    repeat = max(1, (256 << 20) // nbytes)  # small copies repeated to ~256 MiB, so the clock sees them
    dst.copy_(src)  # first touch
    rates = []
    for _ in range(runs):
        sync(device)
        began = time.perf_counter()
        for _ in range(repeat):
            dst.copy_(src)
        sync(device)
        rates.append(repeat * nbytes / (time.perf_counter() - began) / 1e9)
    return rates


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def pick_pages(rng: random.Random, pool: int, count: int, pattern: str) -> tuple[list[int], list[int]]:
    if pattern == "contiguous":
        return list(range(count)), list(range(count))
    return rng.sample(range(pool), count), rng.sample(range(pool), count)


class Bench:
    """One backend's sender (here) and receiver (here or in a child), pools as big as the largest count."""

    def __init__(self, name: str, spec: PoolSpec):
        cls = registry.lookup("kv_transfer", name)
        self.local = LocalPeer(cls)
        self.remote = RemotePeer("kv_transfer", name) if cls.caps.cross_process else self.local
        self.sender = self.local.new(spec, 1)
        self.receiver = self.remote.new(spec, 2)
        self.peer = self.local.call(self.sender, "connect", self.remote.call(self.receiver, "endpoint"))
        self.room = 0

    def move(self, src: list[int], dst: list[int], limit_s: float = 300.0) -> float:
        """Seconds from start to the sender's DONE."""
        self.room += 1
        self.remote.call(self.receiver, "expect", self.room, dst)
        began = time.perf_counter()
        self.local.call(self.sender, "start", self.room, self.peer, src, dst, METADATA)
        while (status := self.local.call(self.sender, "poll", self.room).value) == "pending":
            if time.perf_counter() - began > limit_s:
                raise TimeoutError(f"room {self.room} took over {limit_s:.0f} s")
            time.sleep(0.0002)
        took = time.perf_counter() - began
        if status != "done":
            raise RuntimeError(f"the transfer of room {self.room} failed")
        for end, side in ((self.local, self.sender), (self.remote, self.receiver)):
            end.call(side, "release", self.room)
        return took

    def landed(self, src: list[int], dst: list[int]) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.local.pages(self.sender, src), self.remote.pages(self.receiver, dst)))

    def close(self) -> None:
        self.local.shutdown()
        if self.remote is not self.local:
            self.remote.shutdown()


def measure(name: str, spec: PoolSpec, counts: list[int], runs: int, pattern: str, seed: int = 0) -> list[dict]:
    """Rows of {backend, pages, MiB, GB/s runs} for one backend; checks the bytes of the last transfer landed."""
    bench = Bench(name, spec)
    rng = random.Random(seed)
    rows = []
    try:
        bench.move(*pick_pages(rng, spec.pages, min(counts), pattern))  # connection set up, buffers warm
        for count in counts:
            rates = []
            for _ in range(runs):
                src, dst = pick_pages(rng, spec.pages, count, pattern)
                rates.append(count * page_bytes(spec) / bench.move(src, dst) / 1e9)
            rows.append({"backend": name, "pages": count, "bytes": count * page_bytes(spec), "rates": rates})
        if not bench.landed(src, dst):
            raise AssertionError(f"{name}: the last transfer reported DONE but its pages differ")
    finally:
        bench.close()
    return rows


def summary(rates: list[float]) -> str:
    return f"{statistics.median(rates):.2f} ({min(rates):.2f}-{max(rates):.2f})"
