"""Running a conformance suite in-process as a third party runs it, with test-only plugins found through a
dist-info folder on sys.path (as an installed package's would be)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest


class Outcomes:
    """Collects each test's outcome by its id, e.g. 'test_placement_keeps_the_contract[...]' -> 'failed'."""

    def __init__(self):
        self.by_test: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.by_test[report.nodeid.rpartition("::")[2]] = report.outcome


def run_conformance(plugin: str | list[str], select: str | None = None) -> dict[str, str]:
    """`pytest --pyargs moeplex.conformance --moeplex-plugin KIND:NAME ... [-k select]`: each test's outcome."""
    outcomes = Outcomes()
    selected = [arg for p in ([plugin] if isinstance(plugin, str) else plugin) for arg in ("--moeplex-plugin", p)]
    args = ["-q", "--tb=line", "-p", "no:cacheprovider", "--pyargs", "moeplex.conformance", *selected]
    code = pytest.main(args + (["-k", select] if select else []), plugins=[outcomes])
    assert code in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED), f"the suite did not run: exit {code}"
    return outcomes.by_test


def installed(module, tmp_path, monkeypatch):
    """Generator for a fixture: `module`'s plugins installed through a dist-info folder, run from an empty
    folder (no project settings apply, as for a third party)."""
    site = tmp_path / "site"
    site.mkdir()
    module.write_distribution(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    monkeypatch.chdir(tmp_path)
    importlib.invalidate_caches()
    yield
    sys.modules.pop(module.__name__, None)
