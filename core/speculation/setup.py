"""The engine's drafter: checked against the flags, the plugins and the model, then made."""

from __future__ import annotations

from ..interfaces import Drafter
from ..models.setup import dispatch_tokens_per_rank
from .checks import check_model, check_speculation


def has_mtp_layers(hf_config) -> bool:
    return bool(hf_config.get("num_nextn_predict_layers") or 0)


def check_drafter(config, selection, hf_config) -> type | None:
    """The drafter class --speculative-algorithm names (None for none), or one sentence saying why it cannot run."""
    dcaps = selection.dispatcher.caps
    cls = check_speculation(config, dcaps, dispatch_tokens_per_rank(config, dcaps))
    check_model(config, cls, hf_config, has_mtp_layers(hf_config))
    return cls


def make_drafter(config, selection, model) -> Drafter | None:
    cls = check_drafter(config, selection, model.hf_config)
    return None if cls is None else cls(config.speculative_num_steps)
