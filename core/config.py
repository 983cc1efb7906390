"""EngineConfig: every setting a user can change, validated once (built from CLI flags)."""

from __future__ import annotations

import attrs
import torch

from .parallel import ParallelConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _positive(instance, attribute, value):
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


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
    moe_kernel: str = "torch"
    balancer: str = "static"
    overlap: str = "none"
    # scheduler and KV cache
    max_running_requests: int = attrs.field(default=64, validator=_positive)
    max_batched_tokens: int = attrs.field(default=2048, validator=_positive)  # per-step token budget
    chunked_prefill_size: int = attrs.field(default=512, validator=_positive)
    page_size: int = attrs.field(default=16, validator=_positive)
    max_total_tokens: int | None = attrs.field(default=None, validator=_positive)  # KV pool size in tokens
    kv_memory_fraction: float = 0.25  # of free memory, when max_total_tokens is not given
    show_progress: bool = True
    parallel: ParallelConfig = ParallelConfig()

    def __attrs_post_init__(self):
        if self.max_batched_tokens < self.max_running_requests:
            # every running request must be able to decode in one step
            raise ValueError(
                f"max_batched_tokens ({self.max_batched_tokens}) must be >= max_running_requests "
                f"({self.max_running_requests})"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
