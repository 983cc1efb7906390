"""The DeepEP dispatchers and the DeepGEMM kernel on a machine without them: refusals, and their pure parts.

The GPU paths themselves are tested in test_deepep_deepgemm_gpu.py.
"""

from __future__ import annotations

import sys

import pytest
import torch

from moeplex import selection
from moeplex.config import EngineConfig
from moeplex.interfaces import MoEContext, StandardLayout
from moeplex.kernels.fp8 import silu_mul_quantize
from moeplex.moe.adapters import plan_contiguous, standard_to_contiguous
from moeplex.plugins.dispatchers.deepep import buffers
from moeplex.plugins.dispatchers.deepep.auto import DeepEPAutoDispatcher, low_latency_step
from moeplex.plugins.dispatchers.deepep.low_latency import DeepEPLowLatencyDispatcher, expected_rows
from moeplex.plugins.dispatchers.deepep.normal import DeepEPNormalDispatcher, contiguous_layout, grouped_rows, weighted_sum, PendingNormalDispatch
from moeplex.quant import dequantize_activations, quantize_activations
from moeplex.registry import PluginError


def ctx(**overrides) -> MoEContext:
    settings = dict(
        hidden_size=2048, intermediate_size=256, num_physical_experts=16, top_k=4,
        dtype=torch.bfloat16, device=torch.device("cpu"), ep_size=2, max_tokens_per_rank=128,
    )
    settings.update(overrides)
    return MoEContext(**settings)


@pytest.mark.parametrize(
    ("dispatcher", "kernel", "needle"),
    [
        ("deepep-normal", "torch", "dispatcher 'deepep-normal' needs a CUDA GPU"),
        ("deepep-ll", "torch", "dispatcher 'deepep-ll' needs a CUDA GPU"),
        ("deepep-auto", "torch", "dispatcher 'deepep-auto' needs a CUDA GPU"),
        ("local", "deepgemm", "moe_kernel 'deepgemm' needs a CUDA GPU"),
    ],
)
def test_without_a_gpu_each_refuses_in_one_sentence(dispatcher, kernel, needle, tmp_path):
    config = EngineConfig(model=str(tmp_path), dtype="bf16", dispatcher=dispatcher, moe_kernel=kernel)
    with pytest.raises(PluginError, match=needle) as info:
        selection.resolve(config, ep_size=2, has_gpu=False)
    assert "that run here: " in str(info.value) and str(info.value).endswith(".")


def test_a_missing_package_is_named(tmp_path, monkeypatch):
    real = selection.importlib.util.find_spec
    monkeypatch.setattr(selection.importlib.util, "find_spec", lambda name: None if name == "deep_ep" else real(name))
    monkeypatch.setattr(selection, "_capability", lambda: (9, 0))
    config = EngineConfig(model=str(tmp_path), dtype="bf16", dispatcher="deepep-ll", moe_kernel="torch")
    with pytest.raises(PluginError, match="needs the Python package deep_ep, which is not installed"):
        selection.resolve(config, ep_size=1, has_gpu=True)


def test_a_pre_hopper_gpu_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(selection.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(selection, "_capability", lambda: (8, 0))
    config = EngineConfig(model=str(tmp_path), dtype="bf16", dispatcher="local", moe_kernel="deepgemm")
    with pytest.raises(PluginError, match="compute capability 9.0 or newer .* this one is 8.0"):
        selection.resolve(config, ep_size=1, has_gpu=True)


def test_a_kernel_without_the_masked_layout_cannot_pair_with_auto(tmp_path, monkeypatch):
    monkeypatch.setattr(selection.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(selection, "_capability", lambda: (9, 0))
    from moeplex.interfaces import CONTIGUOUS, KernelCaps
    from moeplex.plugins.moe_kernels.torch_ref import TorchMoEKernel

    class ContiguousOnly(TorchMoEKernel):
        caps = KernelCaps(layouts=frozenset({CONTIGUOUS}), dtypes=frozenset({torch.bfloat16}))

    real_lookup = selection.registry.lookup
    monkeypatch.setattr(
        selection.registry, "lookup", lambda kind, name: ContiguousOnly if name == "contig" else real_lookup(kind, name)
    )
    config = EngineConfig(model=str(tmp_path), dtype="bf16", dispatcher="deepep-auto", moe_kernel="contig")
    with pytest.raises(PluginError, match="produces the masked layout"):
        selection.resolve(config, ep_size=2, has_gpu=True)


def test_dispatch_fp8_needs_a_dispatcher_that_sends_it(tmp_path):
    config = EngineConfig(model=str(tmp_path), dispatcher="naive", dispatch_fp8=True)
    with pytest.raises(PluginError, match="dispatchers that do: deepep-auto, deepep-ll, deepep-normal"):
        selection.resolve(config, ep_size=2, has_gpu=False)


def test_a_fixed_buffer_smaller_than_a_step_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(selection.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(selection, "_capability", lambda: (9, 0))
    config = EngineConfig(
        model=str(tmp_path), dtype="bf16", dispatcher="deepep-ll", moe_kernel="torch",
        max_dispatch_tokens_per_rank=64, max_batched_tokens=2048,
    )
    with pytest.raises(PluginError, match="holds at most --max-dispatch-tokens-per-rank 64 tokens.*deepep-auto"):
        selection.resolve(config, ep_size=1, has_gpu=True)


def test_buffer_limits_follow_deepep():
    buffers.check_low_latency(ctx(), "deepep-ll")
    with pytest.raises(PluginError, match="hidden sizes 2048, 2560, .* not 64"):
        buffers.check_low_latency(ctx(hidden_size=64), "deepep-ll")
    with pytest.raises(PluginError, match="at most 11 experts"):
        buffers.check_low_latency(ctx(top_k=12), "deepep-ll")
    buffers.check_normal(ctx(ep_size=8, num_physical_experts=16), "deepep-normal")
    with pytest.raises(PluginError, match="2, 4, 8 EP ranks of one machine, not 1"):
        buffers.check_normal(ctx(ep_size=1), "deepep-normal")
    buffers.check_normal(ctx(ep_size=2, num_physical_experts=256), "deepep-normal")
    with pytest.raises(PluginError, match="at most 128 expert slots per rank.*not 144 \\(288 over 2 ranks\\)"):
        buffers.check_normal(ctx(ep_size=2, num_physical_experts=288), "deepep-normal")


def test_buffer_sizes_come_from_the_hints_and_the_token_limit():
    calls = []

    def nvl_hint(hidden_bytes, ranks):
        calls.append(("nvl", hidden_bytes, ranks))
        return 1000 + hidden_bytes

    def ll_hint(tokens, hidden, ranks, experts):
        calls.append(("ll", tokens, hidden, ranks, experts))
        return tokens * hidden

    plan = buffers.plan_buffer(ctx(ep_size=2, max_tokens_per_rank=5), True, True, nvl_hint, ll_hint)
    assert plan.ll_tokens_per_rank == 64  # 2 ranks x 64 tokens: whole 128-row tiles per expert
    assert (plan.num_nvl_bytes, plan.num_rdma_bytes, plan.num_qps_per_rank) == (1000 + 4096, 64 * 2048, 8)
    assert calls == [("nvl", 4096, 2), ("ll", 64, 2048, 2, 16)]
    normal_only = buffers.plan_buffer(ctx(), True, False, nvl_hint, ll_hint)
    assert normal_only.num_rdma_bytes == 0 and not normal_only.low_latency
    assert plan.covers(plan) and not normal_only.covers(plan)
    assert buffers.low_latency_tokens(128, 8) == 128 and buffers.low_latency_tokens(1, 1) == 128
    assert buffers.low_latency_tokens(20, 8) == 32


def test_pool_shares_a_big_enough_buffer():
    made = []

    class FakeDeepEP:
        class Buffer:
            def __init__(self, group, **sizes):
                made.append(sizes)

    pool, group = buffers.BufferPool(), object()
    plan = buffers.BufferPlan(10, 20, True, 4, 128)
    first = pool.get(FakeDeepEP, group, plan)
    assert pool.get(FakeDeepEP, group, buffers.BufferPlan(5, 20, True, 4, 128)) is first
    assert pool.get(FakeDeepEP, group, buffers.BufferPlan(10, 40, True, 4, 128)) is not first
    assert len(made) == 2


class FakeDeepEP:
    """deep_ep as far as building buffers goes: sizes from hints, a Buffer that only remembers its sizes."""

    class Config:
        def get_nvl_buffer_size_hint(self, hidden_bytes, ranks):
            return hidden_bytes * ranks

    class Buffer:
        def __init__(self, group, **sizes):
            self.group, self.sizes = group, sizes

        get_dispatch_config = get_combine_config = staticmethod(lambda ranks: FakeDeepEP.Config())
        get_low_latency_rdma_size_hint = staticmethod(lambda tokens, hidden, ranks, experts: tokens * hidden)


def test_buffers_module_holds_no_mutable_state():
    held = [
        name for name, value in vars(buffers).items()
        if not name.startswith("__") and isinstance(value, (buffers.BufferPool, dict, list, set))
    ]
    assert not held, f"module-level state in deepep/buffers.py: {held}; buffers belong to the dispatcher"


def test_each_dispatcher_owns_its_buffers_and_auto_shares_one_between_its_modes(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", FakeDeepEP)
    world = ctx(group=object())
    first, second = DeepEPAutoDispatcher(world), DeepEPAutoDispatcher(world)
    assert first.buffers is not second.buffers and len(first.buffers) == 1
    assert first.normal.buffer is first.low_latency.buffer  # one buffer, both modes
    assert first.normal.buffer is not second.normal.buffer
    shared = buffers.BufferPool()  # several dispatchers in one process: one pool handed to all
    low_latency = DeepEPLowLatencyDispatcher(world, buffers=shared)
    again = DeepEPLowLatencyDispatcher(world, buffers=shared)
    assert again.mode.buffer is low_latency.mode.buffer and len(shared) == 1
    normal = DeepEPNormalDispatcher(world, buffers=shared)
    assert normal.buffers is shared and len(shared) == 2 and not normal.mode.buffer.sizes["low_latency_mode"]


def test_normal_mode_groups_received_rows_per_expert_and_sums_them_back():
    gen = torch.Generator().manual_seed(3)
    num_rows, top_k, experts, hidden = 9, 3, 4, 128
    ids = torch.randint(-1, experts, (num_rows, top_k), generator=gen)
    ids[0] = -1  # a row with nothing here
    weights = torch.rand(num_rows, top_k, generator=gen)
    rows = torch.randn(num_rows, hidden, generator=gen)
    counts = torch.bincount(ids[ids >= 0], minlength=experts).tolist()
    context = ctx(hidden_size=hidden, num_physical_experts=experts * 2, ep_size=2, top_k=top_k)
    pending = PendingNormalDispatch(rows, ids, weights, counts, None, torch.float32)
    layout, plan = contiguous_layout(pending, context)
    want, _ = standard_to_contiguous(StandardLayout(rows, ids, weights, experts), 128)
    torch.testing.assert_close(layout.hidden, want.hidden)
    assert torch.equal(layout.expert_index, want.expert_index)
    assert layout.num_rows == sum(-(-c // 128) * 128 for c in counts)
    # identity experts scaled per expert: sum_k w_k * (e_k + 1) * row
    output = layout.hidden * (layout.expert_index.clamp_min(0) + 1).float()[:, None]
    scale = torch.where(ids >= 0, weights * (ids + 1), 0).sum(1)
    torch.testing.assert_close(weighted_sum(output, plan, weights, num_rows, torch.float32), rows * scale[:, None])


def test_normal_mode_moves_an_fp8_payload_with_its_rows():
    ids = torch.tensor([[1, -1], [0, 1], [1, 0]])
    payload = quantize_activations(torch.randn(3, 256))
    counts = [2, 3]
    pending = PendingNormalDispatch(
        (payload.values, payload.scales), ids, torch.ones(3, 2), counts, None, torch.bfloat16
    )
    layout, plan = contiguous_layout(pending, ctx(hidden_size=256, num_physical_experts=4, top_k=2))
    assert layout.hidden.untyped_storage().nbytes() <= 2  # a placeholder: the rows are in the payload
    assert tuple(layout.hidden.shape) == (256, 256)
    got = dequantize_activations(layout.fp8)
    torch.testing.assert_close(got[plan.rows], dequantize_activations(payload)[plan.sources])
    assert torch.equal(grouped_rows(torch.arange(3.0)[:, None], plan)[plan.rows, 0], plan.sources.float())


def test_plan_contiguous_with_host_counts_equals_the_one_it_syncs_for():
    ids = torch.tensor([[2, 0], [2, -1], [1, 2]])
    synced = plan_contiguous(ids, 3, 4)
    told = plan_contiguous(ids, 3, 4, counts=[1, 1, 3])
    assert torch.equal(synced.expert_index, told.expert_index) and torch.equal(synced.rows, told.rows)
    assert synced.expert_index.tolist() == [0, -1, -1, -1, 1, -1, -1, -1, 2, 2, 2, -1]


class Batch:
    def __init__(self, extend: bool, num_tokens: int, global_num_tokens=None, global_all_decode=None):
        from moeplex.forward_batch import ForwardMode

        self.mode = ForwardMode.EXTEND if extend else ForwardMode.DECODE
        self.num_tokens, self.global_num_tokens, self.global_all_decode = num_tokens, global_num_tokens, global_all_decode


def test_auto_takes_low_latency_only_for_decode_steps_that_fit_on_every_rank():
    assert low_latency_step(Batch(False, 8), 128)
    assert not low_latency_step(Batch(True, 8), 128)
    assert not low_latency_step(Batch(False, 200), 128)
    assert not low_latency_step(None, 128)
    # DP attention: what all ranks agreed decides, not this rank's own batch
    assert not low_latency_step(Batch(False, 8, global_num_tokens=(8, 300), global_all_decode=True), 128)
    assert not low_latency_step(Batch(False, 8, global_num_tokens=(8, 16), global_all_decode=False), 128)
    assert low_latency_step(Batch(True, 0, global_num_tokens=(0, 16), global_all_decode=True), 128)


def test_auto_and_ll_declare_what_the_engine_needs():
    assert DeepEPLowLatencyDispatcher.caps.graph_safe and not DeepEPLowLatencyDispatcher.caps.needs_host_sync
    assert set(DeepEPAutoDispatcher.caps.layouts) == {"contiguous", "masked"}
    assert expected_rows(4, ctx(ep_size=2, top_k=4, num_physical_experts=16)) == 2


def test_fixed_buffers_default_to_a_decode_batch_where_a_fallback_exists(tmp_path):
    config = EngineConfig(model=str(tmp_path), max_running_requests=32, max_batched_tokens=1024)
    assert config.dispatch_tokens_per_rank(DeepEPAutoDispatcher.caps) == 32
    assert config.dispatch_tokens_per_rank(DeepEPLowLatencyDispatcher.caps) == 1024
    pinned = EngineConfig(model=str(tmp_path), max_dispatch_tokens_per_rank=256)
    assert pinned.dispatch_tokens_per_rank(DeepEPAutoDispatcher.caps) == 256


def _silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_quantize_equals_torch_then_quantize(dtype):
    x = (torch.randn(37, 2 * 256, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    values, scales = silu_mul_quantize(x)
    want = quantize_activations(_silu_mul(x))
    assert torch.equal(values.view(torch.uint8), want.values.view(torch.uint8))
    torch.testing.assert_close(scales, want.scales)


def test_silu_mul_quantize_masked_writes_only_counted_rows():
    # several blocks of 16 rows, and 5 column groups (not a multiple of the 4 a masked program loops over)
    x = torch.randn(3, 40, 2 * 640, generator=torch.Generator().manual_seed(2))
    counts = torch.tensor([0, 17, 40], dtype=torch.int32)
    values, scales = silu_mul_quantize(x, counts)
    for expert, count in enumerate(counts.tolist()):
        want = quantize_activations(_silu_mul(x[expert, :count]))
        assert torch.equal(values[expert, :count].view(torch.uint8), want.values.view(torch.uint8))
        torch.testing.assert_close(scales[expert, :count], want.scales)
    with pytest.raises(ValueError, match="not a multiple of the 128-wide fp8 groups"):
        silu_mul_quantize(torch.randn(2, 2 * 100))


def test_quantize_rows_masked_writes_only_counted_rows():
    from moeplex.kernels.fp8 import quantize_rows

    x = torch.randn(3, 40, 640, generator=torch.Generator().manual_seed(4))
    counts = torch.tensor([2, 0, 33], dtype=torch.int32)
    values, scales = quantize_rows(x, counts)
    full_values, full_scales = quantize_rows(x)
    for expert, count in enumerate(counts.tolist()):
        want = quantize_activations(x[expert, :count])
        assert torch.equal(values[expert, :count].view(torch.uint8), want.values.view(torch.uint8))
        assert torch.equal(full_values[expert, :count].view(torch.uint8), want.values.view(torch.uint8))
        torch.testing.assert_close(scales[expert, :count], want.scales)


def test_deepgemm_quantizes_bf16_experts_in_blocks():
    from moeplex.interfaces import BF16, ExpertWeights
    from moeplex.plugins.moe_kernels.deepgemm import check_shapes, quantize_experts
    from moeplex.quant import dequantize_blocks

    w13, w2 = torch.randn(2, 256, 128), torch.randn(2, 128, 128)
    fp8 = quantize_experts(ExpertWeights(w13, w2, BF16))
    assert fp8.w13.dtype == torch.float8_e4m3fn and tuple(fp8.w13_scale.shape) == (2, 2, 1)
    error = (dequantize_blocks(fp8.w13, fp8.w13_scale) - w13).norm() / w13.norm()
    assert error < 0.05
    with pytest.raises(ValueError, match="expert intermediate size to be a multiple of 128, not 96"):
        check_shapes(128, 96)
