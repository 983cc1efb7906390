"""Attention backends: who computes attention over the paged KV cache (`--attention-backend`).

A model's attention layers project, rotate and write the cache themselves, then hand the
attention proper to the backend:

- decode(q [B, Hq, Dk], key_cache [slots, Hkv, Dk], value_cache [slots, Hkv, Dv], batch, scale)
  -> [B, Hq, Dv]: one query per request against its cached sequence, read in place. MLA's
  absorbed decode passes the latent buffer as one KV head and its first kv_lora_rank columns as
  the values.
- extend(q [T, Hq, Dk], k [S, Hkv, Dk], v [S, Hkv, Dv] in kv_indices order, batch, scale)
  -> [T, Hq, Dv]: causal over each request's cached prefix and new tokens.

Every backend gives the `torch` backend's results within the dtype's tolerance. `graph_safe`
says whether decode reads only fixed-size tensors (no host values), so a CUDA graph can capture it.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from ..forward_batch import ForwardBatch
from .torch_ref import PagedGather, paged_decode_attention, ragged_attention


class AttentionBackend(abc.ABC):
    name: ClassVar[str]
    graph_safe: ClassVar[bool] = False

    @abc.abstractmethod
    def decode(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: ForwardBatch, scale: float
    ) -> torch.Tensor:
        """[B, Hq, Dv]: each request's one query against its cached sequence."""

    def extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, scale: float
    ) -> torch.Tensor:
        # torch SDPA per request: flash-capable for whole prompts, a small mask for chunks after a prefix
        return ragged_attention(q, k, v, batch, scale)


class TorchAttention(AttentionBackend):
    """The reference: decode gathers every request's cache rows into a padded block for SDPA."""

    name = "torch"

    def __init__(self):
        self.gather = PagedGather()  # on CPU: pages or slots, measured once per cache shape

    def decode(self, q, key_cache, value_cache, batch, scale):
        return paged_decode_attention(q, key_cache, value_cache, batch, scale, self.gather)

