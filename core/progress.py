"""Progress bars where people wait (loading, random weights, generation): on stderr, and only for a person
watching — off when stderr is not a terminal (logs, pipes, tests) or when the run's show_progress is off."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()


def progress(iterable=None, *, desc: str, unit: str = "it", total: int | None = None, enabled: bool = True) -> tqdm:
    """A tqdm bar on stderr that clears itself when done."""
    return tqdm(
        iterable, desc=desc, unit=unit, total=total, file=sys.stderr, leave=False, disable=not (enabled and stderr_is_tty())
    )
