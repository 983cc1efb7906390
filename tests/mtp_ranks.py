"""Rank entry point of the MTP layer's parallel test (spawned processes import this module by name)."""

from __future__ import annotations

import torch

from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.config import EngineConfig
from moeplex.kv_cache import KVPool
from moeplex.models.mtp import target_hidden_and_logits
from moeplex.models.setup import load_model
from moeplex.parallel import ParallelState, init_parallel
from moeplex.registry import lookup
from moeplex.selection import resolve


def mtp_logits(rank, parallel_config, folder: str, sequences: list[list[int]]) -> torch.Tensor:
    """The MTP layer's logits of every row of one extend over `sequences` (after the target's prefill)."""
    parallel = init_parallel(parallel_config, rank, torch.device("cpu")) if parallel_config.distributed else None
    dispatcher = "naive" if parallel_config.ep_size > 1 else "local"
    config = EngineConfig(model=folder, dtype="fp32", show_progress=False, dispatcher=dispatcher, parallel=parallel_config)
    state = parallel if parallel is not None else ParallelState(parallel_config)
    model = load_model(folder, config, resolve(config, ep_size=state.ep.size), state, mtp=True)
    kv = KVPool(64, 4, model.kv_shapes() + model.mtp_kv_shapes(), torch.float32, "cpu")
    pages = [kv.allocate(kv.pages_for(len(s))) for s in sequences]
    strategy = lookup("overlap", "none")()
    with torch.no_grad():
        target = build_forward_batch([ScheduledSeq(s, 0, p) for s, p in zip(sequences, pages)], kv, "cpu")
        hidden, _ = target_hidden_and_logits(model, target, kv, strategy)
        keep = torch.cat([torch.arange(len(s) - 1) + sum(map(len, sequences[:i])) for i, s in enumerate(sequences)])
        batch = build_forward_batch([ScheduledSeq(s[1:], 0, p) for s, p in zip(sequences, pages)], kv, "cpu")
        _, logits = model.mtp_layers[0](hidden[keep], batch, kv, logits_at=torch.arange(batch.num_tokens), strategy=strategy)
    return logits
