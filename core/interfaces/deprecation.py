"""Deprecations of the plugin API: what a plugin written against an older API still uses, and what replaces it.

The policy (docs/plugins.md, vLLM's): a removed or renamed field, argument, method or hook keeps working for
at least one minor release after the one that deprecates it. Using it warns once per plugin: a
DeprecationWarning pointing at the plugin's line, and one log line naming the plugin, the replacement and
the release that removes it. Every entry here is also in CHANGELOG.md's API section of its release.
"""

from __future__ import annotations

import logging
import sys
import warnings

import attrs

log = logging.getLogger("moeplex.deprecation")


@attrs.frozen
class Deprecation:
    name: str  # as a plugin wrote it: "DispatcherCaps(combine_applies_weights=...)"
    replacement: str  # what to use instead, in a few words
    since: str  # the release that deprecated it
    removed_in: str  # the first release without it (no earlier than two minor releases after `since`)

    def message(self, plugin: str) -> str:
        return (f"{plugin} uses {self.name}, deprecated since moeplex {self.since} and removed in {self.removed_in}: "
                f"{self.replacement}")


COMBINE_APPLIES_WEIGHTS = Deprecation(
    name="DispatcherCaps(combine_applies_weights=...)",
    replacement="drop it; combine does what the kernel's ExpertOutput leaves undone (weights_applied, summed), "
    "whatever a dispatcher declares",
    since="0.2.0",
    removed_in="0.4.0",
)

DEPRECATIONS = (COMBINE_APPLIES_WEIGHTS,)  # every deprecation in force, for docs/plugins.md and the tests


def field(deprecation: Deprecation):
    """An attrs field a plugin may still pass by keyword: None unless given, not compared, not shown."""
    return attrs.field(default=None, kw_only=True, repr=False, eq=False, metadata={"deprecation": deprecation})


def in_use(caps) -> list[Deprecation]:
    """The deprecated fields `caps` was given."""
    return [f.metadata["deprecation"] for f in attrs.fields(type(caps))
            if "deprecation" in f.metadata and getattr(caps, f.name) is not None]


def is_deprecated_field(cls, name: str) -> bool:
    return "deprecation" in attrs.fields_dict(cls)[name].metadata


def warn_fields(caps, stacklevel: int) -> None:
    """A DeprecationWarning per deprecated field given, at the line that built `caps` (`stacklevel` frames up).

    Python's warning registry shows each once per line; DeprecationLog adds the log line naming the plugin.
    """
    for deprecation in in_use(caps):
        frame = sys._getframe(stacklevel)
        where = f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_name}"  # the plugin's module.Class
        warnings.warn(deprecation.message(where), DeprecationWarning, stacklevel=stacklevel + 1)


class DeprecationLog:
    """Logs one line per (plugin, deprecation), naming the plugin as the registry knows it."""

    def __init__(self):
        self._seen: set[tuple[str, str]] = set()

    def report(self, deprecation: Deprecation, plugin: str) -> bool:
        """Log once for `plugin`; False when it already did."""
        key = (plugin, deprecation.name)
        if key in self._seen:
            return False
        self._seen.add(key)
        log.warning("%s", deprecation.message(plugin))
        return True


# One per process on purpose: "once" means once per process, as for Python's own warnings registry.
LOGGED = DeprecationLog()
