"""Flags shared by every command that builds an engine, and the EngineConfig they make."""

from __future__ import annotations

import argparse

from ..config import DTYPES, EngineConfig
from ..models.make_model import default_model


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", metavar="DIR",
        help="Hugging Face style folder (config.json, *.safetensors, tokenizer.json); "
        "default: a tiny random DeepSeek-V3 written once to the user's cache directory",
    )
    model.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="compute and weight dtype (default: fp32)")
    model.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default: cpu)")
    plugins = parser.add_argument_group("plugins (see `moeplex plugins` for what is installed)")
    plugins.add_argument("--dispatcher", default="local", help="how routed tokens reach their experts (default: local)")
    plugins.add_argument("--moe-kernel", default="torch", help="how experts compute (default: torch)")
    plugins.add_argument("--balancer", default="static", help="logical-to-physical expert placement (default: static)")
    plugins.add_argument("--overlap", default="none", help="how a forward step is scheduled (default: none)")
    sched = parser.add_argument_group("scheduler and KV cache")
    sched.add_argument("--max-running-requests", type=int, default=64, help="requests decoding at once (default: 64)")
    sched.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget of one step (default: 2048)")
    sched.add_argument("--chunked-prefill-size", type=int, default=512, help="longest prompt piece per step (default: 512)")
    sched.add_argument("--page-size", type=int, default=16, help="tokens per KV cache page (default: 16)")
    sched.add_argument(
        "--max-total-tokens", type=int, default=None,
        help="KV cache size in tokens (default: a quarter of free memory, at most 131072)",
    )
    parser.add_argument("--seed", type=int, default=0, help="global random seed (default: 0)")


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(
        model=args.model or default_model(),
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        dispatcher=args.dispatcher,
        moe_kernel=args.moe_kernel,
        balancer=args.balancer,
        overlap=args.overlap,
        max_running_requests=args.max_running_requests,
        max_batched_tokens=args.max_batched_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        **overrides,
    )
