"""Flags shared by every command that builds an engine, and the EngineConfig they make.

Each flag is the config field of its name: `flag()` takes the field's default and type from EngineConfig (or
ParallelConfig), so a setting's default is declared once, in the config, and `engine_config` builds the config
from the parsed flags by field name, as `moeplex router` does with its settings.
"""

from __future__ import annotations

import argparse

import attrs
import torch

from ..config import (
    ATTENTION_BACKENDS, DISAGGREGATION_MODES, DISPATCH_ALGORITHMS, DTYPES, PER_STEP, QUANTIZE_EXPERTS, SCHEDULE_POLICIES,
    STAT, EngineConfig,
)
from ..disagg.rank import transfer_backend
from ..models.base import check_model_folder
from ..models.make_model import default_model
from ..models.setup import check_before_start
from ..parallel import ParallelConfig
from ..selection import resolve

CONFIGS = (EngineConfig, ParallelConfig)


def _field(dest: str) -> attrs.Attribute:
    for config in CONFIGS:
        field = getattr(attrs.fields(config), dest, None)
        if field is not None:
            return field
    raise KeyError(f"no config field {dest!r} for a flag")


def flag(group, name: str, help: str, dest: str | None = None, **options) -> None:
    """`name` for the config field `dest` (the flag's own name by default), its default and type the field's.
    A bool field that is off by default is a switch; help may say "%(default)s"."""
    dest = dest or name.lstrip("-").replace("-", "_")
    default = _field(dest).default
    if isinstance(default, attrs.Factory):
        default = None  # computed by the config from other settings (the flag leaves it to the config)
    if isinstance(default, bool) and "action" not in options:
        options["action"] = "store_true"
    elif "type" not in options and "action" not in options and default is not None and "choices" not in options:
        options["type"] = type(default)
    group.add_argument(name, dest=dest, default=default, help=help, **options)


def auto_on_off(value: str) -> bool | None:
    """auto / on / off as the config's None / True / False."""
    choices = {"auto": None, "on": True, "off": False}
    if value not in choices:
        raise argparse.ArgumentTypeError(f"choose from auto, on, off (got {value!r})")
    return choices[value]


def add_engine_flags(parser: argparse.ArgumentParser, serving: bool = True) -> None:
    """Every engine flag; `serving` False (an offline command) refuses the flags of a server's role in one sentence."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", metavar="DIR",
        help="Hugging Face style folder (config.json, *.safetensors, tokenizer.json); "
        "default: a tiny random DeepSeek-V3 written once to the user's cache directory",
    )
    flag(model, "--dtype", "compute and weight dtype (default: %(default)s)", choices=tuple(DTYPES))
    flag(model, "--device", "torch device, e.g. cpu or cuda:0 (default: %(default)s)")
    flag(
        model, "--load-format",
        "auto: read the safetensors files; dummy: random weights made on the device from config.json alone "
        "(default: %(default)s)",
        choices=("auto", "dummy"),
    )
    flag(
        model, "--quantize-experts",
        "fp8: hold the routed experts in fp8 with one scale per 128x128 block, quantizing plain weights at load "
        "(needs an --moe-kernel that takes fp8-block weights); none: quantize nothing. An fp8 checkpoint "
        "(quantization_config in config.json) keeps its experts in fp8 either way where the kernel takes them "
        "(default: %(default)s)",
        choices=QUANTIZE_EXPERTS,
    )
    plugins = parser.add_argument_group("plugins (see `moeplex plugins` for what is installed)")
    flag(plugins, "--dispatcher", "how routed tokens reach their experts (default: %(default)s)")
    flag(plugins, "--moe-kernel", "how experts compute (default: triton on a CUDA device, which CUDA graphs can capture; torch elsewhere)")
    flag(plugins, "--balancer", "logical-to-physical expert placement (default: %(default)s)")
    flag(plugins, "--overlap", "how a forward step is scheduled (default: %(default)s)")
    flag(
        plugins, "--overlap-min-tokens",
        "steps with fewer tokens run without splitting into micro-batches (default: the strategy's own)", type=int,
    )
    flag(
        plugins, "--max-dispatch-tokens-per-rank",
        "tokens one rank sends per MoE layer that fixed-size dispatch buffers (deepep-ll, deepep-auto's "
        "decode steps) hold; default: --max-running-requests for a dispatcher with a fallback mode, "
        "else --max-batched-tokens",
        type=int, metavar="N",
    )
    flag(
        plugins, "--dispatch-fp8",
        "send routed activations as fp8 with one scale per 128 values (dispatchers with fp8_payload; "
        "halves the bytes moved, adds fp8 rounding before the experts)",
    )
    gpu = parser.add_argument_group("GPU execution: attention, CUDA graphs, the overlap schedule")
    flag(
        gpu, "--attention-backend",
        "who computes attention over the paged KV cache: torch (SDPA, the reference) or triton (split-K "
        "decode kernels, MLA decode in the latent space); auto: triton on CUDA, torch elsewhere (default: %(default)s)",
        choices=ATTENTION_BACKENDS,
    )
    flag(
        gpu, "--disable-overlap-schedule",
        "finish each step (read its tokens) before scheduling the next; by default a CUDA engine (every rank "
        "of it) schedules and launches step N+1 while the GPU still runs step N",
        dest="overlap_schedule", action="store_const", const=False,
    )
    flag(
        gpu, "--disable-cuda-graph",
        "run every decode step eagerly; by default on CUDA, decode steps replay CUDA graphs captured at "
        "start-up when the attention backend and every selected plugin are graph-safe",
    )
    flag(
        gpu, "--enable-multi-rank-cuda-graph",
        "let an engine of several ranks replay decode graphs too (every rank pads to one agreed size; an idle "
        "rank replays padding); off by default until it has run on several GPUs (issue #24): such engines run "
        "decode eagerly",
    )
    flag(
        gpu, "--cuda-graph-max-bs",
        "largest decode batch captured in a CUDA graph (sizes 1, 2, 4, 8, then every 8, up to N; with "
        "--disable-prompt-graphs at most --max-running-requests rows, times the draft width when speculating); larger "
        "batches run eagerly, smaller ones pad to the next size. Under speculation with the overlap schedule it is the "
        "room for prompts a verify step admits beside a full grid of --max-running-requests x (steps + 1) rows: the "
        "engine also captures sizes every 32 rows up to that grid plus N (docs/speculative.md) (default: %(default)s)",
        metavar="N",
    )
    flag(
        gpu, "--disable-prompt-graphs",
        "launch every prompt step's kernels from the host; by default, where decode steps replay CUDA graphs, a "
        "prompt step of at most --cuda-graph-max-bs tokens whose rows read few enough cached tokens runs as decode "
        "rows (one per token, each reading the cache up to itself) and replays a decode graph: ~1 ms of host time "
        "instead of ~1 ms per layer",
    )
    sched = parser.add_argument_group("scheduler and KV cache")
    flag(sched, "--max-running-requests", "requests decoding at once (default: %(default)s)")
    flag(sched, "--max-batched-tokens", "token budget of one step (default: %(default)s)")
    flag(sched, "--chunked-prefill-size", "longest prompt piece per step (default: %(default)s)")
    flag(
        sched, "--mixed-chunk",
        "whether prompt chunks and decodes share a step; auto: they do, except where decode steps replay CUDA graphs "
        "and --disable-prompt-graphs is set (a step with a prompt then runs eagerly): there prompts get steps of "
        "their own, as in SGLang. With auto and CUDA graphs, a speculating engine's mixed steps draft where their rows "
        "with every draft replay a captured graph and the draft policy prices the drafts worth a synchronous step "
        "(from what such steps took while serving); with on they may draft always (default: auto)",
        type=auto_on_off, metavar="{auto,on,off}",
    )
    flag(sched, "--page-size", "tokens per KV cache page (default: %(default)s)")
    flag(
        sched, "--max-total-tokens",
        "KV cache size in tokens (default: --kv-memory-fraction of free memory, at most 131072)", type=int,
    )
    flag(
        sched, "--disable-prefix-cache",
        "compute every prompt from its first token; by default a radix tree keeps the KV pages of earlier "
        "prompts and answers, and a request starts at its longest cached prefix (RadixAttention)",
    )
    flag(
        sched, "--schedule-policy",
        "order in which waiting requests are admitted: fcfs (arrival) or lpm (longest cached prefix first; a "
        "request sharing a prefix with one being prefilled waits for it to be cached; arrival order again "
        "beyond 128 waiting requests) (default: %(default)s)",
        choices=SCHEDULE_POLICIES,
    )
    flag(
        sched, "--kv-memory-fraction",
        "share of the device's free memory (host memory on the CPU) the KV cache takes when --max-total-tokens "
        "is not given (default: %(default)s)",
    )
    par = parser.add_argument_group("parallelism (one engine over several processes and machines)")
    flag(par, "--tp-size", "ranks of the engine; attention and dense layers are split over them (default: %(default)s)")
    flag(
        par, "--ep-size",
        "1: every rank holds a slice of every expert; equal to --tp-size: experts sharded over the ranks "
        "(default: %(default)s)",
    )
    flag(par, "--dp-size", "attention data-parallel groups (needs --enable-dp-attention)")
    flag(par, "--enable-dp-attention", "each of the --dp-size groups schedules its own requests; MoE layers stay shared")
    flag(par, "--nnodes", "machines the ranks span (default: %(default)s)")
    flag(par, "--node-rank", "this machine's index among --nnodes (default: %(default)s)")
    flag(
        par, "--dist-init-addr",
        "HOST:PORT where node 0 hosts the rendezvous with --nnodes > 1 (it binds HOST only); "
        "one node uses a free loopback port instead (default: %(default)s)",
    )
    flag(par, "--dist-backend", "default: nccl on CUDA, gloo on CPU", choices=("gloo", "nccl"))
    flag(
        par, "--dist-timeout",
        "seconds a collective may wait before the ranks give up and name the missing rank (default: %(default)s)",
        dest="timeout_s", metavar="SECONDS",
    )
    add_balancing_flags(parser)
    add_speculative_flags(parser)
    add_grammar_flags(parser)
    if serving:
        add_disaggregation_flags(parser)
    else:
        for name in DISAGGREGATION_FLAGS:
            parser.add_argument(name, action=ServeOnly)
    flag(parser, "--seed", "global random seed (default: %(default)s)")


def add_balancing_flags(parser: argparse.ArgumentParser) -> None:
    eplb = parser.add_argument_group("expert placement and load balancing (--balancer chooses the placement)")
    flag(
        eplb, "--ep-num-redundant-experts",
        "physical expert slots beyond one per logical expert, each holding a replica of a hot expert; "
        "experts + R must divide over the EP ranks (default: %(default)s)",
        metavar="R",
    )
    flag(
        eplb, "--ep-dispatch-algorithm",
        "which replica a token uses: static (always the first) or spread (routing choices share the replicas "
        "in turn) (default: %(default)s)",
        choices=DISPATCH_ALGORITHMS,
    )
    flag(
        eplb, "--init-expert-location",
        "start with this placement: a JSON file with phy2log (a placement, used as it is) or with "
        "logical_count (an expert-load dump, balanced at start-up by --balancer); see docs/eplb.md",
        metavar="FILE",
    )
    flag(
        eplb, "--expert-distribution-recorder-mode",
        "what a started expert-load recording keeps: stat (one running total) or per-step (default: %(default)s)",
        choices=(STAT, PER_STEP),
    )
    flag(
        eplb, "--expert-distribution-recorder-buffer-size",
        "steps a per-step recording keeps, the newest ones (default: %(default)s)", metavar="STEPS",
    )
    flag(eplb, "--enable-eplb", "record a sliding window of expert load while serving, for rebalancing without restarting")
    flag(eplb, "--eplb-window-size", "steps of recorded load a rebalance balances (default: %(default)s)", metavar="STEPS")
    flag(
        eplb, "--eplb-rebalance-num-iterations",
        "rebalance every N forward steps (needs --enable-eplb); 0: only when asked (default: %(default)s)",
        metavar="N",
    )
    flag(
        eplb, "--eplb-rebalance-layers-per-chunk",
        "MoE layers whose expert weights move at once, bounding the memory a rebalance borrows (default: %(default)s)",
        metavar="LAYERS",
    )


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    spec = parser.add_argument_group("speculative decoding (see docs/speculative.md)")
    flag(
        spec, "--speculative-algorithm",
        "who drafts tokens for the model to verify: none, nextn (DeepSeek's MTP layers, from the checkpoint), "
        "ngram (the request's own earlier tokens), or any installed drafter (`moeplex plugins`); output is the "
        "same as without speculation (default: %(default)s)",
        metavar="NAME",
    )
    flag(spec, "--speculative-num-steps", "tokens drafted per request per decode step (default: %(default)s)", metavar="N")
    flag(
        spec, "--speculative-num-draft-tokens",
        "tokens a request verifies per step: its last token and the drafts, so --speculative-num-steps + 1 "
        "(the default; drafts form one chain)", type=int, metavar="N",
    )
    flag(
        spec, "--disable-speculative-backoff",
        "draft for every decoding request at every step; by default a request whose drafts missed twice running "
        "pauses drafting for 2, 4, ... 64 tokens (plain steps, under the overlap schedule), "
        "so a workload the drafter cannot predict costs about what it costs without speculation (--speculative-policy fixed)",
    )
    flag(
        spec, "--speculative-policy",
        "how many drafts each request verifies per step: adaptive chooses 0..steps per request every step to "
        "maximize the batch's expected tokens per second, from the verify step's cost measured at start-up per "
        "(requests, rows per request) and each request's running acceptance per position (so it drafts fully at "
        "batch 1 and stops by itself where a verify row costs what a decode row does); fixed drafts "
        "--speculative-num-steps for every decoding request, with backoff. Output is the same either way "
        "(default: %(default)s)",
        choices=("adaptive", "fixed"),
    )
    flag(
        spec, "--disable-speculative-cost-calibration",
        "price verify steps at the start-up measurement only; by default the adaptive policy scales them to what "
        "verify steps take while serving against plain ones (host work the measurement does not see: the drafter's, "
        "the acceptance's, a host slower than the device at large batches), so it stops drafting where drafting "
        "measurably loses. Output is the same either way; with calibration, which steps draft depends on timings",
        dest="speculative_cost_calibration", action="store_false",
    )


DISAGGREGATION_FLAGS = ("--disaggregation-mode", "--disaggregation-transfer-backend", "--disaggregation-transfer-config",
                        "--disaggregation-bootstrap-port", "--disaggregation-bootstrap-timeout",
                        "--disaggregation-transfer-timeout", "--disaggregation-lease")


class ServeOnly(argparse.Action):
    """A flag of `moeplex serve` given to an offline command: refused in one sentence, never silently ignored."""

    def __init__(self, option_strings, dest, **_):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is a flag of `moeplex serve` (the server's role in prefill/decode "
                     "disaggregation); an offline command runs prefill and decode in one process and takes none of them")


def add_grammar_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured outputs (see docs/structured_outputs.md)")
    flag(
        group, "--grammar-backend",
        "grammar_backend plugin that turns JSON schemas, regexes and EBNF grammars (response_format, json_schema, "
        "regex, ebnf) into token masks: xgrammar, llguidance, or any installed one (`moeplex plugins`) "
        "(default: %(default)s)",
        metavar="NAME",
    )


def add_disaggregation_flags(parser: argparse.ArgumentParser) -> None:
    pd = parser.add_argument_group("prefill/decode disaggregation (docs/pd.md; `moeplex router --pd` pairs the roles)")
    flag(
        pd, "--disaggregation-mode",
        "none: prefill and decode in this server; prefill: compute prompts and send their KV pages to a decode "
        "server; decode: receive the KV pages of prompts and generate (default: %(default)s)",
        choices=DISAGGREGATION_MODES,
    )
    flag(pd, "--disaggregation-transfer-backend", "kv_transfer plugin that moves the KV pages (default: %(default)s)")
    flag(
        pd, "--disaggregation-transfer-config",
        "the backend's options as a JSON object of its constructor arguments, e.g. '{\"host\": \"10.0.0.5\"}' for "
        "zmq across hosts (see docs/kv_transfer.md) (default: %(default)s)", metavar="JSON",
    )
    flag(
        pd, "--disaggregation-bootstrap-port",
        "prefill: the port of its bootstrap HTTP endpoint (each rank's transfer endpoint, the KV layout, the rooms "
        "decode servers register) (default: %(default)s)", metavar="PORT",
    )
    flag(
        pd, "--disaggregation-bootstrap-timeout",
        "seconds a request may wait for its peer: prefill for the decode server's destination pages, decode for "
        "free pages and its registration with the prefill server (default: %(default)s)", metavar="SECONDS",
    )
    flag(
        pd, "--disaggregation-transfer-timeout",
        "decode: seconds from registering a request's destination pages until its KV has landed; past it the room "
        "is closed, late bytes are dropped and the request fails (default: %(default)s)", metavar="SECONDS",
    )
    flag(
        pd, "--disaggregation-lease",
        "prefill: seconds the source pages of a request stay reserved for its transfer once it has started; past it "
        "they are freed and a late acknowledgement fails the transfer (default: %(default)s)", metavar="SECONDS",
    )


def _values(config, args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in attrs.fields(config) if hasattr(args, f.name)}


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(**_values(ParallelConfig, args))


def check_device(device: str) -> None:
    """A CUDA device on a machine without one is refused here, before any plugin is blamed for it."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: torch sees no GPU on this machine (torch.cuda.is_available() is false, "
            f"torch {torch.__version__}); use --device cpu"
        )


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    check_device(args.device)
    if args.model:
        check_model_folder(args.model)
    settings = _values(EngineConfig, args)
    settings.update(model=args.model or default_model(), parallel=parallel_config(args))
    if settings.get("moe_kernel") is None:
        settings.pop("moe_kernel", None)  # the config's default for the device
    settings.update(overrides)  # a command's own choices win over the shared flags
    config = EngineConfig(**settings)
    resolve(config, announce=True)  # refuse an impossible selection before any rank starts, and name the choice
    if config.disaggregation_mode != "none":
        transfer_backend(config)  # likewise a kv_transfer backend that cannot serve this role
    check_before_start(config)  # the checkpoint's headers and rank 0's model on the meta device, likewise
    return config
