"""One role's forward step on one GPU, priced term by term, and what it means for tokens/s, TTFT and ITL."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import costs
from . import eager as eager_ops
from .eager import LayerCosts
from .host import Op, timeline_us
from .imbalance import ExpertLoad, balancedness
from .profile import Profile
from .routing import UNIFORM, Routing, block_m
from .shapes import ModelShape

DISPATCHERS = ("local", "deepep-normal", "deepep-ll", "deepep-auto")
MOE_KERNELS = ("triton", "deepgemm")
OVERLAPS = ("none", "tbo")
SPLIT_TERMS = ("attention", "dense", "dispatch", "experts", "combine", "idle", "other", "host")


@dataclass(frozen=True)
class RoleLayout:
    """How one role (prefill, decode, or co-located) runs: its GPUs and the plugins each layer uses."""

    gpus: int = 8
    ep: int = 8  # expert-parallel size (the role's GPUs, or 1 for experts replicated)
    dispatcher: str = "deepep-auto"
    moe_kernel: str = "deepgemm"
    dtype: str = "fp8"  # weights and dispatch payload: bf16 or fp8
    redundant_experts: int = 0
    balancer: str = "eplb"
    overlap: str = "none"
    graphs: bool = True  # CUDA graphs for decode steps

    def check(self, shape: ModelShape) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher {self.dispatcher!r} is not modeled; modeled: {', '.join(DISPATCHERS)}")
        if self.moe_kernel not in MOE_KERNELS:
            raise ValueError(f"moe kernel {self.moe_kernel!r} is not modeled; modeled: {', '.join(MOE_KERNELS)}")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"overlap {self.overlap!r} is not modeled; modeled: {', '.join(OVERLAPS)}")
        if self.dtype not in ("bf16", "fp8") or (self.moe_kernel == "deepgemm" and self.dtype != "fp8"):
            raise ValueError(f"dtype {self.dtype!r} with moe kernel {self.moe_kernel}: deepgemm takes fp8, triton bf16 or fp8")
        if self.ep < 1 or self.gpus % self.ep:
            raise ValueError(f"EP size {self.ep} must divide the role's {self.gpus} GPUs")
        if (self.ep == 1) != (self.dispatcher == "local"):
            raise ValueError("the local dispatcher is for EP 1 only, and EP 1 needs the local dispatcher")
        if (shape.experts + self.redundant_experts) % self.ep:
            raise ValueError(f"{shape.experts} experts + {self.redundant_experts} redundant do not split over EP {self.ep}")


@dataclass(frozen=True)
class Workload:
    input_len: int = 2000
    output_len: int = 500
    zipf_skew: float = 1.0  # the synthetic expert law (see imbalance.py) unless a recorded load is given
    recorded_load: object = None  # torch tensor [L, E] or None
    routing: Routing = UNIFORM  # how a step's pairs spread over experts (routing.py): uniform, or a recorded run's


@dataclass
class StepPrediction:
    mode: str
    tokens_per_gpu: float
    step_us: float
    split_us: dict[str, float]  # one MoE layer's terms (µs), SPLIT_TERMS
    balancedness: float
    notes: list[str] = field(default_factory=list)

    def tokens_per_s_per_node(self, gpus_per_node: int) -> float:
        return self.tokens_per_gpu / (self.step_us * 1e-6) * gpus_per_node


def dispatcher_for(layout: RoleLayout, decode: bool) -> str:
    """The dispatcher a step of this mode runs: deepep-auto is low-latency for decode, normal for prefill."""
    if layout.dispatcher == "deepep-auto":
        return "deepep-ll" if decode else "deepep-normal"
    return layout.dispatcher


def _dispatch_us(hw: Profile, layout: RoleLayout, shape: ModelShape, tokens: float, decode: bool) -> tuple[float, float, bool]:
    """(dispatch, combine, uses the contiguous layout) for this step's mode."""
    kind = dispatcher_for(layout, decode)
    fp8 = layout.dtype == "fp8"
    if kind == "local":
        return 0.0, 0.0, False
    if kind == "deepep-ll":
        d, c = costs.deepep_ll_us(hw, tokens, shape.hidden, shape.top_k, layout.ep, fp8)
        return d, c, False
    d, c = costs.deepep_normal_us(hw, tokens, shape.hidden, shape.top_k, layout.ep, fp8)
    return d, c, True


def _attention_us(hw: Profile, shape: ModelShape, layout: RoleLayout, tokens: float, pairs: float, decode: bool, seq_len: float) -> dict[str, float]:
    """The attention block's GPU time in launch order: projections before the attention kernel, the kernel, o_proj."""
    dtype = layout.dtype
    *before, out = shape.attention_gemms
    gemms = sum(costs.gemm_us(hw, tokens, k, n, dtype) for k, n in before)
    if decode:
        # MLA's absorbed per-head products, batched over heads: priced as one [tokens, k] x [k, heads * n]
        gemms += sum(costs.gemm_us(hw, tokens, k, heads * n, "bf16") for heads, k, n in shape.attention_bmm_gemms)
        per_pair = shape.decode_flops_per_pair
    else:
        per_pair = shape.attn_flops_per_pair
        # prefill expands MLA's latent KV per head (kv_b) instead of absorbing it
        if shape.attention_bmm_gemms:
            heads, nope, lora = shape.attention_bmm_gemms[0]
            v = shape.attention_bmm_gemms[1][2]
            gemms += costs.gemm_us(hw, tokens, lora, heads * (nope + v), dtype)
    core = costs.attention_core_us(hw, tokens, pairs, shape.kv_bytes_per_token, per_pair, decode, seq_len)
    return {"projections": gemms, "core": core, "o_proj": costs.gemm_us(hw, tokens, *out, dtype)}


def predict_step(
    hw: Profile, shape: ModelShape, layout: RoleLayout, workload: Workload, mode: str, tokens_per_gpu: float
) -> StepPrediction:
    """One forward step of `mode` (prefill or decode) with `tokens_per_gpu` tokens on every GPU.

    With CUDA graphs (decode) the step is its kernels' GPU time; an eager step (prefill, decode without
    graphs) walks the host's launches and syncs against it (host.py, eager.py).
    """
    layout.check(shape)
    decode = mode == "decode"
    t = float(tokens_per_gpu)
    if decode:
        requests, context = t, workload.input_len + workload.output_len / 2
        pairs = t * context
        seq = context
    else:
        requests = t / workload.input_len
        # whole prompts when they fit the step; a chunk of a longer prompt otherwise (its keys up to the middle)
        pairs = requests * workload.input_len * (workload.input_len + 1) / 2 if t >= workload.input_len else t * (workload.input_len / 2)
        requests = max(requests, 1.0)
        seq = workload.input_len
    slots = shape.experts + layout.redundant_experts
    local = slots // layout.ep
    mean_pairs = t * shape.top_k
    nodes = max(1, layout.ep // hw.gpus_per_node)
    bal = balancedness(
        ExpertLoad(shape.experts, workload.zipf_skew, workload.recorded_load), mean_pairs, layout.ep, slots,
        layout.balancer, num_nodes=nodes, num_groups=1,  # one expert group: the balancer places globally
    )
    table, size = hw.expert_table(layout.moe_kernel, layout.dtype, shape.hidden, shape.expert_intermediate, local)
    cap = hw.expert_rate_cap(layout.moe_kernel, layout.dtype)
    counts = hw.launches[shape.arch]
    eager = not (decode and layout.graphs)

    def moe_layer(tok: float, pairs_kv: float) -> LayerCosts:
        attn = _attention_us(hw, shape, layout, tok, pairs_kv, decode, seq)
        mean = tok * shape.top_k
        scale = workload.routing.scale(tok, block_m(hw, layout.moe_kernel, mean / local))
        experts_mean = costs.experts_us(table, size, mean, local, cap, scale)
        experts_max = costs.experts_us(table, size, mean / bal, local, cap, scale)
        d, c, contiguous = _dispatch_us(hw, layout, shape, tok, decode)
        shared = 0.0
        if shape.shared_intermediate:
            shared = costs.gemm_us(hw, tok, shape.hidden, 2 * shape.shared_intermediate, layout.dtype)
            shared += costs.gemm_us(hw, tok, shape.shared_intermediate, shape.hidden, layout.dtype)
        group, summing = costs.permute_parts_us(hw, mean / bal, local, shape.hidden) if contiguous else (0.0, 0.0)
        return LayerCosts(
            attn["projections"], attn["core"], attn["o_proj"],
            small_before=costs.small_kernels_us(hw, counts["small_before_attention"], tok, shape.hidden),
            small_after=costs.small_kernels_us(hw, counts["small_per_layer"] - counts["small_before_attention"] - 1, tok, shape.hidden),
            router=costs.router_us(hw, tok, shape.hidden, shape.experts), experts=experts_mean, idle=experts_max - experts_mean,
            shared=shared, group=group, summing=summing,
            dispatch=d / bal, combine=c / bal,  # the busiest rank receives (and sends back) 1/balancedness of the mean
            normal_mode=contiguous,
        )

    layer = moe_layer(t, pairs)
    split = layer.split()
    notes = []
    dense_mlp = costs.gemm_us(hw, t, shape.hidden, 2 * shape.dense_intermediate, layout.dtype) + costs.gemm_us(
        hw, t, shape.dense_intermediate, shape.hidden, layout.dtype
    )
    dense = layer.dense_layer(dense_mlp)
    outside_gpu = costs.gemm_us(hw, requests, shape.hidden, shape.vocab, "bf16") + counts["outside"] * hw.kernel_floor_us
    stretch = costs.sm_slowdown(hw, hw.deepep_normal_sms) if layer.normal_mode else 1.0
    tbo = layout.overlap == "tbo" and t >= 2
    if tbo:
        half = moe_layer(t / 2, pairs / 2)  # our tbo cuts at half the requests (decode) or tokens (prefill)
        # DeepEP normal's kernels hold SMs the other micro-batch's compute then lacks; low-latency ones wait in hooks
        c_half, m_half = half.compute() * stretch, half.dispatch + half.combine
        layer_gpu = costs.overlapped_layer_us(c_half, m_half)
        notes.append(f"tbo: compute half {c_half:.0f} µs x2 against transfers half {m_half:.0f} µs x2 per layer")
    else:
        layer_gpu = layer.compute() + layer.dispatch + layer.combine
    dense_layers = shape.layers - shape.moe_layers
    gpu_step = shape.moe_layers * layer_gpu + dense_layers * dense.compute() + outside_gpu
    step = gpu_step
    if eager:
        host = counts["eager_host_us"]
        moe_ops = eager_ops.overlapped_layer_ops(half, layer_gpu, host, counts, hw) if tbo else eager_ops.layer_ops(layer, counts, hw, decode)
        ops = eager_ops.dense_layer_ops(dense, counts, decode) * dense_layers + moe_ops * shape.moe_layers
        ops += [Op("embedding, final norm, lm_head, sampling", counts["outside"], outside_gpu)]
        step = max(timeline_us(ops, host), gpu_step)
        notes.append(f"eager: {host} µs of host per launch; host-bound share of the step {1 - gpu_step / step:.0%}")
    elif "graph_gap_us" in hw.values:
        # a replayed graph still spends a little between consecutive kernels (measured per launch)
        moe_launches = sum(op.launches for op in eager_ops.layer_ops(half if tbo else layer, counts, hw, decode)) * (2 if tbo else 1)
        dense_launches = sum(op.launches for op in eager_ops.dense_layer_ops(dense, counts, decode))
        launches = shape.moe_layers * moe_launches + dense_layers * dense_launches + counts["outside"]
        step = gpu_step + launches * hw.graph_gap_us
    split["host"] = (step - gpu_step) / max(shape.moe_layers, 1)  # host launches (eager) or graph gaps, per MoE layer
    split["dense"] = dense_layers * dense.compute() / max(shape.moe_layers, 1)  # spread per MoE layer, for the split
    return StepPrediction(mode, t, step, split, bal, notes)


@dataclass(frozen=True)
class Deployment:
    """PD-disaggregated (prefill and decode roles) or co-located (one role doing both)."""

    prefill: RoleLayout
    decode: RoleLayout
    prefill_tokens_per_gpu: int = 16384
    decode_batch_per_gpu: int = 128
    disaggregated: bool = True


@dataclass
class DeploymentPrediction:
    prefill: StepPrediction
    decode: StepPrediction
    prefill_tok_s_node: float
    decode_tok_s_node: float
    ttft_ms: float
    itl_ms: float  # a decode step
    itl_p99_ms: float  # co-located: a decode step that waits behind a prefill step; PD: the decode step
    requests_per_s: float  # what the whole deployment sustains for this workload


def weights_gb_per_gpu(shape: ModelShape, layout: RoleLayout) -> float:
    """Resident weights: every non-expert weight (DP attention replicates them) plus this GPU's expert slots."""
    wb = costs.weight_bytes(layout.dtype)
    attn = sum(k * n for k, n in shape.attention_gemms) + sum(h * k * n for h, k, n in shape.attention_bmm_gemms)
    dense = 3 * shape.hidden * shape.dense_intermediate
    shared = 3 * shape.hidden * shape.shared_intermediate
    non_expert = shape.layers * attn + (shape.layers - shape.moe_layers) * dense + shape.moe_layers * shared
    slots = (shape.experts + layout.redundant_experts) // layout.ep
    experts = shape.moe_layers * slots * shape.expert_bytes(wb)
    embeddings = 2 * shape.vocab * shape.hidden * 2.0
    return (non_expert * wb + experts + embeddings) / 1e9


def kv_gb(shape: ModelShape, tokens: float) -> float:
    return tokens * shape.kv_bytes_per_token * shape.layers / 1e9


def predict(hw: Profile, shape: ModelShape, dep: Deployment, workload: Workload, rate: float | None = None) -> DeploymentPrediction:
    """Tokens/s per node of each role, TTFT and ITL; with `rate` (requests/s) the decode batch follows from it.

    At a rate, the decode batch per GPU is what Little's law keeps in flight (rate x output length x ITL
    over the decode GPUs), found by fixed-point iteration, and a prompt queues for the prefill role as in
    an M/D/1 queue. Without one, the deployment's fixed batch and no queueing.
    """
    dep.prefill.check(shape)
    dep.decode.check(shape)  # both roles refused before either is priced
    node = hw.gpus_per_node
    p = predict_step(hw, shape, dep.prefill, workload, "prefill", dep.prefill_tokens_per_gpu)
    p_node = p.tokens_per_s_per_node(node)
    batch = dep.decode_batch_per_gpu
    if rate is not None:
        batch = 1.0
        for _ in range(30):
            itl_s = predict_step(hw, shape, dep.decode, workload, "decode", max(1, round(batch))).step_us * 1e-6
            batch = 0.5 * batch + 0.5 * rate * workload.output_len * itl_s / dep.decode.gpus
    d = predict_step(hw, shape, dep.decode, workload, "decode", max(1, round(batch)))
    d_node = d.tokens_per_s_per_node(node)
    prefill_capacity = p_node * dep.prefill.gpus / node / workload.input_len  # requests/s
    decode_capacity = d_node * dep.decode.gpus / node / workload.output_len
    if dep.disaggregated:
        req_s = min(prefill_capacity, decode_capacity)
    else:  # one pool alternates: a request costs its prefill time plus its share of decode steps
        req_s = 1 / (1 / prefill_capacity + 1 / decode_capacity)
    kv_bytes = kv_gb(shape, workload.input_len) * 1e9
    link = hw.kv_transfer_intranode_gbps if dep.prefill.gpus + dep.decode.gpus <= node else hw.rdma_nic_gbps
    transfer_ms = kv_bytes / (link * 1e6) if dep.disaggregated else 0.0
    wait_ms = 0.0
    if rate is not None:
        rho = rate / prefill_capacity
        wait_ms = float("inf") if rho >= 1 else rho / (2 * (1 - rho)) * p.step_us / 1e3
    ttft = wait_ms + p.step_us / 1e3 + transfer_ms
    itl = d.step_us / 1e3
    itl_p99 = itl if dep.disaggregated else itl + p.step_us / 1e3
    return DeploymentPrediction(p, d, p_node, d_node, ttft, itl, itl_p99, req_s)
