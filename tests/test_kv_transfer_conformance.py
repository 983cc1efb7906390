"""The kv_transfer conformance suite passes every built-in backend that runs here and fails the broken ones.

It runs in-process as a third party runs it (`pytest --pyargs moeplex.conformance --moeplex-plugin
kv_transfer:NAME`, from an empty folder); the broken backends (tests/kv_transfer_broken.py) are found
through a dist-info folder on sys.path, as an installed package's would be.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

import kv_transfer_broken
from moeplex import registry
from moeplex.interfaces import PluginError
from moeplex.plugins.kv_transfer.nixl import load_nixl


class Outcomes:
    def __init__(self):
        self.by_test: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.by_test[report.nodeid.rpartition("::")[2]] = report.outcome


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    kv_transfer_broken.write_distribution(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    monkeypatch.chdir(tmp_path)  # no project settings apply
    importlib.invalidate_caches()
    yield
    sys.modules.pop("kv_transfer_broken", None)


def run_suite(name: str, select: str | None = None) -> dict[str, str]:
    outcomes = Outcomes()
    args = ["-q", "--tb=line", "-p", "no:cacheprovider", "--pyargs", "moeplex.conformance", "--moeplex-plugin", f"kv_transfer:{name}"]
    code = pytest.main(args + (["-k", select] if select else []), plugins=[outcomes])
    assert code in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED), f"the suite did not run: exit {code}"
    return outcomes.by_test


@pytest.mark.parametrize("name", ["loopback", "zmq", "nixl"])
def test_builtin_backend_passes(third_party, name):
    if name not in registry.discover("kv_transfer"):
        pytest.skip(f"kv_transfer '{name}' is not installed")
    if name == "nixl":
        try:
            load_nixl()
        except PluginError as exc:
            pytest.skip(str(exc))
    outcomes = run_suite(name)
    ran = {test: o for test, o in outcomes.items() if o != "skipped"}
    assert len(ran) >= 15 and set(ran.values()) == {"passed"}, outcomes


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
