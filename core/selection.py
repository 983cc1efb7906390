"""The start-up check: the selected plugins exist, fit this machine and fit each other."""

from __future__ import annotations

import importlib.util
import logging

import attrs
import torch

from . import registry
from .interfaces import FP8_BLOCK
from .moe.adapters import LayoutAdapter
from .registry import PluginError

log = logging.getLogger(__name__)


@attrs.frozen
class PluginSelection:
    dispatcher: type
    moe_kernel: type
    balancer: type
    overlap: type


def _capability() -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability())


def _runnable(kind: str, ok) -> str:
    names = []
    for name, info in registry.discover(kind).items():
        try:
            if ok(info.load().caps):
                names.append(name)
        except PluginError:
            continue
    return ", ".join(names) or "none"


def resolve(config, ep_size: int | None = None, has_gpu: bool | None = None, announce: bool = False) -> PluginSelection:
    """Look up the configured plugins and refuse, in one sentence, a selection that cannot run.

    `ep_size` defaults to the config's, so the launcher can check a selection before any rank
    starts; `announce` logs the selection (one INFO line) once it is accepted.
    """
    has_gpu = torch.cuda.is_available() if has_gpu is None else has_gpu
    ep_size = config.parallel.ep_size if ep_size is None else ep_size
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
        missing = [module for module in caps.requires if importlib.util.find_spec(module) is None]
        if missing:
            raise PluginError(
                f"{kind} '{name}' needs the Python package{'s' if len(missing) > 1 else ''} "
                f"{', '.join(missing)}, which {'are' if len(missing) > 1 else 'is'} not installed (see docs/plugins.md); "
                f"{kind}s that run here: {_runnable(kind, lambda c: not c.needs_gpu or has_gpu)}."
            )
        if has_gpu and caps.min_compute_capability and _capability() < caps.min_compute_capability:
            need, have = caps.min_compute_capability, _capability()
            raise PluginError(
                f"{kind} '{name}' needs a GPU of compute capability {need[0]}.{need[1]} or newer (Hopper for 9.0), "
                f"but this one is {have[0]}.{have[1]}; {kind}s that run here: "
                f"{_runnable(kind, lambda c: not c.min_compute_capability or c.min_compute_capability <= have)}."
            )
    if ep_size > 1 and not dcaps.multi_rank:
        raise PluginError(
            f"dispatcher '{config.dispatcher}' serves one EP rank only, but --ep-size is {ep_size}; "
            f"dispatchers that can span ranks here: {_runnable('dispatcher', lambda c: c.multi_rank and (has_gpu or not c.needs_gpu))}."
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
    def takes_all(caps) -> bool:
        return all(LayoutAdapter.can_adapt(layout, caps.layouts) for layout in dcaps.layouts)

    formats = kcaps.weight_formats
    if getattr(config, "quantize_experts", "none") == "fp8" and FP8_BLOCK not in formats:
        raise PluginError(
            f"--quantize-experts fp8 needs an MoE kernel that takes {FP8_BLOCK} weights, and moe_kernel "
            f"'{config.moe_kernel}' takes {', '.join(sorted(formats))} only; kernels that do: "
            f"{_runnable('moe_kernel', lambda c: FP8_BLOCK in c.weight_formats)}."
        )
    for layout in dcaps.layouts:
        if not LayoutAdapter.can_adapt(layout, kcaps.layouts):
            raise PluginError(
                f"dispatcher '{config.dispatcher}' produces the {layout} layout, which moe_kernel "
                f"'{config.moe_kernel}' (accepting {', '.join(sorted(kcaps.layouts))}) cannot take; kernels that can: "
                f"{_runnable('moe_kernel', takes_all)}."
            )
    if getattr(config, "dispatch_fp8", False) and not dcaps.fp8_payload:
        raise PluginError(
            f"--dispatch-fp8 needs a dispatcher that sends fp8 rows, and '{config.dispatcher}' does not; "
            f"dispatchers that do: {_runnable('dispatcher', lambda c: c.fp8_payload)}."
        )
    if getattr(config, "dispatch_fp8", False) and not getattr(kcaps, "fp8_payload", False):
        raise PluginError(
            f"--dispatch-fp8 sends fp8 rows, which moe_kernel '{config.moe_kernel}' does not take; "
            f"kernels that do: {_runnable('moe_kernel', lambda c: getattr(c, 'fp8_payload', False))}."
        )
    limit = getattr(config, "max_dispatch_tokens_per_rank", None)
    if dcaps.fixed_max_tokens and not dcaps.other_layouts and limit and limit < config.max_batched_tokens:
        raise PluginError(
            f"dispatcher '{config.dispatcher}' holds at most --max-dispatch-tokens-per-rank {limit} tokens, but a "
            f"step may send --max-batched-tokens {config.max_batched_tokens}; lower that, raise the buffer, or use "
            f"a dispatcher that switches modes: {_runnable('dispatcher', lambda c: c.other_layouts)}."
        )
    in_flight = getattr(sel.overlap.caps, "transfers_in_flight", 1)
    if in_flight > dcaps.max_in_flight:
        raise PluginError(
            f"overlap '{config.overlap}' keeps {in_flight} dispatches in flight, but dispatcher "
            f"'{config.dispatcher}' holds {dcaps.max_in_flight} at a time; dispatchers that hold {in_flight}: "
            f"{_runnable('dispatcher', lambda c: c.max_in_flight >= in_flight)}."
        )
    if sel.overlap.caps.needs_async_halves and not dcaps.async_halves:
        log.warning(
            "overlap '%s' hides communication only behind a dispatcher whose waits cost no compute; "
            "dispatcher '%s' has none, so its micro-batches run correctly but overlap nothing",
            config.overlap, config.dispatcher,
        )
    if announce:
        log.info("plugins: %s", describe(config))
    return sel


def chosen(config) -> dict[str, str]:
    """kind -> the plugin name the config selects, for every kind this run uses."""
    names = {kind: getattr(config, kind) for kind in registry.KINDS if getattr(config, kind, None) is not None}
    # the later kinds are chosen by flags named for their feature, and only when that feature is on
    if getattr(config, "speculative_algorithm", "none") != "none":
        names["drafter"] = config.speculative_algorithm
    if getattr(config, "disaggregation_mode", "none") != "none":
        names["kv_transfer"] = config.disaggregation_transfer_backend
    return names


def describe(config) -> str:
    """The selected plugins with the distributions they come from, for the start-up log."""
    found = []
    for kind, name in chosen(config).items():
        info = registry.discover(kind).get(name)
        found.append(f"{kind} {name} ({info.distribution} {info.version})" if info else f"{kind} {name}")
    return ", ".join(found)
