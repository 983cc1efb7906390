"""Model architectures, found by the `architectures` / `model_type` of a Hugging Face config.json."""

from __future__ import annotations

import importlib

# model_type -> module under moeplex.models defining MODEL_CLASS, moe_spec(config) and PRESETS
ARCHITECTURES = {
    "deepseek_v3": "deepseek_v3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
}


def architecture(config: dict, path: str = "config.json"):
    """The module implementing the architecture of a config.json dict (read from `path`)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise ValueError(
            f"{path} gives model_type {model_type!r}, which is not supported; supported architectures: "
            f"{', '.join(ARCHITECTURES)}"
        )
    return importlib.import_module(f"{__name__}.{ARCHITECTURES[model_type]}")
