"""Mixtral: GQA attention, every layer a sparse MoE block (softmax, top-k, renormalised), no shared expert.

Checkpoints name the MoE block `block_sparse_moe` and an expert's projections
w1 (gate), w3 (up), w2 (down).
"""

from __future__ import annotations

from typing import Any


from ..moe.layer import MoELayer
from ..moe.router import RouterSpec
from ..moe.runtime import MoERuntime
from .base import DecoderLayer, MoECausalLM, MoESpec, rope_parameters
from .mha import MHAttention, check_silu, check_sliding_window, kv_shapes

DEFAULT_ROPE_THETA = 1000000.0  # transformers' MixtralConfig default, unlike the generic 10000

_COMMON = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "vocab_size": 512,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": DEFAULT_ROPE_THETA,
    "max_position_embeddings": 4096,
    "head_dim": None,  # hidden_size / num_attention_heads
    "sliding_window": None,
    "attention_dropout": 0.0,
    "router_jitter_noise": 0.0,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "initializer_range": 0.02,
    "use_cache": True,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        **_COMMON,
        "hidden_size": 64,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "small": {
        **_COMMON,
        "hidden_size": 512,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_local_experts": 16,
        "num_experts_per_tok": 2,
    },
    # Mixtral-8x7B's shapes, for --config-only folders run with --load-format dummy
    "8x7b": {
        **_COMMON,
        "torch_dtype": "bfloat16",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
    },
}


def check_config(config: dict[str, Any]) -> None:
    check_silu(config)
    check_sliding_window(config.get("sliding_window"), config)


def moe_spec(config: dict[str, Any]) -> MoESpec:
    return MoESpec(
        num_moe_layers=config["num_hidden_layers"],
        num_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
    )


class MixtralForCausalLM(MoECausalLM):
    expert_names = ("w1", "w3", "w2")

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
            num_experts=config["num_local_experts"],
            top_k=config["num_experts_per_tok"],
            scoring="softmax",
            norm_topk_prob=True,  # Mixtral always renormalises the top-k probabilities
        )
        rope = rope_parameters({"rope_theta": DEFAULT_ROPE_THETA, **config})
        layers = []
        for layer_id in range(config["num_hidden_layers"]):
            mlp = MoELayer(layer_id, hidden, config["intermediate_size"], router, runtime)
            attn = MHAttention.from_config(config, rope_params=rope, tp=runtime.attn_tp)
            layers.append(
                DecoderLayer(layer_id, attn, mlp, hidden, config["rms_norm_eps"], mlp_name="block_sparse_moe")
            )
        return layers

    def kv_shapes(self) -> list[list[tuple[int, ...]]]:
        return kv_shapes(self.config, self.attn_tp)


MODEL_CLASS = MixtralForCausalLM
