"""The `moeplex` command: one sub-command per module of this package."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ..ranks.launcher import RankFailed
from ..registry import PluginError

# sub-command -> module under moeplex.cli defining add_parser(subparsers) and run(args)
COMMANDS = {
    "generate": "generate",
    "bench-one-batch": "bench_one_batch",
    "make-model": "make_model",
    "plugins": "plugins",
    "router": "router",
    "eplb": "eplb",
    "plan": "plan",
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


# the user-error family: a wrong flag, an impossible selection, a bad model folder or file (JSON, config,
# checkpoint: all ValueErrors), a file system refusal, a rank that failed. These print one sentence; anything
# else is a bug in moeplex and keeps its traceback.
USER_ERRORS = (PluginError, ValueError, OSError, RankFailed)
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # the shell's code for a command stopped by Ctrl-C (128 + SIGINT)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="moeplex: %(message)s", stream=sys.stderr)
    try:
        return args.run(args) or 0
    except USER_ERRORS as exc:
        print(f"moeplex {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"moeplex {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"  # not "[Errno 21] Is a directory: 'x'"
    return text


if __name__ == "__main__":
    sys.exit(main())
