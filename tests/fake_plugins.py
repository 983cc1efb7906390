"""Plugins with awkward capabilities, registered through a real dist-info folder on sys.path."""

from __future__ import annotations

import torch

from moeplex.interfaces import (
    MASKED,
    STANDARD,
    DispatcherCaps,
    KernelCaps,
)
from moeplex.plugins.dispatchers.local import LocalDispatcher
from moeplex.plugins.moe_kernels.torch_ref import TorchMoEKernel


class MaskedOnlyDispatcher(LocalDispatcher):
    caps = DispatcherCaps(layout=MASKED, multi_rank=True)


class GpuDispatcher(LocalDispatcher):
    caps = DispatcherCaps(layout=STANDARD, multi_rank=True, needs_gpu=True)


class ManyRanksDispatcher(LocalDispatcher):
    caps = DispatcherCaps(layout=STANDARD, multi_rank=True, single_rank=False)


class Fp8SendingDispatcher(LocalDispatcher):
    caps = DispatcherCaps(layout=STANDARD, multi_rank=False, fp8_payload=True)


class Fp32OnlyStandardKernel(TorchMoEKernel):
    caps = KernelCaps(layouts=frozenset({STANDARD}), dtypes=frozenset({torch.float32}))


class NotAPlugin:
    pass


ENTRY_POINTS = {
    "moeplex.dispatchers": {
        "fake-masked": "fake_plugins:MaskedOnlyDispatcher",
        "fake-gpu": "fake_plugins:GpuDispatcher",
        "fake-many-ranks": "fake_plugins:ManyRanksDispatcher",
        "fake-fp8": "fake_plugins:Fp8SendingDispatcher",
    },
    "moeplex.moe_kernels": {
        "fake-fp32-standard": "fake_plugins:Fp32OnlyStandardKernel",
        "fake-broken": "fake_plugins:NotAPlugin",
        "fake-missing": "fake_plugins_gone:Kernel",
    },
}


def write_distribution(folder) -> None:
    info = folder / "fake_moeplex_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-moeplex-plugins\nVersion: 0.1\n")
    lines = []
    for group, entries in ENTRY_POINTS.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
