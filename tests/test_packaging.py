"""What a plugin author installs: the conformance suites' pytest comes with an extra of moeplex."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_conformance_extra_brings_pytest_and_is_documented():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "moeplex.conformance.plugin" in project["entry-points"]["pytest11"].values()
    assert any(req.startswith("pytest") for req in project["optional-dependencies"].get("conformance", [])), (
        "the conformance suites are a pytest plugin, but no moeplex extra installs pytest"
    )
    for doc in ("README.md", "docs/plugins.md"):
        assert "moeplex[conformance]" in (ROOT / doc).read_text(), f"{doc} does not say how to get pytest"
