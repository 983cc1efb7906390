"""The `moeplex` command: one sub-command per module of this package."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ..launcher import RankFailed
from ..registry import PluginError

# sub-command -> module under moeplex.cli defining add_parser(subparsers) and run(args)
COMMANDS = {
    "generate": "generate",
    "bench-one-batch": "bench_one_batch",
    "make-model": "make_model",
    "plugins": "plugins",
    "router": "router",
    "eplb": "eplb",
    "serve": "serve",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeplex", description="Serve and run Mixture-of-Experts language models with pluggable expert parallelism."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(f"{__name__}.{module}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="moeplex: %(message)s", stream=sys.stderr)
    try:
        return args.run(args) or 0
    except (PluginError, ValueError, FileNotFoundError, RankFailed) as exc:
        # a wrong flag or an impossible selection: one sentence, no traceback
        print(f"moeplex {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
