"""Draw an expert-load dump: a thin wrapper around `moeplex eplb report` (moeplex/moe/load_report.py).

    .venv/bin/python scripts/plot_expert_load.py DUMP.json --out report.png [--placement PLACEMENT.json] [--balancer eplb]

is the same as `moeplex eplb report --load DUMP.json --out report.png ...`; every other flag passes through.
"""

from __future__ import annotations

import sys

from moeplex.cli import main as moeplex_main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return moeplex_main(["eplb", "report", "--load", *argv])


if __name__ == "__main__":
    sys.exit(main())
