"""Plugins with awkward capabilities, registered through a real dist-info folder on sys.path."""

from __future__ import annotations

import ctypes

import torch

import attrs

from moeplex.interfaces import (
    ALL_LAYOUTS,
    MASKED,
    STANDARD,
    Balancer,
    BalancerCaps,
    DispatcherCaps,
    ExpertOutput,
    KernelCaps,
    Placement,
)
from moeplex.interfaces.kernels import dequantize_activations, quantize_activations
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


class StarvesIdleExperts(Balancer):
    """Broken: replicas by recorded load (hottest expert per replica first), so an expert nobody used gets no slot.

    It passes on all-zero loads (the identity) and on dense random ones; the engine refuses its placement
    as soon as one expert records no token.
    """

    caps = BalancerCaps(supports_redundancy=True)

    def rebalance(self, load, num_physical, num_groups, num_nodes, num_gpus) -> Placement:
        load = load.reshape(-1, *load.shape[-2:]).sum(0).double()
        rows = []
        for layer in load:
            if not layer.any():
                rows.append(torch.arange(num_physical) % layer.numel())
                continue
            count = (layer > 0).long()
            for _ in range(num_physical - int(count.sum())):
                count[int(torch.argmax(layer / count.clamp_min(1)))] += 1
            rows.append(torch.repeat_interleave(torch.arange(layer.numel()), count))
        return Placement.from_phy2log(torch.stack(rows), load.shape[-1])


class ComputesInFp16(TorchMoEKernel):
    """Broken: declares bf16 but runs its experts in fp16 (exact enough on unit-scale data, overflows beyond)."""

    caps = KernelCaps(layouts=frozenset(ALL_LAYOUTS), dtypes=frozenset({torch.bfloat16}))

    def apply(self, layout, weights) -> ExpertOutput:
        narrow = attrs.evolve(layout, hidden=layout.hidden.to(torch.float16))
        out = super().apply(narrow, tuple(w.to(torch.float16) for w in weights))
        return ExpertOutput(out.hidden.to(layout.hidden.dtype), out.weights_applied, out.summed)


class QuantizesToFp8(TorchMoEKernel):
    """Broken: declares bf16 but quantizes the activations to fp8 (1x128 groups) before its experts."""

    caps = KernelCaps(layouts=frozenset(ALL_LAYOUTS), dtypes=frozenset({torch.bfloat16}))

    def apply(self, layout, weights) -> ExpertOutput:
        rows = dequantize_activations(quantize_activations(layout.hidden.float())).to(layout.hidden.dtype)
        return super().apply(attrs.evolve(layout, hidden=rows), weights)


class NotAPlugin:
    pass


def _xgrammar():
    from moeplex.plugins.grammar_backends.xgrammar_backend import XGrammarBackend, XGrammarMatcher

    return XGrammarBackend, XGrammarMatcher


class LeakyMask(_xgrammar()[0]):
    """Its mask allows every token: what a backend with a stale or unfilled mask does."""

    def fill_masks(self, matchers, bitmask, rows):
        bitmask[list(rows)] = -1


class _ForgetfulMatcher(_xgrammar()[1]):
    def rollback(self, count):
        pass  # declares rollback, does nothing


class ForgetfulRollback(_xgrammar()[0]):
    def matcher(self, compiled):
        grammar, is_json = compiled
        return _ForgetfulMatcher(grammar, self.json_safe if is_json else None)


class HoldsTheGil(_xgrammar()[0]):
    """Compiles in a C loop that never lets go of the GIL (as a binding that forgets to release it would)."""

    def compile(self, constraint):
        ctypes.PyDLL(None).usleep(500_000)  # a C call through PyDLL keeps the GIL: half a second of nothing else
        return super().compile(constraint)


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
        "fake-fp16-inside": "fake_plugins:ComputesInFp16",
        "fake-fp8-inside": "fake_plugins:QuantizesToFp8",
    },
    "moeplex.balancers": {
        "fake-starves-idle": "fake_plugins:StarvesIdleExperts",
    },
    "moeplex.grammar_backends": {
        "fake-leaky-mask": "fake_plugins:LeakyMask",
        "fake-forgetful-rollback": "fake_plugins:ForgetfulRollback",
        "fake-holds-the-gil": "fake_plugins:HoldsTheGil",
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
