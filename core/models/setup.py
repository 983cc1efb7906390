"""Building a model from a Hugging Face folder: config -> placement -> MoE runtime -> modules -> weights."""

from __future__ import annotations

import contextlib
import logging
import time

import attrs
import torch

from ..attention import make_attention_backend
from ..interfaces import MoEContext, Placement
from ..moe.rebalance import PlacementShape, read_expert_location
from ..moe.runtime import MoERuntime
from ..parallel import Group, ParallelConfig, ParallelState
from ..progress import progress
from ..registry import PluginError
from ..speculation.setup import check_drafter
from . import architecture
from .base import MoECausalLM, MoESpec, read_config
from .expert_format import expert_weight_format
from .loader import CheckpointReader, load_checkpoint
from .mtp import mtp_layer_count, require_mtp_weights
from .random_weights import named_random_tensor
from .synthetic_mtp import acceptance_of, synthetic_tensor

log = logging.getLogger(__name__)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def placement_shape(spec: MoESpec, config, parallel: ParallelState) -> PlacementShape:
    """Logical experts plus the redundant slots, over the EP ranks (refused when they do not divide)."""
    ep = parallel.ep
    redundant = config.ep_num_redundant_experts
    num_physical = spec.num_experts + redundant
    if num_physical % ep.size:
        raise ValueError(
            f"{spec.num_experts} experts plus {redundant} redundant make {num_physical} physical slots, which do not "
            f"divide over {ep.size} EP ranks; choose --ep-num-redundant-experts so that they do"
        )
    return PlacementShape(
        num_layers=spec.num_moe_layers,
        num_logical=spec.num_experts,
        num_physical=num_physical,
        num_groups=spec.num_groups,
        num_nodes=parallel.config.nnodes if ep.size > 1 else 1,
        num_gpus=ep.size,
    )


def initial_placement(shape: PlacementShape, config, balancer) -> Placement:
    """From --init-expert-location, else the balancer's placement of a uniform load."""
    if config.init_expert_location:
        return read_expert_location(config.init_expert_location, shape, balancer)
    return shape.plan(balancer, torch.ones(shape.num_layers, shape.num_logical))


def mtp_layers_to_build(arch, hf_config, mtp: bool) -> int:
    """How many MTP (NextN) layers to build: none unless asked; all that config.json declares when asked."""
    if not mtp:
        return 0
    count = mtp_layer_count(hf_config) if getattr(arch, "HAS_MTP", False) else 0
    if count == 0:
        raise ValueError(
            f"{getattr(hf_config, 'path', 'config.json')} declares no multi-token-prediction (MTP) layer "
            f"(num_nextn_predict_layers); MTP layers exist for deepseek_v3 checkpoints that declare them"
        )
    return count


def build_model(
    folder: str, config, selection, parallel: ParallelState | None = None, hooks=None, mtp: bool = False
) -> MoECausalLM:
    """An empty model of `folder`'s architecture wired to the selected plugins (weights not loaded).

    `mtp`: also build the checkpoint's MTP layers (`model.mtp_layers`, see models/mtp.py), for the
    `nextn` drafter; without it they are not built and their tensors are ignored.
    """
    parallel = parallel if parallel is not None else ParallelState(ParallelConfig())
    ep = parallel.ep
    hf_config = read_config(folder)
    arch = architecture(hf_config)
    mtp_layers = mtp_layers_to_build(arch, hf_config, mtp)
    extra = {"mtp_layers": mtp_layers} if mtp_layers else {}  # only architectures with MTP take the argument
    spec = arch.moe_spec(hf_config, **extra)
    shape = placement_shape(spec, config, parallel)
    placement = initial_placement(shape, config, selection.balancer())
    if spec.intermediate_size % parallel.moe_tp.size:
        raise ValueError(
            f"the experts' intermediate size {spec.intermediate_size} is not divisible by {parallel.moe_tp.size} ranks"
        )
    device = torch.device(config.device)
    ctx = MoEContext(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size // parallel.moe_tp.size,
        num_physical_experts=shape.num_physical,
        top_k=spec.top_k,
        dtype=config.torch_dtype,
        device=device,
        ep_rank=ep.rank,
        ep_size=ep.size,
        group=ep.group,
        max_tokens_per_rank=config.dispatch_tokens_per_rank(selection.dispatcher.caps),
        dispatch_fp8=config.dispatch_fp8,
    )
    runtime = MoERuntime(
        ctx,
        selection.dispatcher,
        selection.moe_kernel,
        placement,
        hooks,
        parallel,
        dispatch_algorithm=config.ep_dispatch_algorithm,
        placement_shape=shape,
        expert_format=expert_weight_format(hf_config, config, selection.moe_kernel, ctx.intermediate_size),
    )
    with device, default_dtype(config.torch_dtype):
        model = arch.MODEL_CLASS(hf_config, runtime, **extra)
    model.hf_config = hf_config
    model.moe_runtime = runtime
    model.set_attention_backend(make_attention_backend(config.attention_backend, device, config.torch_dtype))
    model.use_fused_kernels(device.type == "cuda")  # norms, rope and routing in Triton where it compiles
    return model.eval()


def init_dummy_weights(model: MoECausalLM, seed: int, show_progress: bool = False) -> None:
    """Random weights made on the model's device from config.json alone (--load-format dummy).

    The same values `moeplex make-model --seed SEED` writes: every checkpoint tensor is drawn
    whole from a generator of its own, and each rank keeps its slice and its experts, so any
    parallel layout (and every replica of an expert) holds the same model.
    """
    device = next(model.parameters()).device
    synthetic = acceptance_of(model.hf_config) is not None  # make-model --mtp-acceptance: its synthetic weights
    with torch.no_grad():
        targets = model.weight_targets().items()
        for name, target in progress(targets, desc="making dummy weights", unit="tensor", enabled=show_progress):
            if target.copy is None:
                continue  # another rank's expert
            if synthetic:
                tensor = synthetic_tensor(name, target.shape, seed, model.hf_config, device)
            else:
                tensor = named_random_tensor(name, target.shape, seed, device)
            if target.select is not None:
                dim, start, length = target.select
                tensor = tensor.narrow(dim, start, length)
            target.copy(tensor)


def load_model(
    folder: str, config, selection, parallel: ParallelState | None = None, hooks=None, mtp: bool = False
) -> MoECausalLM:
    """`build_model`, then this rank's weights (read from safetensors, or random ones) and prepared experts.

    `mtp`: build and load the MTP layers too (refused when the checkpoint holds none)."""
    if mtp and config.load_format != "dummy":
        hf_config = read_config(folder)
        if mtp_layer_count(hf_config):  # none declared: build_model says so
            require_mtp_weights(folder, CheckpointReader(folder).names(), hf_config)
    model = build_model(folder, config, selection, parallel, hooks, mtp=mtp)
    first = parallel is None or parallel.rank == 0  # one bar and one log line, not one per rank
    show = config.show_progress and first
    started = time.monotonic()
    if first:
        log.info("loading %s weights of %s", "dummy" if config.load_format == "dummy" else "the", folder)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed, show)  # the same on every rank: replicated weights agree
    else:
        load_checkpoint(model, folder, show_progress=show)
    model.finish_loading()
    if first:
        log.info("weights ready in %.1f s", time.monotonic() - started)
    return model


def check_before_start(config) -> None:
    """What the launching process can refuse before any rank starts: the checkpoint's files (their headers,
    not their data) and rank 0's model built on the meta device (no memory, no process group), which reads
    config.json and refuses a parallel layout the model cannot take (heads, intermediate sizes or expert
    slots that do not divide over the ranks, a dispatcher for the wrong EP size)."""
    from ..selection import resolve  # deferred: selection reads the plugin registry

    if config.load_format != "dummy":
        CheckpointReader(config.model)  # a truncated or corrupt file is named now, not on a rank
    layout = config.parallel
    rank0 = ParallelState(layout, 0, Group(0, layout.attn_tp_size), Group(0, layout.world_size))
    selection = resolve(config, ep_size=rank0.ep.size)  # on the real device: GPU needs are checked there
    check_drafter(config, selection, read_config(config.model))
    try:
        build_model(config.model, attrs.evolve(config, device="meta"), selection, rank0)
    except (ValueError, OSError, PluginError):
        raise  # the layout, the folder or a selection is wrong: say so now
    except Exception as exc:  # a plugin that cannot be built on the meta device: the ranks build it for real
        log.debug("start-up check skipped the meta-device model: %s", exc)
