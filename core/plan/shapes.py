"""The shapes the model prices, read from a config.json of any of our three architectures."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..models import architecture


@dataclass(frozen=True)
class ModelShape:
    arch: str
    layers: int
    moe_layers: int
    hidden: int
    vocab: int
    experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int  # shared experts' total width (0: none)
    dense_intermediate: int
    attention_gemms: tuple[tuple[int, int], ...]  # (K, N) of each attention weight GEMM, per token
    attention_bmm_gemms: tuple[tuple[int, int, int], ...]  # (heads, K, N): MLA's per-head absorbed products
    kv_bytes_per_token: int  # per layer, bf16 cache
    attn_flops_per_pair: int  # per (query, key) pair per layer: scores + weighted values, all heads
    decode_flops_per_pair: int  # the same under MLA's absorbed decode (latent width), else = attn_flops_per_pair

    def expert_bytes(self, weight_bytes: float) -> float:
        return 3 * self.hidden * self.expert_intermediate * weight_bytes


def model_shape(config: dict) -> ModelShape:
    module = architecture(config)
    layers = config["num_hidden_layers"]
    is_moe = getattr(module, "is_moe_layer", lambda _config, _layer: True)  # Mixtral: every layer is MoE
    moe_layers = sum(1 for i in range(layers) if is_moe(config, i))
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    kind = config["model_type"]
    if kind == "deepseek_v3":
        q_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        lora, rope, v = config["kv_lora_rank"], config["qk_rope_head_dim"], config["v_head_dim"]
        q_lora = config.get("q_lora_rank") or 0
        gemms = ((h, q_lora + lora + rope), (q_lora, heads * q_dim), (heads * v, h)) if q_lora else ((h, heads * q_dim + lora + rope), (heads * v, h))
        # decode absorbs kv_b into q and o: per head q_nope -> latent, latent -> v
        bmm = ((heads, config["qk_nope_head_dim"], lora), (heads, lora, v))
        kv = (lora + rope) * 2
        prefill = 2 * heads * (q_dim + v)
        decode = 2 * heads * ((lora + rope) + lora)
        experts, expert_i = config["n_routed_experts"], config["moe_intermediate_size"]
        shared = config.get("n_shared_experts", 1) * expert_i
        dense_i = config["intermediate_size"]
    else:
        head_dim = config.get("head_dim") or h // heads
        kv_heads = config["num_key_value_heads"]
        gemms = ((h, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, h))
        bmm = ()
        kv = 2 * kv_heads * head_dim * 2
        prefill = decode = 2 * heads * 2 * head_dim
        experts = config["num_experts"] if kind == "qwen3_moe" else config["num_local_experts"]
        expert_i = config.get("moe_intermediate_size") or config["intermediate_size"]
        shared = 0
        dense_i = config["intermediate_size"]
    return ModelShape(
        kind, layers, moe_layers, h, config["vocab_size"], experts, config["num_experts_per_tok"], expert_i,
        shared, dense_i, gemms, bmm, kv, prefill, decode,
    )


def load_config(model: str, overrides: dict | None = None) -> dict:
    """A config.json path or folder, or ARCH:PRESET (e.g. deepseek_v3:v3) from our architectures' presets."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.exists():
        config = json.loads(path.read_text())
    elif ":" in model:
        import importlib

        from ..models import ARCHITECTURES

        arch, preset = model.split(":", 1)
        if arch not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        presets = importlib.import_module(f"moeplex.models.{ARCHITECTURES[arch]}").PRESETS
        if preset not in presets:
            raise ValueError(f"unknown preset {preset!r}; {arch} presets: {', '.join(presets)}")
        config = dict(presets[preset])
    else:
        raise ValueError(f"--model {model!r} is neither a config.json (or its folder) nor ARCH:PRESET")
    return {**config, **(overrides or {})}
