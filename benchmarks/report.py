"""How a benchmark hands back its Markdown: printed, and written to --out when given."""

from __future__ import annotations

import platform
from pathlib import Path


def emit(text: str, out: str | Path | None) -> None:
    print(text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.rstrip("\n") + "\n")


def processor() -> str:
    """The machine a table was measured on: the GPU's name, or the CPU's model name (CPU tables name their processor:
    the kernels that win differ between, say, a Xeon with AMX and an EPYC without)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor()
    return f"{name}, {torch.get_num_threads()} torch threads"


def cpu_features() -> str:
    """The instruction sets CPU kernels choose by (oneDNN's bf16/fp16 paths, AMX tiles), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return "flags unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
    return ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in wanted)
