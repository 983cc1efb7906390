"""Admission with the prefix cache: counters count a request once, lpm orders by the cached prefix and holds
back a request whose prefix another one is computing, and no policy changes a token."""

from __future__ import annotations

import random

from moeplex.admission import LPM_MAX_QUEUE, admission_order
from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.kv_cache import KVPool
from moeplex.prefix_cache import PrefixCache
from moeplex.request import Request
from moeplex.sampling import SamplingParams
from moeplex.scheduler import Scheduler

PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


def pool(pages: int, page_size: int = 4) -> tuple[KVPool, PrefixCache]:
    kv = KVPool(pages, page_size, [[(1,)]], dtype=None, device="cpu")
    return kv, PrefixCache(kv)


def request(rid: str, prompt: list[int], outputs: list[int] = ()) -> Request:
    return Request(rid, list(prompt), PARAMS, output_ids=list(outputs))


def cache_tokens(kv: KVPool, cache: PrefixCache, tokens: list[int]) -> None:
    pages = kv.allocate(kv.pages_for(len(tokens)))
    ins = cache.insert(tokens, pages)
    kv.release(ins.duplicates + pages[len(ins.pages) :])


def test_a_request_retried_for_want_of_pages_is_counted_once():
    kv, cache = pool(8)
    prefix = list(range(100, 116))
    cache_tokens(kv, cache, prefix)  # 4 pages cached
    scheduler = Scheduler(kv, max_running=4, token_budget=64, chunk_size=64, cache=cache)
    decoding = request("r", list(range(15)), outputs=[7])  # 16 tokens, 4 pages: the rest of the pool
    decoding.pages, decoding.num_cached = kv.allocate(4), 15
    scheduler.running.append(decoding)
    waiting = request("w", prefix + [1, 2, 3, 4, 5])  # hits 16 tokens, then needs 2 pages nobody frees
    scheduler.add(waiting)
    for _ in range(3):
        assert [w.request for w in scheduler.schedule()] == [decoding]  # w is tried and refused each step
    assert (cache.queried_tokens, cache.hit_tokens, waiting.cached_tokens) == (0, 0, 0)
    assert waiting.pages == [] and cache.evictable_pages == cache.num_pages  # it waits holding nothing
    scheduler.finish(decoding)  # its 3 computed pages join the cache, evictable: w gets its pages now
    assert [w.request for w in scheduler.schedule()] == [waiting]
    assert (cache.queried_tokens, cache.hit_tokens, waiting.cached_tokens) == (21, 16, 16)
    scheduler.preempt(waiting)  # resumed later: a hit again, but not a new lookup of the client's prompt
    assert [w.request for w in scheduler.schedule()] == [waiting]
    assert (cache.queried_tokens, cache.hit_tokens, waiting.cached_tokens) == (21, 16, 16)


def test_lpm_orders_by_cached_prefix_and_keeps_arrival_order_for_ties_and_long_queues():
    kv, cache = pool(64)
    cache_tokens(kv, cache, list(range(100, 132)))
    cold, short, long, cold2 = (request("cold", [1] * 40), request("short", list(range(100, 108)) + [0] * 30),
                                request("long", list(range(100, 132)) + [0] * 3), request("cold2", [2] * 40))
    queue = [cold, short, long, cold2]
    assert admission_order("lpm", queue, [], cache) == [long, short, cold, cold2]
    assert admission_order("fcfs", queue, [], cache) == queue
    assert admission_order("lpm", queue, [], None) == queue
    many = [request(str(i), [3] * 40) for i in range(LPM_MAX_QUEUE)] + [long]
    assert admission_order("lpm", many, [], cache) == many  # too long to sort: arrival order
    shape = [(n.id, n.tokens, n.last_access) for n in cache._nodes()]
    assert shape == [(n.id, n.tokens, n.last_access) for n in cache._nodes()]  # ordering touched nothing


def test_lpm_holds_back_a_request_sharing_an_uncached_prefix_with_one_ahead_or_prefilling():
    kv, cache = pool(64)
    rng = random.Random(0)
    system = [rng.randrange(256) for _ in range(64)]
    a, b, c = (request(x, system + [rng.randrange(256) for _ in range(5)]) for x in "abc")
    other = request("other", [rng.randrange(256) for _ in range(69)])
    near = request("near", system[:20] + [0] * 40)  # shares fewer than 32 tokens with a: not worth a wait
    assert admission_order("lpm", [a, b, other, c, near], [], cache) == [a, other, near]
    a.num_cached = 32  # a is running and half way through the shared prompt
    assert admission_order("lpm", [b, c, other], [a], cache) == [other]
    assert admission_order("lpm", [b, c], [], cache) == [b]  # alone, b is ahead of c sharing the same
    a.num_cached = 69  # a's prompt is computed and cached: b and c hit it, nothing is left to wait for
    cache_tokens(kv, cache, a.prompt_ids)
    assert admission_order("lpm", [b, c], [a], cache) == [b, c]


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(2):
        system = [256] + [rng.randrange(256) for _ in range(47)]
        prompts += [system + [rng.randrange(256) for _ in range(rng.randrange(2, 6))] for _ in range(4)]
    rng.shuffle(prompts)
    return prompts


def test_lpm_caches_within_a_batch_and_changes_no_token(tiny_model_dir):
    settings = dict(model=tiny_model_dir("qwen3_moe"), dtype="fp32", show_progress=False, max_total_tokens=2048,
                    page_size=4, chunked_prefill_size=16, max_batched_tokens=64)
    prompts = shared_prefix_prompts()
    plain = Engine(EngineConfig(**settings, disable_prefix_cache=True)).generate(prompts, PARAMS)
    hits = {}
    for policy in ("fcfs", "lpm"):
        engine = Engine(EngineConfig(**settings, schedule_policy=policy))
        done = engine.generate(prompts, PARAMS)
        assert [r.output_ids for r in done] == [r.output_ids for r in plain]
        cache = engine.prefix_cache
        assert cache.hit_tokens == sum(r.cached_tokens for r in done)
        assert cache.queried_tokens == sum(map(len, prompts))
        hits[policy] = cache.hit_tokens
    # lpm computes each system prompt about once: everyone else waits until at least 32 of its 48 tokens are cached
    assert 6 * 48 >= hits["lpm"] >= 6 * 32 and hits["lpm"] > hits["fcfs"]
