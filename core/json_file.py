"""Reading a JSON file a user handed us: a broken or wrong-shaped file is refused in a sentence naming it."""

from __future__ import annotations

import json


class FileFormatError(ValueError):
    """A file that is not what its role needs (broken JSON, not an object, a field missing)."""


def read_json_object(path: str, what: str = "JSON") -> dict:
    """The object in `path`; `what` names the file's role in the refusal ("load", "config")."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise FileFormatError(f"{path} is not a JSON {what} file: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except UnicodeDecodeError:
        raise FileFormatError(f"{path} is not a {what} file: it is not UTF-8 text") from None
    if not isinstance(data, dict):
        raise FileFormatError(f"{path} must hold a JSON object, but it holds a {_json_kind(data)}")
    return data


def _json_kind(value) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)
