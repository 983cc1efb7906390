"""The layout search: a grid of PD splits, EP sizes, overlap, redundancy and decode batches, best first."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .deployment import Deployment, DeploymentPrediction, RoleLayout, Workload, kv_gb, predict, weights_gb_per_gpu
from .profile import Profile
from .shapes import ModelShape

DECODE_BATCHES = (16, 32, 64, 128, 256)
MEMORY_HEADROOM_GB = 10.0  # activations, graphs, communication buffers: kept free on every GPU


@dataclass(frozen=True)
class Candidate:
    deployment: Deployment
    prediction: DeploymentPrediction

    def describe(self) -> str:
        dep = self.deployment
        d, p = dep.decode, dep.prefill
        tail = f"{p.redundant_experts} redundant, prefill {dep.prefill_tokens_per_gpu} tokens/GPU, decode batch {dep.decode_batch_per_gpu}/GPU"
        if not dep.disaggregated:
            return f"co-located {p.gpus} GPUs EP{p.ep} ({p.overlap}), {tail}"
        return f"prefill {p.gpus} GPUs EP{p.ep} ({p.overlap}) + decode {d.gpus} GPUs EP{d.ep} ({d.overlap}), {tail}"


def _role(gpus: int, shape: ModelShape, overlap: str, redundant: int, kernel: str, dtype: str) -> RoleLayout | None:
    ep = gpus
    dispatcher = "local" if ep == 1 else "deepep-auto"
    if (shape.experts + redundant) % ep:
        return None
    return RoleLayout(gpus, ep, dispatcher, kernel, dtype, redundant, "eplb" if ep > 1 else "static", overlap)


def candidates(hw: Profile, shape: ModelShape, total_gpus: int, kernel: str, dtype: str, prefill_tokens: tuple[int, ...]) -> list[Deployment]:
    node = hw.gpus_per_node
    step = node if total_gpus >= 2 * node else 1
    splits = [(p, total_gpus - p) for p in range(step, total_gpus, step)]
    out = []
    for redundant in (0, 32):
        for batch in DECODE_BATCHES:
            for tokens in prefill_tokens:
                for p_gpus, d_gpus in splits:
                    for p_overlap, d_overlap in itertools.product(("none", "tbo"), repeat=2):
                        pre = _role(p_gpus, shape, p_overlap, redundant, kernel, dtype)
                        dec = _role(d_gpus, shape, d_overlap, redundant, kernel, dtype)
                        if pre and dec:
                            out.append(Deployment(pre, dec, tokens, batch, True))
                for overlap in ("none", "tbo"):
                    both = _role(total_gpus, shape, overlap, redundant, kernel, dtype)
                    if both:
                        out.append(Deployment(both, both, tokens, batch, False))
    return out


def fits(hw: Profile, shape: ModelShape, dep: Deployment, workload: Workload) -> bool:
    context = workload.input_len + workload.output_len
    for role, batch in ((dep.decode, dep.decode_batch_per_gpu), (dep.prefill, 1)):
        need = weights_gb_per_gpu(shape, role) + kv_gb(shape, batch * context) + MEMORY_HEADROOM_GB
        if need > hw.hbm_capacity_gb:
            return False
    return True


def search(
    hw: Profile, shape: ModelShape, workload: Workload, total_gpus: int, max_itl_ms: float | None = None,
    max_ttft_ms: float | None = None, kernel: str = "deepgemm", dtype: str = "fp8", prefill_tokens: tuple[int, ...] = (4096, 16384), top: int = 5,
) -> tuple[list[Candidate], int]:
    """The best layouts by requests/s the whole deployment sustains, under the ITL / TTFT bounds; and how many were priced."""
    found, priced = [], 0
    for dep in candidates(hw, shape, total_gpus, kernel, dtype, prefill_tokens):
        if not fits(hw, shape, dep, workload):
            continue
        priced += 1
        pred = predict(hw, shape, dep, workload)
        if max_itl_ms is not None and pred.itl_p99_ms > max_itl_ms:
            continue
        if max_ttft_ms is not None and pred.ttft_ms > max_ttft_ms:
            continue
        found.append(Candidate(dep, pred))
    found.sort(key=lambda c: (-round(c.prediction.requests_per_s, 6), c.prediction.ttft_ms, c.prediction.itl_p99_ms))
    return found[:top], priced
