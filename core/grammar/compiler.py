"""Compiling constraints in worker threads, each constraint once: the step loop and the HTTP event loop never
wait for a compile they did not ask to wait for."""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..interfaces import Constraint, GrammarBackend, GrammarError

DEFAULT_CACHE_ENTRIES = 1024


class GrammarCompiler:
    """A backend's compile behind a bounded LRU cache of futures, keyed by the constraint (kind + text): a second
    request with the same schema shares the first one's compile, finished or still running. A failed compile is
    cached too (the same text fails the same way)."""

    def __init__(self, backend: GrammarBackend, threads: int = 2, capacity: int = DEFAULT_CACHE_ENTRIES):
        self.backend = backend
        self.capacity = capacity
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[Constraint, Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.compile_seconds: collections.deque[float] = collections.deque(maxlen=4096)  # the latest compiles' times

    def submit(self, constraint: Constraint) -> Future:
        """The future of `constraint`'s compiled grammar (raising GrammarError if it does not compile)."""
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None:
                self._cache.move_to_end(constraint)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self._compile, constraint)
            self._cache[constraint] = future
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
            return future

    def compile(self, constraint: Constraint) -> Any:
        """Blocking: the compiled grammar, or GrammarError. Call it from a thread that may wait."""
        return self.submit(constraint).result()

    def check(self, constraint: Constraint) -> None:
        """GrammarError (with the backend's reason) if `constraint` does not compile."""
        self.compile(constraint)

    def done(self, constraint: Constraint) -> bool:
        """Whether `constraint`'s compile has ended (compiled or failed): check() would not wait."""
        with self._lock:
            future = self._cache.get(constraint)
        return future is not None and future.done()

    def _compile(self, constraint: Constraint) -> Any:
        if constraint.kind not in self.backend.caps.kinds:
            raise GrammarError(f"the grammar backend does not compile {constraint.kind} constraints")
        start = time.perf_counter()
        try:
            return self.backend.compile(constraint)
        finally:
            self.compile_seconds.append(time.perf_counter() - start)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
