"""Multi-head Latent Attention (DeepSeek-V2/V3) over the paged KV cache.

The cache holds, per token, only the normalised KV latent (kv_lora_rank) and the rotated rope key
(qk_rope_head_dim, shared by all heads). Extend up-projects the sequence's latents with kv_b_proj
into per-head nope keys and values, then attends. Decode absorbs the up-projections instead, as
DeepSeek serves it: with kv_b_proj = [W_UK; W_UV] per head, q_nope . (W_UK c) = (W_UK^T q_nope) . c,
so each query moves into the latent space and attends to the cached rows themselves (one "KV head"
that every query head shares, the latent doubling as the value); the latent-space output then
goes through W_UV. Decode reads kv_lora_rank + rope numbers per cached token, not heads * (k + v).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import AttentionBackend, TorchAttention, gather_kv, write_kv
from ..forward_batch import ForwardBatch, ForwardMode
from ..parallel import Group
from .base import RMSNorm, rope_parameters
from .parallel_layers import MergedColumnLinear, RowLinear, column_linear
from .rope import RotaryEmbedding, with_yarn_defaults, yarn_mscale

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps


def mla_rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """rope parameters with transformers' defaults for what DeepSeek configs may leave out."""
    return with_yarn_defaults(rope_parameters(config), config["max_position_embeddings"])


def softmax_scale(config: dict[str, Any]) -> float:
    """1/sqrt(qk_head_dim), times mscale^2 under scaled rope with mscale_all_dim (DeepSeek's YaRN correction)."""
    scale = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
    params = mla_rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all_dim:
        mscale = yarn_mscale(params["factor"], mscale_all_dim)
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    """forward(x [T, H], batch, cache [latent+rope key buffer]) -> [T, H]; names follow the HF checkpoint.

    `backend` computes the attention proper (set by the model's `set_attention_backend`).
    """

    backend: AttentionBackend

    def __init__(self, config: dict[str, Any], tp: Group = Group()):
        super().__init__()
        hidden = config["hidden_size"]
        bias = config.get("attention_bias", False)
        heads = config["num_attention_heads"]
        if heads % tp.size:
            raise ValueError(f"num_attention_heads ({heads}) is not divisible by the attention TP size {tp.size}")
        self.num_heads = heads // tp.size  # heads of this rank; the latent cache is whole on every rank
        self.nope_dim = config["qk_nope_head_dim"]
        self.rope_dim = config["qk_rope_head_dim"]
        self.v_dim = config["v_head_dim"]
        self.kv_lora_rank = config["kv_lora_rank"]
        self.q_lora_rank = config.get("q_lora_rank")
        q_out = heads * (self.nope_dim + self.rope_dim)
        # the input's down-projections (the kv latent with the rope key, and the q LoRA's) as one GEMM
        down = {"kv_a_proj_with_mqa": (self.kv_lora_rank + self.rope_dim, Group())}
        if self.q_lora_rank is None:
            self.q_proj = column_linear(hidden, q_out, tp)
        else:
            down["q_a_proj"] = (self.q_lora_rank, Group())
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = column_linear(self.q_lora_rank, q_out, tp)
        self.down_proj = MergedColumnLinear(hidden, down, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = column_linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), tp)
        self.o_proj = RowLinear(heads * self.v_dim, hidden, tp, bias=bias)
        self.rotary = RotaryEmbedding(
            self.rope_dim, mla_rope_parameters(config), interleaved=config.get("rope_interleave", True)
        )
        self.scale = softmax_scale(config)
        self.backend = TorchAttention()

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def queries(self, x: torch.Tensor, q_down: torch.Tensor | None) -> torch.Tensor:
        """[T, heads, nope + rope] (the rope part not yet rotated) from x, or from x's q LoRA down-projection."""
        q = self.q_proj(x) if q_down is None else self.q_b_proj(self.q_a_layernorm(q_down))
        return q.view(x.shape[0], self.num_heads, self.nope_dim + self.rope_dim)

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached rows [S, latent + rope key] -> keys [S, heads, nope + rope], values [S, heads, v]."""
        latent, k_rope = rows.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(rows.shape[0], self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = k_rope[:, None, :].expand(-1, self.num_heads, -1)
        return torch.cat((k_nope, k_rope), dim=-1), v

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: list[torch.Tensor]) -> torch.Tensor:
        kv_down, *q_down = self.down_proj(x)  # q_down: [the q LoRA's input], or [] without the LoRA
        q_nope, q_rope = self.queries(x, q_down[0] if q_down else None).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = kv_down.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_rope, k_rope = self.rotary(batch.positions, q_rope, k_rope[:, None, :])
        (buffer,) = cache
        write_kv(buffer, batch, torch.cat((self.kv_a_layernorm(latent), k_rope[:, 0]), dim=-1))
        if batch.mode == ForwardMode.DECODE:
            out = self.absorbed_decode(q_nope, q_rope, buffer, batch)
        else:
            k, v = self.expand(gather_kv(buffer, batch))
            out = self.backend.extend(torch.cat((q_nope, q_rope), dim=-1), k, v, batch, self.scale)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.v_dim))

    def absorbed_decode(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, buffer: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """[B, heads, v]: attention in the latent space against the cached rows as they are."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, heads, kv_lora_rank]
        keys = buffer.unsqueeze(1)  # [slots, 1, kv_lora_rank + rope]
        values = buffer[:, : self.kv_lora_rank].unsqueeze(1)  # the latent: a view, no copy
        q = torch.cat((q_latent, q_rope), dim=-1)
        latent_out = self.backend.decode(q, keys, values, batch, self.scale)  # [B, heads, kv_lora_rank]
        return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
