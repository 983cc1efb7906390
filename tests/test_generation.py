"""End-to-end generation through the engine against transformers, and batching invariance."""

from __future__ import annotations

import random

import pytest
import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)


ENGINE_DEFAULTS = dict(dtype="fp32", show_progress=False, max_total_tokens=4096, page_size=4)


@pytest.fixture(autouse=True, params=[False, True], ids=["sequential", "overlap-schedule"])
def overlap_schedule(request, monkeypatch):
    """Every test here runs twice: each step read before the next is scheduled, and the overlap schedule."""
    monkeypatch.setitem(ENGINE_DEFAULTS, "overlap_schedule", request.param)
    return request.param


def make_engine(folder: str, **overrides) -> Engine:
    return Engine(EngineConfig(model=folder, **{**ENGINE_DEFAULTS, **overrides}))


def hf_greedy(folder: str, prompt: list[int], new_tokens: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=258)
    return out[0, len(prompt) :].tolist()


def test_greedy_generation_equals_transformers(tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    prompt = [256] + list(b"Mixture of experts, routed")
    engine = make_engine(folder)
    [request] = engine.generate([prompt], GREEDY)
    assert request.output_ids == hf_greedy(folder, prompt, 32)
    assert engine.flush_cache() and engine.kv.num_free_pages == engine.kv.num_pages


def _mixed_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[256] + [rng.randrange(256) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


@pytest.mark.parametrize("mixed_chunk", [True, False], ids=["mixed-steps", "separate-prefill-steps"])
def test_output_is_identical_alone_and_in_a_batch_of_16(tiny_model_dir, mixed_chunk):
    folder = tiny_model_dir("deepseek_v3")
    prompts = _mixed_prompts(16)
    params = [SamplingParams(max_new_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(16)]
    alone = [make_engine(folder).generate([p], sp)[0].output_ids for p, sp in zip(prompts[:4], params[:4])]
    engine = make_engine(folder, chunked_prefill_size=16, max_batched_tokens=64, mixed_chunk=mixed_chunk)
    assert engine.scheduler.mixed is mixed_chunk
    batched = engine.generate(prompts, params)
    assert [r.output_ids for r in batched[:4]] == alone
    assert [len(r.output_ids) for r in batched] == [sp.max_new_tokens for sp in params]


def test_preempted_requests_resume_with_identical_output(tiny_model_dir):
    folder = tiny_model_dir("qwen3_moe")
    prompts = _mixed_prompts(16, seed=1)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = make_engine(folder).generate(prompts, params)
    # 16 pages of 4 tokens cannot hold 16 requests of up to 64 tokens: preemption must happen
    tight = make_engine(folder, max_total_tokens=64 + 64, page_size=4)
    results = tight.generate(prompts, params)
    assert sum(r.num_preemptions for r in results) > 0
    assert [r.output_ids for r in results] == [r.output_ids for r in roomy]
    assert tight.flush_cache() and tight.kv.num_free_pages == tight.kv.num_pages


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model_dir):
    folder = tiny_model_dir("mixtral")
    prompts = _mixed_prompts(6, seed=2)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = make_engine(folder).generate([prompts[0]], params)[0].output_ids
    batched = make_engine(folder).generate(prompts, params)
    assert batched[0].output_ids == alone
    assert len({tuple(r.output_ids) for r in batched}) > 1


def test_stop_conditions(tiny_model_dir):
    folder = tiny_model_dir("deepseek_v3")
    engine = make_engine(folder)
    prompt = [256] + list(b"stop here")
    free = engine.generate([prompt], GREEDY)[0]
    stop_token = free.output_ids[5]
    by_token = engine.generate([prompt], SamplingParams(max_new_tokens=32, temperature=0.0, stop_token_ids=[stop_token]))[0]
    assert by_token.finish_reason.value == "stop"
    assert by_token.output_ids == free.output_ids[: free.output_ids.index(stop_token) + 1]
    stop_text = free.text[3:5]
    by_text = engine.generate([prompt], SamplingParams(max_new_tokens=32, temperature=0.0, stop=[stop_text]))[0]
    assert by_text.finish_reason.value == "stop" and by_text.stop_reason == stop_text
    assert by_text.text == free.text[: free.text.find(stop_text)]
    eos = engine.eos_ids.pop()
    engine.eos_ids.add(stop_token)
    by_eos = engine.generate([prompt], SamplingParams(max_new_tokens=32, temperature=0.0))[0]
    assert by_eos.output_ids[-1] == stop_token and by_eos.finish_reason.value == "stop"
    assert eos not in engine.eos_ids


def test_abort_frees_the_cache(tiny_model_dir):
    engine = make_engine(tiny_model_dir("deepseek_v3"))
    requests = [engine.add_request(p, GREEDY) for p in _mixed_prompts(4, seed=3)]
    engine.step()
    engine.abort(requests[1].rid)
    while engine.has_work:
        engine.step()
    assert requests[1].finish_reason.value == "abort"
    assert all(r.finish_reason.value == "length" for r in requests[:1] + requests[2:])
    assert engine.flush_cache() and engine.kv.num_free_pages == engine.kv.num_pages


def test_bad_prompts_are_refused(tiny_model_dir):
    engine = make_engine(tiny_model_dir("deepseek_v3"))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 99999], GREEDY)
    with pytest.raises(ValueError, match="KV cache holds at most"):
        engine.add_request(list(range(100)) * 50, GREEDY)


def count_forwards(engine: Engine) -> list[int]:
    """A list that grows by one entry (the batch size) per forward pass the engine launches."""
    calls, forward = [], engine.runner.forward

    def counted(batch):
        calls.append(batch.batch_size)
        return forward(batch)

    engine.runner.forward = counted
    return calls


def test_the_overlap_schedule_wastes_no_step_on_length_and_one_row_on_a_stop(tiny_model_dir, overlap_schedule):
    folder = tiny_model_dir("qwen3_moe")
    engine = make_engine(folder)
    calls = count_forwards(engine)
    prompts = _mixed_prompts(3, seed=4)
    free = engine.generate(prompts, [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 6, 9)])
    assert len(calls) == 9 and calls[3:] == [2, 2, 2, 1, 1, 1]  # one prefill step, then one decode per token
    calls.clear()
    stop = free[2].output_ids[4]
    [stopped] = engine.generate([prompts[2]], SamplingParams(max_new_tokens=9, temperature=0.0, stop_token_ids=[stop]))
    assert stopped.output_ids == free[2].output_ids[: free[2].output_ids.index(stop) + 1]
    # the step after the stop was launched before its token was read: one row of wasted work
    assert len(calls) == len(stopped.output_ids) + overlap_schedule
    assert not engine.has_work and engine.flush_cache() and engine.kv.num_free_pages == engine.kv.num_pages


def test_the_overlap_schedule_is_on_by_default_on_cuda_whatever_the_ranks():
    """Several ranks run it too (tests/test_cuda_graph_parallel.py runs it over gloo ranks)."""
    from moeplex.engine import _overlap_schedule

    assert _overlap_schedule(EngineConfig(model="unused"), torch.device("cuda"))
    assert _overlap_schedule(EngineConfig(model="unused", overlap_schedule=True), torch.device("cpu"))
    assert not _overlap_schedule(EngineConfig(model="unused"), torch.device("cpu"))
    assert not _overlap_schedule(EngineConfig(model="unused", overlap_schedule=False), torch.device("cuda"))


def test_one_request_cannot_fail_its_batch(tiny_model_dir):
    """Degenerate but valid sampling values run as greedy, and a row whose logits turn non-finite ends its
    own request with a reason while the others finish exactly as they would have alone."""
    folder = tiny_model_dir("deepseek_v3")
    prompts = _mixed_prompts(4, seed=5)
    degenerate = [SamplingParams(max_new_tokens=10, ignore_eos=True, **kw)
                  for kw in ({"temperature": 1e-40}, {"temperature": 5e-324}, {"top_p": 1e-50, "seed": 3})]
    alone = [r.output_ids[:10] for r in make_engine(folder).generate(prompts[1:], GREEDY)]
    engine = make_engine(folder)
    first, forward = [True], engine.runner.forward

    def poisoned(batch):  # the first step's row 0 (prompts[0]) comes back as NaN
        logits = forward(batch)
        if first.pop() if first else False:
            logits = logits.clone()
            logits[0] = float("nan")
        return logits

    engine.runner.forward = poisoned
    results = engine.generate(prompts, [GREEDY] + degenerate)
    assert results[0].finish_reason.value == "abort" and "not finite" in results[0].error
    assert [r.output_ids for r in results[1:]] == alone
    assert [r.finish_reason.value for r in results[1:]] == ["length"] * 3
    assert not engine.has_work and engine.flush_cache() and engine.kv.num_free_pages == engine.kv.num_pages
