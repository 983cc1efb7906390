"""Continuous batching over the paged KV pool: admit, chunk, preempt, free."""

from __future__ import annotations

from collections import deque

import attrs

from .kv_cache import KVPool
from .request import FinishReason, Request


@attrs.frozen
class ScheduledWork:
    request: Request
    num_tokens: int  # tokens of request.all_ids[num_cached:] processed this step


class Scheduler:
    """Two queues and a preemption rule.

    Every step, running requests go first (oldest first, so decodes are never
    starved by new prompts), then waiting requests are admitted while the token
    budget, the running-request limit and the KV pool allow. Long prompts are cut
    into chunks. When a running request needs a page and none is free, the newest
    running request is preempted: its pages are freed and it waits at the front
    of the queue to recompute its KV later.

    `mixed=False` keeps prompts and decodes in separate steps, as SGLang does by default:
    a step prefills (prompt chunks and new admissions) whenever there is something to
    prefill, and decodes otherwise. Where decode steps replay CUDA graphs, a mixed step
    would run eagerly over every decoding request for the sake of one prompt.
    """

    def __init__(self, kv: KVPool, max_running: int, token_budget: int, chunk_size: int, mixed: bool = True):
        self.kv = kv
        self.max_running = max_running
        self.token_budget = token_budget
        self.chunk_size = chunk_size
        self.mixed = mixed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.dropped: list[Request] = []  # aborted by the scheduler; the engine reports them

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[ScheduledWork]:
        if self.mixed:
            return self._step(self.running, admit=True)
        # a prompt chunk never preempts: under memory pressure the decodes run (and preempt the newest
        # request), so a prompt recomputed after preemption cannot starve them
        prefill = self._step([r for r in self.running if r.num_uncached > 1], admit=True, preempt=False)
        if prefill:
            return prefill
        decode = self._step([r for r in self.running if r.num_uncached == 1], admit=False)
        # neither: a prompt that needs pages only preemption frees (or that can never fit)
        return decode or self._step(self.running, admit=True)

    def _step(self, candidates: list[Request], admit: bool, preempt: bool = True) -> list[ScheduledWork]:
        """Work for `candidates` (running requests, oldest first), then for admitted waiting requests."""
        work: list[ScheduledWork] = []
        budget = self.token_budget
        for request in list(candidates):  # a copy: reserving may preempt from self.running
            if budget == 0:
                break
            if request not in self.running or request.awaiting_final_token:  # preempted, or nothing left to ask
                continue
            n = self._chunk(request, budget)
            if not self._reserve(request, n, preempt=preempt):
                continue
            work.append(ScheduledWork(request, n))
            budget -= n
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            n = self._chunk(request, budget)
            if not self._reserve(request, n, preempt=False):
                break
            self.waiting.popleft()
            self.running.append(request)
            work.append(ScheduledWork(request, n))
            budget -= n
        return work

    def _chunk(self, request: Request, budget: int) -> int:
        n = min(request.num_uncached, budget)
        return n if n == 1 else min(n, self.chunk_size)

    def _reserve(self, request: Request, n: int, preempt: bool) -> bool:
        """Make request.pages cover num_cached + n tokens, preempting newer requests if allowed."""
        missing = self.kv.pages_for(request.num_cached + n) - len(request.pages)
        while missing > 0:
            pages = self.kv.allocate(missing)
            if pages is not None:
                request.pages.extend(pages)
                return True
            victim = self.running[-1] if preempt and self.running else None
            if victim is None:
                return False
            self.preempt(victim)
            if victim is request:
                if not self.running:
                    # it had the whole pool to itself and still ran out: it can never finish
                    self.waiting.popleft()
                    request.finish(FinishReason.ABORT, error="the KV cache cannot hold this sequence")
                    self.dropped.append(request)
                return False
        return True

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        request.num_cached = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Release a finished (or aborted) request's pages and forget it."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request)

    def _free(self, request: Request) -> None:
        self.kv.release(request.pages)
        request.pages = []
