"""The start-up check: the selected plugins exist, fit this machine and fit each other."""

from __future__ import annotations

import logging

import attrs
import torch

from . import registry
from .moe.adapters import LayoutAdapter
from .registry import PluginError

log = logging.getLogger(__name__)


@attrs.frozen
class PluginSelection:
    dispatcher: type
    moe_kernel: type
    balancer: type
    overlap: type


def _runnable(kind: str, ok) -> str:
    names = []
    for name, info in registry.discover(kind).items():
        try:
            if ok(info.load().caps):
                names.append(name)
        except PluginError:
            continue
    return ", ".join(names) or "none"


def resolve(config, ep_size: int = 1, has_gpu: bool | None = None) -> PluginSelection:
    """Look up the configured plugins and refuse, in one sentence, a selection that cannot run."""
    has_gpu = torch.cuda.is_available() if has_gpu is None else has_gpu
    sel = PluginSelection(
        dispatcher=registry.lookup("dispatcher", config.dispatcher),
        moe_kernel=registry.lookup("moe_kernel", config.moe_kernel),
        balancer=registry.lookup("balancer", config.balancer),
        overlap=registry.lookup("overlap", config.overlap),
    )
    dcaps, kcaps = sel.dispatcher.caps, sel.moe_kernel.caps
    for kind, name, caps in (("dispatcher", config.dispatcher, dcaps), ("moe_kernel", config.moe_kernel, kcaps)):
        if caps.needs_gpu and not has_gpu:
            raise PluginError(
                f"{kind} '{name}' needs a CUDA GPU and none is visible; {kind}s that run here: "
                f"{_runnable(kind, lambda c: not c.needs_gpu)}."
            )
    if ep_size > 1 and not dcaps.multi_rank:
        raise PluginError(
            f"dispatcher '{config.dispatcher}' serves one EP rank only, but --ep-size is {ep_size}; "
            f"dispatchers for several ranks: {_runnable('dispatcher', lambda c: c.multi_rank)}."
        )
    if ep_size == 1 and not dcaps.single_rank:
        raise PluginError(
            f"dispatcher '{config.dispatcher}' needs more than one EP rank; dispatchers for one rank: "
            f"{_runnable('dispatcher', lambda c: c.single_rank)}."
        )
    dtype = config.torch_dtype
    if dtype not in kcaps.dtypes:
        raise PluginError(
            f"moe_kernel '{config.moe_kernel}' does not compute in {config.dtype}; kernels that do: "
            f"{_runnable('moe_kernel', lambda c: dtype in c.dtypes)}."
        )
    if not LayoutAdapter.can_adapt(dcaps.layout, kcaps.layouts):
        raise PluginError(
            f"dispatcher '{config.dispatcher}' produces the {dcaps.layout} layout, which moe_kernel "
            f"'{config.moe_kernel}' (accepting {', '.join(sorted(kcaps.layouts))}) cannot take; kernels that can: "
            f"{_runnable('moe_kernel', lambda c: LayoutAdapter.can_adapt(dcaps.layout, c.layouts))}."
        )
    if sel.overlap.caps.needs_async_halves and not dcaps.async_halves:
        log.warning(
            "overlap '%s' hides communication only behind a dispatcher whose waits cost no compute; "
            "dispatcher '%s' has none, so its micro-batches run correctly but overlap nothing",
            config.overlap, config.dispatcher,
        )
    return sel
