"""The public surface of moeplex's plugin API, and the snapshot that tests/test_api_snapshot.py holds it to.

    python scripts/api_snapshot.py            # what changed against tests/api/current.json (exit 1 if anything)
    python scripts/api_snapshot.py --write    # accept the change: rewrite the snapshot

--write refuses while a changed name is missing from the API section of CHANGELOG.md's top release, or while
that release's "API_VERSION n" line disagrees with moeplex.interfaces.API_VERSION: the snapshot moves only
with a CHANGELOG entry. The surface is what a plugin can see: every public name of `moeplex.interfaces`
(and of `moeplex.interfaces.kernels` where it imports), classes with their attrs fields (type, default),
methods (signature, abstract or not) and class attributes.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import importlib
import inspect
import json
import re
import sys
import types
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "api" / "current.json"  # the API on this branch; api_<n>.json beside it: released ones
CHANGELOG = ROOT / "CHANGELOG.md"
MODULES = ("moeplex.interfaces", "moeplex.interfaces.kernels")


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _stable_repr(value) -> str:
    """repr with sets in sorted order (a set's own order follows string hashing, which changes per process)."""
    if isinstance(value, (set, frozenset)) and value:
        return f"{type(value).__name__}({{{', '.join(sorted(map(_stable_repr, value)))}}})"
    return repr(value)


def _default(field) -> str:
    if field.default is attrs.NOTHING:
        return ""
    if isinstance(field.default, attrs.Factory):
        return " = <factory>"
    return f" = {_stable_repr(field.default)}"


def describe_class(cls: type) -> list[str]:
    bases = ", ".join(b.__name__ for b in cls.__bases__ if b is not object)
    lines = [f"class {cls.__name__}({bases})"]
    own = set(cls.__dict__)
    if attrs.has(cls):
        for field in attrs.fields(cls):
            if field.name in own or field.inherited is False:
                marks = " kw_only" if field.kw_only else ""
                marks += " deprecated" if "deprecation" in field.metadata else ""
                lines.append(f"field {field.name}: {field.type}{_default(field)}{marks}")
    for name, annotation in sorted(cls.__dict__.get("__annotations__", {}).items()):
        if "ClassVar" in str(annotation):
            lines.append(f"classvar {name}: {annotation}")
    if issubclass(cls, enum.Enum):
        lines += [f"member {m.name} = {m.value!r}" for m in cls]
    generated = {"__init__", "__repr__", "__eq__", "__ne__", "__hash__", "__setattr__"} if attrs.has(cls) else set()
    for name, member in sorted(cls.__dict__.items()):
        if (name.startswith("_") and name != "__init__") or name in generated or name.startswith("_abc"):
            continue
        if isinstance(member, property):
            lines.append(f"property {name}")
        elif isinstance(member, (staticmethod, classmethod)):
            lines.append(f"{type(member).__name__} {name}{_signature(member.__func__)}")
        elif inspect.isfunction(member):
            abstract = "abstract " if getattr(member, "__isabstractmethod__", False) else ""
            lines.append(f"{abstract}def {name}{_signature(member)}")
    return lines


def describe(name: str, obj) -> list[str]:
    if inspect.isclass(obj):
        return describe_class(obj)
    if inspect.isfunction(obj):
        return [f"def {name}{_signature(obj)}"]
    if isinstance(obj, (str, int, float, tuple, frozenset)):
        return [f"value {_stable_repr(obj)}"]
    return [f"alias {obj!r}"]


def surface_of(module: types.ModuleType) -> dict[str, list[str]]:
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    out = {}
    for name in sorted(names):
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType):
            continue  # submodules reached by attribute are not a contract; their public names are
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not obj.__module__.startswith("moeplex"):
            continue  # a library's name imported by a public module, not ours to version
        out[name] = describe(name, obj)
    return out


def surface() -> dict[str, list[str]]:
    """{'moeplex.interfaces.DispatcherCaps': [lines...], ...} for every public module that imports here."""
    found = {}
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # interfaces.kernels needs Triton
            found[module_name + SKIPPED] = [f"skipped: {exc}"]
            continue
        found.update({f"{module_name}.{k}": v for k, v in surface_of(module).items()})
    return found


def released() -> list[Path]:
    """The surfaces of released APIs, oldest first: tests/api/api_<API_VERSION>.json (api_1: moeplex 0.1.0)."""
    return sorted(SNAPSHOT.parent.glob("api_*.json"), key=lambda p: int(p.stem.split("_")[1]))


def load_snapshot(path: Path = SNAPSHOT) -> dict:
    return json.loads(path.read_text())


SKIPPED = " (not importable here)"


def changed_names(old: dict[str, list[str]], new: dict[str, list[str]]) -> list[str]:
    """Names whose lines differ, leaving out modules one side could not import (no Triton on that machine)."""
    skipped = tuple(k.removesuffix(SKIPPED) + "." for k in {*old, *new} if k.endswith(SKIPPED))
    names = {k for k in {*old, *new} if not k.endswith(SKIPPED) and not k.startswith(skipped)}
    return sorted(k for k in names if old.get(k) != new.get(k))


def diff_text(old: dict[str, list[str]], new: dict[str, list[str]]) -> str:
    lines = []
    for name in changed_names(old, new):
        lines += difflib.unified_diff(old.get(name, []), new.get(name, []), f"snapshot {name}", f"now {name}", lineterm="")
    return "\n".join(lines)


def top_release(text: str) -> tuple[str, str]:
    """(heading, body) of CHANGELOG.md's first release section."""
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    if not sections:
        raise ValueError("CHANGELOG.md has no '## [version]' section")
    heading, _, body = sections[0].partition("\n")
    return heading.strip(), body


def api_section(body: str) -> str:
    match = re.search(r"^### API\n(.*?)(?=^### |\Z)", body, flags=re.M | re.S)
    return match.group(1) if match else ""


def release_api_version(body: str) -> int | None:
    match = re.search(r"API_VERSION (\d+)", body)
    return int(match.group(1)) if match else None


def unlogged(names: list[str], changelog: str) -> list[str]:
    """The changed names the top release's API section does not name in backticks (`DispatcherCaps` or a
    member of it, `DispatcherCaps.combine_applies_weights`)."""
    section = api_section(top_release(changelog)[1])
    mentioned = set(re.findall(r"`([A-Za-z_][\w.]*)", section))
    mentioned |= {m.split(".")[0] for m in mentioned}
    return [n for n in names if n.rsplit(".", 1)[-1] not in mentioned]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite tests/api/current.json (needs the CHANGELOG entry)")
    args = parser.parse_args(argv)
    from moeplex.interfaces import API_VERSION

    now = surface()
    stored = load_snapshot(SNAPSHOT if SNAPSHOT.exists() else released()[-1])
    names = changed_names(stored["surface"], now)
    if not names and stored["api_version"] == API_VERSION:
        print(f"the plugin API (API_VERSION {API_VERSION}) matches {SNAPSHOT.relative_to(ROOT)}")
        return 0
    print(diff_text(stored["surface"], now) or f"API_VERSION {stored['api_version']} -> {API_VERSION}")
    if not args.write:
        print(f"\n{len(names)} public names changed; name them under '### API' of CHANGELOG.md's top release, "
              "then run: python scripts/api_snapshot.py --write")
        return 1
    changelog = CHANGELOG.read_text()
    missing = unlogged(names, changelog)
    version = release_api_version(top_release(changelog)[1])
    if missing or version != API_VERSION:
        if missing:
            print(f"\nnot written: CHANGELOG.md's top release names none of {', '.join(missing)} under '### API'")
        if version != API_VERSION:
            print(f"\nnot written: CHANGELOG.md's top release says API_VERSION {version}, moeplex.interfaces {API_VERSION}")
        return 1
    SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
    SNAPSHOT.write_text(json.dumps({"api_version": API_VERSION, "surface": now}, indent=1, sort_keys=True) + "\n")
    print(f"\nwrote {SNAPSHOT.relative_to(ROOT)} ({len(now)} names, API_VERSION {API_VERSION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
