"""`moeplex plugins`: the plugin API version, and every installed plugin by kind with its distribution, version
and capabilities."""

from __future__ import annotations

import importlib.metadata as md
import json

from .. import registry
from ..interfaces import API_VERSION


TITLES = {"dispatcher": "dispatchers", "moe_kernel": "MoE kernels", "balancer": "balancers", "overlap": "overlap strategies",
          "kv_transfer": "KV transfer backends", "drafter": "drafters", "grammar_backend": "grammar backends"}


def add_parser(sub) -> None:
    p = sub.add_parser("plugins", help="list installed dispatchers, MoE kernels, balancers, overlap strategies, KV transfer "
                       "backends, drafters and grammar backends")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table: the kinds' "
                   "lists of plugins, and under \"api\" moeplex's version and API_VERSION")
    p.set_defaults(run=run)


def _describe(info: registry.PluginInfo) -> dict:
    entry = {"name": info.name, "distribution": info.distribution, "version": info.version, "target": info.target}
    try:
        entry["capabilities"] = info.capabilities()
    except registry.PluginError as exc:
        entry["error"] = str(exc)
    return entry


def api() -> dict:
    """What a plugin is checked against: the plugin API version (moeplex.interfaces.API_VERSION)."""
    return {"moeplex": md.version("moeplex"), "api_version": API_VERSION}


def run(args) -> int:
    listing = {kind: [_describe(info) for info in registry.discover(kind).values()] for kind in registry.KINDS}
    if args.json:
        print(json.dumps({"api": api(), **listing}, indent=2))
        return 0
    print(f"moeplex {api()['moeplex']}, plugin API_VERSION {API_VERSION}")
    for kind, entries in listing.items():
        print(f"{TITLES[kind]}:")
        for e in entries:
            caps = e.get("capabilities")
            shown = ", ".join(f"{k}={v}" for k, v in caps.items() if v not in (False, None, [], 0)) if caps else e["error"]
            print(f"  {e['name']:<16} {e['distribution']} {e['version']:<10} {shown}")
    return 0
