"""What one rank holds in memory: its weights (experts apart), its KV cache, the process."""

from __future__ import annotations

import resource

import torch

MIB = 1 << 20


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_report(engine) -> dict:
    """Per-rank sizes in MiB; under EP each rank's expert share is 1 / ep of the model's experts."""
    experts = [p for layer in engine.model.moe_layers() for p in layer.expert_tensors()]
    expert_ids = {id(p) for p in experts}
    others = [p for p in engine.model.parameters() if id(p) not in expert_ids]
    kv = [buffer for layer in engine.kv.buffers for buffer in layer]
    report = {
        "rank": engine.parallel.rank,
        "weights_mib": round(_bytes(others) / MIB, 2),
        "experts_mib": round(_bytes(experts) / MIB, 2),
        "kv_cache_mib": round(_bytes(kv) / MIB, 2),
        "kv_cache_tokens": engine.kv.capacity_tokens,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if engine.device.type == "cuda":
        report["gpu_allocated_mib"] = round(torch.cuda.memory_allocated(engine.device) / MIB, 1)
    return report


def describe(report: dict) -> str:
    text = (
        f"rank {report['rank']}: weights {report['weights_mib']} MiB + experts {report['experts_mib']} MiB, "
        f"KV cache {report['kv_cache_mib']} MiB ({report['kv_cache_tokens']} tokens), peak RSS {report['peak_rss_mib']} MiB"
    )
    if "gpu_allocated_mib" in report:
        text += f", GPU allocated {report['gpu_allocated_mib']} MiB"
    return text
