"""Dispatcher contract: with identity experts, combine(dispatch(x)) == sum_k w_k * x on every source rank.

For every routing (random, all tokens to one expert, top-k ids of -1, zero tokens,
idle experts, a rank that sends nothing), with two dispatches in flight at once, and (graph-safe
dispatchers) in a decode step whose every rank's count is known, as a captured decode graph runs it.
Dispatchers declaring `single_rank` run in this process; those declaring `multi_rank`
run on two processes joined by torch.distributed (gloo on CPU).
"""

from __future__ import annotations

import pytest

from moeplex.conformance.dispatch_checks import (
    CASES,
    DECODE_STEP,
    TWO_IN_FLIGHT,
    checks_for,
    device_for_rank,
    hidden_size_for,
    make_context,
    payloads_for,
    run_check,
)
from moeplex.conformance.dispatch_ranks import check_key, run_on_ranks
from moeplex.conformance.plugin import load_plugin

TWO_RANKS = 2


@pytest.fixture(scope="module")
def dispatcher_cls(moeplex_plugin):
    return load_plugin(moeplex_plugin)


@pytest.fixture(scope="module")
def two_rank_results(dispatcher_cls, moeplex_plugin, tmp_path_factory):
    """Every check, run once on two ranks: {check: None or what failed}."""
    out_dir = tmp_path_factory.mktemp(f"dispatcher-{moeplex_plugin.name}")
    return run_on_ranks(moeplex_plugin.name, checks_for(dispatcher_cls.caps), TWO_RANKS, out_dir)


@pytest.fixture(scope="module")
def one_rank_dispatchers(dispatcher_cls):
    """One instance per payload, made once: some dispatchers own buffers that are slow to set up."""
    made = {}

    def get(payload: str):
        if payload not in made:
            ctx = make_context(0, 1, None, device_for_rank(), hidden_size_for(dispatcher_cls.caps), payload == "fp8")
            made[payload] = dispatcher_cls(ctx)
        return made[payload]

    return get


def run(dispatcher_cls, ranks: int, check: str, payload: str, request) -> None:
    """`check` in this process on one rank, or its result from the two-rank run."""
    caps, name = dispatcher_cls.caps, request.getfixturevalue("moeplex_plugin").name
    if payload not in payloads_for(caps):
        pytest.skip(f"dispatcher '{name}' does not declare fp8_payload")
    if ranks == 1:
        if not caps.single_rank:
            pytest.skip(f"dispatcher '{name}' does not declare single_rank")
        run_check(request.getfixturevalue("one_rank_dispatchers")(payload), check)
        return
    if not caps.multi_rank:
        pytest.skip(f"dispatcher '{name}' does not declare multi_rank")
    error = request.getfixturevalue("two_rank_results")[check_key(check, payload)]
    if error:
        pytest.fail(error, pytrace=False)


PAYLOADS = ["bf16", "fp8"]


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("ranks", [1, TWO_RANKS], ids=["one_rank", "two_ranks"])
@pytest.mark.parametrize("routing", list(CASES))
def test_combine_of_dispatch_is_weighted_sum(dispatcher_cls, ranks, routing, payload, request):
    run(dispatcher_cls, ranks, routing, payload, request)


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("ranks", [1, TWO_RANKS], ids=["one_rank", "two_ranks"])
def test_two_dispatches_in_flight(dispatcher_cls, ranks, payload, request):
    run_declared(dispatcher_cls, ranks, TWO_IN_FLIGHT, payload, request, "holds one dispatch in flight")


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("ranks", [1, TWO_RANKS], ids=["one_rank", "two_ranks"])
def test_a_decode_step_of_known_counts(dispatcher_cls, ranks, payload, request):
    """What a graph-safe dispatcher is handed in a captured decode step: every rank's count (one rank idle)."""
    run_declared(dispatcher_cls, ranks, DECODE_STEP, payload, request, "does not declare graph_safe")


def run_declared(dispatcher_cls, ranks, check, payload, request, why_not: str) -> None:
    """Run `check` where the dispatcher's caps call for it; otherwise skip, saying why."""
    if check not in checks_for(dispatcher_cls.caps):
        pytest.skip(f"dispatcher '{request.getfixturevalue('moeplex_plugin').name}' {why_not}")
    run(dispatcher_cls, ranks, check, payload, request)
