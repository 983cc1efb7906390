"""Merge measured entries into a hardware profile: the `--profile` step's outputs become a profile file.

Every benchmark of benchmarks/plan_profile.sh writes JSON whose top-level entries are profile entries
({"value": ..., "source": ...}; `moe_tables` entries by table name). `merge` lays them over a base profile in
the order given (an entry equal to the base's is no news: a whole profile a benchmark wrote around its own entries
changes only those), keeps every other entry of the base as it was, and records what each merged entry replaced, so
a reviewer sees every number that moved and where it came from (`moeplex plan profile-update`).
"""

from __future__ import annotations

import json
from pathlib import Path

from .profile import _read_json


def is_entry(value) -> bool:
    return isinstance(value, dict) and "value" in value and "source" in value


def merge(base: str, measured: list[str]) -> tuple[dict, list[tuple[str, object, object, str]]]:
    """(the merged profile JSON, [(key, old value or None, new value, source)]) of `measured` files over `base`.

    `base` is a shipped profile name (h200) or a JSON file; a measured file's entries without a source are refused,
    so nothing enters a profile unexplained.
    """
    data = _read_json(base)
    original = json.loads(json.dumps(data))
    changes = []
    for path in measured:
        fragment = json.loads(Path(path).read_text())
        if not isinstance(fragment, dict):
            raise ValueError(f"{path}: a measured file is a JSON object of profile entries")
        entries = {k: v for k, v in fragment.items() if k not in ("name", "description", "moe_tables", "launches")}
        for key, entry in entries.items():
            if not isinstance(entry, dict) or "value" not in entry:
                continue  # the file's own details (a routing record's counts, a run's rows): not profile entries
            if not entry.get("source"):
                raise ValueError(f"{path}: entry {key!r} has no source; every number of a profile names where it came from")
            if entry == original.get(key):
                continue  # a whole profile a benchmark wrote around its own entries: the base's entries are not news
            old = data.get(key, {}).get("value") if is_entry(data.get(key)) else None
            if old != entry["value"]:
                changes.append((key, old, entry["value"], entry["source"]))
            data[key] = {k: v for k, v in entry.items()}
        for name, table in (fragment.get("moe_tables") or {}).items():
            if not isinstance(table, dict) or "rows" not in table:
                continue
            if not table.get("source"):
                raise ValueError(f"{path}: moe table {name!r} has no source")
            if table == original["moe_tables"].get(name):
                continue
            old = data["moe_tables"].get(name, {}).get("rows") if isinstance(data["moe_tables"].get(name), dict) else None
            if old != table["rows"]:
                changes.append((f"moe_tables.{name}", old, table["rows"], table["source"]))
            data["moe_tables"][name] = table
    return data, changes


def write(data: dict, out: str) -> None:
    Path(out).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def short(value, width: int = 60) -> str:
    text = "-" if value is None else json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."
