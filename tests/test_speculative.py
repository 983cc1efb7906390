"""Speculative decoding changes no token: every drafter, every architecture, 1..3 steps, with mixed batches,
chunked prompts, preemption, stops inside an accepted run, and the KV pool back to empty afterwards."""

from __future__ import annotations

import importlib
import logging
import os
import sys

import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.models.make_model import ARCHES
from moeplex.parallel import ParallelConfig
from moeplex.ranks.launcher import launch
from moeplex.sampling import SamplingParams

import parallel_ranks
import script_drafters
from test_parallel import LAYOUTS, free_address

PAGE = 4
PROMPTS = [[256] + list(range(10, 20)) * 3, [256, 5, 6, 7, 5, 6, 7, 5, 6], [256] + list(range(40, 75))]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def script_distribution(tmp_path_factory):
    """The oracle and the adversary, installed through an entry point like any third-party drafter."""
    folder = tmp_path_factory.mktemp("script_dist")
    script_drafters.write_distribution(folder)
    sys.path[:0] = [str(folder), os.path.dirname(__file__)]
    importlib.invalidate_caches()
    yield
    sys.path.remove(str(folder))


def settings(folder: str, **overrides) -> dict:
    """The fixed policy, backoff off unless a test turns it on: these tests count the drafts of every step
    (test_speculative_policy.py runs the adaptive policy)."""
    base = dict(model=folder, dtype="fp32", show_progress=False, max_total_tokens=2048, page_size=PAGE,
                disable_speculative_backoff=True, speculative_policy="fixed")
    return {**base, **overrides}


def run(folder: str, prompts=PROMPTS, params=GREEDY, **overrides):
    engine = Engine(EngineConfig(**settings(folder, **overrides)))
    return engine, engine.generate(prompts, params)


def conserved(engine: Engine) -> bool:
    """Nothing in flight and every page free or held by the (idle) prefix cache."""
    cache = engine.prefix_cache
    cached = cache.num_pages if cache is not None else 0
    idle = cache is None or cache.evictable_pages == cache.num_pages
    return not engine.has_work and idle and engine.kv.num_free_pages + cached == engine.kv.num_pages


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    """Non-speculative greedy outputs of PROMPTS, per architecture."""
    return {arch: [r.output_ids for r in run(tiny_model_dir(arch))[1]] for arch in ARCHES}


def scripted(prompts, outputs):
    script_drafters.set_script([list(p) + list(o) for p, o in zip(prompts, outputs)])


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_ngram_changes_no_token(tiny_model_dir, arch, plain, steps):
    engine, got = run(tiny_model_dir(arch), speculative_algorithm="ngram", speculative_num_steps=steps)
    assert [r.output_ids for r in got] == plain[arch]
    assert sum(r.spec_draft_tokens for r in got) > 0  # the repeated prompts gave it something to draft
    assert conserved(engine)


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_the_oracle_is_always_accepted_and_changes_no_token(tiny_model_dir, plain, script_distribution, steps):
    scripted(PROMPTS, plain["deepseek_v3"])
    engine, got = run(tiny_model_dir("deepseek_v3"), speculative_algorithm="test-oracle", speculative_num_steps=steps)
    assert [r.output_ids for r in got] == plain["deepseek_v3"]
    assert engine.speculation.drafter.context.vocab_size == engine.vocab_size == script_drafters.VOCAB
    for r in got:
        assert r.spec_accept_rate == 1.0
        # the first token comes from the prompt's step; every later step gains steps + 1 (fewer at the end)
        assert r.spec_verify_steps == -(-(GREEDY.max_new_tokens - 2) // (steps + 1))
    assert conserved(engine)


@pytest.mark.parametrize("steps", [1, 3])
def test_the_adversary_is_never_accepted_and_changes_no_token(tiny_model_dir, plain, script_distribution, steps):
    scripted(PROMPTS, plain["qwen3_moe"])
    engine, got = run(tiny_model_dir("qwen3_moe"), speculative_algorithm="test-adversary", speculative_num_steps=steps)
    assert [r.output_ids for r in got] == plain["qwen3_moe"]
    for r in got:
        assert r.spec_accept_rate == 0.0 and r.spec_accept_length == 1.0
        assert r.spec_verify_steps == GREEDY.max_new_tokens - 2  # the last step has no room for a draft
    assert conserved(engine)


def test_draft_ids_outside_the_vocabulary_are_refused_with_one_line(tiny_model_dir, plain, script_distribution,
                                                                      caplog):
    """The drafter's right tokens followed by an id past the vocabulary: none of them is verified (the engine
    used to verify the part before the bad id, silently), output is unchanged, one log line names it."""
    scripted(PROMPTS, plain["qwen3_moe"])
    with caplog.at_level(logging.WARNING, logger="moeplex.speculation.step"):
        engine, got = run(tiny_model_dir("qwen3_moe"), speculative_algorithm="test-oov", speculative_num_steps=3)
    assert [r.output_ids for r in got] == plain["qwen3_moe"]
    assert sum(r.spec_draft_tokens for r in got) == 0
    assert engine.speculation.refused >= len(PROMPTS) * 2
    lines = [r.getMessage() for r in caplog.records if "outside the vocabulary" in r.getMessage()]
    assert len(lines) == 1 and "drafter 'test-oov'" in lines[0] and f"0..{script_drafters.VOCAB - 1}" in lines[0]
    assert conserved(engine)


def test_backoff_pauses_a_drafter_that_keeps_missing(tiny_model_dir, plain, script_distribution):
    """With backoff on (the default) the adversary verifies at output lengths 1 and 2, then pauses 2, 4, 8
    tokens: drafts at lengths 1, 2, 4 and 8 of 12, and the same tokens."""
    scripted(PROMPTS, plain["qwen3_moe"])
    engine, got = run(tiny_model_dir("qwen3_moe"), speculative_algorithm="test-adversary", speculative_num_steps=3,
                      disable_speculative_backoff=False)
    assert [r.output_ids for r in got] == plain["qwen3_moe"]
    assert [r.spec_verify_steps for r in got] == [4] * len(PROMPTS)
    assert conserved(engine)


@pytest.mark.parametrize("drafter", ["ngram", "test-oracle", "test-adversary"])
def test_plain_steps_overlap_between_drafting_steps(tiny_model_dir, plain, script_distribution, drafter):
    """Under the overlap schedule (forced on the CPU), steps that draft first read the token in flight; the
    paused requests' steps overlap. Output is unchanged and every page comes back."""
    scripted(PROMPTS, plain["mixtral"])
    engine, got = run(tiny_model_dir("mixtral"), speculative_algorithm=drafter, speculative_num_steps=2,
                      disable_speculative_backoff=False, overlap_schedule=True)
    assert engine.overlap_schedule
    assert [r.output_ids for r in got] == plain["mixtral"]
    assert all(r.spec_verify_steps > 0 for r in got) or drafter == "ngram"
    assert conserved(engine)


def mixed_oracle_engine(folder: str) -> tuple[Engine, list[list[int]], list[list[int]]]:
    """(an oracle engine whose prompts share steps with decodes, its prompts, their plain greedy outputs)."""
    prompts = PROMPTS + [[256] + list(range(100, 140))]
    overrides = dict(chunked_prefill_size=8, max_batched_tokens=64, mixed_chunk=True)
    want = [r.output_ids for r in run(folder, prompts, **overrides)[1]]
    scripted(prompts, want)
    engine = Engine(EngineConfig(**settings(folder, **overrides, speculative_algorithm="test-oracle", speculative_num_steps=2)))
    return engine, prompts, want


def test_mixed_batches_and_chunked_prompts(tiny_model_dir, script_distribution):
    engine, prompts, want = mixed_oracle_engine(tiny_model_dir("mixtral"))
    requests = [engine.add_request(prompts[0], GREEDY)]
    for prompt in prompts[1:]:  # each arrives while the ones before decode with drafts
        engine.step(), engine.step()
        requests.append(engine.add_request(prompt, GREEDY))
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in requests] == want
    assert all(r.spec_accept_rate == 1.0 for r in requests)
    assert conserved(engine)


def test_mixed_steps_of_an_engine_that_mixes_by_default_draft_nothing(tiny_model_dir, script_distribution):
    """`--mixed-chunk auto` on an engine with decode graphs (plain_mixed_steps): a step that holds a prompt chunk
    beside decodes is a plain mixed step; the steps of decodes alone still draft."""
    engine, prompts, want = mixed_oracle_engine(tiny_model_dir("mixtral"))
    engine.plain_mixed_steps = True  # what auto sets where decode steps replay graphs (a GPU)
    steps = []  # per step: (prompt rows in it, decodes in it, drafts verified)
    prepare = engine.runner.prepare

    def prepared(work, *args, drafts=None, **kwargs):
        decodes = sum(1 for item in work if item.request.output_ids)
        steps.append((len(work) - decodes, decodes, sum(len(d) for d in drafts or ())))
        return prepare(work, *args, drafts=drafts, **kwargs)

    engine.runner.prepare = prepared
    requests = [engine.add_request(prompts[0], GREEDY)]
    for prompt in prompts[1:]:
        engine.step(), engine.step()
        requests.append(engine.add_request(prompt, GREEDY))
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in requests] == want
    mixed = [s for s in steps if s[0] and s[1]]
    assert mixed and not any(drafts for _, _, drafts in mixed)
    assert any(drafts for prompts_in, _, drafts in steps if not prompts_in)
    assert conserved(engine)


def test_preemption_in_the_middle_of_speculation(tiny_model_dir, script_distribution):
    folder = tiny_model_dir("deepseek_v3")
    prompts = [[256] + list(range(k, k + 9)) for k in range(0, 40, 10)]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    want = [r.output_ids for r in run(folder, prompts, params)[1]]
    scripted(prompts, want)
    engine, got = run(folder, prompts, params, max_total_tokens=14 * PAGE, speculative_algorithm="test-oracle",
                      speculative_num_steps=3)
    assert [r.output_ids for r in got] == want
    assert sum(r.num_preemptions for r in got) > 0
    assert conserved(engine)


def test_stop_string_and_stop_token_inside_an_accepted_run(tiny_model_dir, plain, script_distribution):
    folder = tiny_model_dir("deepseek_v3")
    output = plain["deepseek_v3"][0]
    scripted(PROMPTS[:1], [output])
    byte = next(k for k, t in enumerate(output) if k >= 3 and t < 128)  # a one-byte character
    cases = [
        SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop=chr(output[byte])),
        SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[output[6]]),
        SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
    ]
    for params in cases:
        [want] = run(folder, PROMPTS[:1], params)[1]
        engine, [got] = run(folder, PROMPTS[:1], params, speculative_algorithm="test-oracle", speculative_num_steps=3)
        assert (got.output_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.output_ids, want.text, want.finish_reason, want.stop_reason
        )
        assert len(got.output_ids) < 12 and got.spec_verify_steps >= 1
        assert conserved(engine)


def test_rejected_positions_never_enter_the_prefix_cache(tiny_model_dir, plain, script_distribution):
    """The adversary writes a wrong token's KV at every step; a later prompt that reuses the first request's
    cached pages must still get the non-speculative tokens."""
    folder = tiny_model_dir("qwen3_moe")
    output = plain["qwen3_moe"][2]
    scripted(PROMPTS[2:], [output])
    engine, _ = run(folder, PROMPTS[2:], speculative_algorithm="test-adversary", speculative_num_steps=3)
    follow_up = PROMPTS[2] + output[:15]
    [want] = run(folder, [follow_up])[1]
    [got] = engine.generate([follow_up], GREEDY)
    assert got.cached_tokens >= 40 and got.output_ids == want.output_ids
    assert conserved(engine)


def test_logprobs_of_accepted_tokens_equal_non_speculative_ones(tiny_model_dir, plain, script_distribution):
    folder = tiny_model_dir("deepseek_v3")
    scripted(PROMPTS, plain["deepseek_v3"])
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    want = run(folder, PROMPTS, params)[1]
    got = run(folder, PROMPTS, params, speculative_algorithm="test-oracle", speculative_num_steps=3)[1]
    for ours, ref in zip(got, want):
        assert len(ours.logprobs) == len(ref.logprobs) == 12
        for a, b in zip(ours.logprobs, ref.logprobs):
            assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-4
            assert [t for t, _ in a["top_logprobs"]] == [t for t, _ in b["top_logprobs"]]


def test_a_seed_reproduces_sampled_speculative_output(tiny_model_dir):
    folder = tiny_model_dir("mixtral")
    seeded = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, seed=11, ignore_eos=True)
    other = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)
    spec = dict(speculative_algorithm="ngram", speculative_num_steps=2)
    [alone] = run(folder, PROMPTS[:1], seeded, **spec)[1]
    engine, together = run(folder, PROMPTS, [seeded, other, other], **spec)
    assert together[0].output_ids == alone.output_ids
    assert conserved(engine)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "dp2-attention"])
def test_ngram_over_ranks_changes_no_token(tiny_model_dir, layout):
    """tp2 with experts over 2 ranks (the naive all-to-all), and 2 DP attention groups (each drafts for its
    own requests; a step is an extend on every rank when any rank verifies drafts)."""
    folder = tiny_model_dir("deepseek_v3")
    single = {f: [r.output_ids for r in run(f, PROMPTS)[1]] for f in [folder]}
    parallel = ParallelConfig(dist_init_addr=free_address(), timeout_s=120, **LAYOUTS[layout])
    spec = {"speculative_algorithm": "ngram", "speculative_num_steps": 2, "dtype": "fp32"}
    results = launch(parallel_ranks.generate_with_settings, parallel, parallel, [folder], PROMPTS,
                     [GREEDY] * len(PROMPTS), spec)
    assert [r["output_ids"] for r in results[folder]] == single[folder]


@pytest.mark.parametrize("drafter", ["test-oracle", "test-adversary"])
def test_verify_as_decode_rows_changes_no_token(tiny_model_dir, plain, script_distribution, drafter):
    """The GPU's form of a verify step (one decode row per request and draft, as with triton attention and
    CUDA graphs), here through the torch backend's paged decode, with a prompt chunk sharing some steps."""
    folder = tiny_model_dir("deepseek_v3")
    scripted(PROMPTS, plain["deepseek_v3"])
    engine = Engine(EngineConfig(**settings(folder, speculative_algorithm=drafter, speculative_num_steps=3,
                                            chunked_prefill_size=8, mixed_chunk=True)))
    engine.speculation.decode_rows = True
    verify_forward, shared = engine.runner.verify_forward, []

    def counted(batch, rows, with_hidden):  # verify steps whose prompt tokens ran as decode rows too
        shared.append(batch.sample_rows is not None and batch.batch_size == batch.num_tokens)
        return verify_forward(batch, rows, with_hidden)

    engine.runner.verify_forward = counted
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    for _ in range(3):
        engine.step()
    requests.append(engine.add_request(PROMPTS[2], GREEDY))  # its chunks share steps with verify rows
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in requests] == plain["deepseek_v3"]
    assert conserved(engine)
    assert any(shared)  # (ModelRunner.verify_rows: the prompt's chunks of 8 read few enough cached tokens)


PENALIZED = [
    SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=1.2, presence_penalty=0.4),
    SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.6, logit_bias={"12": 3}),
    SamplingParams(max_new_tokens=12, temperature=0.0, min_tokens=5, stop_token_ids=[41]),
]


@pytest.mark.parametrize("drafter", ["test-oracle", "ngram"])
def test_penalties_and_biases_change_no_token_under_speculation(tiny_model_dir, script_distribution, drafter):
    """Each verify row is penalized as if its drafts had been generated: the accepted tokens are plain decoding's."""
    folder = tiny_model_dir("qwen3_moe")
    _, plain_runs = run(folder, params=PENALIZED)
    plain_ids = [r.output_ids for r in plain_runs]
    scripted(PROMPTS, plain_ids)
    engine, got = run(folder, params=PENALIZED, speculative_algorithm=drafter, speculative_num_steps=3)
    assert [r.output_ids for r in got] == plain_ids
    if drafter == "test-oracle":
        assert all(r.spec_accept_rate == 1.0 for r in got)
    assert engine.sampler.adjuster.slots == {} and conserved(engine)
