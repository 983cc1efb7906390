"""The prefix cache changes no output: every workload gives the tokens it gives with --disable-prefix-cache,
while the cache is hit, its pages are conserved, and nothing stays locked once the engine is idle."""

from __future__ import annotations

import random

import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.parallel import ParallelConfig
from moeplex.ranks.launcher import launch
from moeplex.ranks.offline import generate
from moeplex.sampling import SamplingParams

import parallel_ranks
from test_parallel import LAYOUTS, free_address

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)


def engines(folder: str, **overrides) -> tuple[Engine, Engine]:
    settings = {**dict(model=folder, dtype="fp32", show_progress=False, max_total_tokens=2048, page_size=PAGE), **overrides}
    return Engine(EngineConfig(**settings)), Engine(EngineConfig(**settings, disable_prefix_cache=True))


def idle_and_conserved(engine: Engine) -> bool:
    cache, kv = engine.prefix_cache, engine.kv
    return not engine.has_work and cache.evictable_pages == cache.num_pages and kv.num_free_pages + cache.num_pages == kv.num_pages


def system_prompt_workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [256] + [rng.randrange(256) for _ in range(37)]
    return [system + [rng.randrange(256) for _ in range(rng.randrange(1, 9))] for _ in range(6)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_shared_system_prompt_is_computed_once_and_changes_no_token(tiny_model_dir, arch, params):
    cached, plain = engines(tiny_model_dir(arch))
    prompts = system_prompt_workload()
    first = cached.generate(prompts[:1], params)  # the system prompt is cached from here on
    rest = cached.generate(prompts[1:], params)
    expected = plain.generate(prompts, params)
    assert [r.output_ids for r in first + rest] == [r.output_ids for r in expected]
    assert all(r.cached_tokens >= 36 for r in rest) and first[0].cached_tokens == 0
    assert idle_and_conserved(cached)


def test_multi_turn_chat_reuses_each_previous_turn(tiny_model_dir, arch):
    cached, plain = engines(tiny_model_dir(arch))
    conversation, reference, computed = [256, 10, 11, 12, 13, 14], [256, 10, 11, 12, 13, 14], 0
    for turn in range(4):
        [got] = cached.generate([conversation], GREEDY)
        [want] = plain.generate([reference], GREEDY)
        assert got.output_ids == want.output_ids
        # the previous turn's prompt and answer are cached up to their last whole page (the last answer
        # token was never fed back, so it has no KV)
        assert got.cached_tokens == min(computed, len(conversation) - 1) // PAGE * PAGE
        computed = len(conversation) + len(got.output_ids) - 1
        user = [50 + turn, 51 + turn, 52 + turn]
        conversation = conversation + got.output_ids + user
        reference = reference + want.output_ids + user
    assert idle_and_conserved(cached)


@pytest.mark.parametrize("length", [PAGE * 5, PAGE * 5 + 1, PAGE * 5 - 1], ids=["on-a-page", "page-plus-one", "page-minus-one"])
def test_a_prompt_seen_before_is_served_from_the_cache_but_its_last_token_computed(tiny_model_dir, length):
    cached, plain = engines(tiny_model_dir("deepseek_v3"))
    prompt = [256] + list(range(60, 60 + length - 1))
    [once] = cached.generate([prompt], GREEDY)
    [again] = cached.generate([prompt], GREEDY)
    [want] = plain.generate([prompt], GREEDY)
    assert once.output_ids == again.output_ids == want.output_ids
    assert again.cached_tokens == (length - 1) // PAGE * PAGE  # at least one token computed, for its logits
    assert idle_and_conserved(cached)


def test_chunked_prefill_shares_a_long_prefix_while_it_is_still_being_computed(tiny_model_dir):
    cached, plain = engines(tiny_model_dir("qwen3_moe"), chunked_prefill_size=8, max_batched_tokens=64)
    prompts = system_prompt_workload(seed=1)
    want = [r.output_ids for r in plain.generate(prompts, GREEDY)]
    requests = [cached.add_request(prompts[0], GREEDY)]
    cached.step()  # the first chunk of the shared prompt is computed and cached
    requests += [cached.add_request(p, GREEDY) for p in prompts[1:]]
    while cached.has_work:
        cached.step()
    assert [r.output_ids for r in requests] == want
    assert sum(r.cached_tokens for r in requests[1:]) > 0
    assert idle_and_conserved(cached)


def test_preemption_under_a_small_pool_evicts_cached_pages_first_and_resumes_from_the_cache(tiny_model_dir):
    folder = tiny_model_dir("mixtral")
    prompts = system_prompt_workload(seed=2) * 2
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = [r.output_ids for r in engines(folder)[1].generate(prompts, params)]
    cached, _ = engines(folder, max_total_tokens=40 * PAGE)
    results = cached.generate(prompts, params)
    assert [r.output_ids for r in results] == want
    assert sum(r.num_preemptions for r in results) > 0 and cached.prefix_cache.evicted_pages > 0
    assert idle_and_conserved(cached)
    assert cached.flush_cache() and cached.kv.num_free_pages == cached.kv.num_pages


def test_flush_refuses_while_a_request_reads_the_cache(tiny_model_dir):
    cached, _ = engines(tiny_model_dir("deepseek_v3"))
    prompt = system_prompt_workload()[0]
    cached.generate([prompt], GREEDY)
    request = cached.add_request(prompt, SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True))
    cached.step()
    assert request.cached_tokens > 0 and not cached.flush_cache()
    cached.abort(request.rid)
    assert cached.flush_cache() and cached.kv.num_free_pages == cached.kv.num_pages


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "dp2-attention"])
def test_over_ranks_the_cache_changes_no_token(tiny_model_dir, layout):
    """Every rank of a DP group keeps the same tree (the same scheduling decisions); two requests at a time,
    so later prompts find the shared system prompt cached."""
    folder = tiny_model_dir("deepseek_v3")
    prompts = system_prompt_workload(seed=3)
    plain = EngineConfig(model=folder, show_progress=False, max_total_tokens=1024, page_size=4, disable_prefix_cache=True)
    reference = generate(plain, prompts, GREEDY)
    parallel = ParallelConfig(dist_init_addr=free_address(), timeout_s=120, **LAYOUTS[layout])
    results = launch(parallel_ranks.generate_with_settings, parallel, parallel, [folder], prompts, [GREEDY] * len(prompts),
                     {"max_running_requests": 2})[folder]
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in reference]
    assert sum(r["cached_tokens"] for r in results) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_on_gpu_the_cache_changes_no_token(tiny_model_dir, arch):
    """Triton attention over a cached prefix (MLA's latent and GQA), CUDA-graph decode, the overlap schedule."""
    gpu = dict(device="cuda", moe_kernel="triton", attention_backend="triton", cuda_graph_max_bs=16, max_running_requests=16)
    cached, plain = engines(tiny_model_dir(arch), **gpu)
    assert cached.runner.graphs is not None and cached.overlap_schedule
    prompts = system_prompt_workload(seed=4)
    first = cached.generate(prompts[:2], GREEDY)
    rest = cached.generate(prompts[2:], GREEDY)
    assert [r.output_ids for r in first + rest] == [r.output_ids for r in plain.generate(prompts, GREEDY)]
    assert all(r.cached_tokens > 0 for r in rest)
    assert idle_and_conserved(cached)


def test_offline_dp_attention_sends_a_shared_prefix_to_the_group_that_holds_it(tiny_model_dir):
    """Offline generate shares prompts out by the server's longest-match rule: the third prompt extends the first,
    so it joins the first's group (by load alone it would go to the group of the short second prompt) and is
    served from that group's cache; one request at a time per group, so the first has finished by then."""
    folder = tiny_model_dir("qwen3_moe")
    system = [256] + list(range(64))
    prompts = [system, [256] + list(range(100, 108)), system + [7, 8, 9, 10]]
    plain = EngineConfig(model=folder, show_progress=False, max_total_tokens=1024, page_size=4, disable_prefix_cache=True)
    reference = generate(plain, prompts, GREEDY)
    parallel = ParallelConfig(dist_init_addr=free_address(), timeout_s=120, **LAYOUTS["dp2-attention"])
    results = launch(parallel_ranks.generate_with_settings, parallel, parallel, [folder], prompts, [GREEDY] * len(prompts),
                     {"max_running_requests": 1})[folder]
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in reference]
    assert [r["cached_tokens"] for r in results] == [0, 0, 64]  # the first prompt's 16 whole pages
