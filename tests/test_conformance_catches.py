"""The conformance suites fail realistic broken plugins (tests/fake_plugins.py), run in-process as a third party runs them."""

from __future__ import annotations

import pytest

import broken_drafters
import fake_plugins
from conformance_run import installed, run_conformance


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    yield from installed(fake_plugins, tmp_path, monkeypatch)


def test_fp16_inside_passes_at_unit_scale_where_the_old_suite_looked(fake_distribution):
    """What let it through before: unit-scale data, on which fp16 arithmetic is as exact as bf16."""
    outcomes = run_conformance("moe_kernel:fake-fp16-inside", "matches_torch_reference and random")
    ran = [o for o in outcomes.values() if o != "skipped"]
    assert ran and set(ran) == {"passed"}, outcomes


def test_balancer_suite_fails_a_balancer_that_starves_idle_experts(fake_distribution):
    outcomes = run_conformance("balancer:fake-starves-idle", "idle_experts or one_hot or zero")
    failed = [test for test, outcome in outcomes.items() if outcome == "failed"]
    assert any(test.startswith("test_every_logical_expert_keeps_a_replica") for test in failed), outcomes
    assert any(test.startswith("test_placement_keeps_the_contract") for test in failed), outcomes
    zero = [o for test, o in outcomes.items() if test.endswith("-zero]")]
    assert zero and all(o == "passed" for o in zero), f"all-zero loads are not where it breaks: {outcomes}"


@pytest.mark.parametrize("kernel", ["fake-fp16-inside", "fake-fp8-inside"])
def test_kernel_suite_fails_a_kernel_that_computes_narrower_than_it_declares(fake_distribution, kernel):
    outcomes = run_conformance(f"moe_kernel:{kernel}", "declared_dtype")
    ran = [o for test, o in outcomes.items() if o != "skipped"]
    assert len(ran) == 3 and set(ran) == {"failed"}, outcomes  # its one dtype, on each layout


@pytest.fixture
def drafter_distribution(tmp_path, monkeypatch):
    yield from installed(broken_drafters, tmp_path, monkeypatch)


def test_drafter_suite_fails_each_broken_drafter_where_the_ngram_one_passes(drafter_distribution):
    """Out-of-vocabulary ids, no proposals at all, state kept past finished(), answers in the wrong order: each
    fails the test that drives the drafter where it drafts, and moeplex's ngram passes it in the same run."""
    broken = [name for entries in broken_drafters.ENTRY_POINTS.values() for name in entries]
    outcomes = run_conformance([f"drafter:{name}" for name in ["ngram", *broken]], "belong_to_the_request")
    by_name = {test.split("[")[1].rstrip("]"): outcome for test, outcome in outcomes.items()}
    assert by_name == {"ngram": "passed", **{name: "failed" for name in broken}}, outcomes


def test_grammar_suite_fails_a_mask_that_lets_invalid_tokens_through(fake_distribution):
    outcomes = run_conformance("grammar_backend:fake-leaky-mask", "following_the_mask")
    assert outcomes and all(o == "failed" for o in outcomes.values()), outcomes


def test_grammar_suite_fails_a_backend_that_cannot_roll_back(fake_distribution):
    outcomes = run_conformance("grammar_backend:fake-forgetful-rollback", "rollback or regex")
    assert outcomes["test_rollback_restores_the_state[fake-forgetful-rollback]"] == "failed", outcomes
    assert all(o == "passed" for test, o in outcomes.items() if "regex" in test), outcomes


def test_grammar_suite_fails_a_backend_that_blocks_while_compiling(fake_distribution):
    outcomes = run_conformance("grammar_backend:fake-holds-the-gil", "leaves_other_threads or cannot_compile")
    assert outcomes["test_compiling_leaves_other_threads_running[fake-holds-the-gil]"] == "failed", outcomes
    assert all(o == "passed" for test, o in outcomes.items() if "cannot_compile" in test), outcomes
