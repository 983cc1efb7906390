"""EngineConfig: every setting a user can change, validated once (built from CLI flags)."""

from __future__ import annotations

import json

import attrs
import torch

from .parallel import ParallelConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUANTIZE_EXPERTS = ("none", "fp8")  # --quantize-experts
AUTO = "auto"
ATTENTION_BACKENDS = (AUTO, "torch", "triton")  # --attention-backend
SCHEDULE_POLICIES = ("fcfs", "lpm")  # --schedule-policy: arrival order, or longest cached prefix first
OFF, STAT, PER_STEP = "off", "stat", "per-step"  # expert-load recording modes
STATIC, SPREAD = "static", "spread"  # --ep-dispatch-algorithm: which replica a routed token uses
DISPATCH_ALGORITHMS = (STATIC, SPREAD)
DISAGGREGATION_MODES = ("none", "prefill", "decode")  # --disaggregation-mode


def _positive(instance, attribute, value):
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def _fraction(instance, attribute, value):
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value}")


def _not_negative(instance, attribute, value):
    if value < 0:
        raise ValueError(f"{attribute.name} must not be negative, got {value}")


def _json_object(instance, attribute, value):
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"{attribute.name} must be a JSON object, got {value!r} ({exc})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{attribute.name} must be a JSON object, got {value!r}")


def _one_of(choices):
    def check(instance, attribute, value):
        if value not in choices:
            raise ValueError(f"{attribute.name} must be one of {', '.join(choices)}, got {value!r}")

    return check


@attrs.frozen
class EngineConfig:
    model: str
    dtype: str = attrs.field(default="fp32", validator=_one_of(tuple(DTYPES)))
    device: str = "cpu"
    seed: int = 0
    # plugins (names are entry-point names)
    dispatcher: str = "local"
    # default: triton on a CUDA device (CUDA graphs can capture it), the torch reference elsewhere
    moe_kernel: str = attrs.field(
        default=attrs.Factory(lambda self: "triton" if str(self.device).startswith("cuda") else "torch", takes_self=True)
    )
    balancer: str = "static"
    overlap: str = "none"
    overlap_min_tokens: int | None = None  # below this many tokens a step runs unsplit (None: the strategy's own)
    max_dispatch_tokens_per_rank: int | None = attrs.field(default=None, validator=_positive)  # fixed buffers
    dispatch_fp8: bool = False  # send routed activations as fp8 where the dispatcher can
    # GPU serving path
    attention_backend: str = attrs.field(default=AUTO, validator=_one_of(ATTENTION_BACKENDS))  # auto: triton on CUDA
    disable_cuda_graph: bool = False  # decode steps run eagerly even where they could replay a graph
    # engines of several ranks capture graphs only when asked: that path has not yet run on several GPUs
    enable_multi_rank_cuda_graph: bool = False
    cuda_graph_max_bs: int = attrs.field(default=256, validator=_positive)  # largest captured decode batch
    # prompt steps run eagerly even where their tokens fit a decode graph as rows (model_runner.prompt_rows)
    disable_prompt_graphs: bool = False
    # the host schedules step N+1 while the GPU runs step N (None: where it pays, a CUDA engine)
    overlap_schedule: bool | None = None
    # scheduler and KV cache
    max_running_requests: int = attrs.field(default=64, validator=_positive)
    max_batched_tokens: int = attrs.field(default=2048, validator=_positive)  # per-step token budget
    chunked_prefill_size: int = attrs.field(default=512, validator=_positive)
    # prompts and decodes share a step (None: unless decode steps replay CUDA graphs, which a prompt would stop)
    mixed_chunk: bool | None = None
    page_size: int = attrs.field(default=16, validator=_positive)
    max_total_tokens: int | None = attrs.field(default=None, validator=_positive)  # KV pool size in tokens
    disable_prefix_cache: bool = False  # every prompt computed from its first token (no radix tree of cached pages)
    # the order waiting requests are admitted in: arrival (fcfs) or longest cached prefix first (lpm)
    schedule_policy: str = attrs.field(default="fcfs", validator=_one_of(SCHEDULE_POLICIES))
    kv_memory_fraction: float = attrs.field(default=0.25, validator=_fraction)  # of free memory, without max_total_tokens
    show_progress: bool = True
    load_format: str = attrs.field(default="auto", validator=_one_of(("auto", "dummy")))
    quantize_experts: str = attrs.field(default="none", validator=_one_of(QUANTIZE_EXPERTS))  # fp8: block-quantize at load
    parallel: ParallelConfig = ParallelConfig()
    # expert placement and load balancing
    ep_num_redundant_experts: int = attrs.field(default=0, validator=_not_negative)  # physical slots beyond one per expert
    ep_dispatch_algorithm: str = attrs.field(default=SPREAD, validator=_one_of(DISPATCH_ALGORITHMS))
    init_expert_location: str | None = None  # a placement file, or a recorded load to balance at start-up
    expert_distribution_recorder_mode: str = attrs.field(default=STAT, validator=_one_of((STAT, PER_STEP)))
    expert_distribution_recorder_buffer_size: int = attrs.field(default=1000, validator=_positive)  # steps kept per-step
    enable_eplb: bool = False  # keep a sliding window of expert load for rebalancing while serving
    eplb_window_size: int = attrs.field(default=1000, validator=_positive)  # steps of load a rebalance uses
    eplb_rebalance_num_iterations: int = attrs.field(default=0, validator=_not_negative)  # 0: only when asked
    eplb_rebalance_layers_per_chunk: int = attrs.field(default=4, validator=_positive)  # layers moved at once
    # speculative decoding: a drafter's name (or none), the tokens it drafts per step, and the tokens a
    # request verifies per step (its last token + the drafts; SGLang's name and meaning, with chain drafts)
    speculative_algorithm: str = "none"
    speculative_num_steps: int = attrs.field(default=3, validator=_positive)
    speculative_num_draft_tokens: int | None = attrs.field(default=None, validator=_positive)
    disable_speculative_backoff: bool = False  # draft for every decoding request every step, however often it misses
    # how many drafts each request verifies per step: adaptive (from a measured step-cost model and each request's
    # acceptance) or fixed (every due request drafts --speculative-num-steps, with backoff)
    speculative_policy: str = attrs.field(default="adaptive", validator=_one_of(("adaptive", "fixed")))
    # the adaptive policy's verify costs scaled to what verify steps take while serving (speculation/calibration.py)
    speculative_cost_calibration: bool = True
    # structured outputs (docs/structured_outputs.md): the grammar_backend plugin that turns constraints into masks
    grammar_backend: str = "xgrammar"
    # prefill/decode disaggregation (docs/pd.md): this server's role, how KV pages move, and the deadlines
    disaggregation_mode: str = attrs.field(default="none", validator=_one_of(DISAGGREGATION_MODES))
    disaggregation_transfer_backend: str = "zmq"
    disaggregation_transfer_config: str = attrs.field(default="{}", validator=_json_object)  # the backend's options
    disaggregation_bootstrap_port: int = attrs.field(default=8998, validator=_positive)
    disaggregation_bootstrap_timeout: float = attrs.field(default=30.0, validator=_positive)
    disaggregation_transfer_timeout: float = attrs.field(default=30.0, validator=_positive)
    disaggregation_lease: float = attrs.field(default=60.0, validator=_positive)

    def __attrs_post_init__(self):
        if self.max_batched_tokens < self.max_running_requests:
            # every running request must be able to decode in one step
            raise ValueError(
                f"max_batched_tokens ({self.max_batched_tokens}) must be >= max_running_requests "
                f"({self.max_running_requests})"
            )
        draft = self.speculative_num_draft_tokens
        if draft is not None and draft != self.speculative_num_steps + 1:
            raise ValueError(
                f"--speculative-num-draft-tokens {draft} must be --speculative-num-steps + 1 "
                f"({self.speculative_num_steps + 1}): drafts form one chain, verified with the request's last token"
            )
        if self.eplb_rebalance_num_iterations and not self.enable_eplb:
            raise ValueError("--eplb-rebalance-num-iterations needs --enable-eplb, which records the load it balances")

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm != "none"

    @property
    def tokens_per_decode(self) -> int:
        """Tokens a decoding request adds to one step: 1, or its last token + drafts when speculating."""
        return self.speculative_num_steps + 1 if self.speculative else 1

    def dispatch_tokens_per_rank(self, dispatcher_caps) -> int:
        """What a fixed dispatch buffer must hold: the flag, else a decode batch (a speculative verify step's:
        one row per request and draft) where the dispatcher has another mode for bigger steps, else any step's."""
        if self.max_dispatch_tokens_per_rank:
            return self.max_dispatch_tokens_per_rank
        decode = self.max_running_requests * self.tokens_per_decode
        return decode if dispatcher_caps.other_layouts else max(self.max_batched_tokens, decode)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
