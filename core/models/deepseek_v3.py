"""DeepSeek-V3: MLA attention, dense MLPs in the first layers, then MoE layers with sigmoid grouped
top-k routing (bias-corrected selection), routed scaling and shared experts."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..moe.layer import MoELayer
from ..moe.router import RouterSpec
from ..moe.runtime import MoERuntime
from .base import DecoderLayer, MoECausalLM, MoESpec, SiluMLP
from .mla import MLAttention
from .mtp import SHARED_COPIES, MTPLayer, checkpoint_name

_TINY = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "torch_dtype": "float32",
    "vocab_size": 512,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
    "tie_word_embeddings": False,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_nextn_predict_layers": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "max_position_embeddings": 163840,
    "rope_interleave": True,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "use_cache": True,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "small": {
        **_TINY,
        "hidden_size": 384,
        "intermediate_size": 1024,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 192,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 64,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
    },
    # the released DeepSeek-V3 shapes, for --config-only folders run with --load-format dummy
    # (cut the depth with `moeplex make-model --set num_hidden_layers=4`)
    "v3": {
        **_TINY,
        "torch_dtype": "bfloat16",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
    },
}

HAS_MTP = True  # checkpoints may carry multi-token-prediction layers (num_nextn_predict_layers)
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def _check_supported(config: dict[str, Any]) -> None:
    """Refuse configs whose routing or activation this implementation would silently get wrong."""
    expected = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu"}
    for key, value in expected.items():
        if config.get(key, value) != value:
            raise ValueError(f"deepseek_v3 supports {key}={value!r} only, the config has {config[key]!r}")


def is_moe_layer(config: dict[str, Any], layer: int) -> bool:
    return (
        bool(config.get("n_routed_experts"))
        and layer >= config.get("first_k_dense_replace", 0)
        and layer % config.get("moe_layer_freq", 1) == 0
    )


def router_spec(config: dict[str, Any]) -> RouterSpec:
    return RouterSpec(
        num_experts=config["n_routed_experts"],
        top_k=config["num_experts_per_tok"],
        scoring="sigmoid",
        norm_topk_prob=config.get("norm_topk_prob", True),
        num_groups=config.get("n_group") or 1,
        topk_groups=config.get("topk_group") or 1,
        scaling_factor=config.get("routed_scaling_factor", 1.0),
        correction_bias=True,
    )


def num_main_moe_layers(config: dict[str, Any]) -> int:
    return sum(is_moe_layer(config, i) for i in range(config["num_hidden_layers"]))


def moe_spec(config: dict[str, Any], mtp_layers: int = 0) -> MoESpec:
    """The MoE shape; `mtp_layers` MTP layers built as well add one MoE layer each (after the main ones)."""
    _check_supported(config)
    return MoESpec(
        num_moe_layers=num_main_moe_layers(config) + (mtp_layers if config.get("n_routed_experts") else 0),
        num_experts=config["n_routed_experts"],
        top_k=config["num_experts_per_tok"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["moe_intermediate_size"],
        num_groups=config.get("n_group") or 1,
    )


def _shared_experts(config: dict[str, Any], runtime: MoERuntime) -> SiluMLP | None:
    count = config.get("n_shared_experts") or 0
    if count == 0:
        return None
    return SiluMLP(config["hidden_size"], config["moe_intermediate_size"] * count, tp=runtime.attn_tp)


class DeepseekV3ForCausalLM(MoECausalLM):
    """The main model; with `mtp_layers` > 0 also the checkpoint's first MTP layers as `self.mtp_layers`
    (models/mtp.py), their KV shapes in `mtp_kv_shapes()`."""

    def __init__(self, config: dict[str, Any], runtime: MoERuntime, mtp_layers: int = 0):
        super().__init__()
        _check_supported(config)
        self.num_hidden_layers = config["num_hidden_layers"]
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        layers = []
        for layer in range(config["num_hidden_layers"]):
            moe_index = sum(is_moe_layer(config, earlier) for earlier in range(layer))
            mlp = self._mlp(config, layer, runtime, moe_index)
            layers.append(DecoderLayer(layer, MLAttention(config, runtime.attn_tp), mlp, hidden, eps))
        self.build_stack(config, layers)
        self.mtp_layers = nn.ModuleList(self._mtp_layer(config, runtime, i) for i in range(mtp_layers))
        self.requires_grad_(False)

    def _mtp_layer(self, config: dict[str, Any], runtime: MoERuntime, index: int) -> MTPLayer:
        layer_id = self.num_hidden_layers + index
        if config.get("n_routed_experts"):  # always an MoE layer, as the main model's MoE layers are
            mlp = self._moe(config, runtime, num_main_moe_layers(config) + index)
        else:
            mlp = SiluMLP(config["hidden_size"], config["intermediate_size"], tp=runtime.attn_tp)
        return MTPLayer(
            layer_id, MLAttention(config, runtime.attn_tp), mlp, config["hidden_size"], config["rms_norm_eps"],
            self.model.embed_tokens, self.lm_head, self.model.norm,
        )

    @staticmethod
    def _mlp(config: dict[str, Any], layer: int, runtime: MoERuntime, moe_index: int) -> nn.Module:
        hidden = config["hidden_size"]
        if not is_moe_layer(config, layer):
            return SiluMLP(hidden, config["intermediate_size"], tp=runtime.attn_tp)
        return DeepseekV3ForCausalLM._moe(config, runtime, moe_index)

    @staticmethod
    def _moe(config: dict[str, Any], runtime: MoERuntime, moe_index: int) -> MoELayer:
        hidden = config["hidden_size"]
        return MoELayer(
            moe_index,
            hidden,
            config["moe_intermediate_size"],
            router_spec(config),
            runtime,
            shared_experts=_shared_experts(config, runtime),
        )

    def kv_shapes(self) -> list[list[tuple[int, ...]]]:
        return [[(layer.self_attn.cache_width,)] for layer in self.model.layers]

    def mtp_kv_shapes(self) -> list[list[tuple[int, ...]]]:
        """Per MTP layer built, its per-token KV shapes: the KV pool's layers after the main ones (pool layer
        num_hidden_layers + i for MTP layer i, its `layer_id`), when the pool is built from
        kv_shapes() + mtp_kv_shapes()."""
        return [[(layer.self_attn.cache_width,)] for layer in self.mtp_layers]

    def weight_targets(self):
        return {checkpoint_name(name, self.num_hidden_layers): t for name, t in super().weight_targets().items()}

    def fp8_weight_names(self) -> set[str]:
        # eh_proj stays in floating point, as in DeepSeek's fp8 release
        names = {checkpoint_name(name, self.num_hidden_layers) for name in super().fp8_weight_names()}
        return {name for name in names if not name.endswith(".eh_proj.weight")}

    def ignores_tensor(self, name: str) -> bool:
        match = _LAYER_NAME.match(name)
        if match and int(match.group(1)) >= self.num_hidden_layers:
            if int(match.group(1)) >= self.num_hidden_layers + len(self.mtp_layers):
                return True  # an MTP layer not built (no drafter uses it)
            return name.endswith(SHARED_COPIES)  # the MTP layer reads the main model's embedding and head
        return super().ignores_tensor(name)


MODEL_CLASS = DeepseekV3ForCausalLM
