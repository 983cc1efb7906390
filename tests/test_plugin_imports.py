"""Every plugin shipped with moeplex imports moeplex only through its public plugin API.

The built-ins are peers of third-party plugins: what they import, a third party may import.
The public modules are declared once, as `moeplex.interfaces.PUBLIC_MODULES` (and listed in
docs/plugins.md); a relative import must stay inside the plugin packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from moeplex.interfaces import PUBLIC_MODULES

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_TREES = {  # folder -> the package it is imported as
    ROOT / "plugins": "moeplex.plugins",
    ROOT / "examples" / "moeplex-example-plugins" / "moeplex_example_plugins": "moeplex_example_plugins",
}


def module_name(path: Path, tree: Path, package: str) -> str:
    parts = [package, *path.relative_to(tree).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, tree: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, relative ones resolved."""
    name = module_name(path, tree, package)
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            # `from moeplex import quant` imports the module moeplex.quant
            found += [(node.lineno, f"{module}.{alias.name}" if module == "moeplex" else module) for alias in node.names]
    return list(dict.fromkeys(found))  # one entry per module a line imports


def violations(path: Path, tree: Path, package: str) -> list[str]:
    bad = []
    for line, module in imported_modules(path, tree, package):
        if module.startswith(package + ".") or module == package:
            continue  # the plugin package's own modules
        if (module == "moeplex" or module.startswith("moeplex.")) and module not in PUBLIC_MODULES:
            bad.append(f"{path.relative_to(tree.parent)}:{line} imports {module}")
    return bad


def plugin_files() -> list[tuple[Path, Path, str]]:
    return [(path, tree, package) for tree, package in PLUGIN_TREES.items() for path in sorted(tree.rglob("*.py"))]


def test_plugins_import_only_the_public_api():
    bad = [line for path, tree, package in plugin_files() for line in violations(path, tree, package)]
    assert not bad, f"plugins may import only {', '.join(PUBLIC_MODULES)} of moeplex:\n" + "\n".join(bad)


def test_the_check_sees_private_and_escaping_imports(tmp_path):
    plugin = tmp_path / "pkg" / "kind" / "mine.py"
    plugin.parent.mkdir(parents=True)
    plugin.write_text(
        "from moeplex.interfaces import MoEKernel\nfrom moeplex.interfaces.kernels import quantize_rows\n"
        "from .sibling import x\nimport moeplex.quant\nfrom moeplex import registry\nfrom moeplex.kernels.fp8 import q\n"
    )
    bad = violations(plugin, tmp_path / "pkg", "moeplex.plugins")
    assert [entry.split(" imports ")[1] for entry in bad] == ["moeplex.quant", "moeplex.registry", "moeplex.kernels.fp8"]


@pytest.mark.parametrize("doc", ["docs/plugins.md", "README.md"])
def test_the_docs_name_the_public_modules_and_no_other(doc):
    text = (ROOT / doc).read_text()
    for module in PUBLIC_MODULES:
        assert f"`{module}`" in text, f"{doc} does not name {module} among what a plugin may import"
    for private in ("moeplex.quant", "moeplex.kernels", "moeplex.moe", "moeplex.registry", "moeplex.forward_batch"):
        assert f"`{private}`" not in text, f"{doc} offers {private} to plugins, which may import only {PUBLIC_MODULES}"
