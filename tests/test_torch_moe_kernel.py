"""The `torch` MoE kernel's standard layout (pairs sorted by expert once, grouped GEMMs) equals the
per-expert loop it replaced, and both equal every pair written out in fp64: on the conformance
routings (ids of -1, idle experts, one expert taking everything, no tokens), at decode and prefill
sizes, in each dtype, and on CPU through each way cpu_experts.py measures (`torch._grouped_mm`, oneDNN
per-expert linears, rows padded per expert into batched matmuls, every expert on every token) and the loop
other devices take; and that the choice between them is measured once per shape."""


import pytest
import torch
import torch.nn.functional as F

from moeplex.conformance.routing import ROUTINGS, make_hidden, make_routing
from moeplex.interfaces import ExpertWeights, MoEContext, StandardLayout
from moeplex.plugins.moe_kernels import cpu_experts, torch_ref
from moeplex.plugins.moe_kernels.torch_ref import TorchMoEKernel

HIDDEN, INTERMEDIATE = 64, 32
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def per_pair_reference(hidden, topk_ids, topk_weights, w13, w2):
    """sum over a token's pairs of weight * expert(token), each pair on its own, in fp64."""
    out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=torch.float64)
    for t, k in (topk_ids >= 0).nonzero().tolist():
        e = topk_ids[t, k]
        gate, up = F.linear(hidden[t].double(), w13[e].double()).chunk(2)
        out[t] += topk_weights[t, k].double() * F.linear(F.silu(gate) * up, w2[e].double())
    return out


def per_expert_loop(hidden, topk_ids, topk_weights, w13, w2):
    """The kernel's former standard path: one small GEMM pair per expert that received tokens."""
    out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=torch.float32)
    for expert in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        token, k = (topk_ids == expert).nonzero(as_tuple=True)
        y = torch_ref._expert(hidden[token], (w13, w2), expert).float() * topk_weights[token, k, None].float()
        out.index_add_(0, token, y)
    return out.to(hidden.dtype)


def case(routing, tokens, experts, top_k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * INTERMEDIATE, HIDDEN, generator=gen) * HIDDEN**-0.5).to(dtype)
    w2 = (torch.randn(experts, HIDDEN, INTERMEDIATE, generator=gen) * INTERMEDIATE**-0.5).to(dtype)
    route = make_routing(routing, tokens, experts, top_k, seed)
    return make_hidden(tokens, HIDDEN, seed).to(dtype), route, w13, w2


ONEDNN_BF16 = cpu_experts.onednn_runs(torch.bfloat16)
ALL_WAYS = ("grouped_mm", "onednn", "padded_bmm", "every_expert", "streamed", "streamed_tiles", "loop")
PATHS = [(dtype, way) for dtype in (torch.float32, torch.bfloat16) for way in ALL_WAYS]


@pytest.mark.parametrize("dtype,path", PATHS, ids=[f"{str(d).removeprefix('torch.')}-{p}" for d, p in PATHS])
@pytest.mark.parametrize(
    "routing,tokens,experts,top_k",
    [(name, 48, 16, 4) for name in ROUTINGS] + [("random", 0, 8, 2), ("random", 1, 8, 1), ("random", 120, 32, 8)],
)
def test_standard_layout_matches_the_loop_and_every_pair(routing, tokens, experts, top_k, dtype, path):
    """Each way, forced, on every conformance routing (the measured choice only picks among them)."""
    hidden, route, w13, w2 = case(routing, tokens, experts, top_k, dtype)
    streamed = cpu_experts.streams(w13, w2)
    tiles = streamed and dtype == torch.bfloat16 and cpu_experts.streams_on_tiles(cpu_experts.pack_for_streaming(w13, w2))
    if path not in cpu_experts.ways_for(dtype, streamed=streamed, tiles=tiles) + ("loop",):
        pytest.skip(f"{path} is not a way for {dtype} on this processor (oneDNN: {cpu_experts.onednn_runs(dtype)}, "
                    f"C++ kernel: {cpu_experts.streams(w13, w2)})")
    layout = StandardLayout(hidden, route.topk_ids, route.topk_weights, experts)
    ctx = MoEContext(HIDDEN, INTERMEDIATE, experts, top_k, dtype, torch.device("cpu"))
    kernel = TorchMoEKernel(ctx)
    if path == "loop":  # the loop over experts that GPUs (and activations in another dtype) take
        result = kernel.apply(layout, (w13, w2))
    else:
        forced = cpu_experts.Choice((1,), (path,))
        result = kernel.apply(layout, cpu_experts.CpuExperts(w13, w2, top_k, forced))
    assert result.weights_applied and result.summed and result.hidden.dtype == dtype
    reference = per_pair_reference(hidden, route.topk_ids, route.topk_weights, w13, w2)
    assert result.hidden.shape == reference.shape
    scale = max(reference.abs().max().item() if tokens else 0.0, 1.0)
    torch.testing.assert_close(result.hidden.double(), reference, rtol=0, atol=TOLERANCE[dtype] * scale)
    former = per_expert_loop(hidden, route.topk_ids, route.topk_weights, w13, w2)
    torch.testing.assert_close(result.hidden, former, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * scale)


def test_padded_bmm_falls_back_when_one_expert_is_crowded():
    """16 experts padded to 185 rows each for 200 rows would be 15x the work: the grouped GEMMs run instead."""
    _, _, w13, w2 = case("random", 4, 16, 4, torch.float32)
    x = torch.randn(200, HIDDEN)
    counts = [185] + [1] * 15
    torch.testing.assert_close(cpu_experts.padded_bmm(x, counts, (w13, w2)), cpu_experts.grouped_mm(x, counts, (w13, w2)))


@pytest.mark.skipif(not cpu_experts.onednn_runs(torch.float16), reason="every_expert runs fp16 where oneDNN does")
def test_every_expert_ignores_an_expert_that_overflows_for_tokens_that_did_not_pick_it():
    """Every expert runs on every token: one that overflows fp16 (inf) for a token that did not pick it must
    add nothing to that token (inf x 0 would be NaN), as the sorted path never computes it."""
    hidden, route, w13, w2 = case("random", 12, 8, 2, torch.float16)
    w13[0] *= 4096  # expert 0 overflows on any row; no token picks it
    topk_ids = torch.where(route.topk_ids == 0, 1 + route.topk_ids.max() % 7, route.topk_ids)
    topk_ids[:, 1] = torch.where(topk_ids[:, 0] == topk_ids[:, 1], 1 + topk_ids[:, 0] % 7, topk_ids[:, 1])
    experts = cpu_experts.CpuExperts(w13, w2, 2, cpu_experts.Choice((1,), ("every_expert",)))
    out = experts.run(hidden, topk_ids, route.topk_weights)
    assert torch.isfinite(out).all()
    reference = per_pair_reference(hidden, topk_ids, route.topk_weights, w13, w2)
    scale = max(reference.abs().max().item(), 1.0)
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=TOLERANCE[torch.bfloat16] * scale)


def fresh_store(monkeypatch, tmp_path) -> None:
    """Nothing measured yet on this 'machine': choices kept in a file of the test's own."""
    from moeplex.kernels.cpu import MeasuredChoices

    store = MeasuredChoices(str(tmp_path / "cpu_choices.json"))
    monkeypatch.setattr(cpu_experts, "measured_choice", store.get)


def test_the_choice_is_measured_once_per_shape_and_the_fastest_way_is_kept(monkeypatch, tmp_path):
    """prepare_weights times each way the dtype allows at three sizes and keeps the fastest per size; the
    next layer of the same shape, in this engine's kernel or another's, reuses the choice (no second
    measurement; another process would read it from the file), another shape is measured."""
    ctx = MoEContext(HIDDEN, INTERMEDIATE, 16, 4, torch.float32, torch.device("cpu"))
    kernel = TorchMoEKernel(ctx)
    calls, now = [], [0.0]
    real_run = cpu_experts.CpuExperts.run

    def timed(self, hidden, topk_ids, topk_weights, way=None):
        calls.append((hidden.shape[0], way))
        # the measurement's clock: onednn costs 2 ms at the smallest size, grouped_mm everywhere else, the C++
        # kernel 3 ms everywhere (so the choice below is among the other two)
        slower = "onednn" if hidden.shape[0] == self.sizes()[0] else "grouped_mm"
        now[0] += 0.003 if way == "streamed" else 0.002 if way == slower else 0.001
        return real_run(self, hidden, topk_ids, topk_weights, way)

    monkeypatch.setattr(cpu_experts.CpuExperts, "run", timed)
    monkeypatch.setattr(cpu_experts, "measuring_clock", lambda: lambda: now[0])
    fresh_store(monkeypatch, tmp_path)
    _, _, w13, w2 = case("random", 4, 16, 4, torch.float32)
    first = kernel.prepare_weights(ExpertWeights(w13, w2))
    timed_ways = set(cpu_experts.ways_for(torch.float32, streamed=cpu_experts.streams(w13, w2)))
    if not cpu_experts.onednn_runs(torch.float32):
        assert first.choice.ways == ("grouped_mm",) * 3 and len(calls) == (0 if len(timed_ways) == 1 else 24)
        return
    sizes = first.sizes()
    assert first.choice.sizes == sizes == (2, 16, 128)
    assert first.choice.ways == ("grouped_mm", "onednn", "onednn")
    assert {way for _, way in calls} == timed_ways and {t for t, _ in calls} == set(sizes)
    measured = len(calls)
    second = TorchMoEKernel(ctx).prepare_weights(ExpertWeights(w13.clone(), w2.clone()))
    assert second.choice == first.choice and len(calls) == measured
    other = kernel.prepare_weights(ExpertWeights(w13[:8].clone(), w2[:8].clone()))
    assert len(calls) > measured and other.choice.sizes == (1, 8, 64)
    assert first.choice.way(1) == "grouped_mm" and first.choice.way(20) == "onednn" and first.choice.way(4000) == "onednn"


def test_gpu_style_weights_and_mixed_dtypes_take_the_loop():
    """Weights on another device than CPU are not measured; activations in another dtype than the weights
    take the loop (which casts the weights), with the same result."""
    hidden, route, w13, w2 = case("random", 24, 16, 4, torch.float32)
    kernel = TorchMoEKernel(MoEContext(HIDDEN, INTERMEDIATE, 16, 4, torch.float32, torch.device("cpu")))
    prepared = kernel.prepare_weights(ExpertWeights(w13, w2))
    assert isinstance(prepared, cpu_experts.CpuExperts) and prepared[0] is w13 and prepared[1] is w2
    layout = StandardLayout(hidden.double(), route.topk_ids, route.topk_weights, 16)
    out = kernel.apply(layout, prepared).hidden
    assert out.dtype == torch.float64 and not prepared.takes(hidden.double())
    reference = per_pair_reference(hidden, route.topk_ids, route.topk_weights, w13, w2)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5 * max(reference.abs().max().item(), 1.0))


def test_no_packed_copy_where_host_memory_is_short(monkeypatch, tmp_path):
    """When a packed copy of the layer would not fit, only the ways that need none are timed and nothing is packed."""
    monkeypatch.setattr(cpu_experts, "packed_copy_fits", lambda nbytes: False)
    fresh_store(monkeypatch, tmp_path)
    _, _, w13, w2 = case("random", 4, 16, 4, torch.float32)
    experts = TorchMoEKernel(MoEContext(HIDDEN, INTERMEDIATE, 16, 4, torch.float32, torch.device("cpu"))).prepare_weights(
        ExpertWeights(w13, w2)
    )
    assert set(experts.choice.ways) == {"grouped_mm"} and not experts._packed
    assert set(cpu_experts.ways_for(torch.bfloat16, may_pack=False)) <= {"grouped_mm", "padded_bmm"}
