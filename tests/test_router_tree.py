"""The router's approximate radix tree and its policies, against a brute-force longest common prefix."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplex.router.policies import CacheAware, RoundRobin, ShortestQueue
from moeplex.router.radix_tree import RadixTree, shared_length, token_text
from moeplex.router.request_text import routing_text
from moeplex.router.workers import Worker, WorkerRegistry

WORKERS = ("http://w0:1", "http://w1:1", "http://w2:1")


def common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


class BruteForce:
    """What the tree should know: every text each worker saw (no eviction)."""

    def __init__(self):
        self.texts: dict[str, list[str]] = {}

    def insert(self, text: str, worker: str) -> None:
        self.texts.setdefault(worker, []).append(text)

    def longest(self, text: str, worker: str) -> int:
        return max((common_prefix(text, seen) for seen in self.texts.get(worker, [])), default=0)

    def size(self, worker: str) -> int:
        """Distinct non-empty prefixes of the worker's texts: one tree character each."""
        return len({t[:k] for t in self.texts.get(worker, []) for k in range(1, len(t) + 1)})


def check_invariants(tree: RadixTree) -> None:
    sizes: dict[str, int] = {}
    for node in tree.nodes():
        assert node.edge and node.seen, "no empty edge, no node nobody saw"
        assert node.parent.children[node.edge[0]] is node
        if node.parent is not tree.root:
            assert node.seen.keys() <= node.parent.seen.keys(), "a worker's share is prefix-closed"
            assert all(node.seen[w] <= node.parent.seen[w] for w in node.seen), "a parent is never older"
        for worker in node.seen:
            sizes[worker] = sizes.get(worker, 0) + len(node.edge)
    assert {w: s for w, s in tree.sizes.items() if s} == sizes


# --- unit tests ----------------------------------------------------------------------------------


def test_insert_and_match_split_edges_and_name_the_workers():
    tree = RadixTree()
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    assert tree.match("hello world!").length == 11 and set(tree.match("hello world!").workers) == {"a"}
    assert tree.match("hello th").length == 8 and set(tree.match("hello th").workers) == {"b"}
    shared = tree.match("hello")
    assert shared.length == 5 and set(shared.workers) == {"a", "b"}
    assert tree.match("goodbye").length == 0 and tree.match("").length == 0
    assert (tree.size("a"), tree.size("b")) == (11, 11)
    check_invariants(tree)


def test_match_only_counts_allowed_workers():
    tree = RadixTree()
    tree.insert("abcdef", "a")
    tree.insert("abc", "b")
    assert tree.match("abcdef", allowed={"b"}).length == 3
    assert tree.match("abcdef", allowed={"c"}).length == 0
    assert tree.match("abcdef", allowed={"a", "b"}).workers.keys() == {"a"}


def test_eviction_drops_least_recently_seen_leaves_first():
    tree = RadixTree()
    tree.insert("aaaa-old", "w")
    tree.insert("bbbb-new", "w")
    tree.insert("aaaa-kept", "x")
    dropped = tree.evict(max_size=9)  # w holds 16 characters, x 9
    assert dropped == {"w": 8} and tree.size("w") == 8
    assert tree.match("bbbb-new").length == 8
    assert tree.match("aaaa-old", allowed={"w"}).length == 0
    assert tree.match("aaaa-kept").length == 9, "another worker's share is untouched"
    check_invariants(tree)


def test_remove_worker_forgets_only_that_worker():
    tree = RadixTree()
    tree.insert("shared prefix one", "a")
    tree.insert("shared prefix two", "b")
    tree.remove_worker("a")
    assert tree.size("a") == 0 and tree.match("shared prefix one").length == len("shared prefix ")
    assert set(tree.match("shared prefix one").workers) == {"b"}
    check_invariants(tree)


def test_shared_length_finds_the_first_difference():
    assert shared_length("abcdef", "xxabcdzz", 2) == 4
    assert shared_length("abc", "xxabc", 2) == 3
    assert shared_length("abc", "xxab", 2) == 2
    assert shared_length("abc", "zzz", 0) == 0


# --- property tests ------------------------------------------------------------------------------

texts = st.text(alphabet="abc", max_size=12)
operations = st.lists(st.tuples(texts, st.sampled_from(WORKERS)), max_size=40)


@settings(max_examples=300, deadline=None, database=None)
@given(operations, st.lists(texts, min_size=1, max_size=8))
def test_match_equals_brute_force_longest_common_prefix(inserts, queries):
    tree, brute = RadixTree(), BruteForce()
    for text, worker in inserts:
        tree.insert(text, worker)
        brute.insert(text, worker)
    check_invariants(tree)
    for worker in WORKERS:
        assert tree.size(worker) == brute.size(worker)
    for query in queries:
        best = {w: brute.longest(query, w) for w in WORKERS}
        match = tree.match(query)
        assert match.length == max(best.values())
        if match.length:
            assert set(match.workers) == {w for w, n in best.items() if n == match.length}
        for worker in WORKERS:  # each worker's own longest match, through `allowed`
            assert tree.match(query, allowed={worker}).length == best[worker]


@settings(max_examples=300, deadline=None, database=None)
@given(operations, st.integers(0, 20))
def test_eviction_keeps_each_worker_under_the_limit_and_its_newest_text(inserts, max_size):
    tree, brute = RadixTree(), BruteForce()
    for text, worker in inserts:
        tree.insert(text, worker)
        brute.insert(text, worker)
    before = {w: tree.size(w) for w in WORKERS}
    dropped = tree.evict(max_size)
    check_invariants(tree)
    for worker in WORKERS:
        assert tree.size(worker) <= max(max_size, 0)
        assert before[worker] - tree.size(worker) == dropped.get(worker, 0)
        newest = [t for t in brute.texts.get(worker, [])][-1:]
        if newest and len(newest[0]) <= max_size:  # least recently used goes first, so the newest stays whole
            assert tree.match(newest[0], allowed={worker}).length == len(newest[0])
        for query in {t for ts in brute.texts.values() for t in ts}:  # eviction only forgets
            assert tree.match(query, allowed={worker}).length <= brute.longest(query, worker)


# --- policies ------------------------------------------------------------------------------------


def workers(*loads: int) -> list[Worker]:
    return [Worker(url, load=load) for url, load in zip(WORKERS, loads)]


def test_cache_aware_sticks_above_the_threshold_and_balances_below_it():
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.1)
    pool = workers(0, 0, 0)
    first = policy.select("system prompt A: question 1", pool)
    assert first.reason == "cache_miss"
    first.worker.load = 5  # busier than the others, but not imbalanced
    again = policy.select("system prompt A: question 2", pool)
    assert (again.worker, again.reason) == (first.worker, "cache_hit")
    other = policy.select("something else entirely", pool)
    assert other.reason == "cache_miss" and other.worker is not first.worker, "a miss goes to the least loaded"


def test_a_new_prefix_goes_to_the_worker_owning_least_text_among_the_least_loaded():
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.1)
    pool = workers(0, 0, 0)
    owners = [policy.select(f"prefix {i} " * 10, pool).worker for i in range(3)]
    assert len(set(owners)) == 3, "equal loads: each new prefix to a worker that owns none yet"
    policy.select("another text of the first worker " * 4, [owners[0]])  # owners[0] now owns the most text
    owners[0].load, owners[1].load, owners[2].load = 3, 4, 7
    # owners[1] is one request busier than the least loaded but owns less text; owners[2] is too busy
    assert policy.select("a fresh prefix " * 10, pool).worker is owners[1]
    owners[1].load = 5  # two requests busier: load decides
    assert policy.select("yet another fresh prefix " * 10, pool).worker is owners[0]


def test_cache_aware_takes_the_shortest_queue_when_imbalanced_by_both_thresholds():
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    pool = workers(0, 0, 0)
    hot = policy.select("hot prefix " * 5, pool).worker
    hot.load = 10
    for w in pool:
        if w is not hot:
            w.load = 7  # 10 - 7 <= 4: balanced, affinity wins
    assert policy.select("hot prefix " * 5 + "1", pool).worker is hot
    idle = next(w for w in pool if w is not hot)
    idle.load = 5  # 10 - 5 > 4 and 10 > 1.5 * 5: imbalanced
    choice = policy.select("hot prefix " * 5 + "2", pool)
    assert (choice.worker, choice.reason) == (idle, "imbalanced")
    idle.load = 7  # both workers now hold the prefix: the less loaded of them wins
    hot.load = 9
    assert policy.select("hot prefix " * 5 + "3", pool).worker is idle


def test_round_robin_and_shortest_queue():
    pool = workers(3, 1, 2)
    rr = RoundRobin()
    assert [rr.select("", pool).worker.url for _ in range(4)] == [WORKERS[0], WORKERS[1], WORKERS[2], WORKERS[0]]
    assert ShortestQueue().select("", pool).worker.url == WORKERS[1]


def test_registry_takes_a_failing_worker_out_and_puts_it_back():
    registry = WorkerRegistry(WORKERS[:2], failure_threshold=2, success_threshold=2)
    worker = registry.get(WORKERS[0])
    assert not registry.failed(worker) and registry.failed(worker)
    assert registry.healthy() == [registry.get(WORKERS[1])]
    assert not registry.passed_check(worker) and registry.passed_check(worker)
    assert len(registry.healthy()) == 2


def test_routing_text_of_each_route():
    assert routing_text("/generate", b'{"text": "hi"}') == "hi"
    assert routing_text("/generate", b'{"input_ids": [[1, 2], [3]]}') == "1,2,"
    assert routing_text("/v1/completions", b'{"prompt": ["a", "b"]}') == "a"
    chat = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}'
    assert routing_text("/v1/chat/completions", chat) == "<user>x"
    assert routing_text("/v1/completions", b'{"prompt":') == ""


def test_retry_backoff_doubles_up_to_the_cap_with_bounded_jitter():
    from moeplex.router.proxy import Forwarder
    from moeplex.router.settings import RouterSettings

    settings = RouterSettings(worker_urls=[], retry_backoff_ms=50, retry_max_backoff_ms=300, retry_jitter=0.2, seed=1)
    forwarder = Forwarder(None, None, None, None, settings)
    for attempt, base in [(1, 0.05), (2, 0.1), (3, 0.2), (4, 0.3), (9, 0.3)]:
        waits = [forwarder.backoff(attempt) for _ in range(200)]
        assert base * 0.8 <= min(waits) < max(waits) <= base * 1.2


# --- the size bound and refused requests ---------------------------------------------------------


def test_the_size_bound_holds_after_every_insert():
    import random

    rng = random.Random(0)
    tree = RadixTree(max_size=2000)
    longest = 0
    for i in range(5000):
        text = "".join(rng.choices("abcdefgh", k=rng.randint(1, 60)))
        longest = max(longest, len(text))
        worker = WORKERS[i % 2]
        tree.insert(text, worker)
        assert tree.size(worker) <= 2000, f"insert {i}: {tree.size(worker)} characters"
    check_invariants(tree)
    assert all(tree.size(w) > 2000 * 3 // 4 for w in WORKERS[:2]), "an eviction keeps most of the bound"


def test_the_cache_aware_policy_bounds_its_tree():
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.1, max_tree_size=500)
    pool = workers(0, 0, 0)
    for i in range(2000):
        policy.select(f"conversation {i}: " + "x" * (i % 40), pool)
        assert max(policy.tree_size(w.url) for w in pool) <= 500


@given(st.lists(st.tuples(texts, st.sampled_from(WORKERS), st.booleans()), max_size=40), st.lists(texts, min_size=1, max_size=8))
@settings(max_examples=200, deadline=None)
def test_a_retracted_insert_leaves_the_tree_as_if_it_never_happened(operations, queries):
    tree, brute = RadixTree(), BruteForce()
    for text, worker, accepted in operations:
        inserted = tree.insert(text, worker)
        if accepted:
            brute.insert(text, worker)
        else:
            tree.retract(inserted)
        check_invariants(tree)
    for worker in WORKERS:
        assert tree.size(worker) == brute.size(worker)
        for query in queries:
            assert tree.match(query, allowed={worker}).length == brute.longest(query, worker)


def test_a_refused_request_gives_back_only_what_it_added():
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.1)
    pool = workers(0, 0, 0)
    kept = policy.select("system prompt: question one", pool)
    refused = policy.select("system prompt: question two", pool)
    assert refused.worker is kept.worker
    policy.refused(refused)
    assert policy.tree.match("system prompt: question two").length == len("system prompt: question ")
    assert policy.tree_size(kept.worker.url) == len("system prompt: question one")


def test_token_text_is_one_character_per_id_across_the_whole_code_point_range():
    ids = [0, 1, 255, 256, 0xD7FF, 0xD800, 0xDBFF, 0xDC00, 0xDFFF, 0xE000, 129279, 0x10FFFF]
    text = token_text(ids)
    assert [ord(c) for c in text] == ids and token_text([]) == ""
    assert token_text(ids[:5]) + token_text(ids[5:]) == text  # a prefix of ids is a prefix of the text


@given(st.lists(st.integers(0, 0x10FFFF), max_size=50))
@settings(max_examples=50)
def test_token_text_matches_chr_of_each_id(ids):
    assert token_text(ids) == "".join(map(chr, ids))


def test_token_text_refuses_an_id_beyond_unicode():
    with pytest.raises((ValueError, OverflowError)):
        token_text([0x110000])
    with pytest.raises((ValueError, OverflowError)):
        token_text([-1])
