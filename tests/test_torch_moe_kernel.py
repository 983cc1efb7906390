"""The `torch` MoE kernel's standard layout (pairs sorted by expert once, grouped GEMMs) equals the
per-expert loop it replaced, and both equal every pair written out in fp64: on the conformance
routings (ids of -1, idle experts, one expert taking everything, no tokens), at decode and prefill
sizes, in each dtype, and on CPU through each path: rows padded per expert into batched matmuls,
`torch._grouped_mm`, and the loop other devices take."""

import pytest
import torch
import torch.nn.functional as F

from moeplex.conformance.routing import ROUTINGS, make_hidden, make_routing
from moeplex.interfaces import ExpertWeights, MoEContext, StandardLayout
from moeplex.plugins.moe_kernels import torch_ref
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


ONEDNN_BF16 = torch_ref._onednn_runs(torch.bfloat16)


PATHS = [(dtype, path) for dtype in (torch.float32, torch.bfloat16) for path in ("padded_bmm", "grouped_mm", "loop", "packed")
         if not (path == "packed" and dtype == torch.float32)]  # packing is for oneDNN's bf16/fp16 only


@pytest.mark.parametrize("dtype,path", PATHS, ids=[f"{str(d).removeprefix('torch.')}-{p}" for d, p in PATHS])
@pytest.mark.parametrize(
    "routing,tokens,experts,top_k",
    [(name, 48, 16, 4) for name in ROUTINGS] + [("random", 0, 8, 2), ("random", 1, 8, 1), ("random", 120, 32, 8)],
)
def test_standard_layout_matches_the_loop_and_every_pair(routing, tokens, experts, top_k, dtype, path, monkeypatch):
    if path == "packed" and not ONEDNN_BF16:
        pytest.skip("the packed path runs bf16 on CPUs where oneDNN does (AVX-512-BF16 / AMX); this one has neither")
    hidden, route, w13, w2 = case(routing, tokens, experts, top_k, dtype)
    monkeypatch.setattr(torch_ref, "_use_padded_bmm", lambda x, counts, weights: path == "padded_bmm")
    if path == "loop":  # the loop over experts that GPUs (and weights in another dtype than the activations) take
        monkeypatch.setattr(torch_ref, "_use_grouped_mm", lambda x, weights: False)
    layout = StandardLayout(hidden, route.topk_ids, route.topk_weights, experts)
    ctx = MoEContext(HIDDEN, INTERMEDIATE, experts, top_k, dtype, torch.device("cpu"))
    weights = (w13, w2)
    if path == "packed":
        weights = torch_ref.PackedExperts(w13, w2)
        monkeypatch.setattr(torch_ref.PackedExperts, "takes", lambda self, hidden, topk_ids: True)
    result = TorchMoEKernel(ctx).apply(layout, weights)
    assert result.weights_applied and result.summed and result.hidden.dtype == dtype
    reference = per_pair_reference(hidden, route.topk_ids, route.topk_weights, w13, w2)
    assert result.hidden.shape == reference.shape
    scale = max(reference.abs().max().item() if tokens else 0.0, 1.0)
    torch.testing.assert_close(result.hidden.double(), reference, rtol=0, atol=TOLERANCE[dtype] * scale)
    former = per_expert_loop(hidden, route.topk_ids, route.topk_weights, w13, w2)
    torch.testing.assert_close(result.hidden, former, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * scale)


def test_padded_bmm_is_taken_only_where_it_wins():
    """bf16 at decode sizes with most experts hit: the batched matmuls; one token, fp32, or one expert
    crowded with every row: not."""
    _, route, w13, w2 = case("random", 48, 16, 4, torch.bfloat16)
    x = torch.zeros(8, HIDDEN, dtype=torch.bfloat16)
    assert torch_ref._use_padded_bmm(x, [1] * 8 + [0] * 8, (w13, w2)) == torch_ref._onednn_runs(torch.bfloat16)
    assert not torch_ref._use_padded_bmm(x, [8] + [0] * 15, (w13, w2))  # one expert hit
    assert not torch_ref._use_padded_bmm(x.float(), [1] * 8 + [0] * 8, (w13.float(), w2.float()))
    crowded = torch.zeros(200, HIDDEN, dtype=torch.bfloat16)
    assert not torch_ref._use_padded_bmm(crowded, [185] + [1] * 15, (w13, w2))  # 16 x 185 rows for 200


@pytest.mark.skipif(not torch_ref._onednn_runs(torch.float16), reason="the packed path runs fp16 where oneDNN does")
def test_packed_experts_ignore_an_expert_that_overflows_for_tokens_that_did_not_pick_it():
    """Every expert runs on every token: one that overflows fp16 (inf) for a token that did not pick it must
    add nothing to that token (inf x 0 would be NaN), as the sorted path never computes it."""
    hidden, route, w13, w2 = case("random", 12, 8, 2, torch.float16)
    w13[0] *= 4096  # expert 0 overflows on any row; no token picks it
    topk_ids = torch.where(route.topk_ids == 0, 1 + route.topk_ids.max() % 7, route.topk_ids)
    topk_ids[:, 1] = torch.where(topk_ids[:, 0] == topk_ids[:, 1], 1 + topk_ids[:, 0] % 7, topk_ids[:, 1])
    layout = StandardLayout(hidden, topk_ids, route.topk_weights, 8)
    kernel = TorchMoEKernel(MoEContext(HIDDEN, INTERMEDIATE, 8, 2, torch.float16, torch.device("cpu")))
    packed = torch_ref.PackedExperts(w13, w2)
    assert packed.takes(hidden, topk_ids)
    out = kernel.apply(layout, packed).hidden
    assert torch.isfinite(out).all()
    reference = per_pair_reference(hidden, topk_ids, route.topk_weights, w13, w2)
    scale = max(reference.abs().max().item(), 1.0)
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=TOLERANCE[torch.bfloat16] * scale)


@pytest.mark.skipif(not ONEDNN_BF16, reason="the packed path runs bf16 on CPUs where oneDNN does (AVX-512-BF16 / AMX)")
def test_packed_experts_are_prepared_for_bf16_on_cpu_and_taken_at_decode_sizes():
    """prepare_weights packs bf16 weights on CPU (fp32 keeps the plain pair); the packed path is taken
    from as many pairs as experts up to 128 tokens, and gives what the sorted path gives."""
    _, route, w13, w2 = case("random", 48, 16, 4, torch.bfloat16)
    ctx = MoEContext(HIDDEN, INTERMEDIATE, 16, 4, torch.bfloat16, torch.device("cpu"))
    kernel = TorchMoEKernel(ctx)
    packed = kernel.prepare_weights(ExpertWeights(w13, w2))
    assert isinstance(packed, torch_ref.PackedExperts) and packed[0] is w13 and packed[1] is w2
    plain = kernel.prepare_weights(ExpertWeights(w13.float(), w2.float()))
    assert not isinstance(plain, torch_ref.PackedExperts)
    ids = torch.zeros(4, 4, dtype=torch.long)
    assert packed.takes(torch.zeros(4, HIDDEN, dtype=torch.bfloat16), ids)  # 16 pairs, 16 experts
    assert not packed.takes(torch.zeros(3, HIDDEN, dtype=torch.bfloat16), ids[:3])  # 12 pairs
    assert not packed.takes(torch.zeros(129, HIDDEN, dtype=torch.bfloat16), torch.zeros(129, 4, dtype=torch.long))
    assert not packed.takes(torch.zeros(4, HIDDEN), ids)  # activations in another dtype
    hidden = make_hidden(48, HIDDEN, 0).to(torch.bfloat16)
    layout = StandardLayout(hidden, route.topk_ids, route.topk_weights, 16)
    torch.testing.assert_close(
        kernel.apply(layout, packed).hidden, kernel.apply(layout, (w13, w2)).hidden, rtol=2e-2, atol=2e-2
    )
