"""Flags shared by every command that builds an engine, and the EngineConfig they make."""

from __future__ import annotations

import argparse

from ..attention import ATTENTION_BACKENDS, AUTO
from ..config import DTYPES, QUANTIZE_EXPERTS, EngineConfig
from ..models.make_model import default_model
from ..moe.recorder import PER_STEP, STAT
from ..moe.replicas import DISPATCH_ALGORITHMS, SPREAD
from ..parallel import ParallelConfig


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", metavar="DIR",
        help="Hugging Face style folder (config.json, *.safetensors, tokenizer.json); "
        "default: a tiny random DeepSeek-V3 written once to the user's cache directory",
    )
    model.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="compute and weight dtype (default: fp32)")
    model.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default: cpu)")
    model.add_argument(
        "--load-format", choices=("auto", "dummy"), default="auto",
        help="auto: read the safetensors files; dummy: random weights made on the device from config.json alone",
    )
    model.add_argument(
        "--quantize-experts", choices=QUANTIZE_EXPERTS, default="none",
        help="fp8: hold the routed experts in fp8 with one scale per 128x128 block, quantizing plain weights at load "
        "(needs an --moe-kernel that takes fp8-block weights); none: quantize nothing. An fp8 checkpoint "
        "(quantization_config in config.json) keeps its experts in fp8 either way where the kernel takes them "
        "(default: none)",
    )
    plugins = parser.add_argument_group("plugins (see `moeplex plugins` for what is installed)")
    plugins.add_argument("--dispatcher", default="local", help="how routed tokens reach their experts (default: local)")
    plugins.add_argument(
        "--moe-kernel", help="how experts compute (default: triton on a CUDA device, which CUDA graphs can capture; torch elsewhere)"
    )
    plugins.add_argument("--balancer", default="static", help="logical-to-physical expert placement (default: static)")
    plugins.add_argument("--overlap", default="none", help="how a forward step is scheduled (default: none)")
    plugins.add_argument(
        "--overlap-min-tokens", type=int, default=None,
        help="steps with fewer tokens run without splitting into micro-batches (default: the strategy's own)",
    )
    plugins.add_argument(
        "--max-dispatch-tokens-per-rank", type=int, default=None, metavar="N",
        help="tokens one rank sends per MoE layer that fixed-size dispatch buffers (deepep-ll, deepep-auto's "
        "decode steps) hold; default: --max-running-requests for a dispatcher with a fallback mode, "
        "else --max-batched-tokens",
    )
    plugins.add_argument(
        "--dispatch-fp8", action="store_true",
        help="send routed activations as fp8 with one scale per 128 values (dispatchers with fp8_payload; "
        "halves the bytes moved, adds fp8 rounding before the experts)",
    )
    gpu = parser.add_argument_group("GPU execution: attention, CUDA graphs, the overlap schedule")
    gpu.add_argument(
        "--attention-backend", choices=ATTENTION_BACKENDS, default=AUTO,
        help="who computes attention over the paged KV cache: torch (SDPA, the reference) or triton (split-K "
        "decode kernels, MLA decode in the latent space); auto: triton on CUDA, torch elsewhere (default: auto)",
    )
    gpu.add_argument(
        "--disable-overlap-schedule", action="store_true",
        help="finish each step (read its tokens) before scheduling the next; by default a CUDA engine of one rank "
        "schedules and launches step N+1 while the GPU still runs step N",
    )
    gpu.add_argument(
        "--disable-cuda-graph", action="store_true",
        help="run every decode step eagerly; by default on CUDA, decode steps replay CUDA graphs captured at "
        "start-up when the attention backend and every selected plugin are graph-safe",
    )
    gpu.add_argument(
        "--cuda-graph-max-bs", type=int, default=256, metavar="N",
        help="largest decode batch captured in a CUDA graph (sizes 1, 2, 4, 8, then every 8, up to N and at most "
        "--max-running-requests); larger batches run eagerly, smaller ones pad to the next size (default: 256)",
    )
    sched = parser.add_argument_group("scheduler and KV cache")
    sched.add_argument("--max-running-requests", type=int, default=64, help="requests decoding at once (default: 64)")
    sched.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget of one step (default: 2048)")
    sched.add_argument("--chunked-prefill-size", type=int, default=512, help="longest prompt piece per step (default: 512)")
    sched.add_argument(
        "--mixed-chunk", choices=("auto", "on", "off"), default="auto",
        help="whether prompt chunks and decodes share a step; auto: they do unless decode steps replay CUDA graphs "
        "(a step with a prompt runs eagerly, so there prompts get steps of their own, as in SGLang) (default: auto)",
    )
    sched.add_argument("--page-size", type=int, default=16, help="tokens per KV cache page (default: 16)")
    sched.add_argument(
        "--max-total-tokens", type=int, default=None,
        help="KV cache size in tokens (default: a quarter of free memory, at most 131072)",
    )
    par = parser.add_argument_group("parallelism (one engine over several processes and machines)")
    par.add_argument("--tp-size", type=int, default=1, help="ranks of the engine; attention and dense layers are split over them (default: 1)")
    par.add_argument(
        "--ep-size", type=int, default=1,
        help="1: every rank holds a slice of every expert; equal to --tp-size: experts sharded over the ranks (default: 1)",
    )
    par.add_argument("--dp-size", type=int, default=1, help="attention data-parallel groups (needs --enable-dp-attention)")
    par.add_argument(
        "--enable-dp-attention", action="store_true",
        help="each of the --dp-size groups schedules its own requests; MoE layers stay shared",
    )
    par.add_argument("--nnodes", type=int, default=1, help="machines the ranks span (default: 1)")
    par.add_argument("--node-rank", type=int, default=0, help="this machine's index among --nnodes (default: 0)")
    par.add_argument(
        "--dist-init-addr", default="127.0.0.1:29517",
        help="HOST:PORT where node 0 hosts the rendezvous with --nnodes > 1 (it binds HOST only); "
        "one node uses a free loopback port instead",
    )
    par.add_argument("--dist-backend", choices=("gloo", "nccl"), default=None, help="default: nccl on CUDA, gloo on CPU")
    par.add_argument(
        "--dist-timeout", type=float, default=300.0,
        help="seconds a collective may wait before the ranks give up and name the missing rank (default: 300)",
    )
    add_balancing_flags(parser)
    parser.add_argument("--seed", type=int, default=0, help="global random seed (default: 0)")


def add_balancing_flags(parser: argparse.ArgumentParser) -> None:
    eplb = parser.add_argument_group("expert placement and load balancing (--balancer chooses the placement)")
    eplb.add_argument(
        "--ep-num-redundant-experts", type=int, default=0, metavar="R",
        help="physical expert slots beyond one per logical expert, each holding a replica of a hot expert; "
        "experts + R must divide over the EP ranks (default: 0)",
    )
    eplb.add_argument(
        "--ep-dispatch-algorithm", choices=DISPATCH_ALGORITHMS, default=SPREAD,
        help="which replica a token uses: static (always the first) or spread (routing choices share the replicas "
        "in turn) (default: spread)",
    )
    eplb.add_argument(
        "--init-expert-location", metavar="FILE", default=None,
        help="start with this placement: a JSON file with phy2log (a placement, used as it is) or with "
        "logical_count (an expert-load dump, balanced at start-up by --balancer); see docs/eplb.md",
    )
    eplb.add_argument(
        "--expert-distribution-recorder-mode", choices=(STAT, PER_STEP), default=STAT,
        help="what a started expert-load recording keeps: stat (one running total) or per-step (default: stat)",
    )
    eplb.add_argument(
        "--expert-distribution-recorder-buffer-size", type=int, default=1000, metavar="STEPS",
        help="steps a per-step recording keeps, the newest ones (default: 1000)",
    )
    eplb.add_argument(
        "--enable-eplb", action="store_true",
        help="record a sliding window of expert load while serving, for rebalancing without restarting",
    )
    eplb.add_argument(
        "--eplb-window-size", type=int, default=1000, metavar="STEPS",
        help="steps of recorded load a rebalance balances (default: 1000)",
    )
    eplb.add_argument(
        "--eplb-rebalance-num-iterations", type=int, default=0, metavar="N",
        help="rebalance every N forward steps (needs --enable-eplb); 0: only when asked (default: 0)",
    )
    eplb.add_argument(
        "--eplb-rebalance-layers-per-chunk", type=int, default=4, metavar="LAYERS",
        help="MoE layers whose expert weights move at once, bounding the memory a rebalance borrows (default: 4)",
    )


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        dp_size=args.dp_size,
        enable_dp_attention=args.enable_dp_attention,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        dist_backend=args.dist_backend,
        timeout_s=args.dist_timeout,
    )


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    settings = dict(
        model=args.model or default_model(),
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        dispatcher=args.dispatcher,
        balancer=args.balancer,
        overlap=args.overlap,
        overlap_min_tokens=args.overlap_min_tokens,
        max_dispatch_tokens_per_rank=args.max_dispatch_tokens_per_rank,
        dispatch_fp8=args.dispatch_fp8,
        attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph,
        overlap_schedule=False if args.disable_overlap_schedule else None,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        max_running_requests=args.max_running_requests,
        max_batched_tokens=args.max_batched_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        mixed_chunk={"auto": None, "on": True, "off": False}[args.mixed_chunk],
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        parallel=parallel_config(args),
        load_format=args.load_format,
        quantize_experts=args.quantize_experts,
        ep_num_redundant_experts=args.ep_num_redundant_experts,
        ep_dispatch_algorithm=args.ep_dispatch_algorithm,
        init_expert_location=args.init_expert_location,
        expert_distribution_recorder_mode=args.expert_distribution_recorder_mode,
        expert_distribution_recorder_buffer_size=args.expert_distribution_recorder_buffer_size,
        enable_eplb=args.enable_eplb,
        eplb_window_size=args.eplb_window_size,
        eplb_rebalance_num_iterations=args.eplb_rebalance_num_iterations,
        eplb_rebalance_layers_per_chunk=args.eplb_rebalance_layers_per_chunk,
    )
    if args.moe_kernel:
        settings["moe_kernel"] = args.moe_kernel  # else the config's default for the device
    settings.update(overrides)  # a command's own choices win over the shared flags
    return EngineConfig(**settings)
