"""Prompt logprobs equal those of one full-prompt forward of Hugging Face transformers, whether the prompt is
computed in one step or in chunks, with part of it in the prefix cache, and over two tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.parallel import ParallelConfig
from moeplex.ranks.offline import generate
from moeplex.sampling import SamplingParams

from test_parallel import free_address

transformers = pytest.importorskip("transformers")

PROMPT = [256] + list(b"prompt logprobs for every position")
ENGINE = dict(dtype="fp32", show_progress=False, max_total_tokens=1024, page_size=4)


def reference(folder: str, prompt: list[int], top: int) -> list[tuple[float, list[int]]]:
    """Per position from 1: the prompt token's logprob and the ids of the top-K, from transformers."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    return [(float(logprobs[q - 1, prompt[q]]), torch.topk(logprobs[q - 1], top).indices.tolist())
            for q in range(1, len(prompt))]


def check(got: list, want: list, start: int) -> None:
    assert len(got) == len(PROMPT)
    for q in range(len(PROMPT)):
        if q < max(start, 1):
            assert got[q] is None
            continue
        logprob, top = want[q - 1]
        assert got[q]["token_id"] == PROMPT[q]
        assert got[q]["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert [t for t, _ in got[q]["top_logprobs"]] == top


@pytest.mark.parametrize("chunk", [4096, 8], ids=["one-step", "chunked"])
def test_prompt_logprobs_equal_a_full_forward(tiny_model_dir, arch, chunk):
    folder = tiny_model_dir(arch)
    engine = Engine(EngineConfig(model=folder, chunked_prefill_size=chunk, **ENGINE))
    params = SamplingParams(max_new_tokens=2, temperature=0.0, prompt_logprobs=3)
    [request] = engine.generate([PROMPT], params)
    check(request.prompt_logprobs, reference(folder, PROMPT, 3), 0)


def test_a_cached_prefix_is_reused_only_before_the_first_position_asked_for(tiny_model_dir):
    folder = tiny_model_dir("deepseek_v3")
    engine = Engine(EngineConfig(model=folder, **ENGINE))
    engine.generate([PROMPT], SamplingParams(max_new_tokens=1, temperature=0.0))  # the whole prompt is cached now
    want = reference(folder, PROMPT, 2)
    [whole] = engine.generate([PROMPT], SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=2))
    assert whole.cached_tokens == 0  # every position asked for: nothing may come from the cache
    check(whole.prompt_logprobs, want, 0)
    late = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=2, prompt_logprobs_start=17)
    [tail] = engine.generate([PROMPT], late)
    assert tail.cached_tokens == 16  # the pages before position 16 (page size 4)
    check(tail.prompt_logprobs, want, 17)
    [plain] = engine.generate([PROMPT], SamplingParams(max_new_tokens=1, temperature=0.0))
    assert plain.cached_tokens == len(PROMPT) - 1 - (len(PROMPT) - 1) % 4 and plain.prompt_logprobs is None


@pytest.mark.slow
def test_prompt_logprobs_over_two_tensor_parallel_ranks(tiny_model_dir):
    folder = tiny_model_dir("qwen3_moe")
    parallel = ParallelConfig(tp_size=2, dist_init_addr=free_address())
    params = SamplingParams(max_new_tokens=2, temperature=0.0, prompt_logprobs=3)
    [result] = generate(EngineConfig(model=folder, parallel=parallel, chunked_prefill_size=8, **ENGINE), [PROMPT], params)
    check(result["prompt_logprobs"], reference(folder, PROMPT, 3), 0)
