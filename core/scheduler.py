"""Continuous batching over the paged KV pool: admit, chunk, preempt, free."""

from __future__ import annotations

from collections import deque

import attrs

from .admission import admission_order
from .kv_cache import KVPool
from .prefix_cache import PrefixCache
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
    of the queue to recompute its KV later. Waiting requests are tried in the order of
    the schedule policy: arrival (fcfs) or longest cached prefix first (lpm, admission.py).

    With a prefix cache, an admitted request starts at its longest cached prefix (at least one prompt
    token is computed, so its logits exist) and the budget counts only the tokens it computes; its KV
    joins the cache after every prompt chunk, on preemption and at its end. When pages run short,
    cached pages no request reads are evicted before any request is preempted.

    `mixed=False` keeps prompts and decodes in separate steps, as SGLang does by default:
    a step prefills (prompt chunks and new admissions) whenever there is something to
    prefill, and decodes otherwise. Where decode steps replay CUDA graphs but prompt steps
    do not (--disable-prompt-graphs), a mixed step would run eagerly over every decoding
    request for the sake of one prompt (engine.py chooses).
    """

    def __init__(
        self, kv: KVPool, max_running: int, token_budget: int, chunk_size: int, mixed: bool = True,
        cache: PrefixCache | None = None, policy: str = "fcfs", mixed_rows: int | None = None,
    ):
        self.kv = kv
        self.cache = cache
        self.policy = policy  # the order of admission: fcfs or lpm (see admission.py)
        self.max_running = max_running
        self.token_budget = token_budget
        self.chunk_size = chunk_size
        self.mixed = mixed
        # with mixed steps: the most rows a step mixing prompt tokens with decodes holds (None: the token budget).
        # Where decode steps replay CUDA graphs it is the largest graph: a mixed step of more rows runs eagerly over
        # every decode (H100, Qwen3 12 layers, steady 64 with 97-token arrivals: 30-40 ms a step against 5 for a
        # decode step, 3018 tok/s against 7099 for separate steps). A prompt piece that does not fit beside the decodes
        # is cut to the rows they leave where those hold at least half of it (it then takes two mixed steps at most,
        # where a step of its own would run eagerly: H100, tiny DeepSeek-V3, concurrency 64, a prompt step of its
        # own 5.7 ms against 0.3 for a graphed one); with fewer rows left it gets a step of its own.
        self.mixed_rows = mixed_rows
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.dropped: list[Request] = []  # aborted by the scheduler; the engine reports them
        self.lookahead = 0  # speculative decoding: positions a decoding request may add beyond its next token

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def may_admit(self) -> bool:
        """Whether a waiting request may be admitted now: one waits and a running slot is free (pages and the token
        budget decide then). With every slot taken, waiting requests change nothing until a running one ends."""
        return bool(self.waiting) and len(self.running) < self.max_running

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[ScheduledWork]:
        if self.mixed:
            mixed = self._mixed_budget()
            if mixed is not None:
                return self._step(self.running, admit=True, budget=mixed[0], room=mixed[1])
        # a prompt chunk never preempts: under memory pressure the decodes run (and preempt the newest
        # request), so a prompt recomputed after preemption cannot starve them
        prefill = self._prefill()
        if prefill:
            return prefill
        decode = self._step([r for r in self.running if r.num_uncached == 1], admit=False)
        # neither: a prompt that needs pages only preemption frees (or that can never fit)
        return decode or self._step(self.running, admit=True)

    def admissions(self) -> list[ScheduledWork]:
        """The prompt step schedule() would give where every running request decodes: waiting requests admitted
        (and running ones mid-prompt), nothing else scheduled or reserved; none with mixed steps or nothing to
        admit. A caller with a step in flight whose tokens are not read yet may launch it before reading them."""
        if self.mixed:
            return []
        return self._prefill()

    def admit_whole(self, rows: int, width: int, allowed) -> list[Request]:
        """Waiting requests admitted with their whole prompt in one step beside decode rows (a verify step under the
        overlap schedule: speculation/overlap.py), in admission order while the next one's uncached prompt tokens,
        each a row, and `width` rows at its last prompt position fit in `rows` and in one chunk, `allowed(request)`
        holds (asked after its prefix-cache match) and its pages are free (never preempting). Its pages cover the
        prompt and those rows; num_cached is its prefix-cached tokens, as in any admission."""
        admitted = []
        if not self.may_admit:
            return admitted
        for request in admission_order(self.policy, self.waiting, self.running, self.cache):
            if len(self.running) >= self.max_running or request.pages:  # (pages: a transferred prompt's KV)
                break
            self._reuse_prefix(request)
            n = request.num_uncached
            if n > min(self.chunk_size, self.token_budget) or n - 1 + width > rows or not allowed(request) or \
                    not self._reserve(request, n - 1 + width, preempt=False):
                self._release(request, keep=False)  # it waits without holding cached pages
                break
            self._admitted(request)
            admitted.append(request)
            rows -= n - 1 + width
        return admitted

    def _prefill(self) -> list[ScheduledWork]:
        return self._step([r for r in self.running if r.num_uncached > 1], admit=True, preempt=False)

    def next_prompt(self) -> Request | None:
        """The request whose prompt tokens the next step would hold: a running one mid-way, else the first waiting
        one where one may be admitted; None where no prompt is due."""
        prompt = next((r for r in self.running if r.num_uncached > 1), None)
        if prompt is None and self.may_admit:
            prompt = self.waiting[0]
        return prompt

    def _mixed_budget(self) -> tuple[int, int | None] | None:
        """(token budget, rows for prompt pieces: None for no limit but the budget) of a mixed step now, or None
        where the step goes unmixed: the rows that mixed_rows leaves beside the decodes hold less than half of the
        next prompt piece (a running request's, else the first waiting one's); where they hold at least half, the
        piece is cut to them."""
        if self.mixed_rows is None:
            return self.token_budget, None
        decodes = sum(1 for r in self.running if r.num_uncached == 1)
        room = max(self.mixed_rows - decodes, 0)
        prompt = self.next_prompt()
        if prompt is not None:
            piece = min(prompt.num_uncached, self.chunk_size)
            if piece > room and 2 * room < piece:
                return None
        return min(self.token_budget, max(self.mixed_rows, decodes)), room

    def _step(self, candidates: list[Request], admit: bool, preempt: bool = True,
              budget: int | None = None, room: int | None = None) -> list[ScheduledWork]:
        """Work for `candidates` (running requests, oldest first), then for admitted waiting requests, within
        `budget` tokens (default: the token budget), prompt pieces within `room` tokens (None: no limit but it)."""
        work: list[ScheduledWork] = []
        budget = self.token_budget if budget is None else budget
        for request in list(candidates):  # a copy: reserving may preempt from self.running
            if budget == 0:
                break
            if request not in self.running or request.awaiting_final_token:  # preempted, or nothing left to ask
                continue
            n = self._chunk(request, budget)
            prompt = room is not None and request.num_uncached > 1
            if prompt:
                n = min(n, room)
                if n == 0:
                    continue
            if not self._reserve(request, n, preempt=preempt):
                continue
            self._reserve_drafts(request, n)
            work.append(ScheduledWork(request, n))
            budget -= n
            if prompt:
                room -= n
        if not (admit and self.waiting and budget > 0 and len(self.running) < self.max_running):
            return work
        for request in admission_order(self.policy, self.waiting, self.running, self.cache):
            if budget == 0 or room == 0 or len(self.running) >= self.max_running:
                break
            self._reuse_prefix(request)
            n = self._chunk(request, budget if room is None else min(budget, room))
            if not self._reserve(request, n, preempt=False):
                self._release(request, keep=False)  # it waits without holding cached pages
                break
            self._admitted(request)
            work.append(ScheduledWork(request, n))
            budget -= n
            if room is not None:
                room -= n
        return work

    def _reserve_drafts(self, request: Request, n: int) -> None:
        """Pages for the drafts a decoding request may verify with its next token, where pages allow (draft_pages;
        fewer pages only mean fewer drafts)."""
        if not self.lookahead or n != 1 or request.num_uncached != 1 or not request.output_ids:
            return
        room = max(0, min(self.lookahead, request.params.max_new_tokens - len(request.output_ids) - 1))
        missing = self.kv.pages_for(request.num_cached + n + room) - len(request.pages)
        if missing > 0:
            request.pages.extend(self.draft_pages(missing))

    def draft_pages(self, count: int) -> list[int]:
        """Up to `count` pages for drafts: free ones, then cached pages no request reads (drafts never preempt).
        Evicting, it frees enough for every running request's drafts at once: draft pages go back to the free list
        when their step is read, so the pool lasts. Until 2026-12-06 drafts took free pages only, and once the
        prefix cache held every page not in use (any server after a while) no request could draft at all: on a
        GPU the overlap schedule was then broken at almost every step for drafts that could not come."""
        free = self.kv.num_free_pages
        if free < count and self.cache is not None:
            pool = self.kv.pages_for(self.lookahead + 1) * len(self.running)
            self.cache.evict(max(count, pool) - free)
        return self.kv.allocate(min(count, self.kv.num_free_pages)) or []

    def _admitted(self, request: Request) -> None:
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:
            self.waiting.remove(request)
        self.running.append(request)
        if self.cache is not None and request.num_preemptions == 0:  # its first admission: count it once
            request.cached_tokens = request.num_cached
            self.cache.record_lookup(request.num_tokens, request.num_cached)

    def _chunk(self, request: Request, budget: int) -> int:
        n = min(request.num_uncached, budget)
        return n if n == 1 else min(n, self.chunk_size)

    def _reserve(self, request: Request, n: int, preempt: bool) -> bool:
        """Make request.pages cover num_cached + n tokens, preempting newer requests if allowed."""
        missing = self.kv.pages_for(request.num_cached + n) - len(request.pages)
        while missing > 0:
            if self.cache is not None and self.kv.num_free_pages < missing:
                self.cache.evict(missing - self.kv.num_free_pages)  # cached pages go before any request
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
        self._release(request, keep=True)  # what it computed stays cached: resuming is a hit
        request.num_cached = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Release a finished (or aborted) request's pages and forget it; its KV joins the prefix cache
        unless it failed (a request whose logits were not finite may have written NaNs)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request, keep=request.error is None)

    def add_decoding(self, request: Request) -> None:
        """A request whose prompt KV is already in its pages (a decode server's, after the transfer): it joins the
        decoding requests at once when there is room, so it never needs a prefill step (nor stalls the decodes)."""
        if len(self.running) < self.max_running:
            self.running.append(request)
        else:
            self.waiting.append(request)  # its pages cover the prompt: admission reserves nothing more

    def detach(self, request: Request) -> None:
        """Take a finished request off the queues with its pages (a prefill server holds them for a transfer);
        finish() releases them later."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    # --- the prefix cache ---------------------------------------------------------------------------
    def cache_progress(self, request: Request) -> None:
        """After a prompt chunk: the pages it filled join the cache, so a request arriving meanwhile shares them."""
        if self.cache is not None:
            self._insert(request)

    def _reuse_prefix(self, request: Request) -> None:
        if self.cache is None or request.pages:
            return
        match = self.cache.match(request.all_ids, request.cache_match_limit)
        self.cache.lock(match.node)
        request.pages, request.num_cached = list(match.pages), match.num_tokens
        request.num_shared_pages, request.cache_node = len(match.pages), match.node

    def _insert(self, request: Request) -> None:
        """The request's full pages of computed KV into the tree; from then on it reads the tree's pages."""
        ids = request.all_ids[: min(request.num_cached, len(request.all_ids))]
        full = len(ids) // self.kv.page_size
        if full <= request.num_shared_pages:
            return
        inserted = self.cache.insert(ids[: full * self.kv.page_size], request.pages[:full])
        self.kv.release(inserted.duplicates)  # its own copies of tokens the tree held already
        self.cache.lock(inserted.node)
        self.cache.unlock(request.cache_node)
        request.pages[:full] = inserted.pages
        request.num_shared_pages, request.cache_node = full, inserted.node

    def _release(self, request: Request, keep: bool) -> None:
        """Give back the request's pages: its own to the free list (or, with `keep`, its computed full pages
        to the prefix cache first), and its lock on the cached ones."""
        if self.cache is not None and request.cache_node is not None:
            if keep:
                self._insert(request)
            self.cache.unlock(request.cache_node)
        self.kv.release(request.pages[request.num_shared_pages :])
        request.pages, request.num_shared_pages, request.cache_node = [], 0, None
        if not keep:
            request.num_cached = 0
