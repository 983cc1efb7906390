"""The start-up check of --speculative-algorithm: one sentence for every combination that cannot run."""

from __future__ import annotations

from .. import registry
from ..registry import PluginError


def drafter_class(config) -> type | None:
    """The selected drafter's class (None without speculation), or a PluginError naming the installed ones."""
    if not config.speculative:
        return None
    drafters = registry.discover("drafter")
    if config.speculative_algorithm not in drafters:
        raise PluginError(
            f"--speculative-algorithm '{config.speculative_algorithm}' is not an installed drafter; "
            f"choose none or one of: {registry.installed_names('drafter')}."
        )
    return drafters[config.speculative_algorithm].load()


def check_speculation(config, dispatcher_caps, dispatch_tokens: int) -> type | None:
    """What the flags alone can refuse: an unknown drafter, a fixed dispatch buffer smaller than a verify step of
    every running request (its decode buffer, for deepep-auto)."""
    cls = drafter_class(config)
    if cls is None:
        return None
    need = config.max_running_requests * config.tokens_per_decode
    if dispatcher_caps.fixed_max_tokens and dispatch_tokens < need:  # verify steps are decode steps (deepep-auto: LL)
        raise PluginError(
            f"dispatcher '{config.dispatcher}' holds {dispatch_tokens} tokens per rank, but a verify step of "
            f"--max-running-requests {config.max_running_requests} x --speculative-num-draft-tokens "
            f"{config.tokens_per_decode} sends {need}; raise --max-dispatch-tokens-per-rank or lower one of those."
        )
    return cls


def check_model(config, cls: type | None, hf_config, has_mtp: bool) -> None:
    """What needs the checkpoint: the drafter supports the architecture and finds the weights it uses."""
    if cls is None:
        return
    arch = hf_config.get("model_type")
    if cls.caps.architectures is not None and arch not in cls.caps.architectures:
        raise PluginError(
            f"drafter '{config.speculative_algorithm}' supports {', '.join(sorted(cls.caps.architectures))} "
            f"models, and {config.model} is {arch}; drafters for every architecture: "
            f"{', '.join(n for n, i in registry.discover('drafter').items() if _any_arch(i))}."
        )
    if cls.caps.needs_weights and not has_mtp:
        raise PluginError(
            f"drafter '{config.speculative_algorithm}' drafts with the checkpoint's MTP (NextN) layers, and "
            f"{config.model} has none (num_nextn_predict_layers is 0 or absent); use --speculative-algorithm ngram."
        )
    if cls.caps.needs_weights and config.parallel.enable_dp_attention:
        raise PluginError(
            f"drafter '{config.speculative_algorithm}' runs MoE layers of its own, which DP attention would have "
            f"to pace on every rank; it runs without --enable-dp-attention (ngram runs with it)."
        )


def _any_arch(info) -> bool:
    try:
        return info.load().caps.architectures is None
    except PluginError:
        return False
