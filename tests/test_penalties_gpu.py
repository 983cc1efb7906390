"""Penalties, biases and min_tokens on the GPU under CUDA graphs and the overlap schedule: the same tokens as an
eager step-by-step engine on the same device, and requests without any keep their output."""

from __future__ import annotations

import pytest
import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[256] + list(b"the the the cat sat on"), [256] + list(b"ab ab ab ab"), [256] + list(b"Mixture")]
PENALIZED = [
    SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.8, logit_bias={"65": 4}),
    SamplingParams(max_new_tokens=16, temperature=0.0, min_tokens=6, allowed_token_ids=list(range(60, 90)) + [257]),
    SamplingParams(max_new_tokens=16, temperature=0.8, seed=5, frequency_penalty=0.8, ignore_eos=True),
]
PLAIN = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def run(folder: str, graphs: bool, overlap: bool):
    engine = Engine(EngineConfig(model=folder, device="cuda", dtype="fp32", show_progress=False, max_total_tokens=4096,
                                 page_size=4, disable_cuda_graph=not graphs, overlap_schedule=overlap))
    prompts = [PROMPTS[i % 3] for i in range(2 * len(PENALIZED))]
    params = [p for pair in zip(PENALIZED, [PLAIN] * len(PENALIZED)) for p in pair]
    out = [r.output_ids for r in engine.generate(prompts, params)]
    alone = [r.output_ids for r in engine.generate(PROMPTS, PLAIN)]
    assert engine.sampler.adjuster.slots == {}
    return out, alone, engine


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_penalties_under_graphs_and_the_overlap_schedule(tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    eager, alone, _ = run(folder, graphs=False, overlap=False)
    fast, _, engine = run(folder, graphs=True, overlap=True)
    assert engine.runner.graphs is not None and engine.overlap_schedule
    assert fast == eager
    for i in range(len(PENALIZED)):
        assert fast[2 * i + 1] == alone[(2 * i + 1) % 3]  # the neighbour without penalties is unchanged
    assert all(60 <= t < 90 or t == 257 for t in fast[4])  # allowed_token_ids
    assert torch.cuda.is_available()
