"""Qwen3-MoE: GQA attention with per-head q/k RMSNorm, softmax top-k routing, no shared expert.

Layers listed in mlp_only_layers, and those off the decoder_sparse_step stride, are dense
(intermediate_size); the others are MoE (moe_intermediate_size per expert).
"""

from __future__ import annotations

from typing import Any


from ..moe.layer import MoELayer
from ..moe.router import RouterSpec
from ..moe.runtime import MoERuntime
from .base import DecoderLayer, MoECausalLM, MoESpec, SiluMLP
from .mha import MHAttention, check_silu, check_sliding_window, kv_shapes

_COMMON = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 512,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "initializer_range": 0.02,
    "use_cache": True,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

PRESETS: dict[str, dict[str, Any]] = {
    # head_dim differs from hidden_size / num_attention_heads, as in the released Qwen3-MoE models
    "tiny": {
        **_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "mlp_only_layers": [1],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    "small": {
        **_COMMON,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 6,
        "mlp_only_layers": [0],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "num_experts": 32,
        "num_experts_per_tok": 4,
    },
    # Qwen3-30B-A3B's shapes, for --config-only folders run with --load-format dummy
    "30b-a3b": {
        **_COMMON,
        "torch_dtype": "bfloat16",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "mlp_only_layers": [],
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 40960,
    },
}


def num_experts(config: dict[str, Any]) -> int:
    # the Hub configs say num_experts; transformers 5 writes its attribute_map twin num_local_experts
    return config["num_experts"] if "num_experts" in config else config["num_local_experts"]


def is_moe_layer(config: dict[str, Any], layer_id: int) -> bool:
    """Transformers' rule: MoE unless listed in mlp_only_layers or off the decoder_sparse_step stride."""
    dense_layers = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1)
    return layer_id not in dense_layers and num_experts(config) > 0 and (layer_id + 1) % step == 0


def check_config(config: dict[str, Any]) -> None:
    check_silu(config)
    # transformers ignores sliding_window unless use_sliding_window is set
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    check_sliding_window(window, config)


def moe_spec(config: dict[str, Any]) -> MoESpec:
    return MoESpec(
        num_moe_layers=sum(is_moe_layer(config, i) for i in range(config["num_hidden_layers"])),
        num_experts=num_experts(config),
        top_k=config["num_experts_per_tok"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["moe_intermediate_size"],
    )


class Qwen3MoeForCausalLM(MoECausalLM):
    def __init__(self, config: dict[str, Any], runtime: MoERuntime):
        super().__init__()
        check_config(config)
        self.config = config
        self.attn_tp = runtime.attn_tp
        self.build_stack(config, self._layers(config, runtime))

    @staticmethod
    def _layers(config: dict[str, Any], runtime: MoERuntime) -> list[DecoderLayer]:
        hidden = config["hidden_size"]
        router = RouterSpec(
            num_experts=num_experts(config),
            top_k=config["num_experts_per_tok"],
            scoring="softmax",
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),  # transformers' default is False
        )
        layers, moe_index = [], 0
        for layer_id in range(config["num_hidden_layers"]):
            if is_moe_layer(config, layer_id):
                mlp = MoELayer(moe_index, hidden, config["moe_intermediate_size"], router, runtime)
                moe_index += 1
            else:
                mlp = SiluMLP(hidden, config["intermediate_size"], tp=runtime.attn_tp)
            attn = MHAttention.from_config(config, qk_norm=True, tp=runtime.attn_tp)
            layers.append(DecoderLayer(layer_id, attn, mlp, hidden, config["rms_norm_eps"]))
        return layers

    def kv_shapes(self) -> list[list[tuple[int, ...]]]:
        return kv_shapes(self.config, self.attn_tp)


MODEL_CLASS = Qwen3MoeForCausalLM
