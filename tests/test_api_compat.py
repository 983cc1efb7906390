"""A plugin package written against the first plugin API (moeplex 0.1.0, API_VERSION 1) keeps working.

tests/fixtures/acme-moe-plugins is such a package, written from docs/plugins.md as it read then: a dispatcher
that still declares `combine_applies_weights` (removed from DispatcherCaps without a deprecation, which made
every plugin of the package fail to import), a kernel and a balancer. The test builds and installs it from its
own source folder as a user would (pip, into a folder put on PYTHONPATH), then loads it through entry points in
fresh processes: `moeplex plugins`, its conformance suites, and `moeplex generate` with all three.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from moeplex.interfaces import API_VERSION, DispatcherCaps, deprecation

FIXTURE = Path(__file__).parent / "fixtures" / "acme-moe-plugins"
ACME = {"dispatcher": "acme-local", "moe_kernel": "acme-loop", "balancer": "acme-roundrobin"}
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def acme_site(tmp_path_factory) -> Path:
    """The folder pip installed acme-moe-plugins into, built from a copy of its source folder (a build writes
    build/ and *.egg-info next to the sources; the tree stays clean)."""
    work = tmp_path_factory.mktemp("acme")
    source, target = work / "src", work / "site"
    shutil.copytree(FIXTURE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    # --no-build-isolation: the build uses this environment's setuptools, as CI without an index must
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--no-build-isolation", "--no-index", "--target", str(target), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (target / "acme_moe_plugins-0.3.1.dist-info" / "entry_points.txt").exists()
    return target


def run_with(site: Path, *args: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def test_every_plugin_of_the_package_loads_and_is_listed(acme_site, tmp_path):
    result = run_with(acme_site, "-m", "moeplex.cli", "plugins", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    listing = json.loads(result.stdout)
    assert listing["api"]["api_version"] == API_VERSION
    for kind, name in ACME.items():
        entry = next((e for e in listing[kind] if e["name"] == name), None)
        assert entry is not None, f"{kind} {name} is not listed"
        assert "error" not in entry, entry["error"]
        assert entry["distribution"] == "acme-moe-plugins" and entry["version"] == "0.3.1"
    # a deprecated field is not a capability: it is not listed as one
    assert "combine_applies_weights" not in next(e for e in listing["dispatcher"] if e["name"] == "acme-local")["capabilities"]


def test_the_package_passes_its_conformance_suites(acme_site, tmp_path):
    selected = [arg for kind, name in ACME.items() for arg in ("--moeplex-plugin", f"{kind}:{name}")]
    result = run_with(acme_site, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--pyargs", "moeplex.conformance",
                      *selected, cwd=tmp_path)
    tail = result.stdout[-3000:]
    assert result.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail
    passed = [line for line in result.stdout.splitlines() if line.endswith("PASSED") or " PASSED " in line]
    for name in ACME.values():  # each suite ran on its plugin, not just skipped
        assert any(f"[{name}" in line for line in passed), f"no conformance test of {name} passed"


def test_generate_with_the_package_equals_the_built_ins(acme_site, tiny_model_dir, tmp_path):
    model = tiny_model_dir("qwen3_moe")
    common = ["-m", "moeplex.cli", "generate", "--model", model, "--prompt", "hello there", "--max-new-tokens", "6",
              "--ignore-eos", "--json", "--dtype", "fp32"]
    acme = run_with(acme_site, *common, "--dispatcher", "acme-local", "--moe-kernel", "acme-loop",
                    "--balancer", "acme-roundrobin", cwd=tmp_path)
    assert acme.returncode == 0, acme.stderr[-3000:]
    built_in = run_with(acme_site, *common, "--dispatcher", "local", "--moe-kernel", "torch", cwd=tmp_path)
    assert built_in.returncode == 0, built_in.stderr[-3000:]
    ids = [json.loads(r.stdout.splitlines()[0])["output_ids"] for r in (acme, built_in)]
    assert ids[0] == ids[1]
    # the start-up line names the plugins, and the deprecation is logged once, naming plugin and removal release
    assert "dispatcher acme-local (acme-moe-plugins 0.3.1)" in acme.stderr
    logged = [line for line in acme.stderr.splitlines() if "combine_applies_weights" in line]
    assert len(logged) == 1, logged
    assert "dispatcher 'acme-local' from acme-moe-plugins 0.3.1" in logged[0] and "0.4.0" in logged[0]
    assert "ExpertOutput" in logged[0]


def test_a_deprecated_field_warns_at_the_plugins_line_and_changes_nothing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = DispatcherCaps(layout="standard", multi_rank=False, combine_applies_weights=True)
    assert [w.category for w in caught] == [DeprecationWarning]
    assert caught[0].filename == __file__  # points at the plugin's line, not at moeplex
    message = str(caught[0].message)
    assert "combine_applies_weights" in message and "0.4.0" in message and __name__ in message
    assert old == DispatcherCaps(layout="standard", multi_rank=False)
    assert deprecation.in_use(old) == [deprecation.COMBINE_APPLIES_WEIGHTS]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DispatcherCaps(layout="standard", multi_rank=False)
    assert caught == []


def test_the_deprecation_log_names_each_plugin_once(caplog):
    log = deprecation.DeprecationLog()
    with caplog.at_level(logging.WARNING, logger="moeplex.deprecation"):
        assert log.report(deprecation.COMBINE_APPLIES_WEIGHTS, "dispatcher 'a' from p 1.0")
        assert not log.report(deprecation.COMBINE_APPLIES_WEIGHTS, "dispatcher 'a' from p 1.0")
        assert log.report(deprecation.COMBINE_APPLIES_WEIGHTS, "dispatcher 'b' from p 1.0")
    assert [r.getMessage().split(" uses ")[0] for r in caplog.records] == ["dispatcher 'a' from p 1.0", "dispatcher 'b' from p 1.0"]


def test_every_deprecation_keeps_the_policy():
    """Removed no earlier than two minor releases after the deprecating one, and listed in CHANGELOG.md."""
    changelog = (Path(__file__).parents[1] / "CHANGELOG.md").read_text()
    for dep in deprecation.DEPRECATIONS:
        since, removed = (tuple(int(p) for p in v.split(".")[:2]) for v in (dep.since, dep.removed_in))
        assert removed[0] > since[0] or removed[1] >= since[1] + 2, dep
        field = dep.name.split("(")[1].split("=")[0] if "(" in dep.name else dep.name
        assert f"`{dep.name.split('(')[0]}.{field}`" in changelog or f"`{dep.name}`" in changelog, dep
