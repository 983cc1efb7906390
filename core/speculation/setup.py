"""The engine's drafter: checked against the flags, the plugins and the model, then made."""

from __future__ import annotations

import torch

from ..batch_builder import ScheduledSeq, build_forward_batch
from ..cuda_graph import Capture, CudaGraphCapture
from ..interfaces import DrafterContext, ForwardBatch
from ..kv_cache import KVPool
from .checks import check_model, check_speculation
from .graphs import graphs_for


def has_mtp_layers(hf_config) -> bool:
    return bool(hf_config.get("num_nextn_predict_layers") or 0)


def check_drafter(config, selection, hf_config) -> type | None:
    """The drafter class --speculative-algorithm names (None for none), or one sentence saying why it cannot run."""
    dcaps = selection.dispatcher.caps
    cls = check_speculation(config, dcaps, config.dispatch_tokens_per_rank(dcaps))
    check_model(config, cls, hf_config, has_mtp_layers(hf_config))
    return cls


def drafter_context(model, kv: KVPool, config, device: torch.device, kv_layer_ids, target_graphs=None,
                    world_size: int = 1, capture: Capture | None = None) -> DrafterContext:
    """The context `bind` gets. `target_graphs`: the target's decode graphs (None: the drafter's steps run eagerly
    too), whose static inputs and sizes the drafter's graphs share; `capture`: CudaGraphCapture by default."""

    def batch_of(seqs) -> ForwardBatch:
        return build_forward_batch([ScheduledSeq(list(ids), start, pages) for ids, start, pages in seqs], kv, device)

    def graphs_for_step(step, width: int):
        captures = capture if capture is not None or target_graphs is None else CudaGraphCapture(device)
        return graphs_for(step, width, config.torch_dtype, target_graphs, captures, world_size,
                          lambda: model.moe_runtime.records_load)

    return DrafterContext(model, kv, config, device, tuple(kv_layer_ids), batch_of, graphs_for_step,
                          vocab_size=int(model.hf_config["vocab_size"]))
