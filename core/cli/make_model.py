"""`moeplex make-model`: write a random-weight checkpoint in the Hugging Face format."""

from __future__ import annotations

from ..models.make_model import ARCHES, write_checkpoint


def add_parser(sub) -> None:
    p = sub.add_parser("make-model", help="write a random-weight Hugging Face checkpoint of a supported architecture")
    p.add_argument("out", metavar="OUT", help="folder to write (created if missing)")
    p.add_argument("--arch", choices=ARCHES, required=True, help="architecture")
    p.add_argument("--preset", default="tiny", help="size: tiny (tests) or small (CPU benchmarks); default tiny")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.set_defaults(run=run)


def run(args) -> int:
    folder = write_checkpoint(args.out, args.arch, args.preset, args.seed)
    print(f"wrote a random {args.arch} ({args.preset}) checkpoint to {folder}")
    return 0
