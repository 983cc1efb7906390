"""How a benchmark hands back its Markdown: printed, and written to --out when given."""

from __future__ import annotations

from pathlib import Path


def emit(text: str, out: str | Path | None) -> None:
    print(text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.rstrip("\n") + "\n")
