"""The cost terms of one layer on one GPU, each a small pure function of shapes and a Profile (µs)."""

from __future__ import annotations

from .profile import ExpertTable, Profile

FP8_SCALE_BYTES = 4 / 128  # one fp32 scale per 128 values: DeepEP's and DeepGEMM's fp8 payload
KERNEL_ALIGN = 128  # DeepGEMM contiguous layout pads each expert's rows to 128


def weight_bytes(dtype: str) -> float:
    return 1.0 + FP8_SCALE_BYTES / 128 if dtype == "fp8" else 2.0  # fp8: 128x128 block scales


def matmul_tflops(hw: Profile, dtype: str) -> float:
    return hw.matmul_fp8_tflops if dtype == "fp8" else hw.matmul_bf16_tflops


def gemm_us(hw: Profile, tokens: float, k: int, n: int, dtype: str = "bf16") -> float:
    """A weight GEMM [tokens, k] x [k, n]: the slower of its FLOPs and its bytes, never under one kernel."""
    if tokens <= 0:
        return 0.0
    flops = 2.0 * tokens * k * n
    moved = k * n * weight_bytes(dtype) + tokens * (k + n) * 2.0
    roofline = max(flops / (matmul_tflops(hw, dtype) * 1e6), moved / (hw.hbm_gbps * 1e3))
    return max(roofline * hw.slowdown("gemm_slowdown", tokens), hw.kernel_floor_us)


def attention_core_us(
    hw: Profile, queries: float, pairs: float, kv_bytes_per_token: int, flops_per_pair: int, decode: bool, seq_len: float = 0.0
) -> float:
    """Scores and weighted values over `pairs` (query, key) pairs.

    Decode reads each query's whole KV (`pairs` keys of `kv_bytes_per_token`) and is bound by it or its
    FLOPs. Prefill is bound by FLOPs at the rate a causal flash kernel reaches at this prompt length
    (`seq_len`): a measured table (`attention_slowdown`, from the --profile step) where the profile has
    one, else the published FlashAttention-2 rate (`attention_prefill_tflops`: torch SDPA's flash backend
    is FlashAttention-2), else the bf16 matmul peak.
    """
    if queries <= 0:
        return 0.0
    flops_us = pairs * flops_per_pair / (hw.matmul_bf16_tflops * 1e6)
    if not decode:
        if "attention_slowdown" in hw.values:
            return max(flops_us * hw.slowdown("attention_slowdown", seq_len or queries), hw.kernel_floor_us)
        if "attention_prefill_tflops" in hw.values:
            rate = hw.interpolated("attention_prefill_tflops", max(seq_len, queries))
            return max(pairs * flops_per_pair / (rate * 1e6), hw.kernel_floor_us)
        return max(flops_us, hw.kernel_floor_us)
    bytes_us = pairs * kv_bytes_per_token / (hw.hbm_gbps * 1e3)
    return max(flops_us, bytes_us, hw.kernel_floor_us)


def router_us(hw: Profile, tokens: float, hidden: int, experts: int) -> float:
    """The router GEMM: fp32 weights and fp32 math (core/moe/router.py; TF32 stays off), so CUDA cores, not tensor cores."""
    if tokens <= 0:
        return 0.0
    flops = 2.0 * tokens * hidden * experts
    moved = hidden * experts * 4.0 + tokens * (hidden * 2.0 + hidden * 4.0 + experts * 4.0)  # weight, bf16 in, fp32 copy, logits
    return max(flops / (hw.fp32_tflops * 1e6), moved / (hw.hbm_gbps * 1e3), hw.kernel_floor_us)


def small_kernels_us(hw: Profile, launches: int, tokens: float, hidden: int) -> float:
    """Norms, rope, cache writes, top-k sums: each reads and writes about one [tokens, hidden] bf16 activation.

    A few tokens (decode) leave each at the per-kernel floor; a prefill chunk makes each one bandwidth-bound.
    """
    if launches <= 0:
        return 0.0
    per_kernel = 2 * tokens * hidden * 2.0 / (hw.hbm_gbps * 1e3)
    return launches * max(per_kernel, hw.kernel_floor_us)


def experts_hit(pairs: float, local_experts: int) -> float:
    """Expected distinct local experts that `pairs` uniformly routed (token, expert) pairs touch."""
    if pairs <= 0 or local_experts <= 0:
        return 0.0
    return local_experts * (1.0 - (1.0 - 1.0 / local_experts) ** pairs)


def experts_us(
    table: ExpertTable, size_factor: float, pairs: float, local_experts: int, best_tflops: float = 0.0, routing_scale: float = 1.0
) -> float:
    """Routed experts on one GPU: hit experts x the measured time per hit expert at their rows.

    `best_tflops` (the best rate measured for this kernel) bounds the extrapolation past the table;
    `routing_scale` is what a recorded routing takes relative to the uniform routing the table was measured
    under (routing.py: the tiles the kernel runs).
    """
    hit = experts_hit(pairs, local_experts)
    if hit == 0:
        return 0.0
    min_us_per_row = 6.0 * table.shape[0] * table.shape[1] / (best_tflops * 1e6) if best_tflops > 0 else 0.0
    return hit * table.us_per_expert(pairs / hit, min_us_per_row) * size_factor * routing_scale


def ranks_reached(peers: int, top_k: int) -> float:
    """Expected other ranks (or nodes) a token's top-k reach when experts spread evenly over peers + 1."""
    total = peers + 1
    return peers * (1.0 - (1.0 - 1.0 / total) ** top_k)


def row_bytes(hidden: int, fp8: bool) -> float:
    return hidden * (1.0 + FP8_SCALE_BYTES) if fp8 else hidden * 2.0


def deepep_normal_us(hw: Profile, tokens: float, hidden: int, top_k: int, ep: int, fp8_dispatch: bool) -> tuple[float, float]:
    """DeepEP normal dispatch and combine of one layer: (dispatch µs, combine µs).

    One copy of a token per destination rank over NVLink inside a node; one per destination node over
    RDMA between nodes (then forwarded by NVLink), at DeepEP's published per-EP RDMA bandwidth. The
    layout/notify kernels are a fixed cost. Combine sends bf16 back along the same paths.
    """
    if ep <= 1 or tokens <= 0:
        return 0.0, 0.0
    per_node = hw.gpus_per_node
    if ep <= per_node:
        copies = tokens * ranks_reached(ep - 1, top_k)
        d = copies * row_bytes(hidden, fp8_dispatch) / (hw.nvlink_normal_gbps * 1e3)
        c = copies * row_bytes(hidden, False) / (hw.nvlink_normal_gbps * 1e3)
    else:
        copies = tokens * ranks_reached(ep // per_node - 1, top_k)
        bw = hw.by_ep("rdma_normal_gbps", ep) * 1e3
        d, c = copies * row_bytes(hidden, fp8_dispatch) / bw, copies * row_bytes(hidden, False) / bw
    return d + hw.deepep_normal_fixed_us, c


def deepep_ll_us(hw: Profile, tokens: float, hidden: int, top_k: int, ep: int, fp8_dispatch: bool) -> tuple[float, float]:
    """DeepEP low-latency dispatch and combine: one copy per (token, expert) pair, no forwarding.

    Between nodes at DeepEP's published low-latency bandwidth for this EP size (its figure counts every
    pair's bytes, 128 tokens per rank); inside one node the remote pairs over NVLink at the measured rate, plus
    the kernels' own cost besides those bytes (ll_fixed_us).
    """
    if ep <= 1 or tokens <= 0:
        return 0.0, 0.0
    pairs = tokens * top_k
    if ep <= hw.gpus_per_node:
        remote = pairs * (ep - 1) / ep
        bw = hw.nvlink_ll_gbps * 1e3
        fixed_d, fixed_c = ll_fixed_us(hw)
        return remote * row_bytes(hidden, fp8_dispatch) / bw + fixed_d, remote * row_bytes(hidden, False) / bw + fixed_c
    d = pairs * row_bytes(hidden, fp8_dispatch) / (hw.by_ep("rdma_ll_dispatch_gbps", ep) * 1e3)
    c = pairs * row_bytes(hidden, False) / (hw.by_ep("rdma_ll_combine_gbps", ep) * 1e3)
    return d, c


def ll_fixed_us(hw: Profile) -> tuple[float, float]:
    """(dispatch, combine) µs the low-latency kernels cost besides their NVLink bytes: measured on one rank, where
    every pair stays local, less a copy of those pairs' rows (`deepep_ll_kernel_us`, benchmarks/plan_dispatch.py),
    else one kernel each."""
    measured = hw.values.get("deepep_ll_kernel_us")
    if measured:
        return float(measured[0]), float(measured[1])
    return hw.kernel_floor_us, hw.kernel_floor_us


def permute_parts_us(hw: Profile, pairs: float, local_experts: int, hidden: int) -> tuple[float, float]:
    """(grouping, summing) µs: received rows grouped per expert (padded to 128), then summed back per token.

    Paid by the contiguous layout (DeepEP normal + DeepGEMM or triton); the masked layout is written in
    place by the low-latency dispatch. Grouping writes the padded rows from the received ones; summing
    reads every pair's row back and writes the token's sum. HBM speed, one kernel each.
    """
    if pairs <= 0:
        return 0.0, 0.0
    padded = pairs + local_experts * KERNEL_ALIGN / 2
    bw = hw.hbm_gbps * 1e3
    group = (padded + pairs) * hidden * 2.0 / bw
    total = 2 * (padded + pairs) * hidden * 2.0 / bw
    return group + hw.kernel_floor_us, total - group + hw.kernel_floor_us


def permute_us(hw: Profile, pairs: float, local_experts: int, hidden: int) -> float:
    """Grouping and summing together (permute_parts_us)."""
    return sum(permute_parts_us(hw, pairs, local_experts, hidden))


def sm_slowdown(hw: Profile, comm_sms: int) -> float:
    """Compute stretch while a communication kernel holds `comm_sms` SMs (DeepEP normal: 20 by default)."""
    return hw.num_sms / (hw.num_sms - comm_sms)


def overlapped_layer_us(compute_half_us: float, comm_half_us: float) -> float:
    """Two micro-batches (our `tbo`): one's transfers in flight while the other computes.

    With one transfer in flight at a time the compute stream runs 2 compute halves and the
    communication 2 transfer halves per layer: the layer takes the longer of the two streams.
    """
    return max(2 * compute_half_us, 2 * comm_half_us)
