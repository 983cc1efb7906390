"""The pytest plugin behind `--moeplex-plugin KIND:NAME`: which installed plugins the conformance suites test.

pytest loads this module in every run wherever moeplex is installed (it is a `pytest11`
entry point), so it acts only on the suite modules in this folder, `test_<kind>.py`, and
imports the registry (and with it torch) only when it does:

    pytest --pyargs moeplex.conformance                                    every installed plugin of every kind
    pytest --pyargs moeplex.conformance --moeplex-plugin moe_kernel:dense  that kernel, and only the kernel suite
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

SUITES = Path(__file__).resolve().parent
PLUGIN_ARG = "moeplex_plugin"  # the test argument that receives the PluginInfo under test
_SELECTION = pytest.StashKey[dict | None]()


def pytest_addoption(parser):
    group = parser.getgroup("moeplex", "moeplex conformance suites")
    group.addoption(
        "--moeplex-plugin",
        action="append",
        default=[],
        metavar="KIND:NAME",
        help="run the moeplex conformance suite of KIND (dispatcher, moe_kernel, balancer, overlap, kv_transfer, drafter, grammar_backend) on the "
        "installed plugin NAME; repeatable. Without it every installed plugin of every kind is tested.",
    )


def pytest_configure(config):
    config.stash[_SELECTION] = parse_selection(config.getoption("moeplex_plugin"))


def parse_selection(values: list[str]) -> dict[str, list[str]] | None:
    """{kind: [names]} from the --moeplex-plugin values; None when none was given (test everything)."""
    if not values:
        return None
    from moeplex import registry

    selection: dict[str, list[str]] = {}
    for value in values:
        kind, _, name = value.partition(":")
        if kind not in registry.KINDS:
            raise pytest.UsageError(
                f"--moeplex-plugin {value}: unknown plugin kind '{kind}'; kinds are {', '.join(registry.KINDS)}."
            )
        if name not in registry.discover(kind):
            raise pytest.UsageError(
                f"--moeplex-plugin {value}: no {kind} named '{name}' is installed; "
                f"installed {kind}s: {registry.installed_names(kind)}."
            )
        names = selection.setdefault(kind, [])
        if name not in names:
            names.append(name)
    return selection


def suite_kind(path: Path) -> str | None:
    """The plugin kind a conformance suite module tests (`test_<kind>.py` in this folder), else None."""
    if not (path.name.startswith("test_") and path.suffix == ".py"):
        return None
    if path.parent.resolve() != SUITES:
        return None
    return path.stem.removeprefix("test_")


def pytest_ignore_collect(collection_path: Path, config):
    """A run that names plugins of some kinds does not collect the other kinds' suites."""
    selection = config.stash.get(_SELECTION, None)
    kind = suite_kind(collection_path)
    if kind is not None and selection is not None and kind not in selection:
        return True
    return None


class SuiteModule(pytest.Module):
    """A suite imported by its package name, whatever folder an (editable) install maps the package from."""

    def _getobj(self):
        module = importlib.import_module(f"{__package__}.{self.path.stem}")
        self.config.pluginmanager.consider_module(module)
        return module


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent):
    if suite_kind(module_path) is None:
        return None
    return SuiteModule.from_parent(parent, path=module_path)


def pytest_generate_tests(metafunc):
    kind = suite_kind(metafunc.definition.path)
    if kind is None or PLUGIN_ARG not in metafunc.fixturenames:
        return
    plugins = plugins_under_test(metafunc.config, kind)
    metafunc.parametrize(PLUGIN_ARG, plugins, ids=[p.name for p in plugins], scope="module")


def plugins_under_test(config, kind: str) -> list:
    """The PluginInfo of every plugin of `kind` this run tests."""
    from moeplex import registry

    installed = registry.discover(kind)
    selection = config.stash.get(_SELECTION, None)
    if selection is None:
        return list(installed.values())
    return [installed[name] for name in selection.get(kind, [])]


def load_plugin(info) -> type:
    """The class of the plugin under test; skips the test when it needs a GPU and none is visible."""
    import torch

    cls = info.load()
    if getattr(cls.caps, "needs_gpu", False) and not torch.cuda.is_available():
        pytest.skip(f"{info.kind} '{info.name}' needs a CUDA GPU and none is visible")
    return cls
