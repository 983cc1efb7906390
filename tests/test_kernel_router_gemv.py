"""`route_small_batch` equals `Router`: gate GEMV, scores and top-k of a small batch in one Triton launch.

The ids must be the torch router's; the weights agree within float error (the GEMV sums in another
order than torch's linear). Without CUDA the kernel runs under Triton's interpreter (fp32, fp16).
"""

import pytest
import torch

from moeplex.kernels import router_gemv
from moeplex.kernels.router_gemv import MAX_TOKENS, _router_kernel, fits, new_counter, route_small_batch
from moeplex.moe.router import Router, RouterSpec
from test_kernel_topk import SPECS, assert_same_routing, routing_case
from triton_guard import DEVICE, skip_unless_runnable

skip_unless_runnable(_router_kernel)


@pytest.fixture(autouse=True)
def few_programs(monkeypatch):
    """Several experts a program: the interpreter runs programs one after another."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(router_gemv, "TARGET_PROGRAMS", 8)


def check(spec: RouterSpec, num_tokens: int, dtype=torch.float32, seed: int = 0, device=DEVICE):
    router, hidden, _ = routing_case(spec, num_tokens, device, seed)
    hidden = hidden.to(dtype)
    counter = new_counter(device)
    want = router(hidden)
    for _ in range(2):  # the counter is back at zero for the next launch
        got = route_small_batch(hidden, router.weight, spec, counter, getattr(router, "e_score_correction_bias", None))
        assert got[0].shape == got[1].shape == (num_tokens, spec.top_k)
        assert_same_routing(got, want)
        assert counter.item() == 0


@pytest.mark.parametrize("num_tokens", [1, 3, MAX_TOKENS])
@pytest.mark.parametrize("name", SPECS)
def test_equals_router(name, num_tokens):
    check(SPECS[name], num_tokens)


def test_one_expert_a_program(monkeypatch):
    monkeypatch.setattr(router_gemv, "TARGET_PROGRAMS", 256)
    check(SPECS["qwen1.5-60-experts"], 2)


@pytest.mark.parametrize("warps", [1, 2, 8])
def test_any_warp_count_routes_alike(monkeypatch, warps):
    """benchmarks/e2e_gpu.py --router-warps times other warp counts (on a GPU the top-k's reductions then span
    fewer warps); the routing must not change."""
    monkeypatch.setattr(router_gemv, "NUM_WARPS", warps)
    check(SPECS["qwen3"], 3)
    check(SPECS["deepseek-v3"], 1)


def test_every_token_block_has_a_warp_count_and_the_override_wins(monkeypatch):
    """Launches of 1..MAX_TOKENS tokens take the warps measured for their block (results/router_warps_h100.md); a
    block without an entry would fail at the launch, not here."""
    blocks = {1 << (tokens - 1).bit_length() for tokens in range(1, MAX_TOKENS + 1)}
    assert blocks == set(router_gemv.WARPS_BY_TOKENS)
    assert all(router_gemv.warps_for(block) in (1, 2, 4, 8) for block in blocks)
    assert router_gemv.warps_for(1) == 1 and router_gemv.warps_for(8) == 4  # one warp made batch 8 14% slower
    monkeypatch.setattr(router_gemv, "NUM_WARPS", 2)
    assert {router_gemv.warps_for(block) for block in blocks} == {2}


def test_fp16_hidden_is_upcast_as_the_router_does():
    check(SPECS["qwen3"], 2, torch.float16)


def test_router_module_takes_the_one_launch_path_for_small_batches():
    spec = SPECS["deepseek-v3"]
    router, hidden, _ = routing_case(spec, 4, DEVICE)
    want = router(hidden)
    router.fused = router.fewer_launches = True
    assert_same_routing(router(hidden), want)
    assert_same_routing(router(torch.cat([hidden] * 5)), tuple(torch.cat([t] * 5) for t in want))  # 20 rows: route_topk


def test_batches_it_does_not_take_are_refused():
    assert not fits(0) and fits(1) and fits(MAX_TOKENS) and not fits(MAX_TOKENS + 1)
    spec = SPECS["mixtral"]
    router, hidden, _ = routing_case(spec, MAX_TOKENS + 1, DEVICE)
    with pytest.raises(ValueError, match="tokens"):
        route_small_batch(hidden, router.weight, spec, new_counter(DEVICE))
    with pytest.raises(ValueError, match="gate weight"):
        route_small_batch(hidden[:2], router.weight[:, :4], spec, new_counter(DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, MAX_TOKENS])
@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3"])
def test_serving_shapes_on_the_gpu(name, num_tokens):
    spec = SPECS[name]
    width = 2048 if name == "qwen3" else 7168
    gen = torch.Generator().manual_seed(3)
    router = Router(width, spec)
    router.weight.data = torch.randn(spec.num_experts, width, generator=gen) / width**0.5
    if spec.correction_bias:
        router.e_score_correction_bias.data = torch.randn(spec.num_experts, generator=gen) * 0.1
    router.to("cuda")
    hidden = torch.randn(num_tokens, width, generator=gen).to("cuda", torch.bfloat16)
    counter = new_counter("cuda")
    for _ in range(3):
        got = route_small_batch(hidden, router.weight, spec, counter, getattr(router, "e_score_correction_bias", None))
        assert_same_routing(got, router(hidden))
    assert counter.item() == 0
