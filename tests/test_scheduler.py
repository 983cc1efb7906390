"""Scheduler invariants under random workloads (no model: tokens are appended by the test)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moeplex.kv_cache import KVPool
from moeplex.request import FinishReason, Request
from moeplex.sampling import SamplingParams
from moeplex.scheduler import Scheduler


def run_to_completion(scheduler: Scheduler, requests: list[Request], max_steps: int = 10_000) -> list[int]:
    """Drive the scheduler like the engine does; check the invariants every step; return tokens per step."""
    for r in requests:
        scheduler.add(r)
    per_step = []
    for _ in range(max_steps):
        if not scheduler.has_work:
            return per_step
        work = scheduler.schedule()
        scheduler.dropped.clear()
        total = sum(w.num_tokens for w in work)
        if not scheduler.mixed:
            # one token to go after a cached prefix: what a decode batch holds (a prompt's last token may be one)
            decoding = {w.request.num_uncached == 1 and w.request.num_cached > 0 for w in work}
            assert len(decoding) <= 1, "a step both prefills and decodes"
        assert total <= scheduler.token_budget
        assert len(scheduler.running) <= scheduler.max_running
        owned = [p for r in scheduler.running for p in r.pages]
        assert len(owned) == len(set(owned)), "a page is owned by two requests"
        assert len(owned) + scheduler.kv.num_free_pages == scheduler.kv.num_pages
        for w in work:
            r = w.request
            assert 1 <= w.num_tokens <= r.num_uncached
            assert w.num_tokens == 1 or w.num_tokens <= scheduler.chunk_size
            assert len(r.pages) * scheduler.kv.page_size >= r.num_cached + w.num_tokens
            r.num_cached += w.num_tokens
            if r.num_uncached == 0:
                r.output_ids.append(len(r.output_ids))
                if len(r.output_ids) >= r.params.max_new_tokens:
                    r.finish(FinishReason.LENGTH)
                    scheduler.finish(r)
        per_step.append(total)
    raise AssertionError("the scheduler did not finish its requests")


def fitting_requests(prompt_lens: list[int], new_tokens: int, kv: KVPool) -> list[Request]:
    """A request per prompt length, those that fit the pool alone."""
    requests = [Request(str(i), list(range(n)), SamplingParams(max_new_tokens=new_tokens))
                for i, n in enumerate(prompt_lens)]
    return [r for r in requests if r.num_tokens + new_tokens <= kv.capacity_tokens]


def make_pool(pages: int, page_size: int = 4) -> KVPool:
    return KVPool(pages, page_size, [[(1,)]], dtype=None, device="cpu")


@settings(max_examples=60, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 60), min_size=1, max_size=20),
    new_tokens=st.integers(1, 20),
    budget=st.integers(8, 64),
    chunk=st.integers(1, 32),
    pages=st.integers(20, 80),
    max_running=st.integers(1, 8),
    mixed=st.booleans(),
)
def test_budget_pool_and_completion(prompt_lens, new_tokens, budget, chunk, pages, max_running, mixed):
    kv = make_pool(pages)
    scheduler = Scheduler(kv, max_running=max_running, token_budget=max(budget, max_running), chunk_size=chunk,
                          mixed=mixed)
    fits = fitting_requests(prompt_lens, new_tokens, kv)
    run_to_completion(scheduler, fits)
    assert all(r.finished for r in fits)
    assert kv.num_free_pages == kv.num_pages


def test_long_prompts_are_chunked_and_decodes_continue_alongside():
    scheduler = Scheduler(make_pool(200), max_running=4, token_budget=32, chunk_size=16)
    short = Request("short", [1, 2, 3], SamplingParams(max_new_tokens=10))
    long = Request("long", list(range(100)), SamplingParams(max_new_tokens=2))
    scheduler.add(short)
    scheduler.schedule()[0].request.num_cached = 3  # short's prompt is in the cache
    short.output_ids.append(0)
    scheduler.add(long)
    work = scheduler.schedule()
    assert [(w.request.rid, w.num_tokens) for w in work] == [("short", 1), ("long", 16)]


def test_unmixed_steps_prefill_first_then_decode():
    scheduler = Scheduler(make_pool(200), max_running=4, token_budget=32, chunk_size=16, mixed=False)
    short = Request("short", [1, 2, 3], SamplingParams(max_new_tokens=10))
    long = Request("long", list(range(20)), SamplingParams(max_new_tokens=2))
    scheduler.add(short)
    scheduler.schedule()[0].request.num_cached = 3
    short.output_ids.append(0)
    scheduler.add(long)

    def step() -> list[tuple[str, int]]:
        work = scheduler.schedule()
        for w in work:
            w.request.num_cached += w.num_tokens
            if w.request.num_uncached == 0:
                w.request.output_ids.append(0)
        return [(w.request.rid, w.num_tokens) for w in work]

    assert step() == [("long", 16)]  # a prompt to prefill: the decode waits
    assert step() == [("long", 4)]  # the prompt's last chunk
    assert step() == [("short", 1), ("long", 1)]  # nothing left to prefill: both decode


def test_unmixed_steps_decode_when_no_prompt_can_be_admitted():
    scheduler = Scheduler(make_pool(200), max_running=1, token_budget=32, chunk_size=16, mixed=False)
    first = Request("first", [1, 2, 3], SamplingParams(max_new_tokens=10))
    scheduler.add(first)
    scheduler.schedule()[0].request.num_cached = 3
    first.output_ids.append(0)
    scheduler.add(Request("second", [4, 5], SamplingParams(max_new_tokens=2)))  # no room: max_running is 1
    assert [(w.request.rid, w.num_tokens) for w in scheduler.schedule()] == [("first", 1)]


def test_preemption_frees_the_newest_request_and_requeues_it_first():
    kv = make_pool(4, page_size=4)  # 16 tokens in all
    scheduler = Scheduler(kv, max_running=4, token_budget=64, chunk_size=64)
    old = Request("old", list(range(8)), SamplingParams(max_new_tokens=8))
    new = Request("new", list(range(8)), SamplingParams(max_new_tokens=8))
    for r in (old, new):
        scheduler.add(r)
    for w in scheduler.schedule():
        w.request.num_cached += w.num_tokens
        w.request.output_ids.append(0)
    work = scheduler.schedule()  # old needs a third page: new is preempted
    assert [w.request.rid for w in work] == ["old"]
    assert new.num_cached == 0 and new.pages == [] and new.num_preemptions == 1
    assert scheduler.waiting[0] is new


def test_a_request_that_cannot_fit_alone_is_aborted_not_spun_on():
    kv = make_pool(2, page_size=4)
    scheduler = Scheduler(kv, max_running=1, token_budget=16, chunk_size=16)
    r = Request("r", list(range(8)), SamplingParams(max_new_tokens=100))
    run_to_completion(scheduler, [r])
    assert r.finish_reason == FinishReason.ABORT and "cannot hold" in r.error
    assert kv.num_free_pages == 2


def test_drafts_take_cached_pages_no_request_reads_but_never_a_requests():
    """Once the prefix cache holds every page not in use (any server after a while), drafts evict cached pages
    (enough for every running request's drafts at once: the pool then lasts, as draft pages go back to the free
    list); a request's own pages are never taken (drafts never preempt)."""
    from moeplex.prefix_cache import PrefixCache

    kv = make_pool(32)
    cache = PrefixCache(kv)
    scheduler = Scheduler(kv, max_running=4, token_budget=64, chunk_size=64, cache=cache)
    scheduler.lookahead = 3
    old = kv.allocate(24)
    cache.insert(list(range(96)), old)  # a finished request's prefix: 24 cached pages, read by no one
    request = Request("r", [7] * 6, SamplingParams(max_new_tokens=50))
    scheduler.add(request)
    [work] = scheduler.schedule()
    assert work.num_tokens == 6 and len(request.pages) == 2
    request.num_cached += 6
    request.output_ids.append(1)
    held = kv.allocate(kv.num_free_pages)  # nothing free but the cache
    [work] = scheduler.schedule()  # its decode token and 3 drafts: 10 positions, 3 pages
    assert work.num_tokens == 1 and len(request.pages) == 3 and cache.evicted_pages >= 1
    cache.evict(cache.evictable_pages)
    kv.allocate(kv.num_free_pages)  # nothing cached either: no draft pages, and no request's taken
    assert scheduler.draft_pages(2) == [] and len(request.pages) == 3


def test_a_prompt_mixes_with_decodes_only_where_the_rows_fit_mixed_rows():
    """mixed_rows (the largest decode graph under --mixed-chunk auto): a prompt piece that fits beside the decodes
    shares their step, capped so the step holds at most mixed_rows rows; one of which the rows left hold at least
    half is cut to them; one of which they hold less gets a step of its own."""
    scheduler = Scheduler(make_pool(200), max_running=8, token_budget=64, chunk_size=16, mixed_rows=8)
    decoding = [Request(f"d{i}", [1, 2, 3], SamplingParams(max_new_tokens=10)) for i in range(5)]
    for r in decoding:
        scheduler.add(r)
    while not all(r.output_ids for r in decoding):  # their prompts, at most 8 rows a step
        work = scheduler.schedule()
        assert sum(w.num_tokens for w in work) <= 8
        for w in work:
            w.request.num_cached += w.num_tokens
            if w.request.num_uncached == 0:
                w.request.output_ids.append(0)
    scheduler.add(Request("fits", [7, 8], SamplingParams(max_new_tokens=2)))
    work = scheduler.schedule()
    assert sorted((w.request.rid, w.num_tokens) for w in work) == [("d0", 1), ("d1", 1), ("d2", 1), ("d3", 1),
                                                                   ("d4", 1), ("fits", 2)]
    for w in work:
        w.request.num_cached += w.num_tokens
        w.request.output_ids.append(0)
    assert all(r.num_uncached == 1 for r in scheduler.running)
    scheduler.add(Request("long", list(range(12)), SamplingParams(max_new_tokens=2)))
    work = scheduler.schedule()  # 6 decodes + a 12-token piece > 8 rows, and 2 rows are less than half: the prompt alone
    assert [(w.request.rid, w.num_tokens) for w in work] == [("long", 12)]
    for w in work:
        w.request.num_cached += w.num_tokens
        w.request.output_ids.append(0)
    for r in scheduler.running[:3]:  # 4 decodes left: 4 rows hold half of an 8-token piece
        r.finish(FinishReason.LENGTH)
        scheduler.finish(r)
    scheduler.add(Request("cut", list(range(8)), SamplingParams(max_new_tokens=2)))
    work = scheduler.schedule()
    assert sorted((w.request.rid, w.num_tokens) for w in work) == [("cut", 4), ("d3", 1), ("d4", 1), ("fits", 1),
                                                                   ("long", 1)]
    for w in work:
        w.request.num_cached += w.num_tokens
    work = scheduler.schedule()  # the rest of the piece beside the decodes
    assert ("cut", 4) in [(w.request.rid, w.num_tokens) for w in work] and len(work) == 5
    unlimited = Scheduler(make_pool(200), max_running=8, token_budget=64, chunk_size=16)
    assert unlimited.mixed_rows is None


@settings(max_examples=40, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 60), min_size=1, max_size=20),
    new_tokens=st.integers(1, 20),
    mixed_rows=st.integers(1, 24),
    max_running=st.integers(1, 8),
)
def test_every_request_finishes_under_a_row_limit(prompt_lens, new_tokens, mixed_rows, max_running):
    kv = make_pool(80)
    scheduler = Scheduler(kv, max_running=max_running, token_budget=32, chunk_size=8, mixed_rows=mixed_rows)
    fits = fitting_requests(prompt_lens, new_tokens, kv)
    schedule = scheduler.schedule

    def checked():  # a step that mixes prompt tokens with decodes holds at most mixed_rows rows (or its decodes)
        work = schedule()
        decodes = sum(1 for w in work if w.request.output_ids and w.request.num_uncached == 1)
        if 0 < decodes < len(work):
            assert sum(w.num_tokens for w in work) <= max(mixed_rows, decodes)
        return work

    scheduler.schedule = checked
    run_to_completion(scheduler, fits)
    assert all(r.finished for r in fits)
    assert kv.num_free_pages == kv.num_pages
