"""`naive` on EP groups of 2 and 4 gloo ranks gives what one process computes for the same MoE layer.

Four processes form one 4-rank EP group, then two 2-rank groups side by side (so the
dispatcher must keep to the group its context names). Every rank builds every rank's
tokens from one seed, runs dispatch -> experts -> combine on its own, and saves what it
got; the test process runs the same tokens through `local`
with all experts in one process and compares, rank by rank. Experts are either identity
(the kernel hands back each pair's row unweighted) or the `torch` kernel on random weights,
fed the standard layout or, through the core's adapter, the contiguous one. Each scenario runs twice:
as an extend step (uneven splits) and as a decode step whose every rank's count is known (fixed blocks
of max(counts) rows per destination, the form a CUDA graph captures).
"""

from __future__ import annotations

import datetime
import functools
import os
import time

import attrs
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeplex.conformance.dispatch_ranks import free_port
from moeplex.ranks.launcher import exit_rank
from moeplex.interfaces import BF16, CONTIGUOUS, STANDARD, ExpertOutput, ExpertWeights, MoEContext
from moeplex.moe.adapters import LayoutAdapter
from moeplex.forward_batch import ForwardBatch, ForwardMode
from moeplex.plugins.dispatchers.naive import fixed_block, plan_blocks, plan_sends
from moeplex.registry import lookup

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 32, 16, 3
PROCESSES = 4
EP_GROUPS = {4: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]]}  # two 2-rank EP groups run side by side in the 4 processes
COLLECTIVE_TIMEOUT_S = 30
SPAWN_TIMEOUT_S = 120
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@attrs.frozen
class Scenario:
    routing: str  # random | dropped_ids (a third of the pairs -1, token 0 routed nowhere) | last_rank_only
    dtype: torch.dtype
    experts: str  # identity | torch | torch_contiguous
    zero_tokens_on_rank_0: bool = False


SCENARIOS = {
    "random_fp32_torch": Scenario("random", torch.float32, "torch"),
    "random_bf16_torch": Scenario("random", torch.bfloat16, "torch"),
    "random_fp32_identity": Scenario("random", torch.float32, "identity"),
    "random_fp32_torch_contiguous": Scenario("random", torch.float32, "torch_contiguous"),
    "rank_0_has_no_tokens": Scenario("random", torch.float32, "torch", zero_tokens_on_rank_0=True),
    "all_tokens_to_last_rank": Scenario("last_rank_only", torch.float32, "identity"),
    "dropped_ids_bf16_identity": Scenario("dropped_ids", torch.bfloat16, "identity"),
    "dropped_ids_fp32_torch": Scenario("dropped_ids", torch.float32, "torch"),
}
IN_FLIGHT = ("random_fp32_torch", "dropped_ids_fp32_torch")  # micro-batches A and B


def make_routing(kind: str, tokens: int, world: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    local = EXPERTS // world
    choices = torch.arange(EXPERTS - local, EXPERTS) if kind == "last_rank_only" else torch.arange(EXPERTS)
    ids = choices[torch.rand(tokens, choices.numel(), generator=gen).argsort(dim=1)[:, :TOP_K]]
    weights = torch.rand(tokens, TOP_K, generator=gen) * 0.9 + 0.1
    if kind == "dropped_ids":
        dropped = torch.rand(tokens, TOP_K, generator=gen) < 1 / 3
        dropped[0] = True
        ids = ids.masked_fill(dropped, -1)
    return ids, weights


def all_inputs(name: str, world: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(hidden [T_r, H], physical ids [T_r, K], weights [T_r, K]) of every rank r."""
    scenario = SCENARIOS[name]
    gen = torch.Generator().manual_seed(100 * world + list(SCENARIOS).index(name))
    inputs = []
    for rank in range(world):
        tokens = 0 if scenario.zero_tokens_on_rank_0 and rank == 0 else 9 + 4 * rank
        ids, weights = make_routing(scenario.routing, tokens, world, gen)
        hidden = torch.randn(tokens, HIDDEN, generator=gen).to(scenario.dtype)
        inputs.append((hidden, ids, weights))
    return inputs


def expert_weights(first: int, count: int, dtype: torch.dtype) -> ExpertWeights:
    """Experts first .. first + count - 1 of one random layer whose outputs are of unit order."""
    gen = torch.Generator().manual_seed(7)
    w13 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5
    return ExpertWeights(w13=w13[first : first + count].to(dtype), w2=w2[first : first + count].to(dtype), format=BF16)


@functools.cache
def plugin(kind: str, name: str) -> type:
    return lookup(kind, name)  # reading entry points costs tens of ms; scenarios ask many times


class MoEStage:
    """One rank's dispatcher plus its experts, for one scenario."""

    def __init__(self, dispatcher_name: str, scenario: Scenario, ctx: MoEContext):
        self.dispatcher = plugin("dispatcher", dispatcher_name)(ctx)
        self.experts = scenario.experts
        self.kernel = plugin("moe_kernel", "torch")(ctx)
        weights = expert_weights(ctx.first_local_expert, ctx.num_local_experts, scenario.dtype)
        self.prepared = self.kernel.prepare_weights(weights)

    def expert_output(self, layout) -> ExpertOutput:
        if self.experts == "identity":
            rows = layout.hidden.unsqueeze(1).expand(-1, layout.topk_ids.shape[1], -1).contiguous()
            return ExpertOutput(rows, weights_applied=False, summed=False)
        if self.experts == "torch_contiguous":
            contiguous, restore = LayoutAdapter(STANDARD, frozenset({CONTIGUOUS}), 4)(layout)
            return restore(self.kernel.apply(contiguous, self.prepared))
        return self.kernel.apply(layout, self.prepared)

    def forward(self, hidden, ids, weights, batch=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(combined [T, H], the local top-k ids this rank received)."""
        dispatched = self.dispatcher.dispatch(hidden, ids, weights, batch)
        output = self.expert_output(dispatched.layout)
        return self.dispatcher.combine(output, dispatched.handle), dispatched.layout.topk_ids


def context(rank: int, world: int, dtype: torch.dtype, group=None) -> MoEContext:
    return MoEContext(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, dtype, torch.device("cpu"), rank, world, group)


def two_in_flight(ep_rank: int, world: int, group) -> list[torch.Tensor]:
    """Micro-batches A and B: start A, start B, finish A, finish B; combine B first, finish A first."""
    stage = MoEStage("naive", SCENARIOS["random_fp32_torch"], context(ep_rank, world, torch.float32, group))
    dispatcher = stage.dispatcher
    batches = [all_inputs(name, world)[ep_rank] for name in IN_FLIGHT]
    pending = [dispatcher.dispatch_start(*batch) for batch in batches]
    dispatched = [dispatcher.dispatch_finish(p) for p in pending]
    combining = [dispatcher.combine_start(stage.expert_output(d.layout), d.handle) for d in reversed(dispatched)]
    return [dispatcher.combine_finish(c) for c in reversed(combining)]


def decode_step(inputs) -> ForwardBatch:
    """A decode step's batch as the DP agreement leaves it: every rank's token count known to all."""
    counts = tuple(hidden.shape[0] for hidden, _, _ in inputs)
    return attrs.evolve(ForwardBatch.idle(), mode=ForwardMode.DECODE, global_num_tokens=counts, global_all_decode=True)


def run_ep_group(world: int, group) -> dict:
    """{scenario: (combined, received local ids)}, the same as fixed blocks under {scenario/blocks}, and
    {"two_in_flight": [combined A, combined B]} on one EP group."""
    ep_rank = dist.get_rank(group)
    results = {}
    for name, scenario in SCENARIOS.items():
        stage = MoEStage("naive", scenario, context(ep_rank, world, scenario.dtype, group))
        inputs = all_inputs(name, world)
        results[name] = stage.forward(*inputs[ep_rank])
        results[f"{name}/blocks"] = stage.forward(*inputs[ep_rank], decode_step(inputs))
    results["two_in_flight"] = two_in_flight(ep_rank, world, group)
    return results


def rank_main(rank: int, port: int, out_dir: str) -> None:
    """One of 4 processes: an EP rank of the 4-rank group, then of one of two 2-rank groups running side by side."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group("gloo", rank=rank, world_size=PROCESSES, timeout=timeout)
    try:
        pairs = [dist.new_group(members) for members in EP_GROUPS[2]]  # every process creates every group
        results = {4: run_ep_group(4, dist.group.WORLD), 2: run_ep_group(2, pairs[rank // 2])}
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    exit_rank()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> list[dict]:
    """What every process saved, {world: {check: result}}, from one spawn of 4 gloo processes."""
    out_dir = tmp_path_factory.mktemp("naive")
    spawned = mp.spawn(rank_main, args=(free_port(), str(out_dir)), nprocs=PROCESSES, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not spawned.join(timeout=1):
        if time.monotonic() > deadline:
            for process in spawned.processes:
                process.kill()
            pytest.fail(f"{PROCESSES} naive ranks did not finish in {SPAWN_TIMEOUT_S} s")
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(PROCESSES)]


@pytest.fixture(params=sorted(EP_GROUPS), ids=lambda world: f"{world}_ranks")
def ep_groups(request, saved) -> tuple[int, list[list[dict]]]:
    """(EP world size, for each EP group of that size the results of its ranks in EP-rank order)."""
    world = request.param
    return world, [[saved[rank][world] for rank in members] for members in EP_GROUPS[world]]


@functools.cache
def single_process(name: str, world: int) -> list[torch.Tensor]:
    """Every rank's tokens through `local` with all experts in this process, split back per rank."""
    inputs = all_inputs(name, world)
    scenario = SCENARIOS[name]
    stage = MoEStage("local", scenario, context(0, 1, scenario.dtype))
    hidden, ids, weights = (torch.cat(parts) for parts in zip(*inputs))
    combined, _ = stage.forward(hidden, ids, weights)
    return list(combined.split([h.shape[0] for h, _, _ in inputs]))


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, the input's {want.dtype}"
    tol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=lambda d: f"{what}\n{d}")


@pytest.mark.parametrize("splits", ["uneven", "blocks"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_single_process(ep_groups, name, splits):
    world, groups = ep_groups
    want = single_process(name, world)
    key = name if splits == "uneven" else f"{name}/blocks"
    for group, results in enumerate(groups):
        for rank, rank_results in enumerate(results):
            assert_close(rank_results[key][0], want[rank], f"{key}: EP group {group}, rank {rank} of {world}")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fixed_blocks_receive_max_count_rows_from_every_rank(ep_groups, name):
    world, groups = ep_groups
    block = max(hidden.shape[0] for hidden, _, _ in all_inputs(name, world))
    for results in groups:
        for rank, rank_results in enumerate(results):
            received = rank_results[f"{name}/blocks"][1]
            assert received.shape[0] == world * block, f"rank {rank} of {world} received {received.shape[0]} rows"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_token_reaches_each_expert_rank_once(ep_groups, name):
    world, groups = ep_groups
    local = EXPERTS // world
    inputs = all_inputs(name, world)
    for rank in range(world):
        expected_rows = sum(int(((ids // local == rank) & (ids >= 0)).any(dim=1).sum()) for _, ids, _ in inputs)
        for results in groups:
            received = results[rank][name][1]
            assert received.shape[0] == expected_rows, f"rank {rank} of {world} received {received.shape[0]} rows"
            assert bool(((received >= -1) & (received < local)).all()), f"rank {rank} got non-local ids {received}"
            assert bool((received >= 0).any(dim=1).all()), f"rank {rank} got a row with no expert of its own"


def test_two_micro_batches_in_flight(ep_groups):
    world, groups = ep_groups
    for index, name in enumerate(IN_FLIGHT):
        want = single_process(name, world)
        for results in groups:
            for rank, rank_results in enumerate(results):
                got = rank_results["two_in_flight"][index]
                assert_close(got, want[rank], f"micro-batch {name}: rank {rank} of {world}")


def test_plan_sends_once_per_rank_with_local_ids():
    # 2 ranks of 4 experts: token 0 -> experts 0 (rank 0) and 5 (rank 1); token 1 -> 6, 7, 4 (all rank 1)
    plan = plan_sends(torch.tensor([[0, 5, -1], [6, 7, 4], [-1, -1, -1]]), num_local_experts=4, ep_size=2)
    assert plan.counts.tolist() == [1, 2]
    assert plan.source_tokens.tolist() == [0, 0, 1]
    assert plan.local_ids.tolist() == [[0, -1, -1], [-1, 1, -1], [2, 3, 0]]


def test_fixed_blocks_only_for_decode_steps_with_known_counts():
    decode = decode_step([(torch.zeros(3, 1), None, None), (torch.zeros(0, 1), None, None)])
    assert fixed_block(decode) == 3
    assert fixed_block(attrs.evolve(decode, global_all_decode=False)) is None  # a rank extends: uneven splits
    assert fixed_block(attrs.evolve(decode, global_num_tokens=None)) is None  # counts unknown
    assert fixed_block(None) is None
    # 2 ranks of 4 experts, blocks of 3 rows: token 0 -> experts 0 (rank 0) and 5 (rank 1); token 1 -> 6, 7, 4
    plan = plan_blocks(torch.tensor([[0, 5, -1], [6, 7, 4]]), num_local_experts=4, ep_size=2, block=3)
    assert plan.source_tokens is None and plan.counts.tolist() == [3, 3]
    assert plan.local_ids.tolist() == [
        [[0, -1, -1], [-1, -1, -1], [-1, -1, -1]],  # to rank 0: token 0's expert 0; token 1 has none there; padding
        [[-1, 1, -1], [2, 3, 0], [-1, -1, -1]],  # to rank 1
    ]
