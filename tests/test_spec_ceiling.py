"""benchmarks/spec_ceiling.py's model of a step's reads: its weight bytes are transformers' DeepseekV3 parameters,
and its distinct experts a step are what our router picks over random rows."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from spec_ceiling import BYTES, StepBytes, reads, v3_config  # noqa: E402

from moeplex.models.deepseek_v3 import router_spec  # noqa: E402
from moeplex.moe.router import Router  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402


def test_weight_bytes_are_transformers_parameters():
    """DeepSeek-V3's full shapes at 4 layers, built on the meta device (no memory): each part the model counts
    equals the parameters transformers' layer holds (norms and the router's gate aside, under 0.1% of a layer)."""
    config = v3_config(4, 16)
    with torch.device("meta"):
        model = hf.DeepseekV3ForCausalLM(hf.DeepseekV3Config(**config))
    parts = StepBytes(config, context=0)

    def size(module) -> int:
        return BYTES * sum(p.numel() for name, p in module.named_parameters() if "norm" not in name)

    dense, moe = model.model.layers[0], model.model.layers[config["first_k_dense_replace"]]
    assert size(dense.self_attn) == parts.attention
    assert size(dense.mlp) == parts.dense
    assert size(moe.mlp.shared_experts) == parts.shared
    assert size(moe.mlp.experts) == parts.experts * parts.expert
    assert size(model.lm_head) == parts.lm_head
    assert reads(parts.target(1)) == pytest.approx(
        sum(size(layer.self_attn) for layer in model.model.layers) + size(model.lm_head) + size(dense.mlp)
        * parts.dense_layers + parts.moe_layers * (parts.shared + parts.top_k * parts.expert))


@pytest.mark.parametrize("experts", [16, 256])
@pytest.mark.parametrize("rows", [1, 4, 32])
def test_distinct_experts_match_the_router_over_random_rows(experts, rows):
    """Group-limited top-8 (8 groups, 4 kept) over rows of random hidden states and a random gate: the mean count
    of experts a step's rows pick is the model's E * (1 - (1 - k/E)^rows), within 3%."""
    config = v3_config(4, experts)
    spec = router_spec(config)
    router = Router(64, spec)
    gen = torch.Generator().manual_seed(experts + rows)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    trials = 400
    ids, _ = router(torch.randn(trials * rows, 64, generator=gen))
    picked = torch.zeros(trials, experts, dtype=torch.bool)
    picked.scatter_(1, ids.view(trials, rows * spec.top_k), True)
    measured = picked.sum(1).float().mean().item()
    assert measured == pytest.approx(StepBytes(config, context=0).distinct_experts(rows), rel=0.03)
