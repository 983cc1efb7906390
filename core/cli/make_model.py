"""`moeplex make-model`: write a random-weight checkpoint in the Hugging Face format."""

from __future__ import annotations

import json

from ..models.make_model import ARCHES, write_checkpoint


def add_parser(sub) -> None:
    p = sub.add_parser("make-model", help="write a random-weight Hugging Face checkpoint of a supported architecture")
    p.add_argument("out", metavar="OUT", help="folder to write (created if missing)")
    p.add_argument("--arch", choices=ARCHES, required=True, help="architecture")
    p.add_argument(
        "--preset", default="tiny",
        help="size: tiny (tests), small (CPU benchmarks), or the released shapes (deepseek_v3: v3, qwen3_moe: 30b-a3b, "
        "mixtral: 8x7b; use with --config-only); default tiny",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.add_argument(
        "--config-only", action="store_true",
        help="write config and tokenizer but no weights (run it with --load-format dummy)",
    )
    p.add_argument(
        "--fp8", action="store_true",
        help="write a DeepSeek-V3 style fp8 checkpoint: every linear projection but lm_head as float8_e4m3fn with "
        "one fp32 scale per 128x128 block (X.weight_scale_inv), and quantization_config in config.json",
    )
    p.add_argument(
        "--mtp", type=int, default=0, metavar="N",
        help="deepseek_v3: also write N multi-token-prediction (NextN) layers as model.layers.{num_hidden_layers + i} "
        "(enorm, hnorm, eh_proj, a decoder layer, shared_head.norm), for the nextn drafter; config.json's "
        "num_nextn_predict_layers is set to N (default 0: none)",
    )
    p.add_argument(
        "--mtp-acceptance", type=float, default=None, metavar="RATE",
        help="with --mtp: synthetic weights instead of random ones, a target close to a fixed next-token map and an "
        "MTP layer whose drafts it accepts at RATE per position (e.g. 0.8: accept length about 3 with 3 steps), "
        "for measuring nextn; recorded in config.json, so --load-format dummy makes the same weights "
        "(docs/speculative.md says how they are made)",
    )
    p.add_argument(
        "--synthetic-map", action="store_true",
        help="synthetic weights instead of random ones for any architecture: a target close to a fixed next-token "
        "map (every layer runs, at full cost), so a prompt that walks the map is copied token for token, for "
        "measuring prompt-lookup (ngram) drafting at a real acceptance; recorded in config.json like "
        "--mtp-acceptance, which implies it (docs/speculative.md)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a config.json field, VALUE as JSON (e.g. --set num_hidden_layers=4); repeatable",
    )
    p.set_defaults(run=run)


def _overrides(pairs: list[str]) -> dict:
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {pair!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value  # a bare string
    return overrides


def run(args) -> int:
    folder = write_checkpoint(
        args.out, args.arch, args.preset, args.seed, overrides=_overrides(args.set), config_only=args.config_only,
        fp8=args.fp8, show_progress=True, mtp=args.mtp, mtp_acceptance=args.mtp_acceptance,
        synthetic_map=args.synthetic_map,
    )
    what = "config (no weights)" if args.config_only else "random fp8 checkpoint" if args.fp8 else "random checkpoint"
    layers = f" with {args.mtp} MTP layer(s)" if args.mtp else ""
    if args.mtp_acceptance is not None:
        what = f"synthetic checkpoint (MTP drafts accepted at {args.mtp_acceptance} per position)"
    elif args.synthetic_map:
        what = "synthetic checkpoint (a target close to a fixed next-token map)"
    print(f"wrote a {args.arch} ({args.preset}) {what}{layers} to {folder}")
    return 0
