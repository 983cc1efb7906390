"""The prefix cache's radix tree: unit cases, then random request workloads against a real KVPool."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from moeplex.kv_cache import KVPool
from moeplex.prefix_cache import PrefixCache


def make_cache(pages: int = 16, page_size: int = 2) -> tuple[KVPool, PrefixCache]:
    kv = KVPool(pages, page_size, [[(1,)]], dtype=None, device="cpu")
    return kv, PrefixCache(kv)


def cached(kv: KVPool, cache: PrefixCache, tokens: list[int]):
    """Play a request that computed all of tokens in its own pages and inserted them."""
    pages = kv.allocate(kv.pages_for(len(tokens)))
    ins = cache.insert(tokens, pages)
    kv.release(ins.duplicates + pages[len(ins.pages) :])  # duplicates, and the partial last page
    return ins


def test_empty_tree_matches_nothing():
    kv, cache = make_cache()
    m = cache.match([1, 2, 3, 4, 5], 4)
    assert (m.pages, m.num_tokens, m.node) == ([], 0, cache.root)
    assert cache.peek([1, 2, 3, 4, 5], 4) == 0
    assert (cache.queried_tokens, cache.hit_tokens, cache.num_pages) == (0, 0, 0)  # the scheduler counts admissions


def test_match_is_page_aligned_and_bounded_by_max_tokens():
    kv, cache = make_cache(page_size=2)
    ins = cached(kv, cache, [1, 2, 3, 4, 5, 6, 7])  # three full pages; the 7th token's page is not cached
    assert len(ins.pages) == 3 and ins.duplicates == []
    assert cache.num_pages == 3 and kv.num_free_pages == 13
    assert cache.match([1, 2, 3, 4, 5, 6, 7], 6).pages == ins.pages
    assert cache.match([1, 2, 3, 4, 5, 6], 5).pages == ins.pages[:2]  # prompt_len - 1 leaves a token to compute
    assert cache.match([1, 2, 3, 4, 5, 6], 1).num_tokens == 0
    assert cache.match([1, 2, 3, 9, 5, 6], 6).num_tokens == 2  # diverges inside the second page
    assert cache.match([1, 2, 3, 4, 5, 6], -1).num_tokens == 0


def test_peek_finds_what_match_finds_without_splitting_or_touching():
    kv, cache = make_cache(page_size=2)
    a = cached(kv, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    b = cached(kv, cache, [9, 9, 1, 1])
    before = [(n.id, n.tokens, n.last_access) for n in cache._nodes()]
    for tokens, limit in [([1, 2, 3, 4, 5, 0], 5), ([1, 2, 3, 9], 4), ([1, 2, 3, 4, 5, 6, 7, 8, 0], 8), ([9, 9, 1], 2), ([4], 1)]:
        assert cache.peek(tokens, limit) == {5: 4, 4: 2, 8: 8, 2: 2, 1: 0}[limit]
    assert [(n.id, n.tokens, n.last_access) for n in cache._nodes()] == before  # no split, no access time
    assert cache.match([1, 2, 3, 4, 5, 0], 5).pages == a.pages[:2]  # match does split
    assert len(list(cache._nodes())) == len(before) + 1 and cache.peek([9, 9, 1, 1, 0], 4) == 4 == len(b.pages) * 2


def test_record_lookup_counts_what_the_scheduler_reports_and_reset_zeroes_it():
    kv, cache = make_cache()
    cache.record_lookup(10, 4)
    cache.record_lookup(6, 0)
    assert (cache.queried_tokens, cache.hit_tokens) == (16, 4)
    cache.reset_counters()
    assert (cache.queried_tokens, cache.hit_tokens, cache.evicted_pages) == (0, 0, 0)


def test_partial_overlap_splits_the_edge():
    kv, cache = make_cache(page_size=2)
    a = cached(kv, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    mine = kv.allocate(4)
    b = cache.insert([1, 2, 3, 4, 9, 9, 9, 9], mine)
    assert b.pages == a.pages[:2] + mine[2:]  # the shared two pages are the tree's
    assert b.duplicates == mine[:2]
    kv.release(b.duplicates)
    assert cache.num_pages == 6 and kv.num_free_pages == 10
    assert len(cache.root.children) == 1 and len(next(iter(cache.root.children.values())).children) == 2
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 0], 8).pages == a.pages
    assert cache.match([1, 2, 3, 4, 9, 9, 9, 9, 0], 8).pages == b.pages
    assert cache.match([1, 2, 3, 4, 0], 4).pages == a.pages[:2]


@pytest.mark.parametrize("diverge_at", [1, 2, 5, 7, 9])
def test_a_long_edge_matches_up_to_the_page_where_it_diverges(diverge_at):
    """The edge is compared whole, then by a binary search over its pages: every divergence point is found."""
    kv, cache = make_cache(pages=32, page_size=3)
    tokens = list(range(30))  # one edge of ten pages
    a = cached(kv, cache, tokens)
    other = tokens[: diverge_at * 3 + 1] + [99] + tokens[diverge_at * 3 + 2 :]  # differs inside page diverge_at
    assert cache.peek(other + [0], 30) == diverge_at * 3
    assert cache.match(other + [0], 30).pages == a.pages[:diverge_at]
    assert cache.match(tokens + [0], 30).pages == a.pages  # the split edge still matches whole


def test_match_splits_so_its_node_covers_exactly_the_matched_pages():
    kv, cache = make_cache(page_size=2)
    a = cached(kv, cache, [1, 2, 3, 4, 5, 6])
    m = cache.match([1, 2, 3, 4, 7], 4)
    assert m.pages == a.pages[:2] and m.node.pages == a.pages[:2]
    cache.lock(m.node)
    assert cache.evictable_pages == 1
    assert cache.evict(3) == 1 and kv.num_free_pages == 16 - 2
    cache.unlock(m.node)


def test_insert_extending_a_matched_prefix_adopts_only_the_new_pages():
    kv, cache = make_cache(page_size=2)
    a = cached(kv, cache, [1, 2, 3, 4])
    m = cache.match([1, 2, 3, 4, 5, 6, 7], 6)
    cache.lock(m.node)
    pages = m.pages + kv.allocate(2)  # the request's page table: the tree's prefix, then its own pages
    ins = cache.insert([1, 2, 3, 4, 5, 6, 7], pages)
    assert ins.pages == pages[:3] and ins.duplicates == [] and ins.pages[:2] == a.pages
    cache.lock(ins.node)
    cache.unlock(m.node)
    assert cache.num_pages == 3 and cache.evictable_pages == 0


def test_a_split_keeps_a_locked_handle_protecting_its_whole_path():
    kv, cache = make_cache(page_size=2)
    a = cached(kv, cache, [1, 2, 3, 4, 5, 6])
    cache.lock(a.node)
    b = cached(kv, cache, [1, 2, 7, 7])  # splits a's edge above the locked node
    assert cache.evictable_pages == 1
    assert cache.evict(10) == 1
    assert b.pages[1] in kv._free and not set(a.pages) & set(kv._free)
    cache.unlock(a.node)
    assert cache.evict(10) == 3 and kv.num_free_pages == 16 and cache.num_pages == 0


def test_unlock_below_zero_and_lock_after_eviction_are_errors():
    kv, cache = make_cache()
    a = cached(kv, cache, [1, 2, 3, 4])
    with pytest.raises(ValueError):
        cache.unlock(a.node)
    cache.lock(a.node)
    cache.unlock(a.node)
    with pytest.raises(ValueError):
        cache.unlock(a.node)
    cache.evict(2)
    with pytest.raises(ValueError):
        cache.lock(a.node)
    cache.lock(cache.root)  # nothing matched: the root is locked and unlocked like any node
    cache.unlock(cache.root)


def test_evict_takes_least_recently_used_leaves_first_and_trims_the_last_one():
    kv, cache = make_cache(page_size=2)
    x = cached(kv, cache, [1, 1, 1, 1])
    y = cached(kv, cache, [2, 2, 2, 2])
    z = cached(kv, cache, [3, 3, 3, 3])
    cache.match([1, 1, 1, 1, 0], 4)  # x is now the most recently used
    assert cache.evict(3) == 3
    assert set(y.pages) | {z.pages[1]} <= set(kv._free)
    assert cache.match([3, 3, 3, 3, 0], 4).pages == z.pages[:1]  # a trimmed leaf still caches its prefix
    assert cache.match([1, 1, 1, 1, 0], 4).pages == x.pages
    assert cache.evicted_pages == 3 and cache.num_pages == 3


def test_evicting_a_leaf_exposes_its_parent():
    kv, cache = make_cache(page_size=1)
    cached(kv, cache, [1, 2, 3])
    cached(kv, cache, [1, 2, 4])
    assert cache.num_pages == 4
    assert cache.evict(4) == 4 and cache.num_pages == 0 and kv.num_free_pages == 16
    assert cache.root.children == {}


def test_flush_refuses_while_locked_and_empties_the_pool_after():
    kv, cache = make_cache()
    a = cached(kv, cache, [1, 2, 3, 4, 5])
    cached(kv, cache, [6, 7])
    cache.lock(a.node)
    assert cache.flush() is False
    assert cache.num_pages == 3 and kv.num_free_pages == 13
    cache.unlock(a.node)
    assert cache.flush() is True
    assert cache.num_pages == 0 and kv.num_free_pages == 16 and cache.match([1, 2, 3, 4, 5], 4).num_tokens == 0


def test_insert_needs_a_page_for_every_full_page_of_tokens():
    kv, cache = make_cache(page_size=2)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [0])
    assert cache.insert([1], []).node is cache.root


class Requests(RuleBasedStateMachine):
    """Random workloads: the test plays the requests as the scheduler would, against a real KVPool.

    A request's page table is the tree's pages it locked (`shared` of them), then its private pages.
    Other holders lock a match without computing anything. `model` maps every cached page-aligned
    prefix to its page: what the tree should hold, kept from the outside (evictions are read off the
    pool's free list).
    """

    POOL = 12

    @initialize(page_size=st.sampled_from([1, 2, 3]))
    def setup(self, page_size):
        self.P = page_size
        self.kv = KVPool(self.POOL, page_size, [[(1,)]], dtype=None, device="cpu")
        self.cache = PrefixCache(self.kv)
        self.requests: list[dict] = []  # tokens, pages, shared, node
        self.holders: list[tuple] = []  # (node, pages) of a locked match
        self.model: dict[tuple[int, ...], int] = {}
        self.seen: list[list[int]] = []

    def protected(self) -> set[int]:
        return {p for r in self.requests for p in r["pages"][: r["shared"]]} | {p for _, ps in self.holders for p in ps}

    def private(self) -> list[int]:
        return [p for r in self.requests for p in r["pages"][r["shared"] :]]

    def check_match(self, tokens, max_tokens, m):
        usable = max(0, min(len(tokens), max_tokens)) // self.P
        expected = 0
        while expected < usable and tuple(tokens[: (expected + 1) * self.P]) in self.model:
            expected += 1
        assert m.num_tokens == len(m.pages) * self.P == expected * self.P <= max(max_tokens, 0)
        assert m.pages == [self.model[tuple(tokens[: (i + 1) * self.P])] for i in range(expected)]

    def adopt(self, request, upto):
        """Insert request's first `upto` tokens, as after a prefill chunk or at finish."""
        tokens, pages = request["tokens"][:upto], request["pages"]
        ins = self.cache.insert(tokens, pages)
        n = len(tokens) // self.P
        assert len(ins.pages) == n
        assert set(ins.duplicates) <= set(pages[request["shared"] :]), "a duplicate the request did not own"
        assert ins.duplicates == [mine for mine, tree in zip(pages, ins.pages) if mine != tree]
        for i, page in enumerate(ins.pages):
            assert self.model.setdefault(tuple(tokens[: (i + 1) * self.P]), page) == page
        self.kv.release(ins.duplicates)
        request["pages"] = ins.pages + pages[n:]
        self.cache.lock(ins.node)
        self.cache.unlock(request["node"])
        request["node"], request["shared"] = ins.node, n

    def draw_tokens(self, data, min_size=0):
        """Mostly a prefix of an earlier sequence, extended: what shares pages (and splits edges)."""
        base = data.draw(st.sampled_from(self.seen)) if self.seen and data.draw(st.integers(0, 3)) else []
        tokens = base[: data.draw(st.integers(0, len(base)))] + data.draw(st.lists(st.integers(0, 1), max_size=6))
        tokens = tokens[:12] if len(tokens) >= min_size else tokens + [0] * min_size
        self.seen.append(tokens)
        return tokens

    @rule(data=st.data())
    def admit(self, data):
        self.start(self.draw_tokens(data, min_size=1))

    @rule(data=st.data())
    def serve(self, data):
        """A whole request in one step (admitted, computed, cached, finished): what fills the tree."""
        request = self.start(self.draw_tokens(data, min_size=1))
        if request is not None:
            self.end(request, cache_it=True)

    def start(self, tokens):
        m = self.cache.match(tokens, len(tokens) - 1)
        self.check_match(tokens, len(tokens) - 1, m)
        self.cache.lock(m.node)
        missing = self.kv.pages_for(len(tokens)) - len(m.pages)
        if missing > self.kv.num_free_pages:
            self.evict(missing - self.kv.num_free_pages)
        mine = self.kv.allocate(missing)
        if mine is None:
            self.cache.unlock(m.node)
            return None
        request = {"tokens": list(tokens), "pages": m.pages + mine, "shared": len(m.pages), "node": m.node}
        self.requests.append(request)
        return request

    def end(self, request, cache_it):
        if cache_it:
            self.adopt(request, len(request["tokens"]))
        self.requests.remove(request)
        self.kv.release(request["pages"][request["shared"] :])
        self.cache.unlock(request["node"])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def prefill_chunk(self, data):
        request = data.draw(st.sampled_from(self.requests))
        self.adopt(request, data.draw(st.integers(request["shared"] * self.P, len(request["tokens"]))))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), cache_it=st.booleans())
    def finish(self, data, cache_it):
        self.end(data.draw(st.sampled_from(self.requests)), cache_it)

    @rule(data=st.data(), max_tokens=st.integers(-1, 12), hold=st.booleans())
    def match(self, data, max_tokens, hold):
        tokens = self.draw_tokens(data)
        shape = [(n.id, n.tokens, n.last_access) for n in self.cache._nodes()]
        peeked = self.cache.peek(tokens, max_tokens)
        assert [(n.id, n.tokens, n.last_access) for n in self.cache._nodes()] == shape, "peek changed the tree"
        m = self.cache.match(tokens, max_tokens)
        assert peeked == m.num_tokens
        self.check_match(tokens, max_tokens, m)
        if hold:
            self.cache.lock(m.node)
            self.holders.append((m.node, m.pages))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def release_hold(self, data):
        holder = data.draw(st.sampled_from(self.holders))
        self.holders.remove(holder)
        self.cache.unlock(holder[0])

    @rule(num_pages=st.integers(0, 12))
    def evict(self, num_pages):
        protected, free_before = self.protected(), set(self.kv._free)
        evictable = self.cache.evictable_pages
        freed = self.cache.evict(num_pages)
        evicted = set(self.kv._free) - free_before
        assert freed == len(evicted) == min(num_pages, evictable)
        assert not evicted & protected, "a locked page was evicted"
        self.model = {k: p for k, p in self.model.items() if p not in evicted}

    @rule(now=st.integers(0, 4))
    def flush(self, now):
        if now:  # rarely: a flush empties what the other rules built up
            return
        locked = bool(self.protected())
        free_before = self.kv.num_free_pages
        assert self.cache.flush() is not locked
        if locked:
            assert self.kv.num_free_pages == free_before
        else:
            self.model = {}
            assert self.cache.num_pages == 0

    @invariant()
    def pages_have_one_owner_each(self):
        free, tree, private = list(self.kv._free), list(self.model.values()), self.private()
        owned = free + tree + private
        assert len(owned) == len(set(owned)), "a page has two owners"
        assert sorted(owned) == list(range(self.POOL))
        assert len(free) + self.cache.num_pages + len(private) == self.POOL
        assert self.cache.num_pages == len(self.model)

    @invariant()
    def locks_count_exactly_the_protected_pages(self):
        protected = self.protected()
        assert protected <= set(self.model.values())
        assert self.cache.evictable_pages == self.cache.num_pages - len(protected)

    @invariant()
    def cached_prefixes_are_prefix_closed(self):
        for prefix in self.model:
            assert len(prefix) % self.P == 0
            assert len(prefix) == self.P or prefix[: -self.P] in self.model

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for request in self.requests:
            self.kv.release(request["pages"][request["shared"] :])
            self.cache.unlock(request["node"])
        for node, _ in self.holders:
            self.cache.unlock(node)
        assert self.cache.flush() is True
        assert self.kv.num_free_pages == self.POOL and self.cache.num_pages == 0 and self.cache.evictable_pages == 0


Requests.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
test_random_workloads_keep_the_invariants = Requests.TestCase
