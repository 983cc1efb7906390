"""DeepGEMM and DeepEP on a Hopper GPU: each against the torch reference, and whole MoE layers in CUDA graphs.

Skipped, with the reason, where there is no GPU or the packages are missing. The
dispatchers' own contract runs through the conformance suite (test_conformance_gpu).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from moeplex.conformance.dispatch_ranks import free_port
from moeplex.interfaces import FP8_BLOCK, ExpertWeights, MoEContext, StandardLayout
from moeplex.moe.adapters import LayoutAdapter
from moeplex.quant import dequantize_activations, dequantize_blocks, quantize_activations, quantize_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU"
    ),
]
needs_deep_gemm = pytest.mark.skipif(importlib.util.find_spec("deep_gemm") is None, reason="deep_gemm not installed")
needs_deep_ep = pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="deep_ep not installed")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def fp8_experts(num_experts: int, hidden: int, inter: int, seed: int = 0) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    (w13_q, s13), (w2_q, s2) = quantize_blocks(w13), quantize_blocks(w2)
    return ExpertWeights(w13_q.cuda(), w2_q.cuda(), FP8_BLOCK, s13.cuda(), s2.cuda())


@needs_deep_gemm
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_deepgemm_gemms_match_torch_on_the_dequantized_inputs(layout):
    import deep_gemm

    experts, m, n, k = 4, 256, 512, 384
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(experts * m if layout == "contiguous" else experts, *(() if layout == "contiguous" else (m,)), k, generator=gen)
    w = torch.randn(experts, n, k, generator=gen)
    a = quantize_activations(x)
    w_q, w_s = quantize_blocks(w)
    w_deq = dequantize_blocks(w_q, w_s)
    a_deq = dequantize_activations(a)
    if layout == "contiguous":
        index = torch.arange(experts).repeat_interleave(m).int()
        index[m - 5 : m] = -1  # padding rows
        out = torch.empty(experts * m, n, dtype=torch.bfloat16, device="cuda")
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
            (a.values.cuda(), a.scales.cuda()), (w_q.cuda(), w_s.cuda()), out, index.cuda()
        )
        want = torch.einsum("mk,mnk->mn", a_deq, w_deq[index.clamp_min(0).long()])
        valid = index >= 0
        assert relative_error(out.cpu()[valid], want[valid]) <= 2e-3
    else:
        counts = torch.tensor([m, 0, 17, 130], dtype=torch.int32)
        out = torch.empty(experts, m, n, dtype=torch.bfloat16, device="cuda")
        deep_gemm.m_grouped_fp8_gemm_nt_masked(
            (a.values.cuda(), a.scales.cuda()), (w_q.cuda(), w_s.cuda()), out, counts.cuda(), 128
        )
        want = torch.einsum("emk,enk->emn", a_deq, w_deq)
        for e, c in enumerate(counts.tolist()):
            if c:
                assert relative_error(out.cpu()[e, :c], want[e, :c]) <= 2e-3, f"expert {e}"


def moe_reference(hidden, topk_ids, topk_weights, weights: ExpertWeights) -> torch.Tensor:
    """The `torch` kernel on dequantized fp8 experts, in fp32."""
    from moeplex.interfaces import BF16, STANDARD
    from moeplex.plugins.moe_kernels.torch_ref import TorchMoEKernel

    w13 = dequantize_blocks(weights.w13, weights.w13_scale)
    w2 = dequantize_blocks(weights.w2, weights.w2_scale)
    num_experts = w13.shape[0]
    ctx = MoEContext(hidden.shape[1], w2.shape[2], num_experts, topk_ids.shape[1], torch.float32, hidden.device)
    kernel = TorchMoEKernel(ctx)
    out = kernel.apply(
        StandardLayout(hidden.float(), topk_ids, topk_weights.float(), num_experts),
        kernel.prepare_weights(ExpertWeights(w13, w2, BF16)),
    )
    assert out.summed and STANDARD
    return out.hidden


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=gen, device="cuda")
    weights, ids = scores.topk(top_k, dim=1)
    return ids, (weights / weights.sum(1, keepdim=True)).float()


@needs_deep_gemm
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_deepgemm_kernel_matches_the_torch_kernel_within_fp8(layout):
    from moeplex.plugins.moe_kernels.deepgemm import DeepGemmMoEKernel

    experts, hidden_size, inter, top_k, tokens = 8, 512, 256, 3, 300
    weights = fp8_experts(experts, hidden_size, inter)
    ctx = MoEContext(hidden_size, inter, experts, top_k, torch.bfloat16, torch.device("cuda"))
    kernel = DeepGemmMoEKernel(ctx)
    hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(tokens, experts, top_k, seed=4)
    standard = StandardLayout(hidden, ids, w, experts)
    converted, restore = LayoutAdapter("standard", frozenset({layout}), kernel.caps.alignment)(standard)
    from moeplex.interfaces import reduce_standard

    got = reduce_standard(restore(kernel.apply(converted, kernel.prepare_weights(weights))), ids, w)
    want = moe_reference(hidden, ids, w, weights)
    assert relative_error(got, want) <= 0.05  # activations quantized twice to fp8 (3 mantissa bits)


@needs_deep_gemm
@needs_deep_ep
def test_low_latency_moe_layer_in_a_cuda_graph_equals_local_torch():
    """deepep-ll + deepgemm, captured once and replayed on new tokens, against local + torch."""
    from moeplex.plugins.dispatchers.deepep.low_latency import DeepEPLowLatencyDispatcher
    from moeplex.plugins.moe_kernels.deepgemm import DeepGemmMoEKernel

    experts, hidden_size, inter, top_k, tokens = 16, 2048, 256, 4, 32
    weights = fp8_experts(experts, hidden_size, inter, seed=5)
    for fp8_dispatch in (False, True):
        ctx = MoEContext(
            hidden_size, inter, experts, top_k, torch.bfloat16, torch.device("cuda"),
            max_tokens_per_rank=tokens, dispatch_fp8=fp8_dispatch,
        )
        dispatcher, kernel = DeepEPLowLatencyDispatcher(ctx), DeepGemmMoEKernel(ctx)
        prepared = kernel.prepare_weights(weights)
        static_hidden = torch.zeros(tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
        static_ids = torch.zeros(tokens, top_k, device="cuda", dtype=torch.int64)
        static_w = torch.zeros(tokens, top_k, device="cuda", dtype=torch.float32)

        def layer():
            dispatched = dispatcher.dispatch(static_hidden, static_ids, static_w)
            return dispatcher.combine(kernel.apply(dispatched.layout, prepared), dispatched.handle)

        ids, w = routing(tokens, experts, top_k, seed=6)
        static_ids.copy_(ids), static_w.copy_(w), static_hidden.normal_()
        layer()  # warm-up: DeepGEMM compiles its kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer()
        for seed in (7, 8):
            ids, w = routing(tokens, experts, top_k, seed=seed)
            static_ids.copy_(ids), static_w.copy_(w), static_hidden.normal_()
            graph.replay()
            torch.cuda.synchronize()
            eager = layer()
            want = moe_reference(static_hidden, static_ids, static_w, weights)
            what = f"fp8 dispatch {fp8_dispatch}, seed {seed}"
            assert relative_error(eager, want) <= 0.06, f"eager, {what}"
            assert relative_error(static_out, want) <= 0.06, f"graph replay, {what}"


NORMAL_RANK_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.environ["TESTS_DIR"])
from test_deepep_deepgemm_gpu import fp8_experts, moe_reference, relative_error, routing
from moeplex.interfaces import MoEContext, ExpertWeights, FP8_BLOCK
from moeplex.conformance.dispatch_checks import backend_for, device_for_rank
from moeplex.plugins.dispatchers.deepep.normal import DeepEPNormalDispatcher
from moeplex.plugins.moe_kernels.deepgemm import DeepGemmMoEKernel
rank, world = int(sys.argv[1]), 2
device = device_for_rank(rank, world, needs_gpu=True)
torch.cuda.set_device(device)
dist.init_process_group(backend_for(device, world), init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=world)
experts, hidden_size, inter, top_k, tokens = 16, 2048, 256, 4, 1000 + 300 * rank
weights = fp8_experts(experts, hidden_size, inter, seed=9)
local = slice(rank * experts // world, (rank + 1) * experts // world)
mine = ExpertWeights(weights.w13[local], weights.w2[local], FP8_BLOCK, weights.w13_scale[local], weights.w2_scale[local])
for fp8 in (False, True):
    ctx = MoEContext(hidden_size, inter, experts, top_k, torch.bfloat16, device, ep_rank=rank, ep_size=world,
                     group=dist.group.WORLD, dispatch_fp8=fp8)
    dispatcher, kernel = DeepEPNormalDispatcher(ctx), DeepGemmMoEKernel(ctx)
    hidden = torch.randn(tokens, hidden_size, device=device, dtype=torch.bfloat16)
    ids, w = routing(tokens, experts, top_k, seed=20 + rank)
    dispatched = dispatcher.dispatch(hidden, ids, w)
    out = dispatcher.combine(kernel.apply(dispatched.layout, kernel.prepare_weights(mine)), dispatched.handle)
    error = relative_error(out, moe_reference(hidden, ids, w, weights))
    assert error <= 0.06, f"rank {rank} fp8 dispatch {fp8}: relative error {error}"
dist.barrier()
dist.destroy_process_group()
print("ok", rank)
"""


@needs_deep_gemm
@needs_deep_ep
def test_normal_mode_moe_layer_on_a_prefill_batch_equals_local_torch(tmp_path):
    """deepep-normal + deepgemm on two ranks (two GPUs, or two processes sharing one) against local + torch."""
    script = tmp_path / "rank.py"
    script.write_text(NORMAL_RANK_SCRIPT)
    env = {**os.environ, "TESTS_DIR": os.path.dirname(__file__)}
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, str(script), str(rank), port], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{output[-4000:]}"
