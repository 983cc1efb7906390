"""The plugin API's public surface changes only with a CHANGELOG entry and an API_VERSION.

tests/api/current.json is the surface on this branch, written by `python scripts/api_snapshot.py --write`,
which refuses unless CHANGELOG.md's top release names every changed name under '### API' and says the
API_VERSION moeplex.interfaces has. tests/api/api_1.json is moeplex 0.1.0's surface (API_VERSION 1).
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from moeplex.interfaces import API_VERSION

ROOT = Path(__file__).parents[1]
SPEC = importlib.util.spec_from_file_location("api_snapshot", ROOT / "scripts" / "api_snapshot.py")
snap = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(snap)
REGENERATE = ("add a bullet naming them under '### API' of CHANGELOG.md's top release, "
              "then run: python scripts/api_snapshot.py --write")


@pytest.fixture(scope="module")
def surface():
    return snap.surface()


def test_the_public_surface_matches_the_snapshot(surface):
    stored = snap.load_snapshot()
    changed = snap.changed_names(stored["surface"], surface)
    assert not changed, f"the plugin API changed ({', '.join(changed)}):\n{snap.diff_text(stored['surface'], surface)}\n{REGENERATE}"
    assert stored["api_version"] == API_VERSION, f"API_VERSION is {API_VERSION}, the snapshot's {stored['api_version']}; {REGENERATE}"


def test_the_changelog_names_every_change_since_the_first_release(surface):
    changelog = snap.CHANGELOG.read_text()
    first = snap.load_snapshot(snap.released()[0])
    assert first["api_version"] == 1
    changed = snap.changed_names(first["surface"], surface)
    api_sections = "".join(snap.api_section(s) for s in re.split(r"^## ", changelog, flags=re.M)[1:])
    named = set(re.findall(r"`([A-Za-z_][\w.]*)", api_sections))
    named |= {n.split(".")[0] for n in named}
    missing = [n for n in changed if n.rsplit(".", 1)[-1] not in named]
    assert not missing, f"changed since 0.1.0 without an API entry in CHANGELOG.md: {missing}"
    assert changed and API_VERSION > first["api_version"]


def test_the_top_release_carries_this_package_and_api_version():
    heading, body = snap.top_release(snap.CHANGELOG.read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert heading.startswith(f"[{version}]"), (heading, version)
    assert snap.release_api_version(body) == API_VERSION


def test_write_refuses_a_change_the_changelog_does_not_name():
    changelog = "# Changelog\n\n## [9.9.0] - unreleased\n\nAPI_VERSION 9\n\n### API\n\n- Added `GrammarBackend`.\n\n### Added\n\n- `Other`\n"
    names = ["moeplex.interfaces.GrammarBackend", "moeplex.interfaces.DispatcherCaps", "moeplex.interfaces.Other"]
    assert snap.unlogged(names, changelog) == ["moeplex.interfaces.DispatcherCaps", "moeplex.interfaces.Other"]
    member = changelog.replace("`GrammarBackend`", "`GrammarBackend` and `DispatcherCaps.new_field`")
    assert snap.unlogged(names[:2], member) == []
    assert snap.release_api_version(snap.top_release(changelog)[1]) == 9


def test_the_surface_sees_fields_signatures_and_defaults(surface):
    """What a plugin notices shows in the snapshot: a field's default, a method's arguments, abstractness."""
    caps = surface["moeplex.interfaces.DispatcherCaps"]
    assert "field max_in_flight: int = 2" in caps
    assert any(line.startswith("field combine_applies_weights") and line.endswith("deprecated") for line in caps)
    dispatcher = surface["moeplex.interfaces.Dispatcher"]
    assert any(line.startswith("abstract def dispatch_start(self, hidden") for line in dispatcher)
    assert surface["moeplex.interfaces.API_VERSION"] == [f"value {API_VERSION}"]
