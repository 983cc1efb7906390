"""The dispatcher contract as checks that each EP rank runs on its own tokens.

With identity experts (a kernel whose output is the rows it received, in whatever
layout the dispatcher produced), combine(dispatch(x)) must equal sum_k w_k * x on
every source rank. Each rank builds its inputs from a seed, so it knows its answer.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch

from moeplex.interfaces import (
    Dispatcher,
    ExpertOutput,
    ForwardBatch,
    ForwardMode,
    MoEContext,
    StandardLayout,
    reduce_standard,
)
from moeplex.quant import dequantize_activations

from .routing import Routing, make_hidden, make_routing

HIDDEN_SIZE = 128  # one fp8 scale group, for dispatchers that send an fp8 payload
NUM_EXPERTS = 8  # physical experts over all EP ranks
TOP_K = 3
MAX_TOKENS_PER_RANK = 256
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
FP8_TOLERANCE = 0.15  # an fp8 payload rounds each activation to 3 mantissa bits


@attrs.frozen
class DispatchCase:
    routing: str  # a name in moeplex.conformance.routing.ROUTINGS
    tokens: Callable[[int, int], int]  # (ep_rank, ep_size) -> tokens this rank sends


CASES = {
    "random": DispatchCase("random", lambda rank, world: 24 + 7 * rank),
    "one_expert": DispatchCase("one_expert", lambda rank, world: 20),
    "dropped_ids": DispatchCase("dropped_ids", lambda rank, world: 17 + rank),
    "zero_tokens": DispatchCase("random", lambda rank, world: 0),
    "idle_experts": DispatchCase("idle_experts", lambda rank, world: 21),
    "silent_rank": DispatchCase("random", lambda rank, world: 0 if rank == world - 1 else 19),
}
TWO_IN_FLIGHT = "two_in_flight"
CHECKS = (*CASES, TWO_IN_FLIGHT)
# graph-safe dispatchers: a decode step whose every rank's count is known, as the engine's agreement and every
# captured decode graph pass it (a rank with no tokens among them)
DECODE_STEP = "decode_step"
DECODE_STEP_CASE = "silent_rank"


def device_for_rank(ep_rank: int = 0, ep_size: int = 1, needs_gpu: bool = False) -> torch.device:
    """A GPU per rank where there are enough; else one shared GPU for a GPU-only plugin; else the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= ep_size:
        return torch.device("cuda", ep_rank)
    if torch.cuda.is_available() and needs_gpu:
        return torch.device("cuda", 0)
    return torch.device("cpu")


def backend_for(device: torch.device, ep_size: int) -> str:
    """NCCL where every rank has a GPU of its own; gloo otherwise (NCCL refuses two ranks on one GPU)."""
    shared = device.type == "cuda" and torch.cuda.device_count() < ep_size
    return "nccl" if device.type == "cuda" and not shared else "gloo"


def hidden_size_for(caps) -> int:
    """HIDDEN_SIZE, or the smallest hidden size a dispatcher that names its sizes can move."""
    sizes = getattr(caps, "hidden_sizes", None)
    return HIDDEN_SIZE if not sizes or HIDDEN_SIZE in sizes else min(sizes)


def payloads_for(caps) -> tuple[str, ...]:
    """The row formats to check: bf16 always, fp8 too for a dispatcher that can send it."""
    return ("bf16", "fp8") if getattr(caps, "fp8_payload", False) else ("bf16",)


def make_context(
    ep_rank: int, ep_size: int, group, device: torch.device, hidden_size: int = HIDDEN_SIZE, fp8: bool = False
) -> MoEContext:
    return MoEContext(
        hidden_size=hidden_size,
        intermediate_size=hidden_size,
        num_physical_experts=NUM_EXPERTS,
        top_k=TOP_K,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        device=device,
        ep_rank=ep_rank,
        ep_size=ep_size,
        group=group,
        max_tokens_per_rank=MAX_TOKENS_PER_RANK,
        dispatch_fp8=fp8,
    )


def case_inputs(case_name: str, ctx: MoEContext, seed: int) -> tuple[torch.Tensor, Routing]:
    """This rank's hidden [T, H] and routing over all physical experts for one case."""
    case = CASES[case_name]
    num_tokens = case.tokens(ctx.ep_rank, ctx.ep_size)
    rank_seed = seed * 1009 + ctx.ep_rank
    routing = make_routing(case.routing, num_tokens, ctx.num_physical_experts, ctx.top_k, rank_seed)
    hidden = make_hidden(num_tokens, ctx.hidden_size, rank_seed).to(ctx.device, ctx.dtype)
    routing = Routing(routing.topk_ids.to(ctx.device), routing.topk_weights.to(ctx.device))
    return hidden, routing


def output_forms(layout_name: str) -> tuple[str, ...]:
    """The ExpertOutput forms a kernel may hand this layout's combine (the `torch` kernel sums standard rows)."""
    return ("per_pair", "summed") if layout_name == StandardLayout.name else ("rows",)


def identity_output(layout, form: str, dtype: torch.dtype) -> ExpertOutput:
    """What identity experts return: every received row unchanged, in the layout's output shape."""
    rows = layout.hidden if layout.fp8 is None else dequantize_activations(layout.fp8)
    rows = rows.to(dtype)
    if not isinstance(layout, StandardLayout):
        return ExpertOutput(rows.clone(), weights_applied=False, summed=False)
    per_pair = ExpertOutput(
        rows.unsqueeze(1).expand(-1, layout.topk_ids.shape[1], -1).contiguous(), weights_applied=False, summed=False
    )
    if form == "per_pair":
        return per_pair
    summed = reduce_standard(per_pair, layout.topk_ids, layout.topk_weights)
    return ExpertOutput(summed, weights_applied=True, summed=True)


def assert_combined(out: torch.Tensor, hidden: torch.Tensor, routing: Routing, what: str, fp8: bool) -> None:
    expected = routing.weighted_sum(hidden)
    assert tuple(out.shape) == tuple(expected.shape), (
        f"{what}: combine returned shape {tuple(out.shape)} for {tuple(expected.shape)} sent"
    )
    tol = FP8_TOLERANCE if fp8 else TOLERANCE[hidden.dtype]
    torch.testing.assert_close(
        out.float().cpu(),
        expected.cpu(),
        rtol=tol,
        atol=tol,
        msg=lambda detail: f"{what}: combine(dispatch(x)) != sum_k w_k * x with identity experts\n{detail}",
    )


def decode_step(ctx: MoEContext, case_name: str) -> ForwardBatch:
    """The step a dispatcher is handed in a decode step of known counts: every rank's tokens in the case."""
    counts = tuple(CASES[case_name].tokens(rank, ctx.ep_size) for rank in range(ctx.ep_size))
    idle = ForwardBatch.idle(ctx.device)
    return attrs.evolve(idle, mode=ForwardMode.DECODE, global_num_tokens=counts, global_all_decode=True)


def check_round_trip(dispatcher: Dispatcher, case_name: str, batch: ForwardBatch | None = None) -> None:
    """Every collective first, every assertion after, so a wrong answer leaves the ranks in step."""
    ctx = dispatcher.ctx
    round_trips = []
    for form in output_forms(dispatcher.caps.layout):
        hidden, routing = case_inputs(case_name, ctx, seed=list(CASES).index(case_name))
        dispatched = dispatcher.dispatch(hidden, routing.topk_ids, routing.topk_weights, batch)
        out = dispatcher.combine(identity_output(dispatched.layout, form, ctx.dtype), dispatched.handle)
        round_trips.append((form, out, hidden, routing, dispatched.layout.fp8 is not None))
    for form, out, hidden, routing, fp8 in round_trips:
        what = f"rank {ctx.ep_rank} of {ctx.ep_size}, routing '{case_name}', kernel output {form}"
        assert_combined(out, hidden, routing, what, fp8)


def check_two_in_flight(dispatcher: Dispatcher) -> None:
    """One instance serves two micro-batches: start A, start B, finish B, finish A, then combine both."""
    ctx = dispatcher.ctx
    form = output_forms(dispatcher.caps.layout)[0]
    hidden_a, routing_a = case_inputs("random", ctx, seed=101)
    hidden_b, routing_b = case_inputs("idle_experts", ctx, seed=102)
    pending_a = dispatcher.dispatch_start(hidden_a, routing_a.topk_ids, routing_a.topk_weights)
    pending_b = dispatcher.dispatch_start(hidden_b, routing_b.topk_ids, routing_b.topk_weights)
    dispatched_b = dispatcher.dispatch_finish(pending_b)
    dispatched_a = dispatcher.dispatch_finish(pending_a)
    combining_b = dispatcher.combine_start(identity_output(dispatched_b.layout, form, ctx.dtype), dispatched_b.handle)
    combining_a = dispatcher.combine_start(identity_output(dispatched_a.layout, form, ctx.dtype), dispatched_a.handle)
    out_a = dispatcher.combine_finish(combining_a)
    out_b = dispatcher.combine_finish(combining_b)
    rank = f"rank {ctx.ep_rank} of {ctx.ep_size}"
    assert_combined(out_a, hidden_a, routing_a, f"{rank}, micro-batch A", dispatched_a.layout.fp8 is not None)
    assert_combined(out_b, hidden_b, routing_b, f"{rank}, micro-batch B", dispatched_b.layout.fp8 is not None)


def checks_for(caps) -> tuple[str, ...]:
    """The checks a dispatcher must pass: two in flight only where it declares room for two, a decode step of
    known counts where it declares itself graph-safe."""
    checks = CHECKS if getattr(caps, "max_in_flight", 2) >= 2 else tuple(CASES)
    return (*checks, DECODE_STEP) if getattr(caps, "graph_safe", False) else checks


def run_check(dispatcher: Dispatcher, name: str) -> None:
    if name == TWO_IN_FLIGHT:
        check_two_in_flight(dispatcher)
    elif name == DECODE_STEP:
        check_round_trip(dispatcher, DECODE_STEP_CASE, decode_step(dispatcher.ctx, DECODE_STEP_CASE))
    else:
        check_round_trip(dispatcher, name)
