"""Building a model from a Hugging Face folder: config -> placement -> MoE runtime -> modules -> weights."""

from __future__ import annotations

import contextlib

import torch

from ..interfaces import MoEContext
from ..moe.runtime import MoERuntime
from ..parallel import ParallelConfig, ParallelState
from . import architecture
from .base import MoECausalLM, read_config
from .loader import load_checkpoint


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(folder: str, config, selection, parallel: ParallelState | None = None, hooks=None) -> MoECausalLM:
    """An empty model of `folder`'s architecture wired to the selected plugins (weights not loaded)."""
    parallel = parallel if parallel is not None else ParallelState(ParallelConfig())
    ep = parallel.ep
    hf_config = read_config(folder)
    arch = architecture(hf_config)
    spec = arch.moe_spec(hf_config)
    num_physical = spec.num_experts
    empty_load = torch.zeros(spec.num_moe_layers, spec.num_experts)
    placement = selection.balancer().rebalance(
        empty_load, num_physical, spec.num_groups, parallel.config.nnodes, ep.size
    )
    placement.check(ep.size)
    if spec.intermediate_size % parallel.moe_tp.size:
        raise ValueError(
            f"the experts' intermediate size {spec.intermediate_size} is not divisible by {parallel.moe_tp.size} ranks"
        )
    device = torch.device(config.device)
    ctx = MoEContext(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size // parallel.moe_tp.size,
        num_physical_experts=num_physical,
        top_k=spec.top_k,
        dtype=config.torch_dtype,
        device=device,
        ep_rank=ep.rank,
        ep_size=ep.size,
        group=ep.group,
    )
    runtime = MoERuntime(ctx, selection.dispatcher, selection.moe_kernel, placement, hooks, parallel)
    with device, default_dtype(config.torch_dtype):
        model = arch.MODEL_CLASS(hf_config, runtime)
    model.hf_config = hf_config
    return model.eval()


def load_model(folder: str, config, selection, parallel: ParallelState | None = None, hooks=None) -> MoECausalLM:
    """`build_model`, then read this rank's weights from the safetensors files and prepare the experts."""
    model = build_model(folder, config, selection, parallel, hooks)
    load_checkpoint(model, folder, show_progress=config.show_progress)
    model.finish_loading()
    return model
