"""MoE kernel contract: the output equals the `torch` reference kernel's within the dtype's tolerance.

For every layout, dtype and weight format the kernel declares (on a CPU too), on routings
with zero tokens, top-k 1, idle experts, ids of -1 (pairs whose expert lives on another
rank), and all tokens on one expert in a count that is not a multiple of the kernel's
alignment. Outputs are compared as [N, H], finished the way the core finishes them: the
layout adapter's restore, then `reduce_standard`.

Two more checks: each declared dtype is the one the kernel computes in (activations far from
unit scale, against an fp32 reference, within what that dtype's rounding allows: a kernel that
declares bf16 or fp32 but computes in fp16 overflows, one that computes in fp8 is too coarse);
and a kernel declaring `fp8_payload` is fed rows as fp8 values with 128-wide scales.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from moeplex.conformance.plugin import load_plugin
from moeplex.conformance.routing import Routing, make_hidden, make_routing
from moeplex.interfaces import (
    ALL_LAYOUTS,
    BF16,
    FP8_BLOCK,
    STANDARD,
    WEIGHT_FORMATS,
    ExpertWeights,
    MoEContext,
    StandardLayout,
    placeholder,
    reduce_standard,
)
from moeplex.moe.adapters import LayoutAdapter
from moeplex.quant import dequantize_activations, quantize_activations, quantize_blocks
from moeplex.registry import lookup

HIDDEN_SIZE = 128  # multiples of 128: the fp8 block size
INTERMEDIATE_SIZE = 128
NUM_EXPERTS = 4  # idle experts beside busy ones; kernels run interpreted on a CPU pay per expert
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
# An fp8 kernel may quantize the activations too (1x128 groups, 3 mantissa bits): about 4% of each
# token's output, by norm, on these shapes. Rows are compared by norm, within this fraction.
FP8_ROW_TOLERANCE = 0.15
# The dtype check: activations this far from unit scale (outputs ~1e6 for fp32 and bf16, past fp16's
# 65504; well inside fp16's range for fp16), and the error each dtype's rounding leaves in a row, by norm,
# against an fp32 reference on the same (rounded) inputs: bf16 ~0.5%, fp16 ~0.05%; fp8 is ~5%.
DTYPE_SCALE = {torch.float32: 1000.0, torch.bfloat16: 1000.0, torch.float16: 4.0}
DTYPE_ROW_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@attrs.frozen
class KernelCase:
    routing: str  # a name in moeplex.conformance.routing.ROUTINGS
    top_k: int
    tokens: int | None  # None: the kernel's alignment + 5, all on one expert


CASES = {
    "random": KernelCase("random", top_k=3, tokens=37),
    "zero_tokens": KernelCase("random", top_k=3, tokens=0),
    "top_k_1": KernelCase("random", top_k=1, tokens=37),
    "idle_experts": KernelCase("idle_experts", top_k=2, tokens=37),
    "ids_of_other_ranks": KernelCase("dropped_ids", top_k=3, tokens=37),
    "unaligned_count_on_one_expert": KernelCase("one_expert", top_k=3, tokens=None),
}


@pytest.fixture(scope="module")
def kernel_cls(moeplex_plugin):
    return load_plugin(moeplex_plugin)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def skip_unless_declared(name: str, caps, layout: str, dtype: torch.dtype, weight_format: str) -> None:
    if layout not in caps.layouts:
        pytest.skip(f"moe_kernel '{name}' does not declare the {layout} layout")
    if dtype not in caps.dtypes:
        pytest.skip(f"moe_kernel '{name}' does not declare {dtype}")
    if weight_format not in caps.weight_formats:
        pytest.skip(f"moe_kernel '{name}' does not declare the {weight_format} weight format")


def make_context(dtype: torch.dtype, top_k: int) -> MoEContext:
    return MoEContext(
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_physical_experts=NUM_EXPERTS,
        top_k=top_k,
        dtype=dtype,
        device=device(),
    )


def make_weights(weight_format: str, dtype: torch.dtype) -> ExpertWeights:
    """One layer's experts, scaled so every expert's output is of unit order."""
    gen = torch.Generator().manual_seed(11)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE_SIZE, HIDDEN_SIZE, generator=gen) / HIDDEN_SIZE**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN_SIZE, INTERMEDIATE_SIZE, generator=gen) / INTERMEDIATE_SIZE**0.5
    if weight_format == BF16:
        return ExpertWeights(w13=w13.to(device(), dtype), w2=w2.to(device(), dtype), format=BF16)
    (w13_q, w13_scale), (w2_q, w2_scale) = quantize_blocks(w13), quantize_blocks(w2)
    return ExpertWeights(
        w13=w13_q.to(device()),
        w2=w2_q.to(device()),
        format=FP8_BLOCK,
        w13_scale=w13_scale.to(device()),
        w2_scale=w2_scale.to(device()),
    )


def copy_of(weights: ExpertWeights) -> ExpertWeights:
    """Each kernel prepares its own copy: prepare_weights may transform in place."""
    tensors = {name: getattr(weights, name) for name in ("w13", "w2", "w13_scale", "w2_scale")}
    return attrs.evolve(weights, **{name: t.clone() for name, t in tensors.items() if t is not None})


def case_inputs(case: KernelCase, alignment: int, dtype: torch.dtype) -> tuple[torch.Tensor, Routing]:
    tokens = alignment + 5 if case.tokens is None else case.tokens
    routing = make_routing(case.routing, tokens, NUM_EXPERTS, case.top_k, seed=tokens + case.top_k)
    hidden = make_hidden(tokens, HIDDEN_SIZE, seed=tokens).to(device(), dtype)
    return hidden, Routing(routing.topk_ids.to(device()), routing.topk_weights.to(device()))


def run_kernel(kernel, layout_name: str, weights: ExpertWeights, hidden: torch.Tensor, routing: Routing):
    """[N, H] output of `kernel` on the tokens, fed in `layout_name` and finished as the core finishes it."""
    prepared = kernel.prepare_weights(copy_of(weights))
    standard = StandardLayout(hidden, routing.topk_ids, routing.topk_weights, NUM_EXPERTS)
    adapter = LayoutAdapter(STANDARD, frozenset({layout_name}), kernel.caps.alignment)
    layout, restore = adapter(standard)
    output = restore(kernel.apply(layout, prepared))
    return reduce_standard(output, routing.topk_ids, routing.topk_weights)


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str) -> None:
    """Each token's output within `tolerance` of the reference's norm (of a typical row's, where that is ~0)."""
    if not want.numel():
        return
    want_norm = want.norm(dim=1)
    floor = 0.1 * want_norm.mean().clamp_min(1e-6)  # tokens routed nowhere must stay near zero
    error = (got - want).norm(dim=1) / torch.maximum(want_norm, floor)
    worst = int(error.argmax())
    assert error[worst] <= tolerance, (
        f"{what}: token {worst} is off by {float(error[worst]):.3f} of its norm (up to {tolerance} allowed)"
    )


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("weight_format", WEIGHT_FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_matches_torch_reference(kernel_cls, moeplex_plugin, layout, dtype, weight_format, case):
    torch_dtype = DTYPES[dtype]
    skip_unless_declared(moeplex_plugin.name, kernel_cls.caps, layout, torch_dtype, weight_format)
    top_k = CASES[case].top_k
    weights = make_weights(weight_format, torch_dtype)
    hidden, routing = case_inputs(CASES[case], kernel_cls.caps.alignment, torch_dtype)
    got = run_kernel(kernel_cls(make_context(torch_dtype, top_k)), layout, weights, hidden, routing)
    reference = lookup("moe_kernel", "torch")(make_context(torch_dtype, top_k))
    want = run_kernel(reference, STANDARD, weights, hidden, routing)
    assert tuple(got.shape) == tuple(want.shape), f"output shape {tuple(got.shape)}, reference {tuple(want.shape)}"
    what = f"{moeplex_plugin.name} on the {layout} layout differs from the torch kernel"
    if weight_format == FP8_BLOCK or getattr(kernel_cls.caps, "fp8_compute", False):
        assert_rows_close(got.float(), want.float(), FP8_ROW_TOLERANCE, what)
    else:
        tol = TOLERANCE[torch_dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=lambda detail: f"{what}\n{detail}")


def fp32_reference(weights: ExpertWeights, hidden: torch.Tensor, routing: Routing, top_k: int) -> torch.Tensor:
    """The torch kernel in fp32 on the same values: what a kernel computing exactly would return."""
    exact = attrs.evolve(weights, w13=weights.w13.float(), w2=weights.w2.float())
    reference = lookup("moe_kernel", "torch")(make_context(torch.float32, top_k))
    return run_kernel(reference, STANDARD, exact, hidden.float(), routing)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_computes_in_the_declared_dtype(kernel_cls, moeplex_plugin, layout, dtype):
    torch_dtype = DTYPES[dtype]
    skip_unless_declared(moeplex_plugin.name, kernel_cls.caps, layout, torch_dtype, BF16)
    if getattr(kernel_cls.caps, "fp8_compute", False):
        pytest.skip(f"moe_kernel '{moeplex_plugin.name}' declares fp8_compute")
    case = CASES["random"]
    weights = make_weights(BF16, torch_dtype)
    hidden, routing = case_inputs(case, kernel_cls.caps.alignment, torch.float32)
    hidden = (hidden * DTYPE_SCALE[torch_dtype]).to(torch_dtype)
    got = run_kernel(kernel_cls(make_context(torch_dtype, case.top_k)), layout, weights, hidden, routing)
    assert got.dtype == torch_dtype, f"{moeplex_plugin.name} returned {got.dtype} for {dtype} activations"
    assert torch.isfinite(got).all(), (
        f"{moeplex_plugin.name} on the {layout} layout overflowed on {dtype} activations of scale "
        f"{DTYPE_SCALE[torch_dtype]:g}: it computes in a narrower format than the {dtype} it declares"
    )
    want = fp32_reference(weights, hidden, routing, case.top_k)
    assert_rows_close(
        got.float(), want, DTYPE_ROW_TOLERANCE[torch_dtype],
        f"{moeplex_plugin.name} on the {layout} layout is less exact than {dtype} arithmetic allows",
    )


@pytest.mark.parametrize("weight_format", WEIGHT_FORMATS)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_takes_an_fp8_payload(kernel_cls, moeplex_plugin, layout, weight_format):
    caps = kernel_cls.caps
    if not getattr(caps, "fp8_payload", False):
        pytest.skip(f"moe_kernel '{moeplex_plugin.name}' does not declare fp8_payload")
    torch_dtype = next(d for d in (torch.bfloat16, torch.float16, torch.float32) if d in caps.dtypes)
    skip_unless_declared(moeplex_plugin.name, caps, layout, torch_dtype, weight_format)
    case = CASES["unaligned_count_on_one_expert"] if layout != STANDARD else CASES["random"]
    weights = make_weights(weight_format, torch_dtype)
    hidden, routing = case_inputs(case, caps.alignment, torch_dtype)
    payload = quantize_activations(hidden.float())
    rows = placeholder(tuple(hidden.shape), torch_dtype, hidden.device)  # the rows are in the payload only
    kernel = kernel_cls(make_context(torch_dtype, case.top_k))
    prepared = kernel.prepare_weights(copy_of(weights))
    standard = StandardLayout(rows, routing.topk_ids, routing.topk_weights, NUM_EXPERTS, fp8=payload)
    layout_in, restore = LayoutAdapter(STANDARD, frozenset({layout}), caps.alignment)(standard)
    got = reduce_standard(restore(kernel.apply(layout_in, prepared)), routing.topk_ids, routing.topk_weights)
    exact = dequantize_activations(payload).to(torch_dtype)
    reference = lookup("moe_kernel", "torch")(make_context(torch_dtype, case.top_k))
    want = run_kernel(reference, STANDARD, weights, exact, routing)
    assert tuple(got.shape) == tuple(want.shape), f"output shape {tuple(got.shape)}, reference {tuple(want.shape)}"
    assert_rows_close(
        got.float(), want.float(), FP8_ROW_TOLERANCE,
        f"{moeplex_plugin.name} on the {layout} layout does not compute on the fp8 rows it was sent",
    )
