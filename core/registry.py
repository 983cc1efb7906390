"""Plugin discovery through entry points, and the start-up check of a selection.

Built-in plugins register through the same entry-point groups as third-party
packages; the core never imports a plugin module by name.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

import attrs

from .interfaces import deprecation
from .interfaces import (
    Balancer, Dispatcher, Drafter, GrammarBackend, KVTransfer, MoEKernel, OverlapStrategy, PluginError,
)

KINDS = {
    "dispatcher": ("moeplex.dispatchers", Dispatcher),
    "moe_kernel": ("moeplex.moe_kernels", MoEKernel),
    "balancer": ("moeplex.balancers", Balancer),
    "overlap": ("moeplex.overlap", OverlapStrategy),
    "kv_transfer": ("moeplex.kv_transfer", KVTransfer),
    "drafter": ("moeplex.drafters", Drafter),
    "grammar_backend": ("moeplex.grammar_backends", GrammarBackend),
}


@attrs.frozen
class PluginInfo:
    kind: str
    name: str
    target: str  # "module:attr" of the entry point
    distribution: str
    version: str

    def load(self) -> type:
        base = KINDS[self.kind][1]
        try:
            cls = _entry_point(self).load()
        except Exception as exc:  # a broken third-party package must name itself
            raise PluginError(
                f"{self.kind} '{self.name}' from {self.distribution} {self.version} failed to import ({exc!r})."
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise PluginError(
                f"{self.kind} '{self.name}' from {self.distribution} ({self.target}) is not a subclass of {base.__name__}."
            )
        if not hasattr(cls, "caps"):
            raise PluginError(f"{self.kind} '{self.name}' from {self.distribution} declares no `caps`.")
        if attrs.has(type(cls.caps)):
            for used in deprecation.in_use(cls.caps):
                deprecation.LOGGED.report(used, self.label)
        return cls

    @property
    def label(self) -> str:
        """How messages name the plugin: "dispatcher 'acme-local' from acme-moe-plugins 0.3.1"."""
        return f"{self.kind} '{self.name}' from {self.distribution} {self.version}"

    def capabilities(self) -> dict[str, Any]:
        caps = self.load().caps
        shown = attrs.asdict(caps, recurse=False, filter=lambda field, _: "deprecation" not in field.metadata)
        return {k: _plain(v) for k, v in shown.items()}


def _plain(value):
    if isinstance(value, (frozenset, set)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if hasattr(value, "is_floating_point"):  # torch.dtype
        return str(value).removeprefix("torch.")
    return value


def _entry_point(info: PluginInfo) -> md.EntryPoint:
    return md.EntryPoint(name=info.name, value=info.target, group=KINDS[info.kind][0])


def discover(kind: str) -> dict[str, PluginInfo]:
    """Every installed plugin of one kind, by name."""
    group = KINDS[kind][0]
    found: dict[str, PluginInfo] = {}
    for ep in md.entry_points(group=group):
        dist = ep.dist
        found.setdefault(
            ep.name,
            PluginInfo(
                kind=kind,
                name=ep.name,
                target=ep.value,
                distribution=dist.metadata["Name"] if dist else "?",
                version=dist.version if dist else "?",
            ),
        )
    return dict(sorted(found.items()))


def installed_names(kind: str) -> str:
    return ", ".join(discover(kind)) or "none"


def lookup(kind: str, name: str) -> type:
    """The plugin class of `kind` called `name`, or a PluginError naming the installed ones."""
    if kind not in KINDS:
        raise PluginError(f"unknown plugin kind '{kind}'; kinds are {', '.join(KINDS)}.")
    plugins = discover(kind)
    if name not in plugins:
        raise PluginError(f"No {kind} named '{name}' is installed; installed {kind}s: {installed_names(kind)}.")
    return plugins[name].load()
