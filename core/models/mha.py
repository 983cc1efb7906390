"""Multi-head and grouped-query attention over the paged KV cache (Mixtral, Qwen3-MoE and their kin).

Each layer caches one key and one value row per token: [num_kv_heads, head_dim] each.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import AttentionBackend, TorchAttention, gather_kv, write_kv
from ..forward_batch import ForwardBatch, ForwardMode
from ..kernels.rope import KVWrite
from ..parallel import Group
from .base import RMSNorm, rope_parameters
from .parallel_layers import MergedColumnLinear, RowLinear
from .rope import RotaryEmbedding, with_yarn_defaults


def head_dim(config: dict[str, Any]) -> int:
    # Mixtral configs write head_dim as null (or omit it) when it is hidden_size / num_attention_heads
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def kv_head_split(num_kv_heads: int, tp: Group) -> Group:
    """How key-value heads divide over the ranks: evenly, or, with fewer heads than ranks, one
    head per rank, each replicated on tp / num_kv_heads neighbouring ranks (the ranks whose
    query heads read it)."""
    if num_kv_heads % tp.size == 0:
        return tp
    if tp.size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) and the attention TP size {tp.size} must divide one another"
        )
    return Group(rank=tp.rank * num_kv_heads // tp.size, size=num_kv_heads)


def kv_shapes(config: dict[str, Any], tp: Group = Group()) -> list[list[tuple[int, ...]]]:
    """Per layer, a key and a value of [this rank's kv heads, head_dim] per token."""
    kv_heads = config["num_key_value_heads"]
    shape = (kv_heads // kv_head_split(kv_heads, tp).size, head_dim(config))
    return [[shape, shape] for _ in range(config["num_hidden_layers"])]


def check_sliding_window(window: int | None, config: dict[str, Any]) -> None:
    """Refuse a sliding window that could bind: every attention backend attends to the whole sequence.

    A window of at least max_position_embeddings never changes a result for the sequences
    the model is made for, so it is accepted and ignored.
    """
    longest = config.get("max_position_embeddings")
    if window is not None and (longest is None or window < longest):
        raise ValueError(
            f"sliding_window is {window} (below max_position_embeddings {longest}); moeplex attends to the whole "
            "sequence, which would change results for longer sequences; set sliding_window to null"
        )


def check_silu(config: dict[str, Any]) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act is {act!r}; the MLPs and MoE kernels compute silu only")


class MHAttention(nn.Module):
    """q/k/v projections -> optional per-head RMSNorm of q and k (Qwen3) -> rope -> paged attention -> o_proj.

    `backend` computes the attention proper (set by the model's `set_attention_backend`).
    """

    backend: AttentionBackend
    fewer_launches = False  # the rope kernel also writes the KV cache (set by MoECausalLM.use_fused_kernels)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_params: dict[str, Any],
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        tp: Group = Group(),
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        kv_tp = kv_head_split(num_kv_heads, tp)
        # each rank keeps whole heads: num_heads / tp query heads and the key-value heads they read
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads // tp.size, num_kv_heads // kv_tp.size, head_dim
        self.scale = head_dim**-0.5
        kv_size = (num_kv_heads * head_dim, kv_tp)
        parts = {"q_proj": (num_heads * head_dim, tp), "k_proj": kv_size, "v_proj": kv_size}
        self.qkv_proj = MergedColumnLinear(hidden_size, parts, bias=qkv_bias)
        self.o_proj = RowLinear(num_heads * head_dim, hidden_size, tp, bias=o_bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.qk_norm = qk_norm_eps is not None
        self.rotary_emb = RotaryEmbedding(head_dim, rope_params)
        self.backend = TorchAttention()

    @classmethod
    def from_config(
        cls, config: dict[str, Any], rope_params: dict[str, Any] | None = None, qk_norm: bool = False, tp: Group = Group()
    ):
        """The attention of a Hugging Face config; `attention_bias` covers q, k, v and o as in Qwen3-MoE."""
        bias = bool(config.get("attention_bias", False))
        return cls(
            hidden_size=config["hidden_size"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
            head_dim=head_dim(config),
            rope_params=rope_params or with_yarn_defaults(rope_parameters(config), config["max_position_embeddings"]),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm_eps=config["rms_norm_eps"] if qk_norm else None,
            tp=tp,
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: list[torch.Tensor]) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else ()
        key_cache, value_cache = cache
        if self.fewer_launches and self.rotary_emb.fused:
            q = self.rotary_emb.rotate_and_store(batch.positions, q, k, KVWrite(v, key_cache, value_cache,
                                                                              batch.out_cache_loc), *norms)
        else:
            q, k = self.rotary_emb(batch.positions, q, k, *norms)
            write_kv(key_cache, batch, k)
            write_kv(value_cache, batch, v)
        if batch.mode == ForwardMode.DECODE:
            out = self.backend.decode(q, key_cache, value_cache, batch, self.scale)
        else:
            out = self.backend.extend(q, gather_kv(key_cache, batch), gather_kv(value_cache, batch), batch, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
