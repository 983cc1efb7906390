"""The kv_transfer conformance suite passes cuda-ipc's protocol on CPU memory and fails the broken backends.

(That it passes every built-in backend that runs here, all of its tests, is checked by test_conformance.py's
run of every built-in plugin in a fresh process: the same suite, run once rather than twice.)

It runs in-process as a third party runs it (`pytest --pyargs moeplex.conformance --moeplex-plugin
kv_transfer:NAME`, from an empty folder); the broken backends (tests/kv_transfer_broken.py) are found
through a dist-info folder on sys.path, as an installed package's would be.
"""

from __future__ import annotations

import pytest

import kv_transfer_broken
from conformance_run import installed, run_conformance


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    yield from installed(kv_transfer_broken, tmp_path, monkeypatch)


def run_suite(name: str, select: str | None = None) -> dict[str, str]:
    return run_conformance(f"kv_transfer:{name}", select)


def test_cuda_ipc_protocol_passes_on_cpu_memory(third_party):
    """cuda-ipc's pull-and-confirm code, with shared files in place of CUDA IPC (tests/kv_transfer_cpu_pull.py)."""
    outcomes = run_suite("cpu-pull")
    ran = {test: o for test, o in outcomes.items() if o != "skipped"}
    assert len(ran) >= 15 and set(ran.values()) == {"passed"}, outcomes


def test_suite_fails_a_backend_that_acknowledges_before_the_bytes_land(third_party):
    outcomes = run_suite("acks-before-bytes")
    failed = {test.partition("[")[0] for test, o in outcomes.items() if o == "failed"}
    assert {"test_moves_pages_and_metadata", "test_done_means_the_bytes_landed"} <= failed, outcomes
    assert outcomes["test_unexpected_room_is_dropped_and_fails[acks-before-bytes]"] == "passed", outcomes


def test_suite_fails_a_backend_that_writes_after_an_abort(third_party):
    outcomes = run_suite("writes-after-abort", "abort or dropped")
    assert outcomes["test_room_aborted_by_the_receiver_is_dropped[writes-after-abort]"] == "failed", outcomes
    assert outcomes["test_nothing_lands_after_the_receiver_aborts[writes-after-abort]"] == "failed", outcomes
    assert outcomes["test_unexpected_room_is_dropped_and_fails[writes-after-abort]"] == "passed", outcomes


def test_suite_fails_a_backend_whose_bytes_land_just_after_its_done(third_party):
    """20 ms behind, across processes: the look at the pages follows the receiver's DONE in its own process.
    (The sender's DONE waits for a message from the receiver, which on a loaded machine may itself take that long:
    whether the sender-side test catches this backend depends on that, not on the suite.)"""
    outcomes = run_suite("done-before-its-copies", "done_means")
    assert outcomes["test_done_means_the_bytes_landed[done-before-its-copies-receiver]"] == "failed", outcomes


def test_suite_fails_a_backend_that_waits_for_a_dead_peer_for_ever(third_party):
    outcomes = run_suite("ignores-a-dead-peer", "dead_peer or moves_pages")
    assert outcomes["test_a_dead_peer_ends_every_wait_with_a_reason[ignores-a-dead-peer-receiver]"] == "failed", outcomes
    assert outcomes["test_moves_pages_and_metadata[ignores-a-dead-peer-mha]"] == "passed", outcomes
